"""Baton: decode_node."""
