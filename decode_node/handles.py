"""Checks of the KV handles a ``Decode`` call brings, before any block is reserved: what a handle must say for
this worker to fill a reservation from it. A handle that fails is not an error of the request: the worker
prefills it itself (``kv_pull_fallbacks_total{reason="handle_unusable"|"prefix_unusable"}``)."""

from __future__ import annotations

from engine.core.kv_cache_manager import window_start
from proto import baton_pb2 as pb


def handle_problem(handle: pb.KVHandle, num_prompt_tokens: int, window: int | None, block_size: int) -> str | None:
    """Why a prompt's handle cannot fill this worker's reservation of ``num_prompt_tokens``, if it cannot. It
    must name every prompt block from ``first_block`` on, and skip only blocks this model's next token no longer
    attends to (``window``: every layer's sliding window, or None)."""
    if handle.engine not in ("", "baton"):
        return f"its blocks are {handle.engine}'s KV, which only a {handle.engine} engine reads"
    needed = window_start(num_prompt_tokens, window, block_size)
    if not 0 <= handle.first_block <= needed:
        return (f"it starts at prompt block {handle.first_block}; this model attends from block {needed} of the "
                f"{num_prompt_tokens}-token prompt")
    num_blocks = -(-num_prompt_tokens // block_size) - handle.first_block
    if len(handle.block_ids) != num_blocks:
        return f"{len(handle.block_ids)} block ids for the {num_blocks} prompt blocks from {handle.first_block} on"
    return None


def prefix_problem(handle: pb.KVHandle, num_tokens: int, block_size: int) -> str | None:
    """Why a prefix handle cannot cover the first whole blocks of a request of ``num_tokens``, if it cannot."""
    n = len(handle.block_hashes)
    if handle.engine not in ("", "baton"):
        return f"its blocks are {handle.engine}'s KV, which only a {handle.engine} engine reads"
    if n == 0 or len(handle.block_ids) != n:
        return f"{len(handle.block_ids)} block ids for {n} block hashes"
    if handle.first_block:
        return f"a prefix handle starts at block 0, not {handle.first_block}"
    if handle.num_tokens != n * block_size:
        return f"num_tokens {handle.num_tokens} is not {n} blocks of {block_size} tokens"
    if n * block_size >= num_tokens:
        return f"a prefix of {handle.num_tokens} tokens leaves nothing to compute of {num_tokens}"
    return None


def prefix_reason(num_pulled_tokens: int, num_local_tokens: int, worker_id: str) -> str:
    if not num_pulled_tokens:
        return f"the prefix {worker_id} leased was cached here already ({num_local_tokens} tokens); nothing pulled"
    local = f" ({num_local_tokens} more were cached here)" if num_local_tokens else ""
    return f"imported {num_pulled_tokens} prefix tokens from {worker_id}{local}"
