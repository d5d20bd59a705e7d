"""Speculative decoding with n-gram drafts (issue 24, item 1): the proposer and verification on exact values,
the scheduler's books (blocks given back after rejected drafts, stops inside accepted drafts, max_tokens), and
the engine end to end: greedy and seeded outputs identical with speculation on and off, drafts accepted."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.config import CacheConfig, SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import SampledTokens
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.speculation import SpeculativeConfig, Speculator, accepted, ngram_drafts
from engine.errors import InvalidRequest
from engine.tiny import build_model
from tests.tiny_model import shared_tiny


# ---- proposer and verification ----------------------------------------------------------------
def test_ngram_drafts_follow_the_most_recent_longest_match():
    #            0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]  # last 2-gram (2, 3) occurred at 1 and 5: the most recent wins
    assert ngram_drafts(tokens, 3, 2, 4) == [4, 5, 7]
    assert ngram_drafts(tokens, 10, 2, 4) == [4, 5, 7, 2, 3]  # up to the sequence's end
    assert ngram_drafts(tokens + [4, 5], 2, 2, 4) == [7, 2]  # (3, 4, 5) is the longest: after index 6..8
    assert ngram_drafts([1, 2, 3, 4], 3, 2, 4) == []  # no n-gram repeats
    assert ngram_drafts([5, 5], 3, 1, 4) == [5]  # (5,) occurred at 0: 1-grams allowed here
    assert ngram_drafts([7], 3, 1, 4) == []


def test_accepted_keeps_drafts_up_to_the_first_difference_then_the_targets_token():
    assert accepted([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted, plus the bonus token
    assert accepted([4, 5, 6], [4, 8, 6, 7]) == [4, 8]  # the target's own token replaces the first miss
    assert accepted([4, 5, 6], [9, 5, 6, 7]) == [9]
    assert accepted([], [3]) == [3]


def test_config_is_checked():
    with pytest.raises(InvalidRequest, match="not supported"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(InvalidRequest, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(InvalidRequest, match="unknown"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "draft_model": "x"})
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2}).num_speculative_tokens == 2


def test_a_request_whose_drafts_fail_stops_drafting():
    spec = Speculator(SpeculativeConfig(probe_tokens=8, min_acceptance=0.25))
    request = _request("r", [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=50)
    assert spec.drafts(request, 4) == [3, 1, 2]
    spec.record("r", 4, 1)
    spec.record("r", 4, 0)  # 1 of 8 accepted: below a quarter
    assert spec.drafts(request, 4) == []
    assert spec.forget("r") == (8, 1) and spec.drafts(request, 4) == [3, 1, 2]  # a new request with its id drafts


# ---- the scheduler's books ----------------------------------------------------------------------
def _request(rid: str, prompt: list[int], max_tokens: int = 16, **params) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(prompt), seed=0,
                   sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, **params))


def _scheduler(num_blocks: int = 16, k: int = 4) -> Scheduler:
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=num_blocks), b"x" * 16)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    return Scheduler(config, kv, Speculator(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1)))


def _step(sched: Scheduler, target):
    """One step whose 'model' samples ``target(request, offset)`` at each logit row."""
    out = sched.schedule()
    tokens = [target(s.request, j) for s in out.seqs for j in range(s.num_rows)]
    deltas = sched.update(out, SampledTokens(tokens))
    sched.kv_cache.pool.check_invariants()
    return out, {d.request_id: d for d in deltas}


def test_rejected_drafts_give_their_blocks_back_and_accepted_ones_count_as_computed():
    sched = _scheduler()
    request = _request("r", [1, 2, 3, 4, 5, 6, 1, 2], max_tokens=12)
    sched.add_request(request)
    _step(sched, lambda r, j: 3)  # prefill samples 3: ... 6 1 2 3, whose (1, 2, 3) occurred at the start
    out, deltas = _step(sched, lambda r, j: [4, 9, 9, 9, 9][j])  # drafts 4 5 6 1: only the first accepted
    seq = out.seqs[0]
    assert seq.draft_token_ids == (4, 5, 6, 1) and (seq.start, seq.num_new_tokens) == (8, 5)
    assert len(seq.block_ids) == 4  # room for 13 tokens
    assert deltas["r"].new_token_ids == [4, 9]  # one draft accepted, then the target's own token
    assert request.num_computed_tokens == 10 and request.num_tokens == 11  # token 3 and draft 4 computed
    assert sched.kv_cache.block_ids("r") == list(seq.block_ids[:3])  # 11 tokens need 3 blocks: the 4th went back
    assert sched.speculator.num_drafted == 4 and sched.speculator.num_accepted == 1


def test_a_stop_inside_accepted_drafts_ends_the_request_there_and_frees_everything():
    sched = _scheduler()
    request = _request("r", [1, 2, 3, 1], max_tokens=12, stop_token_ids=[1])
    sched.add_request(request)
    _step(sched, lambda r, j: 2)
    _, deltas = _step(sched, lambda r, j: [3, 1, 2, 5][j])  # drafts 3 1 2, all accepted, but 1 stops it
    assert deltas["r"].new_token_ids == [3, 1] and deltas["r"].finish_reason is not None
    assert deltas["r"].num_draft_tokens == 3 and deltas["r"].num_accepted_tokens == 3
    assert sched.kv_cache.pool.num_free_blocks == sched.kv_cache.pool.num_blocks


def test_drafts_never_run_past_max_tokens_or_the_budget():
    sched = _scheduler()
    request = _request("r", [1, 2, 3, 1, 2, 3, 1], max_tokens=3)
    sched.add_request(request)
    _step(sched, lambda r, j: 2)  # first output
    out, _ = _step(sched, lambda r, j: [3, 1][j])
    assert out.seqs[0].draft_token_ids == (3,)  # 2 outputs to go: one draft and the token after it
    assert not sched.has_unfinished()


# ---- the engine end to end -------------------------------------------------------------------
def _looping_prompts(vocab: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase (drafts from the prompt), and plain random ones (drafts from the output's
    own loops: the tiny random models fall into them)."""
    rng = random.Random(seed)
    phrase = [rng.randrange(3, vocab) for _ in range(12)]
    return [phrase * 4, [rng.randrange(3, vocab) for _ in range(30)], phrase * 2 + [rng.randrange(3, vocab)]]


