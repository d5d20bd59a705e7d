"""The vLLM engine's pure parts (no vLLM needed): its block events as Baton's index entries, request values in
vLLM's terms, a vLLM prefill's leases, and the ``--engine vllm`` flags."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from engine.core.block_pool import TIER_HOST, TIER_POOL, BlockEventKind
from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from kv_transfer.hashing import hash_blocks, root_hash
from worker.main import parser
from worker.vllm_engine.blocks import VLLMBlockBridge
from worker.vllm_engine.cli import vllm_options
from worker.vllm_engine.leases import VLLMLeases
from worker.vllm_engine.params import (
    decode_kv_params, encode_kv_params, logprobs_of, prefill_max_tokens, sampling_kwargs,
)

FP = b"\x07" * 16
TOKENS = list(range(1000, 1000 + 3 * 32))  # three vLLM blocks of 32 tokens = 12 index blocks of 8


def stored(events):
    return [e.block_hash for e in events if e.kind is BlockEventKind.STORED]


def test_a_vllm_block_is_its_index_blocks_chained_from_the_salted_root_and_its_parent():
    bridge = VLLMBlockBridge(FP, index_block_size=8, vllm_block_size=32)
    first = bridge.stored([11, 12], None, TOKENS[:64], "GPU", [("tenant",), None])
    expected = hash_blocks(TOKENS, 8, root_hash(FP, 8, "tenant"))
    assert stored(first) == expected[:8] and {e.tier for e in first} == {TIER_POOL}
    third = bridge.stored([13], 12, TOKENS[64:], "GPU")  # a later request's block, chained on its parent
    assert stored(third) == expected[8:]
    unsalted = VLLMBlockBridge(FP, 8, 32).stored([21], None, TOKENS[:32])
    assert stored(unsalted) == hash_blocks(TOKENS[:32], 8, root_hash(FP, 8, ""))


def test_unchainable_blocks_stay_out_of_the_index():
    bridge = VLLMBlockBridge(FP, 8, 32)
    assert bridge.stored([13], 99, TOKENS[64:]) == []  # a parent this bridge never saw
    assert bridge.stored([11], None, TOKENS[:32], extra_keys=[("lora-a", "salt")]) == []  # an adapter's block
    assert bridge.stored([11], None, TOKENS[:31]) == []  # tokens that are not whole blocks
    assert bridge.stored([11], None, TOKENS[:32], medium="DISK") == []  # a tier the index does not name
    assert bridge.unchained == 4 and bridge.holdings() == {TIER_POOL: [], TIER_HOST: []}


def test_removal_per_tier_and_clearing_report_exactly_what_was_stored():
    bridge = VLLMBlockBridge(FP, 8, 32)
    pool = stored(bridge.stored([11, 12], None, TOKENS[:64]))
    host = stored(bridge.stored([11], None, TOKENS[:32], medium="CPU"))
    assert host == pool[:4]
    gone = bridge.removed([11], "GPU")
    assert [e.block_hash for e in gone] == pool[:4] and {e.tier for e in gone} == {TIER_POOL}
    assert bridge.holdings() == {TIER_POOL: pool[4:], TIER_HOST: pool[:4]}
    assert bridge.removed([11], "GPU") == [] and bridge.removed([77]) == []
    cleared = bridge.cleared()
    assert sorted((e.block_hash, e.tier) for e in cleared) == sorted(
        [(h, TIER_POOL) for h in pool[4:]] + [(h, TIER_HOST) for h in pool[:4]])
    assert bridge.holdings() == {TIER_POOL: [], TIER_HOST: []}


def test_a_hash_leaves_the_index_only_with_its_last_physical_copy():
    """vLLM caches without de-duplicating: two physical blocks with one hash are stored, and evicted, one by one."""
    bridge = VLLMBlockBridge(FP, 8, 32)
    first = stored(bridge.stored([11], None, TOKENS[:32]))
    assert bridge.stored([11], None, TOKENS[:32]) == []  # a second copy: the index knows the block already
    assert bridge.removed([11]) == []  # one copy evicted, the other still serves hits
    assert bridge.holdings()[TIER_POOL] == first
    assert [e.block_hash for e in bridge.removed([11])] == first  # the last copy gone
    assert bridge.holdings()[TIER_POOL] == [] and bridge.removed([11]) == []


def test_a_vllm_block_size_that_is_no_multiple_of_the_index_block_is_refused():
    with pytest.raises(ValueError, match="multiple"):
        VLLMBlockBridge(FP, 16, 40)
    with pytest.raises(ValueError, match="multiple"):
        VLLMBlockBridge(FP, 16, 8)


def test_sampling_values_in_vllms_terms():
    params = SamplingParams(temperature=0.5, top_k=None, top_p=0.9, seed=3, max_tokens=40, min_tokens=5,
                            stop_token_ids=(7,), stop=("x",), logprobs=2)
    kwargs = sampling_kwargs(params, max_tokens=1)
    assert kwargs["top_k"] == 0 and kwargs["max_tokens"] == 1 and kwargs["min_tokens"] == 1
    assert kwargs["stop_token_ids"] == [7] and "stop" not in kwargs and kwargs["seed"] == 3
    assert sampling_kwargs(params)["max_tokens"] == 40


def test_a_prompt_ending_on_a_vllm_block_boundary_prefills_its_first_token_too():
    assert [prefill_max_tokens(n, 128) for n in (1, 127, 128, 129, 256)] == [1, 1, 2, 1, 2]


def test_kv_params_round_trip_and_bad_ones_are_invalid():
    params = {"remote_engine_id": "e", "remote_block_ids": [[1, 2]], "remote_host": "h", "remote_port": 5}
    assert decode_kv_params(encode_kv_params(params)) == params
    for raw in (b"\xff", b"[1]", b'{"remote_block_ids": []}', b"not json"):
        with pytest.raises(InvalidRequest, match="engine_params"):
            decode_kv_params(raw)


def test_logprobs_keep_the_sampled_token_and_the_top_ones_by_rank():
    lp = lambda value, rank: SimpleNamespace(logprob=value, rank=rank)
    entries = [{5: lp(-0.1, 1), 6: lp(-2.0, 2)}, {9: lp(-3.0, 7), 5: lp(-0.2, 1), 6: lp(-1.5, 2)}]
    assert logprobs_of(entries, [5, 9], 2) == [(-0.1, [(5, -0.1), (6, -2.0)]), (-3.0, [(5, -0.2), (6, -1.5)])]
    assert logprobs_of(None, [5], 0) == []


def test_a_vllm_lease_frees_through_vllm_unless_its_reader_read_it():
    freed, now = [], [0.0]
    leases = VLLMLeases(10.0, freed.append, clock=lambda: now[0])
    read, unread, aborted, old = (leases.open(f"r{i}", {"i": i}) for i in range(4))
    assert len(leases) == 4
    assert leases.release(read.lease_id, read=True) and freed == []  # vLLM freed it on the reader's notification
    assert leases.release(unread.lease_id) and freed == [unread]  # the router gave up: vLLM is told
    assert not leases.release(unread.lease_id)  # once
    assert leases.release_request("r2") and freed == [unread, aborted]
    now[0] = 11.0
    assert leases.expire() == [old] and freed == [unread, aborted]  # vLLM's own lease, as long, freed it
    assert len(leases) == 0


def _args(*extra: str) -> argparse.Namespace:
    return parser("decode").parse_args(["--redis-url", "redis://x", "--engine", "vllm", *extra])


def test_the_vllm_options_come_from_the_worker_flags():
    options = vllm_options(_args("--num-blocks", "64", "--vllm-cpus", "1", "--lease-ttl-s", "9"), "/m")
    assert (options.model, options.num_blocks, options.cpus, options.lease_ttl_s) == ("/m", 64, "1", 9.0)
    assert options.block_size == 128 and options.index_block_size == 16 and options.dtype == "float32"
    assert options.kv_connector == "nixl"
    baton = vllm_options(_args("--vllm-kv-connector", "baton", "--kv-transport", "auto"), "/m")
    assert (baton.kv_connector, baton.kv_transports) == ("baton", "cma,tcp")
    assert vllm_options(_args("--vllm-kv-connector", "baton"), "/m").kv_transports == "tcp"  # as Baton's workers


@pytest.mark.parametrize("flags, message", [
    (("--kv-host-blocks", "8"), "--kv-host-blocks"),
    (("--tensor-parallel-size", "2"), "--tensor-parallel-size"),
    (("--kv-cache-dtype", "int8"), "--kv-cache-dtype"),
    (("--weights", "int4"), "--weights"),
    (("--vllm-block-size", "120"), "multiple of --block-size"),
    (("--kv-transport", "cma"), "NixlConnector moves the KV itself"),
    (("--vllm-kv-connector", "baton", "--kv-transport", "ucx"), "serves cma and tcp"),
])
def test_what_a_vllm_worker_cannot_do_is_refused_by_name(flags, message):
    with pytest.raises(ValueError, match=message):
        vllm_options(_args(*flags), "/m")
