"""Baton's connector for vLLM, its vLLM-free half (``worker/vllm_engine/kv_plane.py``): vLLM's layer-major cache seen
as one ``KVBuffer``; the scheduler side's orders (serve a finished prefill under a lease, pull what a decode lacks,
release what it will not read); two worker sides moving blocks over cma and tcp, leases ended by their read, a
release or their TTL, failed pulls reported as load errors. vLLM's own calls into it run in
tests/integration/test_vllm_engine.py (the ``baton`` connector)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kv_transfer.layout import KVLayout
from kv_transfer.transport import kind_available
from worker.vllm_engine.kv_plane import Orders, PlaneScheduler, PlaneWorker, PullOrder, ServeOrder, kv_buffer_of

LAYERS, BLOCKS, HEADS, BLOCK, HEAD_DIM = 3, 12, 2, 32, 16
LAYOUT = KVLayout(model_fingerprint=b"vllm-test", dtype="float32", block_size=BLOCK, num_layers=LAYERS,
                  num_kv_heads=HEADS, head_dim=HEAD_DIM)
KINDS = ["tcp", pytest.param("cma", marks=pytest.mark.skipif(kind_available("cma") is not None,
                                                             reason=str(kind_available("cma"))))]


def vllm_caches(seed: int) -> dict[str, torch.Tensor]:
    """As vLLM 0.32 allocates a CPU cache: one backing allocation, each layer a ``[blocks, heads, block, 2 * head_dim]``
    view of it, layer after layer (vllm/v1/worker/utils.py ``allocate_kv_cache``)."""
    backing = torch.empty(LAYERS * BLOCKS * HEADS * BLOCK * 2 * HEAD_DIM, dtype=torch.float32)
    backing.copy_(torch.randn(backing.shape, generator=torch.Generator().manual_seed(seed)))
    layers = backing.view(LAYERS, BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
    return {f"model.layers.{i}.self_attn.attn": layers[i] for i in reversed(range(LAYERS))}  # any order


def test_vllm_caches_are_seen_as_one_kv_buffer_without_a_copy():
    caches = vllm_caches(0)
    buffer = kv_buffer_of(LAYOUT, caches)
    assert buffer.num_blocks == BLOCKS
    for layer in range(LAYERS):
        for block in (0, 5, BLOCKS - 1):
            cache = caches[f"model.layers.{layer}.self_attn.attn"]
            assert bytes(buffer.array[layer, block]) == cache[block].numpy().tobytes()
    caches["model.layers.1.self_attn.attn"][4].fill_(7.0)  # vLLM writes: the buffer sees it
    assert (buffer.array[1, 4].view(np.float32) == 7.0).all()


def test_caches_in_separate_allocations_or_of_another_shape_are_refused():
    caches = {name: cache.clone() for name, cache in vllm_caches(0).items()}  # each layer its own allocation
    with pytest.raises(ValueError, match="one layer-major host allocation"):
        kv_buffer_of(LAYOUT, caches)
    with pytest.raises(ValueError, match="2 KV caches for 3 layers"):
        kv_buffer_of(LAYOUT, dict(list(vllm_caches(0).items())[:2]))


def request(rid: str, params: dict | None, prompt_len: int = 100) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, prompt_token_ids=list(range(prompt_len)),
                           num_computed_tokens=prompt_len)


def test_the_scheduler_side_leases_a_finished_prefill_and_orders_pulls_and_releases():
    p, d = PlaneScheduler("engine-p", {"lease_ttl_s": 9}), PlaneScheduler("engine-d", {})
    p.uris = "tcp://127.0.0.1:1"
    # P: a completed prefill for a remote decoder keeps its blocks under a lease; an aborted one does not
    keep, params = p.finished(request("p1", {"do_remote_decode": True}), [4, 5, 6], completed=True)
    assert keep and params["remote_block_ids"] == [4, 5, 6] and params["remote_uris"] == p.uris
    assert params["connector"] == "baton" and params["do_remote_prefill"] and params["remote_engine_id"] == "engine-p"
    assert p.finished(request("p2", {"do_remote_decode": True}), [7], completed=False) == (False, None)
    assert p.finished(request("p3", None), [7], completed=True) == (False, None)
    (serve,) = p.take_orders().to_serve
    assert (serve.request_id, serve.lease_id, serve.block_ids, serve.ttl_s) == ("p1", params["remote_lease_id"],
                                                                              [4, 5, 6], 9.0)
    assert not p.take_orders().to_serve  # handed over once
    # D: loads what its own cache lacks, asynchronously; pulls into the blocks vLLM allocated (its unhashed ones)
    wanting = request("d1", dict(params))
    assert d.matched(wanting, 32) == (68, True) and d.matched(request("d0", None), 0) == (0, False)
    d.allocated(wanting, SimpleNamespace(get_unhashed_block_ids=lambda: [10, 11]), 68)
    d.allocated(wanting, SimpleNamespace(get_unhashed_block_ids=lambda: [12]), 0)  # vLLM's second call: nothing
    (pull,) = d.take_orders().to_pull
    assert (pull.local_block_ids, pull.remote_block_ids, pull.lease_id, pull.release) == (
        [10, 11], [4, 5, 6], params["remote_lease_id"], False)
    # a decode that needs nothing (all cached) or ends before its pull releases P's lease
    d.allocated(request("d2", dict(params)), SimpleNamespace(get_unhashed_block_ids=lambda: []), 0)
    assert d.finished(request("d3", dict(params)), [], completed=False) == (False, None)
    assert [(o.request_id, o.release, o.local_block_ids) for o in d.take_orders().to_pull] == [
        ("d2", True, []), ("d3", True, [])]


def wait_for(worker: PlaneWorker, timeout_s: float = 10.0) -> tuple[set[str], set[str]]:
    """What ``finished`` reports, polled as vLLM's steps poll it, until something is."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sent, received = worker.finished()
        if sent or received:
            return sent or set(), received or set()
        time.sleep(0.01)
    raise AssertionError("nothing finished")


