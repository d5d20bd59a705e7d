"""Baton: bench."""
