"""Blocks that fall out of a sliding window are freed (issue 24, item 4): a model whose every layer attends within
a window (Mistral) holds about a window of KV per running request, however long it runs; exact ids on the books,
greedy parity on the tiny Mistral checkpoint in a pool far smaller than its requests."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.config import CacheConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request


def _request(prompt_len: int) -> Request:
    return Request(request_id="r", prompt_token_ids=list(range(prompt_len)), seed=0,
                   sampling_params=SamplingParams(temperature=0, max_tokens=8))


def test_blocks_wholly_before_the_window_are_freed_and_point_at_the_pad_block():
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=10), b"x" * 16)
    request = _request(14)
    kv.allocate_slots(request, 14)  # blocks 0-3
    request.num_computed_tokens = 14
    kv.commit(request)
    kv.free_outside_window(request, window=6)  # the next token (position 14) sees 9..14: blocks 0, 1 go
    assert kv.block_ids("r") == [10, 10, 2, 3] and request.num_window_freed == 2
    assert kv.pool.num_free_blocks == 8  # blocks 0, 1 back, still cached (evictable)
    assert kv.pool.lookup(request.block_hashes[0]) == 0
    kv.free_outside_window(request, window=6)  # nothing more yet
    assert kv.pool.num_free_blocks == 8
    kv.free(request)
    kv.pool.check_invariants()
    assert kv.pool.num_free_blocks == 10 and request.num_window_freed == 0


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(50)] for _ in range(3)]


def test_long_generations_fit_a_pool_of_a_few_windows_and_equal_the_roomy_engine(tiny_checkpoints):
    """Three requests of 200 tokens (13 blocks of 16 each) in a 12-block pool, window 20: no preemption, no
    truncation, greedy output equal to a 128-block pool's; also through the fixed-shape decode path."""
    checkpoint = tiny_checkpoints["mistral-swa"]
    prompts = _prompts(checkpoint.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    generate = lambda llm: [o.outputs[0].token_ids  # noqa: E731
                            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    expected = generate(LLM(str(checkpoint.path), num_blocks=128))
    assert all(len(tokens) == 150 for tokens in expected)
    for graphs in (False, True):
        llm = LLM(str(checkpoint.path), num_blocks=12, max_num_batched_tokens=64)
        if graphs:
            llm.engine.runner.use_decode_graphs((1, 2, 4), capture=False)
        assert generate(llm) == expected
        stats = llm.engine.stats()
        assert stats.num_preemptions == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_models_with_a_full_attention_layer_keep_every_block(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["qwen2-layer-swa"].path), num_blocks=32)
    assert llm.engine.model_config.uniform_window is None and llm.engine.scheduler.config.sliding_window is None
    assert LLM(str(tiny_checkpoints["mistral-swa"].path), num_blocks=32).engine.scheduler.config.sliding_window == 20


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_windowed_requests_resume_exactly(tiny_checkpoints, mode):
    checkpoint = tiny_checkpoints["mistral-swa"]
    prompts = [p[:20] for p in _prompts(checkpoint.vocab_size) * 2]  # six of 2 blocks: all admitted, then grow
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    generate = lambda llm: [o.outputs[0].token_ids  # noqa: E731
                            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    expected = generate(LLM(str(checkpoint.path), num_blocks=128))
    llm = LLM(str(checkpoint.path), num_blocks=12, max_num_batched_tokens=64, kv_host_blocks=64,
              preemption_mode=mode)
    assert generate(llm) == expected
    preemptions, host = llm.engine.stats().num_preemptions, llm.engine.kv_cache_manager.host
    assert preemptions > 0
    # swap: every preempted request's window went to the host tier (64 blocks: room for all) and came back;
    # recompute: nothing did
    swapped = preemptions if mode == "swap" else 0
    assert (host.num_swapped_out, host.num_swapped_in) == (swapped, swapped)
    host.check_invariants()
