"""queue_s: a request's wait in the scheduler queue before its first scheduled step (fake clock, no model).

The instant is taken once, on the first WAITING -> RUNNING transition; it rides on the request's deltas
(the first one is what the workers report as ``Timings.queue_ms``). A request whose KV was pulled never
waits to be prefilled here: its queue_s stays None.
"""

from __future__ import annotations

from engine.core.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from tests.unit.test_scheduler import make_scheduler, step


class Clock:
    def __init__(self) -> None:
        self.now_s = 50.0

    def __call__(self) -> float:
        return self.now_s


def timed_request(request_id: str, prompt_len: int, clock: Clock, *, max_tokens: int = 2) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(range(1, prompt_len + 1)),
                   sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens), seed=0,
                   arrival_time=clock(), clock=clock)


def test_queue_time_is_arrival_to_first_schedule_exactly():
    clock = Clock()
    sched = make_scheduler(max_num_batched_tokens=8)  # one 8-token prompt per step
    first = timed_request("a", 8, clock)
    sched.add_request(first)
    clock.now_s += 0.25
    second = timed_request("b", 8, clock)
    sched.add_request(second)
    clock.now_s += 0.5
    _, deltas = step(sched)  # a: first scheduled 0.75 s after its arrival; b waits (budget spent)
    assert first.queue_s == 0.75 and second.queue_s is None and deltas["a"].queue_s == 0.75
    clock.now_s += 1.0
    _, deltas = step(sched)  # b: first scheduled now, 1.5 s after it arrived
    assert second.queue_s == 1.5 and deltas["b"].queue_s == 1.5 and deltas["a"].queue_s == 0.75


def test_preemption_and_later_steps_keep_the_first_instant():
    clock = Clock()
    request = timed_request("a", 4, clock, max_tokens=3)
    request.transition(RequestStatus.RUNNING)
    clock.now_s += 2.0
    request.transition(RequestStatus.PREEMPTED)
    request.transition(RequestStatus.RUNNING)
    assert request.queue_s == 0.0


def test_pulled_kv_has_no_queue_time():
    clock = Clock()
    request = timed_request("a", 4, clock)
    request.transition(RequestStatus.WAITING_FOR_REMOTE_KV)
    clock.now_s += 1.0
    request.transition(RequestStatus.RUNNING)
    assert request.queue_s is None
