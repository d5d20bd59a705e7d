"""What the router sent workers and they have not finished: the prompts' backlog and the pending prefixes."""

from __future__ import annotations

from router.routing.in_progress import InflightPrefills, PendingPrefixes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def hashes(*names: str) -> list[bytes]:
    return [name.encode() for name in names]


def test_the_backlog_drains_at_the_workers_rate_from_when_each_prompt_was_sent():
    clock = Clock()
    inflight = InflightPrefills(clock=clock)
    inflight.add("p0", "r1", 3000)
    assert inflight.backlog("p0", 1000.0) == 3000 and inflight.backlog("p1", 1000.0) == 0
    clock.now += 2.0
    assert inflight.backlog("p0", 1000.0) == 1000  # 2 s into a 3 s prompt: 1 s left
    inflight.add("p0", "r2", 500)
    assert inflight.backlog("p0", 1000.0) == 1500  # behind what is left of the first
    clock.now += 1.5
    assert inflight.backlog("p0", 1000.0) == 0  # both done at that rate, though neither has answered
    clock.now += 10.0
    inflight.add("p0", "r3", 200)  # a new prompt behind two the rate says are done: only its own tokens
    assert inflight.backlog("p0", 1000.0) == 200
    assert inflight.tokens() == {"p0": 3700} and "p0" in inflight


def test_an_answered_prompt_leaves_the_backlog_for_good():
    clock = Clock()
    inflight = InflightPrefills(clock=clock)
    inflight.add("d0", "r1", 400)
    inflight.add("d0", "r2", 100)
    inflight.remove("d0", "r1")
    assert inflight.backlog("d0", 1000.0) == 100 and inflight.tokens() == {"d0": 100}
    inflight.remove("d0", "r2")
    inflight.remove("d0", "r2")  # twice (answered, then the request's cleanup): harmless
    assert inflight.tokens() == {} and "d0" not in inflight


def test_a_pending_prefix_counts_its_leading_blocks_per_worker():
    pending = PendingPrefixes(clock=Clock())
    pending.add("r1", "d0", hashes("a", "b", "c"))
    pending.add("r2", "p1", hashes("a", "x"))
    assert pending.lookup(hashes("a", "b", "c", "d")) == {"d0": 3, "p1": 1}
    assert pending.lookup(hashes("a", "b", "z")) == {"d0": 2, "p1": 1}
    assert pending.lookup(hashes("z", "a")) == {}  # a run counts from the prompt's first block
    assert pending.lookup([]) == {}


def test_settled_prefixes_stay_for_the_grace_and_add_the_decode_worker():
    clock = Clock()
    pending = PendingPrefixes(grace_s=1.0, clock=clock)
    pending.add("r1", "p0", hashes("a", "b"))
    clock.now += 30.0  # however long the prefill takes, it stays until answered
    assert pending.lookup(hashes("a", "b")) == {"p0": 2}
    pending.settle("r1", also=["d1"])
    pending.finish("r1")  # settled: the request's end leaves it to the grace
    assert pending.lookup(hashes("a", "b")) == {"p0": 2, "d1": 2}
    clock.now += 1.0
    assert pending.lookup(hashes("a", "b")) == {} and len(pending) == 0


def test_an_unsettled_request_forgets_its_prefix_and_others_keep_theirs():
    pending = PendingPrefixes(clock=Clock())
    pending.add("r1", "d0", hashes("a", "b"))
    pending.add("r2", "d0", hashes("a", "c"))
    pending.finish("r1")  # failed before its first token: its blocks may never be computed
    assert pending.lookup(hashes("a", "b")) == {"d0": 1} and len(pending) == 1
    pending.finish("r2")
    assert pending.lookup(hashes("a", "c")) == {} and len(pending) == 0
    pending.add("r3", "d0", [])  # a prompt under one block: nothing to hold
    assert len(pending) == 0
