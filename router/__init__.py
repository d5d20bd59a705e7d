"""Baton: router."""
