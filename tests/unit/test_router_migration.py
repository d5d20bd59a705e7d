"""Request migration against scripted workers (the fakes of test_router_relay: real router, real Redis, gRPC
worker servers whose answers each test scripts): a decode worker failing after tokens were streamed hands the
request to another one with the prompt plus every token sent, the same seed and limits, and the client's stream
goes on with no token repeated or missing; bounded, counted, and a clear UNAVAILABLE when it cannot move."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from kv_transfer.hashing import hash_blocks, root_hash
from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc
from router.migration import Migrations, failure_text
from router.server import start_router
from tests.unit.test_router_relay import (  # noqa: F401 - fixtures
    BLOCK_SIZE, FINGERPRINT, LONG_PROMPT, SHORT_PROMPT, FakeWorker, cluster, fail_with, fresh_rates, loop, model_dir,
    redis_server, request, router_config, stub, tokenizer, tokens, wait_until,
)


def test_the_books_count_moves_and_sum_each_wait_from_a_failure_to_the_next_token():
    books = Migrations(limit=3)
    books.resumed(1.0)  # a token with no failure before it: no wait
    books.moved(10.0)
    books.resumed(10.5)
    books.moved(20.0)
    books.moved(25.0)  # that worker failed before its first token: the wait since 20 goes on
    assert books.exhausted
    books.resumed(26.0)
    assert (books.count, books.stalled_s) == (3, 0.5 + 6.0)
    with pytest.raises(AssertionError):
        books.moved(30.0)
    assert failure_text("d0", 3, grpc.StatusCode.UNAVAILABLE, "reset") == \
        "decode worker d0 failed after 3 tokens were streamed: UNAVAILABLE: reset"
    assert failure_text("d0", 1, grpc.StatusCode.UNAVAILABLE, "reset").endswith("after 1 token was streamed: UNAVAILABLE: reset")
    assert failure_text("d0", 0, grpc.StatusCode.INTERNAL, "boom") == "decode worker d0 failed: INTERNAL: boom"


def migrations_counted(stub, code: str = "UNAVAILABLE") -> float:
    registry = stub.running.relay.metrics.registry
    return registry.get_sample_value("baton:request_migrations_total", {"code": code}) or 0.0


def resuming(worker: FakeWorker, num_cached_tokens: int = 40) -> Callable[..., AsyncIterator[pb.DecodeResponse]]:
    """A decode worker that resumes at ``num_output_tokens_so_far`` as the engine does, with a logprob per token
    (minus its position) and figures of its own that must not replace the route's."""
    async def decode(request: pb.DecodeRequest, context: Any) -> AsyncIterator[pb.DecodeResponse]:
        start = request.num_output_tokens_so_far
        for i in range(start, request.sampling.max_tokens):
            last = i == request.sampling.max_tokens - 1
            yield pb.DecodeResponse(
                token_ids=[worker.tokens[i]], logprobs=[pb.Logprobs(logprob=-float(i))],
                num_cached_tokens=num_cached_tokens, finish_reason=pb.FINISH_REASON_LENGTH if last else 0,
                timings=pb.Timings(prefill_ms=999.0, transfer_bytes=7, transfer_ms=1.0) if i == start else None)
    return decode


def failing_after(worker: FakeWorker, n: int) -> Callable[..., Any]:
    """Streams the outputs ``num_output_tokens_so_far`` .. + n (logprob: minus the position), then fails."""
    async def decode(request: pb.DecodeRequest, context: Any) -> AsyncIterator[pb.DecodeResponse]:
        start = request.num_output_tokens_so_far
        for i in range(start, start + n):
            timings = pb.Timings(transfer_bytes=1000, transfer_ms=2.0, queue_ms=4.0) if i == start else None
            yield pb.DecodeResponse(token_ids=[worker.tokens[i]], logprobs=[pb.Logprobs(logprob=-float(i))],
                                    num_cached_tokens=5, timings=timings)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
    return decode