@pytest.fixture(params=KINDS)
def pair(request):
    settings = {"transports": request.param, "lease_ttl_s": 1.0}  # how long a reader asks for an unknown lease too
    p, d = PlaneWorker(LAYOUT, settings), PlaneWorker(LAYOUT, settings)
    p_caches, d_caches = vllm_caches(1), vllm_caches(2)
    p.register(p_caches)
    d.register(d_caches)
    yield p, d
    p.shutdown()
    d.shutdown()


def test_a_pull_moves_the_blocks_and_ends_p_s_lease(pair):
    p, d = pair
    assert p.uris.startswith(p.kinds[0] + "://")
    # D asks before P registered the lease (P's next engine step): it asks again until then
    d.start(Orders([], [PullOrder("d-req", [9, 7], [2, 3, 4], p.uris, "lease-1")]))  # D's cache had block 2's tokens
    time.sleep(0.3)
    p.start(Orders([ServeOrder("p-req", "lease-1", [2, 3, 4], 30.0)], []))
    assert wait_for(d) == (set(), {"d-req"})
    for src, dst in ((3, 9), (4, 7)):
        assert np.array_equal(d.buffer.array[:, dst], p.buffer.array[:, src])
    assert not np.array_equal(d.buffer.array[:, 8], p.buffer.array[:, 2])  # nothing else written
    assert wait_for(p) == ({"p-req"}, set())  # read: vLLM frees P's blocks
    ((rid, num_bytes, seconds, kind),) = d.take_stats()
    assert (rid, num_bytes, kind) == ("d-req", 2 * LAYOUT.bytes_per_block, p.kinds[0]) and seconds > 0
    assert d.take_load_errors() == set()


def test_a_failed_pull_is_a_load_error_and_a_lease_nobody_reads_ends_at_its_ttl_or_release(pair):
    p, d = pair
    d.start(Orders([], [PullOrder("d-req", [5, 6], [1, 2], p.uris, "no-such-lease")]))  # asked again for 1 s
    assert wait_for(d) == (set(), {"d-req"}) and d.take_load_errors() == {5, 6}  # vLLM recomputes them
    p.start(Orders([ServeOrder("p-ttl", "lease-ttl", [1], 0.2)], []))
    assert wait_for(p) == ({"p-ttl"}, set())
    p.start(Orders([ServeOrder("p-rel", "lease-rel", [1, 2], 30.0)], []))
    d.start(Orders([], [PullOrder("d-rel", [], [], p.uris, "lease-rel", release=True)]))
    assert wait_for(p) == ({"p-rel"}, set())
    assert d.finished() == (None, None) and not d.take_stats()  # a release is no load vLLM waits for
