"""Scheduler driven by hand (no model): schedule() -> fake sampled tokens -> update().

10-block pool, block_size 4, exact block ids (vLLM style). Every scenario runs to completion and ends
with the pool full and ``check_invariants()`` passing; a Hypothesis test runs random workloads.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, SchedulerConfig
from engine.core.block_pool import BlockEventKind
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import RequestDelta, SampledTokens, SchedulerOutput
from engine.core.request import FinishReason, Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams

BS = 4
FINGERPRINT = b"x" * 16
Sampler = Callable[[Request], int]


def make_scheduler(
    *, num_blocks: int = 10, max_num_batched_tokens: int = 64, max_num_seqs: int = 8, max_model_len: int = 40,
    chunked: bool = True,
) -> Scheduler:
    kv = KVCacheManager(CacheConfig(block_size=BS, num_blocks=num_blocks), FINGERPRINT)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(config, kv)


def make_request(
    request_id: str, prompt, *, max_tokens: int = 16, priority: int = 0, eos=(), cache_salt: str = "", **params
) -> Request:
    return Request(
        request_id=request_id, prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, **params), seed=0,
        eos_token_ids=frozenset(eos), priority=priority, cache_salt=cache_salt,
    )


def positional_token(request: Request) -> int:
    """A fake greedy model: the next token depends only on the position (so recompute reproduces it)."""
    return 1000 + request.num_tokens


def step(sched: Scheduler, sample: Sampler = positional_token) -> tuple[SchedulerOutput, dict[str, RequestDelta]]:
    out = sched.schedule()
    tokens = [sample(seq.request) for seq in out.seqs if seq.samples]
    deltas = sched.update(out, SampledTokens(tokens))
    sched.kv_cache.pool.check_invariants()
    assert len({d.request_id for d in deltas}) == len(deltas)
    return out, {d.request_id: d for d in deltas}


def view(out: SchedulerOutput) -> list[tuple[str, int, int, tuple[int, ...]]]:
    return [(s.request.request_id, s.start, s.num_new_tokens, s.block_ids) for s in out.seqs]


def scripted(tokens: dict[str, list[int]]) -> Sampler:
    iters = {rid: iter(seq) for rid, seq in tokens.items()}
    return lambda request: next(iters[request.request_id])


def run_to_completion(sched: Scheduler, sample: Sampler = positional_token, max_steps: int = 200) -> dict:
    finished: dict[str, RequestDelta] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return finished
        _, deltas = step(sched, sample)
        finished.update({rid: d for rid, d in deltas.items() if d.finished})
    raise AssertionError("scheduler did not drain")


def assert_drained(sched: Scheduler) -> None:
    pool = sched.kv_cache.pool
    assert not sched.has_unfinished()
    assert sched.kv_cache.num_requests() == 0
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks
    assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))


# ---- chunked prefill, mixing, limits ----------------------------------------------------------
def test_chunked_prefill_splits_a_prompt_by_the_token_budget():
    sched = make_scheduler(max_num_batched_tokens=4)
    a = make_request("a", range(10), max_tokens=2)
    sched.add_request(a)
    out, deltas = step(sched)
    assert view(out) == [("a", 0, 4, (0,))]
    assert out.num_batched_tokens == 4 and not out.seqs[0].samples and deltas == {}
    out, deltas = step(sched)
    assert view(out) == [("a", 4, 4, (0, 1))]
    assert deltas == {}
    assert a.output_token_ids == []
    out, deltas = step(sched)
    assert view(out) == [("a", 8, 2, (0, 1, 2))]
    assert out.num_batched_tokens == 2
    assert deltas["a"].new_token_ids == [1010] and not deltas["a"].finished
    out, deltas = step(sched)
    assert view(out) == [("a", 10, 1, (0, 1, 2))]
    assert deltas["a"].finish_reason is FinishReason.LENGTH
    assert a.output_token_ids == [1010, 1011]
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert_drained(sched)


def test_decode_and_prefill_share_one_token_budget():
    sched = make_scheduler(max_num_batched_tokens=6)
    sched.add_request(make_request("a", range(5), max_tokens=5))
    out, _ = step(sched)
    assert view(out) == [("a", 0, 5, (0, 1))]
    sched.add_request(make_request("b", range(100, 108), max_tokens=1))
    out, deltas = step(sched)
    assert view(out) == [("a", 5, 1, (0, 1)), ("b", 0, 5, (2, 3))]  # the decode first, the prefill gets the rest
    assert out.num_batched_tokens == 6
    assert list(deltas) == ["a"]
    out, deltas = step(sched)
    assert view(out) == [("a", 6, 1, (0, 1)), ("b", 5, 3, (2, 3))]
    assert out.num_batched_tokens == 4
    assert deltas["b"].finish_reason is FinishReason.LENGTH
    out, _ = step(sched)
    assert view(out) == [("a", 7, 1, (0, 1))]
    out, deltas = step(sched)
    assert view(out) == [("a", 8, 1, (0, 1, 4))]  # b's full blocks stay cached (evictable); 4 is plain free
    assert deltas["a"].finish_reason is FinishReason.LENGTH
    assert_drained(sched)


def test_a_request_waits_for_the_prefix_another_is_computing_then_takes_it_from_the_cache():
    sched = make_scheduler(max_num_batched_tokens=8)
    shared = list(range(12))  # 3 full blocks
    sched.add_request(make_request("a", shared + [50, 51], max_tokens=1))
    sched.add_request(make_request("b", shared + [60, 61, 62], max_tokens=1))
    sched.add_request(make_request("c", range(100, 103), max_tokens=1))  # no full block: never held back
    out, _ = step(sched)
    assert view(out) == [("a", 0, 8, (0, 1))]  # a's first chunk takes the whole budget
    out, deltas = step(sched)
    # a's blocks 0-1 are cached now, block 2 is in a's last chunk: b waits for it, c takes the rest
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in out.seqs] == [("a", 8, 6), ("c", 0, 2)]
    assert sched.num_prefix_waits == 1 and deltas["a"].finished
    out, deltas = step(sched)
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in out.seqs] == [("c", 2, 1), ("b", 12, 3)]
    assert deltas["b"].num_cached_tokens == 12  # all three shared blocks from the cache: only its tail computed
    assert_drained(sched)


def test_two_waiting_requests_with_a_new_prefix_compute_it_once():
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.add_request(make_request("a", range(9), max_tokens=1))
    sched.add_request(make_request("b", range(10), max_tokens=1))
    sched.add_request(make_request("other-tenant", range(10), max_tokens=1, cache_salt="t2"))
    out, deltas = step(sched)
    assert [s.request.request_id for s in out.seqs] == ["a", "other-tenant"]  # another salt shares no block
    out, deltas = step(sched)
    assert view(out)[0][:3] == ("b", 8, 2) and deltas["b"].num_cached_tokens == 8
    assert_drained(sched)


def test_without_prefix_caching_nothing_waits():
    kv = KVCacheManager(CacheConfig(block_size=BS, num_blocks=10, enable_prefix_caching=False), FINGERPRINT)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=40), kv)
    sched.add_request(make_request("a", range(9), max_tokens=1))
    sched.add_request(make_request("b", range(10), max_tokens=1))
    out, _ = step(sched)
    assert [s.request.request_id for s in out.seqs] == ["a", "b"] and sched.num_prefix_waits == 0
    assert_drained(sched)


def test_max_num_seqs_is_respected():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid, [ord(rid)] * 4, max_tokens=2))
    out, _ = step(sched)
    assert [s.request.request_id for s in out.seqs] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]
    out, deltas = step(sched)
    assert [s.request.request_id for s in out.seqs] == ["a", "b"]
    assert deltas["a"].finished and deltas["b"].finished
    out, _ = step(sched)
    assert view(out) == [("c", 0, 4, (4,))]  # a held 0-1 and b 2-3; c takes the next never-used block
    run_to_completion(sched)
    assert_drained(sched)


def test_waiting_order_is_priority_then_arrival():
    sched = make_scheduler()
    specs = [("r0", 1), ("r1", 0), ("r2", 0), ("r3", 1), ("r4", -1)]
    for rid, priority in specs:
        sched.add_request(make_request(rid, [int(rid[1])] * 3, max_tokens=1, priority=priority))
    out, deltas = step(sched)
    assert [s.request.request_id for s in out.seqs] == ["r4", "r1", "r2", "r0", "r3"]
    assert all(d.finished for d in deltas.values())
    assert_drained(sched)


def test_one_seq_at_a_time_runs_in_priority_then_fcfs_order():
    sched = make_scheduler(max_num_seqs=1)
    for rid, priority in [("r0", 1), ("r1", 0), ("r2", 0), ("r3", 1)]:
        sched.add_request(make_request(rid, [int(rid[1])] * 3, max_tokens=1, priority=priority))
    order = []
    while sched.has_unfinished():
        out, _ = step(sched)
        order += [s.request.request_id for s in out.seqs]
    assert order == ["r1", "r2", "r0", "r3"]
    assert_drained(sched)


def test_empty_schedule():
    sched = make_scheduler()
    out = sched.schedule()
    assert out.is_empty and out.num_batched_tokens == 0 and out.preempted_ids == ()
    assert sched.update(out, SampledTokens([])) == []


def test_duplicate_request_id_is_refused():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(make_request("a", [2]))
    finished = run_to_completion(sched)
    assert list(finished) == ["a"]
    assert_drained(sched)


def test_prefill_without_chunking_waits_for_a_step_with_room():
    sched = make_scheduler(max_num_batched_tokens=8, max_model_len=8, chunked=False)
    sched.add_request(make_request("a", range(6), max_tokens=2))
    sched.add_request(make_request("b", range(100, 104), max_tokens=1))
    out, _ = step(sched)
    assert view(out) == [("a", 0, 6, (0, 1))]  # b's 4 tokens do not fit in the 2 left; it is not split
    out, _ = step(sched)
    assert view(out) == [("a", 6, 1, (0, 1)), ("b", 0, 4, (2,))]
    run_to_completion(sched)
    assert_drained(sched)


def test_prefill_without_chunking_refuses_a_budget_below_max_model_len():
    # Without chunking, a request longer than the budget (a long prompt, or a preempted request that grew)
    # could never be admitted again: the configuration that could deadlock is refused up front.
    with pytest.raises(InvalidRequest, match="max_num_batched_tokens"):
        make_scheduler(max_num_batched_tokens=7, max_model_len=16, chunked=False)
    make_scheduler(max_num_batched_tokens=7, max_model_len=16, num_blocks=1, chunked=True)  # chunking: fine
    make_scheduler(max_num_batched_tokens=4, max_model_len=16, num_blocks=1, chunked=False)  # capped at 4


# ---- preemption -----------------------------------------------------------------------------
def test_preemption_takes_the_newest_and_readmits_it_from_the_prefix_cache():
    sched = make_scheduler()
    a = make_request("a", range(0, 12), max_tokens=2)
    b = make_request("b", range(100, 112), max_tokens=4)
    c = make_request("c", range(200, 212), max_tokens=3)
    for request in (a, b, c):
        sched.add_request(request)
    out, _ = step(sched)
    assert view(out) == [("a", 0, 12, (0, 1, 2)), ("b", 0, 12, (3, 4, 5)), ("c", 0, 12, (6, 7, 8))]
    c_first_token = c.output_token_ids[0]
    c_hashes = list(c.block_hashes)
    sched.kv_cache.pool.take_events()

    # Each needs a fourth block; one is free. a takes it, b's growth preempts c (the newest).
    out, deltas = step(sched)
    assert out.preempted_ids == ("c",)
    assert view(out) == [("a", 12, 1, (0, 1, 2, 9)), ("b", 12, 1, (3, 4, 5, 8))]
    assert c.status is RequestStatus.PREEMPTED and c in sched.waiting
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert c.output_token_ids == [c_first_token]  # tokens are preserved across the preemption
    assert sched.kv_cache.block_ids("c") == []
    removed = [e for e in sched.kv_cache.pool.take_events() if e.kind is BlockEventKind.REMOVED]
    assert [(e.block_id, e.block_hash) for e in removed] == [(8, c_hashes[2])]  # c's tail evicted first
    assert deltas["a"].finish_reason is FinishReason.LENGTH

    # c comes back: blocks 6 and 7 are still cached, so only tokens 8..12 are recomputed.
    out, deltas = step(sched)
    assert out.preempted_ids == ()
    assert view(out) == [("b", 13, 1, (3, 4, 5, 8)), ("c", 8, 5, (6, 7, 9, 2))]
    assert deltas["c"].new_token_ids == [1013]  # the last prefill chunk samples c's next token
    assert sched.kv_cache.pool.lookup(c_hashes[2]) == 9  # the recomputed third block is published again
    assert c.status is RequestStatus.RUNNING
    assert c.num_cached_tokens == 0  # counts only the first admission
    assert (sched.kv_cache.pool.num_cache_queries, sched.kv_cache.pool.num_cache_hits) == (9, 2)
    assert c.output_token_ids == [c_first_token, 1013]

    finished = run_to_completion(sched)
    assert set(finished) == {"b", "c"}
    assert c.output_token_ids == [1012, 1013, 1014]  # the same tokens as without a preemption
    assert b.output_token_ids == [1012, 1013, 1014, 1015]
    assert sched.num_preemptions == 1 and sched.stats().num_preemptions == 1
    assert_drained(sched)


def test_preemption_takes_the_lowest_priority_even_if_older():
    sched = make_scheduler()
    low = make_request("low", range(0, 20), max_tokens=3, priority=1)
    high = make_request("high", range(100, 120), max_tokens=2, priority=0)
    sched.add_request(low)
    sched.add_request(high)
    out, _ = step(sched)
    assert view(out) == [("high", 0, 20, (0, 1, 2, 3, 4)), ("low", 0, 20, (5, 6, 7, 8, 9))]
    out, deltas = step(sched)
    assert out.preempted_ids == ("low",)
    assert view(out) == [("high", 20, 1, (0, 1, 2, 3, 4, 9))]  # low's tail block (9) evicted for high
    assert deltas["high"].finished
    out, _ = step(sched)
    assert view(out) == [("low", 16, 5, (5, 6, 7, 8, 9, 4))]  # 4 blocks hit; 9 plain free, 4 evicted
    run_to_completion(sched)
    assert low.output_token_ids == [1020, 1021, 1022]
    assert_drained(sched)


def test_a_later_higher_priority_request_runs_first_and_preempts_an_older_lower_one():
    sched = make_scheduler()
    low = make_request("low", range(0, 20), max_tokens=5, priority=1)
    high = make_request("high", range(100, 116), max_tokens=2, priority=0)
    sched.add_request(low)
    out, _ = step(sched)
    assert view(out) == [("low", 0, 20, (0, 1, 2, 3, 4))]
    sched.add_request(high)
    out, _ = step(sched)
    assert view(out) == [("low", 20, 1, (0, 1, 2, 3, 4, 5)), ("high", 0, 16, (6, 7, 8, 9))]
    out, deltas = step(sched)  # high now goes first; its growth preempts low, not itself
    assert out.preempted_ids == ("low",)
    assert view(out) == [("high", 16, 1, (6, 7, 8, 9, 5))]
    assert deltas["high"].finish_reason is FinishReason.LENGTH
    out, _ = step(sched)
    assert view(out) == [("low", 20, 2, (0, 1, 2, 3, 4, 5))]  # five blocks back from the cache
    run_to_completion(sched)
    assert low.output_token_ids == [1020, 1021, 1022, 1023, 1024]
    assert_drained(sched)


def test_max_model_len_is_capped_at_the_pool_so_a_lone_request_always_fits():
    # max_model_len caps at the pool (40 tokens): a lone request fills exactly the 10 blocks.
    sched = make_scheduler(max_model_len=1000)
    assert sched.max_model_len == 40
    a = make_request("a", range(38), max_tokens=16)
    sched.add_request(a)
    finished = run_to_completion(sched)
    assert finished["a"].finish_reason is FinishReason.LENGTH
    assert a.num_tokens == 40 and a.num_output_tokens == 2
    assert sched.num_preemptions == 0
    assert_drained(sched)


# ---- stopping -------------------------------------------------------------------------------
def test_stop_on_eos():
    sched = make_scheduler()
    a = make_request("a", [1, 2, 3], eos=[2])
    sched.add_request(a)
    finished = run_to_completion(sched, scripted({"a": [5, 2, 9]}))
    assert finished["a"].finish_reason is FinishReason.STOP
    assert finished["a"].new_token_ids == [2]
    assert a.output_token_ids == [5, 2]
    assert a.stop_reason == 2 and a.status is RequestStatus.FINISHED_STOPPED
    assert_drained(sched)


def test_ignore_eos_runs_to_max_tokens():
    sched = make_scheduler()
    a = make_request("a", [1, 2, 3], eos=[2], ignore_eos=True, max_tokens=3)
    sched.add_request(a)
    finished = run_to_completion(sched, scripted({"a": [2, 2, 2, 2]}))
    assert finished["a"].finish_reason is FinishReason.LENGTH
    assert a.output_token_ids == [2, 2, 2] and a.stop_reason is None
    assert_drained(sched)


def test_stop_token_ids_stop_even_with_ignore_eos():
    sched = make_scheduler()
    a = make_request("a", [1, 2, 3], eos=[2], stop_token_ids=[7], ignore_eos=True)
    sched.add_request(a)
    finished = run_to_completion(sched, scripted({"a": [2, 5, 7, 9]}))
    assert finished["a"].finish_reason is FinishReason.STOP
    assert a.output_token_ids == [2, 5, 7] and a.stop_reason == 7
    assert_drained(sched)


def test_min_tokens_delays_eos_and_stop_tokens():
    sched = make_scheduler()
    a = make_request("a", [1, 2, 3], eos=[2], min_tokens=3)
    b = make_request("b", [4, 5, 6], stop_token_ids=[7], min_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    finished = run_to_completion(sched, scripted({"a": [2, 2, 2, 2], "b": [7, 7, 7]}))
    assert a.output_token_ids == [2, 2, 2]
    assert b.output_token_ids == [7, 7]
    assert finished["a"].finish_reason is finished["b"].finish_reason is FinishReason.STOP
    assert_drained(sched)


def test_max_tokens_finishes_with_length():
    sched = make_scheduler()
    a = make_request("a", [1, 2, 3], max_tokens=3)
    sched.add_request(a)
    finished = run_to_completion(sched)
    assert finished["a"].finish_reason is FinishReason.LENGTH
    assert a.output_token_ids == [1003, 1004, 1005]
    assert a.status is RequestStatus.FINISHED_LENGTH and a.stop_reason is None
    assert_drained(sched)


def test_max_model_len_caps_the_output():
    sched = make_scheduler(max_model_len=12)
    a = make_request("a", range(10), max_tokens=16)
    sched.add_request(a)
    finished = run_to_completion(sched)
    assert finished["a"].finish_reason is FinishReason.LENGTH
    assert a.num_output_tokens == 2 and a.num_tokens == 12
    assert_drained(sched)


def test_finished_delta_reports_prompt_and_cached_tokens():
    sched = make_scheduler()
    first = make_request("first", range(10), max_tokens=1)
    sched.add_request(first)
    run_to_completion(sched)
    second = make_request("second", range(10), max_tokens=1)
    sched.add_request(second)
    finished = run_to_completion(sched)
    assert finished["second"].num_prompt_tokens == 10
    assert finished["second"].num_cached_tokens == 8
    assert second.num_cached_tokens == 8
    assert_drained(sched)


# ---- aborts ---------------------------------------------------------------------------------
def test_abort_waiting_request():
    sched = make_scheduler(max_num_seqs=1)
    a = make_request("a", range(4), max_tokens=2)
    b = make_request("b", range(100, 104), max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert b.status is RequestStatus.WAITING
    delta = sched.abort("b")
    assert delta == RequestDelta("b", [], FinishReason.ABORT, [], 4, 0)
    assert b.status is RequestStatus.FINISHED_ABORTED
    assert b not in sched.waiting
    assert sched.abort("b") is None  # already gone
    run_to_completion(sched)
    assert_drained(sched)


def test_abort_running_request_frees_its_blocks():
    sched = make_scheduler(max_num_batched_tokens=4)
    a = make_request("a", range(10))
    sched.add_request(a)
    step(sched)
    step(sched)
    assert sched.kv_cache.block_ids("a") == [0, 1]
    delta = sched.abort("a")
    assert delta.finish_reason is FinishReason.ABORT and delta.new_token_ids == []
    assert a.status is RequestStatus.FINISHED_ABORTED
    assert sched.running == [] and sched.schedule().is_empty
    assert_drained(sched)


def test_abort_preempted_request():
    sched = make_scheduler()
    sched.add_request(make_request("a", range(0, 20), max_tokens=5))
    sched.add_request(make_request("b", range(100, 120), max_tokens=5))
    step(sched)
    out, _ = step(sched)
    assert out.preempted_ids == ("b",)
    assert sched.abort("b").finish_reason is FinishReason.ABORT
    run_to_completion(sched)
    assert_drained(sched)


def test_abort_unknown_request():
    assert make_scheduler().abort("nope") is None


def test_stats():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", range(6)))
    sched.add_request(make_request("b", range(6)))
    step(sched)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert (stats.num_free_blocks, stats.num_total_blocks) == (8, 10)
    assert stats.kv_cache_usage == pytest.approx(0.2)
    run_to_completion(sched)
    assert_drained(sched)


# ---- random workloads -----------------------------------------------------------------------
EOS = 0


@st.composite
def workloads(draw):
    """Random geometry and requests; a ``crowded`` workload arrives at once into a tight pool (preemptions)."""
    crowded = draw(st.booleans())
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(min_value=2, max_value=6 if crowded else 12))
    max_model_len = draw(st.integers(min_value=2, max_value=num_blocks * block_size + 4))
    cap = min(max_model_len, num_blocks * block_size)
    chunked = draw(st.booleans())
    budget_min = 1 if chunked else cap  # without chunking a whole prompt must fit one step's budget
    budget = draw(st.integers(min_value=budget_min, max_value=max(budget_min, 64 if crowded else 24)))
    max_num_seqs = draw(st.integers(min_value=3 if crowded else 1, max_value=8 if crowded else 4))
    base = draw(st.lists(st.integers(min_value=1, max_value=3), min_size=cap, max_size=cap))  # shared prefixes
    requests = []
    for i in range(draw(st.integers(min_value=1, max_value=8))):
        prompt_len = draw(st.integers(min_value=1, max_value=max(1, cap - 1)))
        shared = draw(st.integers(min_value=0, max_value=prompt_len))
        tail = draw(st.lists(st.integers(min_value=1, max_value=9), min_size=prompt_len - shared,
                             max_size=prompt_len - shared))
        max_tokens = draw(st.integers(min_value=1, max_value=12))
        requests.append(dict(
            request_id=f"r{i}", prompt=base[:shared] + tail, max_tokens=max_tokens,
            min_tokens=draw(st.integers(min_value=0, max_value=min(2, max_tokens))),
            priority=draw(st.integers(min_value=0, max_value=2)),
            salt=draw(st.sampled_from(["", "", "t"])),
            arrival_step=0 if crowded else draw(st.integers(min_value=0, max_value=4)),
            abort_step=draw(st.one_of(st.none(), st.none(), st.integers(min_value=0, max_value=12))),
        ))
    return dict(block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len, chunked=chunked,
                budget=budget, max_num_seqs=max_num_seqs, requests=requests)


def model_token(prompt: list[int], position: int) -> int:
    """The fake model's output at ``position``: a function of the prompt and position; EOS now and then."""
    return (sum(prompt) * 7 + position * 13) % 11