def test_a_decode_worker_failing_mid_stream_is_migrated_and_the_stream_goes_on_exactly(stub, cluster, tokenizer,
                                                                                         tokens):
    d0, d1 = cluster.add("d0", "decode"), cluster.add("d1", "decode", running=1)  # d0 first: d1 is busier
    d0.decode, d1.decode = failing_after(d0, 2), resuming(d1)
    before = migrations_counted(stub)
    responses = list(stub.Generate(request(SHORT_PROMPT), timeout=10))
    out = [t for r in responses for t in r.token_ids]
    assert out == tokens[:6]  # no token repeated, none missing
    assert [lp.logprob for r in responses for lp in r.logprobs] == [-float(i) for i in range(6)]
    assert "".join(r.text for r in responses) == tokenizer.decode(tokens[:6])
    first, resumed = d0.decode_requests[0], d1.decode_requests[0]
    prompt_ids = tokenizer.encode(SHORT_PROMPT)
    assert list(resumed.token_ids) == [*prompt_ids, *tokens[:2]] and resumed.prompt_len == len(prompt_ids)
    assert resumed.num_output_tokens_so_far == 2 and resumed.request_id == first.request_id
    assert resumed.sampling.HasField("seed") and resumed.sampling == first.sampling  # same seed, same max_tokens
    assert not resumed.HasField("handle") and not resumed.HasField("prefix_handle")
    final = responses[-1]
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert (final.usage.completion_tokens, final.usage.cached_prompt_tokens) == (6, 5)  # d0's count, not d1's 40
    t = final.timings
    assert (t.migrations, t.decode_worker, t.route_kind) == (1, "d1", "local") and t.migration_ms > 0
    assert (t.transfer_bytes, t.queue_ms) == (1000, 4.0) and t.prefill_ms != 999.0  # d0's figures, not d1's
    assert ("; migrated: decode worker d0 failed after 2 tokens were streamed: UNAVAILABLE: connection reset; "
            "resumed on d1 (") in t.route_reason, t.route_reason
    assert migrations_counted(stub) == before + 1
    wait_until(lambda: d0.aborts == [first.request_id])  # d0 may be alive and still hold it
    relay = stub.running.relay
    wait_until(lambda: not relay.inflight and not relay.inflight_prefill_tokens)  # the books followed it


def test_a_remotely_prefilled_request_resumes_locally_with_every_token_sent(stub, cluster, tokenizer, tokens):
    d0, d1 = cluster.add("d0", "decode"), cluster.add("d1", "decode", running=1)
    p0 = cluster.add("p0", "prefill")
    d0.decode, d1.decode = failing_after(d0, 2), resuming(d1)
    responses = list(stub.Generate(request(LONG_PROMPT, seed=99, temperature=0.7), timeout=10))
    assert [t for r in responses for t in r.token_ids] == tokens[:6]  # P's first, d0's two, d1's three
    assert len(p0.prefill_requests) == 1  # a prefill worker samples output 0: it cannot resume output 3
    resumed = d1.decode_requests[0]
    assert list(resumed.token_ids) == [*tokenizer.encode(LONG_PROMPT), *tokens[:3]]
    assert resumed.num_output_tokens_so_far == 3 and resumed.sampling.seed == 99
    assert not resumed.HasField("handle")  # P's lease ended when d0 answered
    t = responses[-1].timings
    assert (t.route_kind, t.prefill_worker, t.decode_worker, t.migrations) == ("remote", "p0", "d1", 1)
    assert "failed after 3 tokens were streamed" in t.route_reason and t.prefill_ms == 3.0, t.route_reason
    wait_until(lambda: p0.releases == [d0.decode_requests[0].handle.lease_id])


def test_a_migrated_request_imports_a_holders_prefix_of_prompt_and_outputs(stub, cluster, tokenizer, tokens):
    d0, d1 = cluster.add("d0", "decode"), cluster.add("d1", "decode", running=1)
    p0 = cluster.add("p0", "prefill")
    prompt_ids = tokenizer.encode(LONG_PROMPT)
    hashes = hash_blocks(prompt_ids, BLOCK_SIZE, root_hash(bytes.fromhex(FINGERPRINT), BLOCK_SIZE, b""))
    cluster.run(lambda registry: registry.index.publish("p0", hashes, []))  # p0 caches every full prompt block
    d0.decode, d1.decode = failing_after(d0, 2), resuming(d1)
    responses = list(stub.Generate(request(LONG_PROMPT), timeout=10))
    assert [t for r in responses for t in r.token_ids] == tokens[:6]
    first, again = p0.lease_prefix_requests  # d0 imported the prompt's prefix; d1 the same, for prompt + outputs
    assert list(first.token_ids) == prompt_ids and list(again.token_ids) == [*prompt_ids, *tokens[:2]]
    resumed = d1.decode_requests[0]
    assert resumed.prefix_handle.lease_id == "prefix-2" and resumed.num_output_tokens_so_far == 2
    t = responses[-1].timings
    assert t.migrations == 1 and "resumed on d1 (cost" in t.route_reason and "tokens from p0)" in t.route_reason
    wait_until(lambda: p0.releases == ["prefix-1", "prefix-2"])  # each released once its reader answered


