"""The modelled workers, step by step with exact times and block counts: P's chunked steps, prefix reuse, in-batch
sit-out and leases; D's segments, joins at a step boundary, local prefills chunked into its steps, memory waits.
Every scenario ends with the block pool's own invariants (``BlockPool.check_invariants``)."""

from __future__ import annotations

from collections import Counter

import pytest

from sim.decode_worker import DecodeWorker, LocalJob
from sim.kv_pool import KVPool
from sim.prefill_worker import PrefillJob, PrefillWorker
from sim.self_report import SelfReport


class StepTime:
    """1 s per step, plus 1 s per 100 prompt tokens in it."""

    def step_s(self, decode_seqs, decode_context, chunks=()):
        return 1.0 + sum(c.new for c in chunks) / 100

    def explain(self, decode_seqs, decode_context, chunks=()):
        return {}


def hashes(tag: str, n: int) -> tuple[bytes, ...]:
    return tuple(f"{tag}{i}".encode() for i in range(n))


def prefill_worker(num_blocks: int = 50, step_tokens: int = 100) -> PrefillWorker:
    return PrefillWorker("p0", KVPool(num_blocks), block_size=10, time_model=StepTime(), step_tokens=step_tokens,
                         report=SelfReport())


def decode_worker(num_blocks: int = 40, *, chunk: int = 100, cap: int = 64) -> DecodeWorker:
    return DecodeWorker("d0", KVPool(num_blocks), block_size=10, time_model=StepTime(), chunk_tokens=chunk,
                        report=SelfReport(), itl=Counter(), max_segment_steps=cap)


def run_prefill(worker: PrefillWorker, end_s: float | None) -> list[tuple[str, float]]:
    done = []
    while end_s is not None:
        finished, next_s = worker.end_step(end_s)
        done += [(job.request_id, job.finished_s) for job in finished]
        end_s = next_s
    return done


def test_a_prompt_is_computed_in_budgeted_chunks_and_pinned_until_pulled():
    p = prefill_worker()
    job = PrefillJob("a", hashes("x", 25), 250, 0.0)
    assert p.submit(job, 0.0) == 2.0  # 100 tokens: 1 + 100 / 100
    assert run_prefill(p, 2.0) == [("a", 5.5)]  # then 100 (4.0) and 50 (5.5)
    assert p.num_steps == 3 and p.busy_s == pytest.approx(5.5)
    assert p.pool.num_free_blocks == 25 and "a" in p.leases  # pinned under the lease
    assert p.release("a", 6.0) is None
    assert p.pool.num_free_blocks == 50 and p.pool.cached_prefix(job.hashes) == 25  # cached, evictable
    p.pool.check_drained()


def test_a_cached_prefix_is_reused_and_only_the_rest_computed():
    p = prefill_worker()
    run_prefill(p, p.submit(PrefillJob("a", hashes("x", 25), 250, 0.0), 0.0))
    p.release("a", 6.0)
    second = PrefillJob("b", hashes("x", 20) + hashes("y", 5), 250, 6.0)
    assert p.submit(second, 6.0) == pytest.approx(6.0 + 1.5)  # 50 tokens left after 200 cached
    assert second.cached_tokens == 200
    run_prefill(p, 7.5)
    p.release("b", 8.0)
    p.pool.check_drained()


def test_a_fully_cached_prompt_still_computes_its_last_token_block():
    p = prefill_worker()
    run_prefill(p, p.submit(PrefillJob("a", hashes("x", 10), 100, 0.0), 0.0))
    p.release("a", 3.0)
    again = PrefillJob("b", hashes("x", 10), 100, 3.0)
    p.submit(again, 3.0)
    assert again.cached_tokens == 90  # at most prompt - 1 tokens: the last block is recomputed


def test_a_prompt_waits_while_another_computes_its_prefix_then_reuses_it():
    p = prefill_worker(step_tokens=1000)
    first, second = PrefillJob("a", hashes("x", 20), 200, 0.0), PrefillJob("b", hashes("x", 20), 200, 0.0)
    assert p.submit(first, 0.0) == 3.0
    assert p.submit(second, 0.0) is None  # P is busy; b is admitted at the next step
    finished, next_s = p.end_step(3.0)
    assert [j.request_id for j in finished] == ["a"] and second.cached_tokens == 190
    assert next_s == pytest.approx(3.0 + 1.1)  # b computes its last block only


def test_the_sit_out_is_what_saves_the_work():
    p = prefill_worker(step_tokens=1000)
    first, second = PrefillJob("a", hashes("x", 20), 200, 0.0), PrefillJob("b", hashes("x", 20), 200, 0.0)
    p.waiting.extend([first, second])
    assert p._begin(0.0) == 3.0  # both ready at once: b still sits out behind a
    assert [j.request_id for j in p.running] == ["a"]


