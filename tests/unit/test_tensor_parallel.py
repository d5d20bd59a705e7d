"""Tensor parallelism in the engine (``engine/parallel/``): rank 1 is a real process, started and stopped by the
engine; greedy output equals one rank's token for token; refusals and rank failures are clean and bounded."""

from __future__ import annotations

import os
import random
import signal
import threading

import pytest
import torch

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine, EngineDead
from engine.core.speculation import SpeculativeConfig
from engine.errors import InvalidRequest, TensorParallelError
from tests.conftest import TINY_SPEC_NAMES

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
NGRAM = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, probe_tokens=1000)  # drafts at any match


def _prompts(vocab: int, seed: int, lengths=(7, 50, 200)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _generate(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _one_by_one(llm: LLM, prompts) -> list[list[int]]:
    return [_generate(llm, [p])[0] for p in prompts]


def _assert_pool_full(llm: LLM) -> None:
    pool = llm.engine.kv_cache_manager.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


def _stopped(llm: LLM) -> bool:
    return all(proc.poll() is not None for proc in llm.engine.tp.procs)


@pytest.mark.parametrize("name", TINY_SPEC_NAMES)
def test_greedy_output_with_two_ranks_equals_one_rank(tiny_checkpoints, name):
    """Chunked prefills (a 64-token budget) mixed with decodes, windows ending mid-block (mistral, qwen2), q/k
    norms (qwen3), tied embeddings in a sharded checkpoint (llama3)."""
    checkpoint = tiny_checkpoints[name]
    prompts = _prompts(checkpoint.vocab_size, seed=1)
    one_rank = LLM(str(checkpoint.path), num_blocks=64, max_num_batched_tokens=64)
    expected = _generate(one_rank, prompts)
    with LLM(str(checkpoint.path), num_blocks=64, max_num_batched_tokens=64, tensor_parallel_size=2) as llm:
        assert _generate(llm, prompts) == expected
        # scoring (and calibration) packs its own step for the other rank
        torch.testing.assert_close(llm.engine.prompt_logits(prompts[1]), one_rank.engine.prompt_logits(prompts[1]),
                                   rtol=1e-4, atol=1e-4)
        runner = llm.engine.runner
        assert runner.kv_cache.shape[4] == 1 and len(runner.kv_ranks) == 2  # each rank holds 1 of the 2 KV heads
        assert llm.engine.tensor_parallel_size == 2
        _assert_pool_full(llm)
    assert _stopped(llm)


def test_quantized_kv_host_tier_and_ngram_drafts_under_two_ranks(tiny_checkpoints):
    """An int8 cache of 10 blocks over a 16-block host tier, with n-gram drafts: each rank quantizes its own
    heads, rank 0 copies every rank's blocks to and from the host tier, drafts ride the broadcast step. (A prefix
    hit reads dequantized KV where the first run attended to its own full-precision K/V, so the second round is
    compared with one rank's second round, not with the first.)"""
    checkpoint = tiny_checkpoints["qwen3"]
    prompts = _prompts(checkpoint.vocab_size, seed=2, lengths=(60,) * 6)
    args = dict(num_blocks=10, kv_host_blocks=16, kv_cache_dtype="int8", speculative_config=NGRAM)
    one_rank = LLM(str(checkpoint.path), **args)
    expected = _one_by_one(one_rank, prompts), _one_by_one(one_rank, prompts[3:])
    with LLM(str(checkpoint.path), tensor_parallel_size=2, **args) as llm:
        # the second round finds the prefixes in the host tier
        assert (_one_by_one(llm, prompts), _one_by_one(llm, prompts[3:])) == expected
        stats = llm.engine.stats()
        assert stats.host_tier_loaded > 0 and stats.host_tier_saved > 0 and stats.spec_draft_tokens > 0
        _assert_pool_full(llm)


def test_a_draft_model_runs_whole_on_rank_zero(tiny_checkpoints):
    target, draft = tiny_checkpoints["llama"], tiny_checkpoints["qwen2"]  # the same vocabulary, other weights
    spec = SpeculativeConfig(model=str(draft.path), num_speculative_tokens=3, probe_tokens=1000)
    prompts = _prompts(target.vocab_size, seed=3, lengths=(20, 40))
    expected = _generate(LLM(str(target.path), num_blocks=64), prompts)
    with LLM(str(target.path), num_blocks=64, speculative_config=spec, tensor_parallel_size=2) as llm:
        assert _generate(llm, prompts) == expected
        assert llm.engine.stats().spec_draft_tokens > 0
        _assert_pool_full(llm)


@pytest.mark.parametrize("size, what", [(3, r"attention heads \(4\)"), (4, r"KV heads \(2\)")])
def test_a_degree_that_does_not_split_the_heads_is_refused_before_loading(tiny_checkpoints, size, what):
    with pytest.raises(InvalidRequest, match=f"tensor_parallel_size {size} does not divide the model's {what}"):
        LLM(str(tiny_checkpoints["llama"].path), num_blocks=16, tensor_parallel_size=size)
    with pytest.raises(InvalidRequest, match="tensor_parallel_size must be >= 1"):
        LLM(str(tiny_checkpoints["llama"].path), tensor_parallel_size=0)


def test_a_rank_killed_mid_generation_fails_the_engine_with_its_exit_status(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama"].path), num_blocks=32, tensor_parallel_size=2, tp_timeout_s=30)
    try:
        rank1 = llm.engine.tp.procs[0]
        assert _generate(llm, [[5, 6, 7]])  # the ranks work

        def kill_rank1(done: int, total: int) -> None:
            if rank1.returncode is None:
                os.kill(rank1.pid, signal.SIGKILL)  # not reaped here: the next step finds out on its own

        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, progress=kill_rank1)
        _assert_pool_full(llm)  # generate aborted its request
        with pytest.raises(TensorParallelError, match="rank 1"):
            _generate(llm, [[8, 9]])  # every later step refuses at once
    finally:
        llm.close()
    assert _stopped(llm)


def test_a_hung_rank_fails_the_step_after_the_timeout(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama"].path), num_blocks=32, tensor_parallel_size=2, tp_timeout_s=2)
    rank1 = llm.engine.tp.procs[0]
    os.kill(rank1.pid, signal.SIGSTOP)
    try:
        with pytest.raises(TensorParallelError, match="collective failed"):
            _generate(llm, [[5, 6, 7]])
        _assert_pool_full(llm)
    finally:
        os.kill(rank1.pid, signal.SIGCONT)
        llm.close()
    assert _stopped(llm)


def test_an_idle_engine_loop_stops_when_a_rank_dies(tiny_checkpoints):
    """The async engine notices a dead rank between steps, with nothing to run: ``on_dead`` tells the shell (a
    worker exits, so the router routes around it) and every later call fails with EngineDead."""
    llm = LLM(str(tiny_checkpoints["llama"].path), num_blocks=32, tensor_parallel_size=2)
    dead = threading.Event()
    errors: list[BaseException] = []
    async_engine = AsyncEngine(llm.engine, on_dead=lambda exc: (errors.append(exc), dead.set()))
    async_engine.start()
    try:
        os.kill(llm.engine.tp.procs[0].pid, signal.SIGKILL)
        assert dead.wait(30), "the engine loop did not notice the dead rank"
        assert isinstance(errors[0], TensorParallelError) and "rank 1" in str(errors[0])
        with pytest.raises(EngineDead):
            async_engine._check_alive()
    finally:
        async_engine.stop()
        llm.close()
    assert _stopped(llm)


@pytest.mark.slow
def test_the_real_model_with_three_ranks_equals_one_rank():
    """SmolLM2-135M (9 heads, 3 KV heads: 3 ranks of 3 and 1; 2 is refused); about 2 minutes on 2 cores."""
    prompts = ["The capital of France is", "def fibonacci(n):\n    "]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM("smollm2", num_blocks=64).generate(prompts, params)]
    with pytest.raises(InvalidRequest, match=r"attention heads \(9\)"):
        LLM("smollm2", tensor_parallel_size=2)
    with LLM("smollm2", num_blocks=64, tensor_parallel_size=3) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        _assert_pool_full(llm)
