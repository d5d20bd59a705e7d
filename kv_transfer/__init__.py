"""Baton's lowest layer: block hashing, KV layout, the Redis KV index and the data-plane transports.

This ``__init__`` imports nothing heavy; import the submodules you need.
"""
