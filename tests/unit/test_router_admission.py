"""The router-wide admission limit (``--max-inflight-requests``): N + k concurrent requests against a real
router whose scripted decode worker holds every stream open -> exactly k refused with RESOURCE_EXHAUSTED
(gRPC) or 429 + Retry-After (HTTP), each counted in ``baton:request_errors_total``, none of them sent to
a worker; the N admitted ones complete once released, and the slots come back."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc
from router.admission import DEFAULT_RETRY_AFTER_S, MIN_RETRY_AFTER_S, AdmissionGate
from router.errors import Overloaded, retry_metadata
from router.main import build_parser, config_from_args
from router.server import RunningRouter, start_router
from tests.unit.test_router_relay import (  # noqa: F401 - fixtures
    SHORT_PROMPT, cluster, loop, model_dir, redis_server, request, router_config, tokenizer, tokens, wait_until,
)

LIMIT, EXTRA = 3, 4


@pytest.fixture(scope="module")
def router(loop, model_dir, redis_server) -> Iterator[RunningRouter]:  # noqa: F811
    running = loop.run(start_router(router_config(model_dir, redis_server.url, max_inflight_requests=LIMIT),
                                    http_port=0))
    running.relay.admission = AdmissionGate(LIMIT)  # as router.main.serve applies the configured limit
    yield running
    loop.run(running.stop(0.5))


class Gate:
    """Decode streams send one token, then wait here until the test opens the gate."""

    def __init__(self, loop_thread) -> None:
        self._loop = loop_thread
        self.event = loop_thread.run(self._make())

    @staticmethod
    async def _make() -> asyncio.Event:
        return asyncio.Event()

    def open(self) -> None:
        self._loop.loop.call_soon_threadsafe(self.event.set)

    def decode(self, script: list[int]):
        async def held(request: pb.DecodeRequest, context: Any) -> AsyncIterator[pb.DecodeResponse]:
            yield pb.DecodeResponse(token_ids=[script[0]])
            await asyncio.wait_for(self.event.wait(), 20)
            yield pb.DecodeResponse(token_ids=[script[1]], finish_reason=pb.FINISH_REASON_LENGTH)
        return held


def errors(router: RunningRouter, code: str) -> float:
    return router.metrics.registry.get_sample_value("baton:request_errors_total", {"code": code}) or 0.0


def burst(router: RunningRouter, gate: Gate, call) -> list[Any]:
    """LIMIT + EXTRA concurrent calls; the gate opens once the EXTRA refused ones have all returned."""
    with ThreadPoolExecutor(LIMIT + EXTRA) as pool:
        futures = [pool.submit(call) for _ in range(LIMIT + EXTRA)]
        wait_until(lambda: sum(f.done() for f in futures) == EXTRA, timeout_s=20)
        assert router.relay.admission.inflight == LIMIT  # the refused ones hold no slot
        gate.open()
        return [f.result(30) for f in futures]


def test_grpc_burst_refuses_exactly_the_excess(router, cluster, loop, tokens):  # noqa: F811
    gate = Gate(loop)
    decode = cluster.add("d0", "decode")
    decode.decode = gate.decode(tokens)
    before = errors(router, "RESOURCE_EXHAUSTED")
    arrived = router.metrics.registry.get_sample_value("baton:requests_received_total")

    def call() -> tuple[str, Any]:
        with grpc.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            try:
                responses = list(pb_grpc.GenerationStub(channel).Generate(request(SHORT_PROMPT, 2), timeout=30))
                return "ok", [t for r in responses for t in r.token_ids]
            except grpc.RpcError as exc:
                trailing = dict(exc.trailing_metadata() or ())
                return exc.code().name, (exc.details(), trailing)

    results = burst(router, gate, call)
    refused = [result[0] for code, result in results if code == "RESOURCE_EXHAUSTED"]
    hints = [result[1].get("retry-after-ms") for code, result in results if code == "RESOURCE_EXHAUSTED"]
    assert all(hint is not None and int(hint) > 0 for hint in hints)  # machine-readable retry hint
    assert [tokens_ for code, tokens_ in results if code == "ok"] == [tokens[:2]] * LIMIT
    assert len(refused) == EXTRA and all("retry after" in details and f"limit of {LIMIT}" in details
                                         for details in refused)
    assert errors(router, "RESOURCE_EXHAUSTED") == before + EXTRA
    # every one arrived, refused or not: the planner's traffic rate counts the demand
    assert router.metrics.registry.get_sample_value("baton:requests_received_total") == arrived + LIMIT + EXTRA
    assert len(decode.decode_requests) == LIMIT  # nothing was sent (or queued) for a refused request
    wait_until(lambda: router.relay.admission.inflight == 0)


def test_http_burst_is_429_with_retry_after(router, cluster, loop, tokens):  # noqa: F811
    gate = Gate(loop)
    decode = cluster.add("d0", "decode")
    decode.decode = gate.decode(tokens)
    before = errors(router, "RESOURCE_EXHAUSTED")
    url = f"http://127.0.0.1:{router.http_server.port}/v1/completions"

    def call() -> tuple[int, str | None, dict]:
        body = json.dumps({"prompt": SHORT_PROMPT, "max_tokens": 2, "stream": True}).encode()
        http = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(http, timeout=30) as response:
                return response.status, None, {"body": response.read()}
        except urllib.error.HTTPError as error:
            return error.code, error.headers.get("Retry-After"), json.loads(error.read())

    results = burst(router, gate, call)
    refused = [(retry, body) for status, retry, body in results if status == 429]
    assert sum(status == 200 for status, _, _ in results) == LIMIT and len(refused) == EXTRA
    assert all(int(retry) >= 1 and "retry after" in body["error"]["message"] for retry, body in refused)
    assert errors(router, "RESOURCE_EXHAUSTED") == before + EXTRA
    assert len(decode.decode_requests) == LIMIT
    wait_until(lambda: router.relay.admission.inflight == 0)


def test_the_gate_counts_refuses_and_hints():
    gate = AdmissionGate(2)
    gate.enter()
    gate.enter()
    with pytest.raises(Overloaded) as info:
        gate.enter()
    assert gate.inflight == 2 and gate.num_refused == 1
    assert info.value.retry_after_s == DEFAULT_RETRY_AFTER_S  # nothing finished yet
    assert retry_metadata(info.value) == (("retry-after-ms", "1000"),)
    gate.leave(duration_s=4.0)  # one left after 4 s; one still in flight: a slot in ~4 s
    assert gate.retry_after_s() == 4.0
    gate.leave(duration_s=0.0)
    assert gate.inflight == 0 and gate.retry_after_s() == pytest.approx(3.2)
    for _ in range(50):
        gate.enter()
        gate.leave(duration_s=0.0)
    assert gate.retry_after_s() == MIN_RETRY_AFTER_S
    assert retry_metadata(ValueError("x")) == ()


def test_no_limit_admits_everything_and_bad_limits_are_refused():
    gate = AdmissionGate(None)
    for _ in range(1000):
        gate.enter()
    assert gate.inflight == 1000 and gate.num_refused == 0
    with pytest.raises(ValueError):
        AdmissionGate(0)


def test_the_flag_reaches_the_config(model_dir):  # noqa: F811
    args = build_parser().parse_args(["--model", str(model_dir), "--max-inflight-requests", "7"])
    assert config_from_args(args).max_inflight_requests == 7
    assert config_from_args(build_parser().parse_args(["--model", str(model_dir)])).max_inflight_requests is None
    with pytest.raises(ValueError):
        config_from_args(build_parser().parse_args(["--model", str(model_dir), "--max-inflight-requests", "0"]))


def test_planner_flags_reach_the_admin_service(model_dir, loop, redis_server):  # noqa: F811
    args = build_parser().parse_args(["--model", str(model_dir), "--planner-max-workers", "2",
                                      "--planner-down-cooldown-s", "30"])
    config = config_from_args(args)
    assert (config.planner.max_workers, config.planner.down_cooldown_s) == (2, 30.0)
    running = loop.run(start_router(router_config(model_dir, redis_server.url, planner=config.planner)))
    try:
        from proto import baton_pb2 as pb
        from proto import baton_pb2_grpc as pb_grpc

        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            request = pb.PlanRequest(
                ttft_p90_ms=100.0, itl_p90_ms=15.0, rate=1000.0, isl=2000, osl=500,  # needs far more than 2 each
                prefill_curve=pb.PrefillCurve(prompt_lens=[128, 4096], tokens_per_s=[10_000, 10_000]),
                decode_curve=pb.DecodeCurve(batch_sizes=[1, 8, 32, 64], itl_ms=[10, 12, 20, 36]))
            plan = pb_grpc.AdminStub(channel).Plan(request, timeout=10)
        assert (plan.prefill, plan.decode) == (2, 2)  # capped where the router was told to stop
    finally:
        loop.run(running.stop(0.5))
