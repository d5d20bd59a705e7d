"""Baton: deploy."""
