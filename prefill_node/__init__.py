"""Baton: prefill_node."""