def test_a_prompt_waits_for_blocks_held_under_leases():
    p = prefill_worker(num_blocks=30)
    run_prefill(p, p.submit(PrefillJob("a", hashes("x", 25), 250, 0.0), 0.0))
    blocked = PrefillJob("b", hashes("y", 10), 100, 6.0)
    assert p.submit(blocked, 6.0) is None and p.load().waiting == 1
    assert p.load().queued_prefill_tokens == 100
    assert p.release("a", 7.0) == pytest.approx(9.0)  # the lease's blocks come back: b starts at once
    run_prefill(p, 9.0)
    p.release("b", 10.0)
    p.pool.check_drained()


def test_a_pulled_request_decodes_in_one_segment_and_frees_its_blocks():
    d = decode_worker()
    reservation = d.reserve_remote(hashes("x", 2), 20, 4)
    assert len(reservation.blocks) == 3  # 24 tokens
    assert d.join("r", reservation, hashes("x", 2), 20, 3, 0.5, 1.0) == (4.0, 1)  # 3 steps of 1 s
    outcome, nxt = d.on_step(4.0, 1)
    assert outcome.finished == [("r", 4.0)] and nxt is None
    assert d.itl == Counter({1.5: 1, 1.0: 2})  # first gap from P's first token at 0.5, then one per step
    assert d.pool.cached_prefix(hashes("x", 2)) == 2  # the pulled blocks stay cached
    d.pool.check_drained()


def test_a_join_takes_effect_at_the_next_step_boundary():
    d = decode_worker()
    first = d.reserve_remote(hashes("a", 1), 10, 11)
    assert d.join("r1", first, hashes("a", 1), 10, 10, 0.0, 0.0) == (10.0, 1)
    second = d.reserve_remote(hashes("b", 1), 10, 6)
    assert d.join("r2", second, hashes("b", 1), 10, 5, 2.0, 2.5) == (3.0, 2)  # cut after step 3
    stale, nxt = d.on_step(10.0, 1)  # the old segment's end is stale: nothing happens
    assert stale.finished == [] and nxt is None and d.running["r1"].remaining == 10
    outcome, nxt = d.on_step(3.0, 2)
    assert outcome.finished == [] and nxt == (8.0, 3)  # r1: 7 left, r2: 5 -> 5 steps
    outcome, nxt = d.on_step(8.0, 3)
    assert outcome.finished == [("r2", 8.0)] and nxt == (10.0, 4)
    outcome, nxt = d.on_step(10.0, 4)
    assert outcome.finished == [("r1", 10.0)] and nxt is None
    assert sum(d.itl.values()) == 10 + 5 and d.itl[2.0] == 1  # r2's first gap: 4.0 - 2.0
    d.pool.check_drained()


def test_a_local_prefill_rides_in_chunks_then_decodes():
    d = decode_worker()
    job = LocalJob("l", hashes("x", 25), 250, 2, 0.0)
    assert d.submit(job, 0.0) == (2.0, 1)
    times = []
    event = (2.0, 1)
    while event is not None:
        outcome, event = d.on_step(*event)
        times += [("first", j.request_id, t) for j, t in outcome.first_tokens]
        times += [("done", r, t) for r, t in outcome.finished]
    assert times == [("first", "l", 5.5), ("done", "l", 6.5)]  # chunks of 100, 100, 50, then one decode step
    assert d.report.prefill_tokens_per_s == pytest.approx(100 / 1.5, rel=0.5)
    assert d.pool.cached_prefix(job.hashes) == 25
    again = LocalJob("m", hashes("x", 10) + hashes("z", 5), 150, 1, 7.0)
    d.submit(again, 7.0)
    assert again.cached_tokens == 100
    d.on_step(7.0 + 1.5, d.version)
    d.pool.check_drained()


def test_a_long_batch_is_cut_every_max_segment_steps():
    d = decode_worker(cap=4)
    reservation = d.reserve_remote(hashes("x", 1), 10, 10)
    event = d.join("r", reservation, hashes("x", 1), 10, 9, 0.0, 0.0)
    ends = []
    while event is not None:
        ends.append(event[0])
        event = d.on_step(*event)[1]
    assert ends == [4.0, 8.0, 9.0]  # 4 + 4 + 1 steps


def test_a_local_prefill_waits_for_blocks_a_running_request_holds():
    d = decode_worker(num_blocks=10)
    reservation = d.reserve_remote(hashes("x", 5), 50, 30)  # 8 blocks
    event = d.join("r", reservation, hashes("x", 5), 50, 2, 0.0, 0.0)
    waiting = LocalJob("l", hashes("y", 4), 40, 1, 0.5)
    assert d.submit(waiting, 0.5) == (1.0, 2)  # a boundary, but no room: it waits
    outcome, event = d.on_step(1.0, 2)
    assert d.active is None and d.load().waiting == 1 and d.load().queued_prefill_tokens == 40
    outcome, event = d.on_step(*event)
    assert outcome.finished == [("r", 2.0)] and d.active is waiting and event == (3.4, 4)
    d.on_step(*event)
    d.pool.check_drained()
