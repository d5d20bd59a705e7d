"""The OpenAI HTTP front's errors in ``baton:request_errors_total``, against scripted gRPC workers (the
relay tests' cluster): an error that ends a stream after its headers went out counts once, under the
status name the gRPC front would have used."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from router.server import RunningRouter, start_router
from tests.unit.test_router_relay import (  # noqa: F401 - fixtures
    SHORT_PROMPT, cluster, fail_with, loop, model_dir, redis_server, router_config, tokenizer, tokens,
)


@pytest.fixture(scope="module")
def router(loop, model_dir, redis_server) -> Iterator[RunningRouter]:  # noqa: F811
    running = loop.run(start_router(router_config(model_dir, redis_server.url), http_port=0))
    yield running
    loop.run(running.stop(0.5))


def post(router: RunningRouter, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{router.http_server.port}/v1/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def unavailable(router: RunningRouter) -> float:
    return router.metrics.registry.get_sample_value("baton:request_errors_total", {"code": "UNAVAILABLE"}) or 0.0


def test_a_failure_after_the_headers_counts_once(router, cluster, tokens):  # noqa: F811
    decode = cluster.add("d0", "decode")
    decode.decode = fail_with(grpc.StatusCode.UNAVAILABLE, "worker died", after=tokens[:2])
    before = unavailable(router)
    status, body = post(router, {"prompt": SHORT_PROMPT, "max_tokens": 6, "stream": True})
    events = [line.removeprefix(b"data: ") for line in body.split(b"\n\n") if line]
    assert status == 200 and events[-1] == b"[DONE]"
    assert "worker died" in json.loads(events[-2])["error"]["message"]  # the stream's last event
    assert unavailable(router) == before + 1


def test_a_failure_before_any_byte_is_a_counted_503(router, cluster, tokens):  # noqa: F811
    decode = cluster.add("d0", "decode")
    decode.decode = fail_with(grpc.StatusCode.UNAVAILABLE, "worker died", after=tokens[:2])
    before = unavailable(router)
    status, body = post(router, {"prompt": SHORT_PROMPT, "max_tokens": 6})
    assert status == 503 and "worker died" in json.loads(body)["error"]["message"]
    assert unavailable(router) == before + 1