def _generate(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, probe_tokens=1000)  # drafts at any match


@pytest.fixture(scope="module")
def trained_tiny(tmp_path_factory) -> str:
    """`baton model tiny`, briefly trained: its greedy outputs fall into loops, which n-gram drafts predict."""
    return str(shared_tiny(tmp_path_factory))


@pytest.mark.parametrize("name", ["llama", "mistral-swa", "qwen3"])
def test_greedy_output_is_identical_with_speculation_on(tiny_checkpoints, name):
    """Random checkpoints (windows ending mid-block on mistral): drafts are proposed at every 1-gram match and
    mostly rejected, so rollback runs at almost every step."""
    checkpoint = tiny_checkpoints[name]
    prompts = _looping_prompts(checkpoint.vocab_size, seed=4)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = _generate(LLM(str(checkpoint.path), num_blocks=64), prompts, params)
    llm = LLM(str(checkpoint.path), num_blocks=64, speculative_config=SPEC)
    assert _generate(llm, prompts, params) == expected
    stats = llm.engine.stats()
    assert stats.spec_draft_tokens >= 100 and stats.spec_steps >= 30
    assert stats.num_free_blocks == stats.num_total_blocks


def test_greedy_output_is_identical_where_most_drafts_are_accepted(trained_tiny):
    prompts = _looping_prompts(4096, seed=4)
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    expected = _generate(LLM(trained_tiny, num_blocks=64), prompts, params)
    llm = LLM(trained_tiny, num_blocks=64, speculative_config=SPEC)
    assert _generate(llm, prompts, params) == expected
    stats = llm.engine.stats()
    assert stats.spec_accepted_tokens >= 100 and stats.spec_accepted_tokens > stats.spec_draft_tokens / 2
    assert stats.num_free_blocks == stats.num_total_blocks


