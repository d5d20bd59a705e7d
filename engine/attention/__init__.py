"""Attention backends behind one interface: ``torch`` (CPU and reference) and ``flashinfer`` (CUDA)."""
