"""Client side of the fault scenarios and the soak: Generate calls with deadlines, one thread each.

A call that is still running ``HANG_GRACE_S`` past its own deadline is reported as ``HUNG`` (gRPC should
have ended it at the deadline), so a hang is counted, never waited out.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc

HANG_GRACE_S = 5.0


@dataclass
class Outcome:
    code: str  # "OK", a gRPC status name, or "HUNG"
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    details: str = ""
    last: pb.GenerateResponse | None = None  # the final response of a completed call
    sampling: dict = field(default_factory=dict)  # beyond greedy: e.g. temperature, top_p, seed


def generate(address: str, prompt: list[int], max_tokens: int, deadline_s: float,
             progress: list[int] | None = None, slot: int = 0, sampling: dict | None = None) -> Outcome:
    """One Generate call, greedy unless ``sampling`` says otherwise; ``progress[slot]`` counts the tokens received
    so far."""
    sampling = sampling or {}
    params = pb.SamplingParams(**{"temperature": 0.0, **sampling}, max_tokens=max_tokens, ignore_eos=True)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params)
    outcome = Outcome("OK", prompt, max_tokens, sampling=sampling)
    with grpc.insecure_channel(address) as channel:
        try:
            for response in pb_grpc.GenerationStub(channel).Generate(request, timeout=deadline_s):
                outcome.tokens.extend(response.token_ids)
                outcome.last = response
                if progress is not None:
                    progress[slot] = len(outcome.tokens)
        except grpc.RpcError as exc:
            outcome.code, outcome.details = exc.code().name, exc.details() or ""
    return outcome


class Batch:
    """Concurrent calls, started at once; ``wait_tokens`` waits until each running call streamed some."""

    def __init__(self, address: str, prompts: list[list[int]], max_tokens: int, deadline_s: float,
                 sampling: dict | None = None) -> None:
        self.deadline_s = deadline_s
        self.progress = [0] * len(prompts)
        self._started = time.monotonic()
        self._pool = ThreadPoolExecutor(len(prompts), thread_name_prefix="fault-client")
        self._futures = [self._pool.submit(generate, address, p, max_tokens, deadline_s, self.progress, i, sampling)
                         for i, p in enumerate(prompts)]
        self._prompts, self._max_tokens = prompts, max_tokens

    def wait_tokens(self, min_tokens: int, timeout_s: float = 20.0) -> bool:
        """True once every call has streamed ``min_tokens`` or ended; False at the timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(f.done() or n >= min_tokens for f, n in zip(self._futures, self.progress)):
                return True
            time.sleep(0.02)
        return False

    def wait_any_done(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not any(f.done() for f in self._futures):
            time.sleep(0.02)

    def results(self) -> list[Outcome]:
        """Every call's outcome; a call running past its deadline + ``HANG_GRACE_S`` is ``HUNG``."""
        out = []
        for i, future in enumerate(self._futures):
            left_s = self._started + self.deadline_s + HANG_GRACE_S - time.monotonic()
            try:
                out.append(future.result(timeout=max(left_s, 0.0)))
            except TimeoutError:
                out.append(Outcome("HUNG", self._prompts[i], self._max_tokens))
        self._pool.shutdown(wait=False)
        return out