def test_seeded_sampling_is_identical_with_speculation_on_for_every_seed(trained_tiny):
    """20 seeds x 3 prompts, top-p sampling: each stream equal to speculation off (the test of 'same
    distribution': the same noise decides every token, drafts only skip forward passes)."""
    prompts = _looping_prompts(4096, seed=5)
    plain = LLM(trained_tiny, num_blocks=128)
    llm = LLM(trained_tiny, num_blocks=128, speculative_config=SPEC)
    for seed in range(20):
        params = SamplingParams(temperature=0.2, top_p=0.9, seed=seed, max_tokens=30, ignore_eos=True)
        assert _generate(llm, prompts, params) == _generate(plain, prompts, params), seed
    assert llm.engine.stats().spec_accepted_tokens >= 20  # drafts the sampled target agreed with


def test_penalties_logprobs_and_min_tokens_keep_their_meaning(trained_tiny):
    prompts = _looping_prompts(4096, seed=6)
    plain = LLM(trained_tiny, num_blocks=64)
    llm = LLM(trained_tiny, num_blocks=64, speculative_config=SPEC)
    cases = [SamplingParams(temperature=0, max_tokens=40, logprobs=2, min_tokens=30, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3, ignore_eos=True)]
    for params in cases:
        a = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        b = plain.generate([{"prompt_token_ids": p} for p in prompts], params)
        for x, y in zip(a, b):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            if params.logprobs:
                assert [e[0] for e in x.outputs[0].logprobs] == pytest.approx([e[0] for e in y.outputs[0].logprobs],
                                                                              abs=1e-4)
    assert llm.engine.stats().spec_accepted_tokens >= 50  # the logprobs case drafted (penalties never do)


# ---- a draft model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def undertrained_tiny(tmp_path_factory) -> str:
    """The tiny model trained less: the same tokenizer and vocabulary, other predictions (a draft)."""
    return str(build_model("tiny", tmp_path_factory.mktemp("tiny-draft"), train_steps=15, progress=lambda _: None))


def _draft(model: str, k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(model=model, num_speculative_tokens=k, probe_tokens=1000)


def test_the_target_as_its_own_draft_accepts_every_greedy_draft(trained_tiny):
    prompts = _looping_prompts(4096, seed=7)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = _generate(LLM(trained_tiny, num_blocks=64), prompts, params)
    llm = LLM(trained_tiny, num_blocks=64, speculative_config=_draft(trained_tiny))
    assert _generate(llm, prompts, params) == expected
    stats = llm.engine.stats()
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens >= 60  # the same model proposes what it picks
    assert stats.num_free_blocks == stats.num_total_blocks


def test_another_draft_model_keeps_outputs_identical_greedy_seeded_and_preempted(trained_tiny, undertrained_tiny):
    prompts = _looping_prompts(4096, seed=8)
    plain = LLM(trained_tiny, num_blocks=64)
    llm = LLM(trained_tiny, num_blocks=64, speculative_config=_draft(undertrained_tiny))
    for params in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=0.3, seed=11, max_tokens=40, ignore_eos=True)):
        assert _generate(llm, prompts, params) == _generate(plain, prompts, params)
    stats = llm.engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # a different model: some drafts fail
    tight = LLM(trained_tiny, num_blocks=8, speculative_config=_draft(undertrained_tiny))  # preempts under load
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert _generate(tight, prompts, params) == _generate(plain, prompts, params)
    assert tight.engine.stats().num_preemptions > 0


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_checkpoints, trained_tiny):
    with pytest.raises(InvalidRequest, match="vocabulary"):
        LLM(str(tiny_checkpoints["llama"].path), num_blocks=16, speculative_config=_draft(trained_tiny))
    with pytest.raises(InvalidRequest, match="needs a model"):
        SpeculativeConfig(method="draft_model")
