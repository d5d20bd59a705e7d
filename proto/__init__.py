"""Baton: proto."""