def fake_token(request: Request) -> int:
    return model_token(request.prompt_token_ids, request.num_tokens)


class FakeKV:
    """Simulated KV contents per block slot: every step must read exactly the tokens it computed before."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}

    def run(self, out: SchedulerOutput) -> None:
        bs = self.block_size
        for seq in out.seqs:
            tokens = seq.request.all_token_ids
            assert len(seq.block_ids) * bs >= seq.end
            for pos in range(seq.start):  # attention reads the whole prefix from the cache
                assert self.slots.get((seq.block_ids[pos // bs], pos % bs)) == tokens[pos], (
                    f"{seq.request.request_id}: KV at position {pos} is wrong"
                )
            for pos in range(seq.start, seq.end):
                self.slots[(seq.block_ids[pos // bs], pos % bs)] = tokens[pos]


def check_step(sched: Scheduler, out: SchedulerOutput, config: dict) -> None:
    ids = [s.request.request_id for s in out.seqs]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    assert len(ids) <= config["max_num_seqs"]
    assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.seqs) <= config["budget"]
    assert all(s.num_new_tokens > 0 and s.start == s.request.num_computed_tokens for s in out.seqs)
    assert all(s.request.status is RequestStatus.RUNNING for s in out.seqs)
    if not config["chunked"]:
        assert all(s.start + s.num_new_tokens == s.request.num_tokens for s in out.seqs)
    pool, kv = sched.kv_cache.pool, sched.kv_cache
    holders = [0] * pool.num_blocks
    for request in sched.running:
        for block_id in kv.block_ids(request.request_id):
            holders[block_id] += 1
    assert holders == [pool.ref_count(b) for b in range(pool.num_blocks)], "ref counts != block holders"
    assert all(not kv.block_ids(r.request_id) for r in sched.waiting), "a waiting request holds blocks"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads())
def test_random_workloads_finish_without_leaks_or_deadlock(w):
    kv = KVCacheManager(CacheConfig(block_size=w["block_size"], num_blocks=w["num_blocks"]), FINGERPRINT)
    config = SchedulerConfig(max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=w["budget"],
                             max_model_len=w["max_model_len"], enable_chunked_prefill=w["chunked"])
    sched = Scheduler(config, kv)
    fake_kv = FakeKV(w["block_size"])
    specs = w["requests"]
    requests: dict[str, Request] = {}
    finished: dict[str, RequestDelta] = {}
    max_steps = 50 + 10 * sum(len(s["prompt"]) + s["max_tokens"] for s in specs)
    for step_no in range(max_steps):
        for spec in specs:
            if spec["arrival_step"] == step_no:
                request = make_request(spec["request_id"], spec["prompt"], max_tokens=spec["max_tokens"],
                                       min_tokens=spec["min_tokens"], priority=spec["priority"],
                                       eos=[EOS], cache_salt=spec["salt"])
                requests[request.request_id] = request
                sched.add_request(request)
            if spec["abort_step"] == step_no and spec["request_id"] in requests:
                delta = sched.abort(spec["request_id"])
                if delta is not None:
                    assert spec["request_id"] not in finished
                    assert delta.finish_reason is FinishReason.ABORT
                    finished[delta.request_id] = delta
        if len(requests) == len(specs) and not sched.has_unfinished():
            break
        out = sched.schedule()
        check_step(sched, out, w)
        fake_kv.run(out)
        tokens = [fake_token(s.request) for s in out.seqs if s.samples]
        for delta in sched.update(out, SampledTokens(tokens)):
            if delta.finished:
                assert delta.request_id not in finished, "a request finished twice"
                finished[delta.request_id] = delta
        kv.pool.check_invariants()
        assert sched.kv_cache.num_requests() == len(sched.running)
    else:
        raise AssertionError(f"no progress after {max_steps} steps: deadlock or livelock")

    assert set(finished) == set(requests) == {s["request_id"] for s in specs}
    cap = sched.max_model_len
    for rid, request in requests.items():
        assert request.status.finished
        reason = finished[rid].finish_reason
        outputs = request.output_token_ids
        assert request.all_token_ids == request.prompt_token_ids + outputs
        params = request.sampling_params
        # Outputs are exactly what the fake model produces, whatever the preemptions in between.
        prompt = request.prompt_token_ids
        assert outputs == [model_token(prompt, len(prompt) + i) for i in range(len(outputs))]
        if reason is FinishReason.STOP:
            assert outputs[-1] == EOS and len(outputs) >= params.min_tokens
        elif reason is FinishReason.LENGTH:
            assert len(outputs) == params.max_tokens or request.num_tokens >= cap
        first_stoppable = max(params.min_tokens - 1, 0)
        assert EOS not in outputs[first_stoppable:-1], "generation went on past a stopping EOS"
        assert len(outputs) <= params.max_tokens and request.num_tokens <= cap
    assert_drained(sched)