def test_when_the_retry_fails_too_before_any_token_the_first_token_from_p_is_kept_and_the_request_moves(
        stub, cluster, tokenizer, tokens):
    d0, d1 = cluster.add("d0", "decode"), cluster.add("d1", "decode", running=1)
    d2, p0 = cluster.add("d2", "decode", running=2), cluster.add("p0", "prefill")
    d0.decode, d1.decode, d2.decode = failing_after(d0, 0), failing_after(d1, 0), resuming(d2)
    responses = list(stub.Generate(request(LONG_PROMPT), timeout=10))
    assert [t for r in responses for t in r.token_ids] == tokens[:6]  # P's first token, then d2's five
    retry, moved = d1.decode_requests[0], d2.decode_requests[0]
    assert retry.handle.lease_id == d0.decode_requests[0].handle.lease_id  # the retry: the same lease, once
    assert list(moved.token_ids) == [*tokenizer.encode(LONG_PROMPT), tokens[0]] and moved.num_output_tokens_so_far == 1
    t = responses[-1].timings
    assert (t.migrations, t.decode_worker) == (1, "d2")
    assert "migrated: decode worker d1 failed after 1 token was streamed" in t.route_reason, t.route_reason
    assert moved.handle.lease_id == retry.handle.lease_id  # still unread: d2 may pull P's KV as a retry would
    wait_until(lambda: p0.releases == [retry.handle.lease_id])  # released once, after d2 answered


def test_a_stop_string_across_the_move_ends_the_stream(stub, cluster, tokenizer, tokens):
    d0, d1 = cluster.add("d0", "decode"), cluster.add("d1", "decode", running=1)
    d0.decode, d1.decode = failing_after(d0, 2), resuming(d1)
    full = tokenizer.decode(tokens)
    head, tail = tokenizer.decode(tokens[:2]), tokenizer.decode(tokens[2:4])
    stop = head[-2:] + tail[:2]  # begins in d0's tokens, ends in d1's
    responses = list(stub.Generate(request(SHORT_PROMPT, max_tokens=100, stop=[stop]), timeout=10))
    assert "".join(r.text for r in responses) == full[: full.index(stop)]
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP and responses[-1].timings.migrations == 1
    wait_until(lambda: d1.aborts == [d1.decode_requests[0].request_id])  # d1 was still generating


def test_a_worker_failing_before_resuming_hands_the_request_on_again(stub, cluster, tokens):
    d0, d1, d2 = (cluster.add("d0", "decode"), cluster.add("d1", "decode", running=1),
                  cluster.add("d2", "decode", running=2))
    d0.decode, d1.decode, d2.decode = failing_after(d0, 2), failing_after(d1, 0), resuming(d2)
    before = migrations_counted(stub)
    responses = list(stub.Generate(request(SHORT_PROMPT), timeout=10))
    assert [t for r in responses for t in r.token_ids] == tokens[:6]
    assert d1.decode_requests[0].token_ids == d2.decode_requests[0].token_ids  # the same two outputs, twice
    t = responses[-1].timings
    assert (t.migrations, t.decode_worker) == (2, "d2")
    assert "decode worker d1 failed after 2 tokens were streamed" in t.route_reason, t.route_reason
    assert migrations_counted(stub) == before + 2


def test_migrations_are_bounded_then_unavailable(stub, cluster, tokens):
    workers = [cluster.add(f"d{i}", "decode", running=i) for i in range(4)]
    for worker in workers:
        worker.decode = failing_after(worker, 1)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request(SHORT_PROMPT), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == ("decode worker d2 failed after 3 tokens were streamed: UNAVAILABLE: connection "
                                    "reset (migrated 2 times already, the limit)"), info.value.details()
    assert workers[3].decode_requests == []


def test_no_other_decode_worker_is_a_clear_unavailable(stub, cluster, tokens):
    d0 = cluster.add("d0", "decode")
    d0.decode = fail_with(grpc.StatusCode.INTERNAL, "boom", after=tokens[:2])
    call = stub.Generate(request(SHORT_PROMPT), timeout=10)
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for response in call:
            received.extend(response.token_ids)
    assert received == tokens[:2] and info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == ("decode worker d0 failed after 2 tokens were streamed: INTERNAL: boom; no other "
                                    "decode worker can resume it (no decode workers (1 failed))"), info.value.details()


def test_without_migrations_a_failure_after_tokens_is_unavailable(loop, model_dir, redis_server, cluster, tokens):
    d0, d1 = cluster.add("d0", "decode"), cluster.add("d1", "decode", running=1)
    d0.decode = fail_with(grpc.StatusCode.INTERNAL, "boom", after=tokens[:2])
    running = loop.run(start_router(router_config(model_dir, redis_server.url, max_migrations=0)))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            with pytest.raises(grpc.RpcError) as info:
                list(pb_grpc.GenerationStub(channel).Generate(request(SHORT_PROMPT), timeout=10))
    finally:
        loop.run(running.stop(0.5))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == "decode worker d0 failed after 2 tokens were streamed: INTERNAL: boom"
    assert d1.decode_requests == []
