"""The router's request flow against scripted workers: real router gRPC server, real redis-server,
real gRPC worker servers whose answers each test scripts (the worker nodes have their own tests; these
pin down what the router sends them and how it reacts: fallback, retry, stop strings, cancellation,
deadlines, lease release)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from engine.tokenizer import Tokenizer
from kv_transfer.hashing import hash_blocks, root_hash
from kv_transfer.registry import Registry, connect
from kv_transfer.workers import WorkerInfo, WorkerLoad
from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.routing.in_progress import PendingPrefixes
from router.routing.policy import PolicyConfig
from router.routing.rates import Rates
from router.server import start_router
from tests.redis_server import RedisServer, free_port, require_redis_server
from tests.unit.test_router_server import LoopThread, make_model_folder

NS = "relay"
FINGERPRINT = "5a" * 16
BLOCK_SIZE = 16
LONG_PROMPT = "def function(argument): return argument + 1\n" * 8  # > 64 tokens: remote prefill
SHORT_PROMPT = "Hello"


class FakeWorker(pb_grpc.WorkerServicer):
    """A Worker service whose Prefill / Decode answers come from the test; records what it was sent."""

    def __init__(self, worker_id: str, role: str, tokens: list[int]) -> None:
        self.worker_id, self.role, self.tokens = worker_id, role, tokens
        self.prefill_requests: list[pb.PrefillRequest] = []
        self.decode_requests: list[pb.DecodeRequest] = []
        self.aborts: list[str] = []
        self.releases: list[str] = []
        self.decode_cancelled = threading.Event()
        self.first_tokens: list[pb.FirstTokenRequest] = []  # layer-wise deliveries (FirstToken)
        self._first_token_waiters: dict[str, asyncio.Future] = {}
        self.prefill_after_handle: Callable[[pb.PrefillRequest, Any], Any] | None = None  # PrefillStream's 2nd
        self.abort_error: grpc.StatusCode | None = None
        self.lease_prefix_requests: list[pb.LeasePrefixRequest] = []
        self.lease_prefix_error: grpc.StatusCode | None = None
        self.prefill: Callable[[pb.PrefillRequest, Any], Any] = self.default_prefill
        self.decode: Callable[[pb.DecodeRequest, Any], AsyncIterator[pb.DecodeResponse]] = self.default_decode

    async def default_prefill(self, request: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:
        handle = pb.KVHandle(worker_id=self.worker_id, lease_id=f"lease-{request.request_id}",
                             block_ids=[1, 2, 3], num_tokens=len(request.token_ids))
        return pb.PrefillResponse(first_token=self.tokens[0], handle=handle, num_cached_tokens=16,
                                  timings=pb.Timings(prefill_ms=3.0, queue_ms=1.0))

    async def default_decode(self, request: pb.DecodeRequest, context: Any) -> AsyncIterator[pb.DecodeResponse]:
        start = request.num_output_tokens_so_far
        if request.first_token_pending:  # as a real D: wait for P's first token (or the order to recompute)
            first = await self._first_token_of(request.request_id)
            start += 0 if first.recompute else 1
        remaining = self.tokens[start : request.sampling.max_tokens]
        for i, token in enumerate(remaining):
            last = i == len(remaining) - 1
            timings = pb.Timings(transfer_bytes=1_000_000, transfer_ms=2.0, transfer_blocks=7, transport="tcp")
            yield pb.DecodeResponse(
                token_ids=[token], num_cached_tokens=5,
                finish_reason=pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED,
                timings=timings if last else None,
            )

    async def Prefill(self, request, context):
        self.prefill_requests.append(request)
        return await self.prefill(request, context)

    async def PrefillStream(self, request, context):
        """The handle first (kv_pending), then ``prefill_after_handle`` (default: ``prefill``)."""
        self.prefill_requests.append(request)
        handle = pb.KVHandle(worker_id=self.worker_id, lease_id=f"lease-{request.request_id}", block_ids=[1, 2, 3],
                             num_tokens=len(request.token_ids))
        yield pb.PrefillResponse(kv_pending=True, handle=handle)
        yield await (self.prefill_after_handle or self.prefill)(request, context)

    async def FirstToken(self, request, context):
        self.first_tokens.append(request)
        self._future(request.request_id).set_result(request)
        return pb.FirstTokenResponse(found=True)

    def _future(self, request_id: str) -> asyncio.Future:
        return self._first_token_waiters.setdefault(request_id, asyncio.get_running_loop().create_future())

    async def _first_token_of(self, request_id: str) -> pb.FirstTokenRequest:
        return await asyncio.wait_for(self._future(request_id), 5)

    async def Decode(self, request, context):
        self.decode_requests.append(request)
        completed = False
        try:
            async for response in self.decode(request, context):
                yield response
            completed = True
        finally:  # cancelled mid-await (CancelledError) or while grpc was sending (GeneratorExit)
            if not completed:
                self.decode_cancelled.set()

    async def Abort(self, request, context):
        self.aborts.append(request.request_id)
        if self.abort_error is not None:
            await context.abort(self.abort_error, "abort failed")
        return pb.AbortResponse(found=True)

    async def ReleaseLease(self, request, context):
        self.releases.append(request.lease_id)
        return pb.ReleaseLeaseResponse(found=True)

    async def LeasePrefix(self, request, context):
        """Leases every full block of the prompt but the last token's (as a real worker holding all of it)."""
        self.lease_prefix_requests.append(request)
        if self.lease_prefix_error is not None:
            await context.abort(self.lease_prefix_error, "lease failed")
        num_blocks = (len(request.token_ids) - 1) // BLOCK_SIZE
        handle = pb.KVHandle(worker_id=self.worker_id, lease_id=f"prefix-{len(self.lease_prefix_requests)}",
                             block_ids=list(range(num_blocks)), num_tokens=num_blocks * BLOCK_SIZE)
        return pb.LeasePrefixResponse(handle=handle)


async def hang_forever(*_: Any) -> Any:
    await asyncio.sleep(3600)
    yield pb.DecodeResponse()  # pragma: no cover - makes this an async generator


def fail_with(code: grpc.StatusCode, message: str, after: list[int] | None = None) -> Callable[..., Any]:
    async def decode(request: pb.DecodeRequest, context: Any) -> AsyncIterator[pb.DecodeResponse]:
        for token in after or []:
            yield pb.DecodeResponse(token_ids=[token])
        await context.abort(code, message)

    return decode


class Cluster:
    """Fake workers registered in Redis the way real ones register (same keys, same registry code)."""

    def __init__(self, loop: LoopThread, redis_url: str, tokens: list[int]) -> None:
        self.loop, self.redis_url, self.tokens = loop, redis_url, tokens
        self._servers: list[grpc.aio.Server] = []
        self._ids: list[str] = []
        self.registry: Registry | None = None

    async def _registry(self) -> Registry:
        if self.registry is None:
            self.registry = Registry(connect(self.redis_url), NS, ttl_s=120)
        return self.registry

    def add(self, worker_id: str, role: str, *, running: int = 0, address: str | None = None) -> FakeWorker:
        worker = FakeWorker(worker_id, role, self.tokens)
        self.loop.run(self._add(worker, running, address))
        return worker

    async def _add(self, worker: FakeWorker, running: int, address: str | None) -> None:
        if address is None:
            server = grpc.aio.server()
            pb_grpc.add_WorkerServicer_to_server(worker, server)
            address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            self._servers.append(server)
        info = WorkerInfo(worker_id=worker.worker_id, role=worker.role, grpc_address=address,
                          kv_uri="tcp://127.0.0.1:1", model_fingerprint=FINGERPRINT,
                          layout_json=f'{{"block_size": {BLOCK_SIZE}}}', total_blocks=1000)
        registry = await self._registry()
        await registry.register(info)
        load = WorkerLoad(running=running, waiting=0, free_blocks=1000, queued_prefill_tokens=0)
        await registry.heartbeat(info, load)
        self._ids.append(worker.worker_id)

    def run(self, coro_fn: Callable[[Registry], Any]) -> Any:
        async def call() -> Any:
            return await coro_fn(await self._registry())

        return self.loop.run(call())

    async def _close(self) -> None:
        registry = await self._registry()
        for worker_id in self._ids:
            await registry.deregister(worker_id)
        await asyncio.gather(*(server.stop(0) for server in self._servers))
        await registry.index._redis.aclose()

    def close(self) -> None:
        self.loop.run(self._close())


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    require_redis_server()
    with RedisServer.start() as server:
        yield server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_folder(tmp_path_factory.mktemp("relay-model") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


def router_config(model_dir: Path, redis_url: str, **overrides: Any) -> RouterConfig:
    """Each test's router prices its own books only: the module's router (``stub``) runs beside it, and its books
    name fake workers that each test starts afresh under the same ids (tests/unit/test_router_shared_books.py
    covers routers sharing their books)."""
    return RouterConfig(model_path=model_dir, redis_url=redis_url, ns=NS, host="127.0.0.1", port=0,
                        worker_list_ttl_s=0.0, policy=PolicyConfig(disagg_threshold_tokens=64),
                        **{"shared_books": None, **overrides})


@pytest.fixture(scope="module")
def stub(loop, model_dir, redis_server) -> Iterator[pb_grpc.GenerationStub]:
    running = loop.run(start_router(router_config(model_dir, redis_server.url)))
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        generation = pb_grpc.GenerationStub(channel)
        generation.running = running  # tests read the relay's learned rates
        yield generation
    loop.run(running.stop(0.5))


@pytest.fixture(autouse=True)
def fresh_rates(request) -> None:
    """Each test starts from the rates' defaults and no pending prefixes: what earlier tests' fake workers
    taught the router (their speeds depend on this machine's load), and the prompts it sent them within the
    last second (fake workers publish nothing to the index), must not change this test's routing decisions."""
    for name in ("stub", "layerwise_stub"):
        if name in request.fixturenames:
            relay = request.getfixturevalue(name).running.relay
            relay.routing.rates = Rates(relay.policy.rates)
            relay.pending_prefixes = PendingPrefixes()


@pytest.fixture
def tokens(tokenizer) -> list[int]:
    return tokenizer.encode(" the quick brown fox jumps over the lazy dog again and again", add_special_tokens=False)


@pytest.fixture
def cluster(loop, redis_server, tokens) -> Iterator[Cluster]:
    c = Cluster(loop, redis_server.url, tokens)
    yield c
    c.close()


def request(prompt: str, max_tokens: int = 6, **sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, request_id="r1",
                              sampling=pb.SamplingParams(max_tokens=max_tokens, **sampling))


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def remote_prefills(stub) -> tuple[float, float, float]:
    """The router's remote-prefill series so far: (requests, their prompt tokens, the tokens P found cached)."""
    value = stub.running.relay.metrics.registry.get_sample_value
    return (value("baton:remote_prefill_prompt_tokens_count"), value("baton:remote_prefill_prompt_tokens_sum"),
            value("baton:remote_prefill_cached_tokens_total"))


def test_short_prompt_is_decoded_locally(stub, cluster, tokenizer, tokens):
    d0 = cluster.add("d0", "decode")
    p0 = cluster.add("p0", "prefill")
    remote_before = remote_prefills(stub)
    responses = list(stub.Generate(request(SHORT_PROMPT), timeout=10))
    assert p0.prefill_requests == [] and remote_prefills(stub) == remote_before  # not the prefill pool's traffic
    sent = d0.decode_requests[0]
    prompt_ids = tokenizer.encode(SHORT_PROMPT)
    assert list(sent.token_ids) == prompt_ids and sent.prompt_len == len(prompt_ids)
    assert not sent.HasField("handle") and sent.num_output_tokens_so_far == 0 and sent.sampling.HasField("seed")
    out_ids = [t for r in responses for t in r.token_ids]
    assert out_ids == tokens[:6]
    assert "".join(r.text for r in responses) == tokenizer.decode(tokens[:6])
    final = responses[-1]
    assert final.finish_reason == pb.FINISH_REASON_LENGTH and all(r.request_id == "r1" for r in responses)
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_prompt_tokens) == (
        len(prompt_ids), 6, 5)
    t = final.timings
    assert (t.route_kind, t.decode_worker, t.prefill_worker) == ("local", "d0", "")
    assert t.route_reason.endswith("<= threshold 64") and t.ttft_ms > 0 and t.e2e_ms >= t.ttft_ms
    assert d0.aborts == [] and p0.releases == []


def test_long_prompt_prefills_remotely_then_decodes_with_the_handle(stub, cluster, tokenizer, tokens):
    d0 = cluster.add("d0", "decode")
    p0 = cluster.add("p0", "prefill")
    count, prompt, cached = remote_prefills(stub)
    responses = list(stub.Generate(request(LONG_PROMPT), timeout=10))
    prompt_ids = tokenizer.encode(LONG_PROMPT)
    assert remote_prefills(stub) == (count + 1, prompt + len(prompt_ids), cached + 16)  # the planner's P traffic
    assert len(prompt_ids) > 64
    assert list(responses[0].token_ids) == [tokens[0]]  # P's first token goes out before any decode token
    prefill, decode = p0.prefill_requests[0], d0.decode_requests[0]
    assert list(prefill.token_ids) == prompt_ids and prefill.decode_worker_id == "d0"
    assert decode.handle.lease_id == f"lease-{prefill.request_id}" and decode.request_id == prefill.request_id
    assert list(decode.token_ids) == [*prompt_ids, tokens[0]] and decode.num_output_tokens_so_far == 1
    assert decode.prompt_len == len(prompt_ids)
    assert decode.sampling.seed == prefill.sampling.seed and prefill.sampling.HasField("seed")
    assert [t for r in responses for t in r.token_ids] == tokens[:6]
    final = responses[-1]
    assert final.usage.cached_prompt_tokens == 16  # P's prefix hit, not D's
    t = final.timings
    assert (t.route_kind, t.prefill_worker, t.decode_worker) == ("remote", "p0", "d0")
    assert (t.transfer_bytes, t.transfer_blocks, t.transport, t.prefill_ms) == (1_000_000, 7, "tcp", 3.0)
    assert t.transfer_gbps == pytest.approx(0.5)
    # D's first answer acks the pull: the router releases P's lease on D's behalf, exactly once.
    wait_until(lambda: p0.releases == [decode.handle.lease_id])
    assert p0.aborts == [] and d0.aborts == []
    # the measured timings feed the cost model: 1 MB in 2 ms is 0.5 GB/s on the p0 -> d0 link
    rates = stub.running.relay.routing.rates
    assert rates.link_gb_per_s("p0", "d0") == pytest.approx(0.5)
    computed = len(prompt_ids) - 16  # in P's 3 ms call, 1 ms queued: its rate is over the 2 ms of compute
    assert rates.prefill_tokens_per_s("p0", None) == pytest.approx(computed / 2e-3)


def test_a_decode_worker_note_is_appended_to_the_route_reason(stub, cluster, tokens):
    d0, _ = cluster.add("d0", "decode"), cluster.add("p0", "prefill")

    async def pull_failed(request: pb.DecodeRequest, context: Any) -> AsyncIterator[pb.DecodeResponse]:
        note = pb.Timings(route_reason="KV pull failed (peer gone); prefilled locally", decode_worker="d0")
        yield pb.DecodeResponse(token_ids=tokens[1:2], timings=note, finish_reason=pb.FINISH_REASON_LENGTH)

    d0.decode = pull_failed
    final = list(stub.Generate(request(LONG_PROMPT, max_tokens=2), timeout=10))[-1]
    assert final.timings.route_kind == "remote"
    assert final.timings.route_reason.endswith("> threshold 64; KV pull failed (peer gone); prefilled locally")


def test_client_seed_reaches_both_workers(stub, cluster):
    d0, p0 = cluster.add("d0", "decode"), cluster.add("p0", "prefill")
    list(stub.Generate(request(LONG_PROMPT, seed=1234, temperature=0.8), timeout=10))
    assert p0.prefill_requests[0].sampling.seed == d0.decode_requests[0].sampling.seed == 1234


def test_stop_strings_are_not_sent_to_workers(stub, cluster):
    d0 = cluster.add("d0", "decode")
    list(stub.Generate(request(SHORT_PROMPT, stop=["zzz"]), timeout=10))
    assert list(d0.decode_requests[0].sampling.stop) == []


def test_dead_prefill_worker_falls_back_to_local_prefill(stub, cluster, tokens):
    d0 = cluster.add("d0", "decode")
    cluster.add("p0", "prefill", address=f"127.0.0.1:{free_port()}")  # registered, but nothing listens
    responses = list(stub.Generate(request(LONG_PROMPT), timeout=10))
    assert [t for r in responses for t in r.token_ids] == tokens[:6]
    decode = d0.decode_requests[0]
    assert not decode.HasField("handle") and decode.num_output_tokens_so_far == 0
    t = responses[-1].timings
    assert t.route_kind == "local" and t.route_reason == "fallback: prefill on p0 failed (UNAVAILABLE)"
    assert t.prefill_worker == ""


def test_failing_prefill_worker_is_aborted_and_the_request_completes(stub, cluster, tokens):
    d0, p0 = cluster.add("d0", "decode"), cluster.add("p0", "prefill")

    async def broken(request: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:
        await context.abort(grpc.StatusCode.INTERNAL, "device error")

    p0.prefill = broken
    responses = list(stub.Generate(request(LONG_PROMPT), timeout=10))
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    wait_until(lambda: p0.aborts == [p0.prefill_requests[0].request_id])
    assert len(d0.decode_requests) == 1


def test_a_failed_prefill_is_retried_once_on_another_prefill_worker(stub, cluster, tokens):
    d0, p0, p1 = cluster.add("d0", "decode"), cluster.add("p0", "prefill"), cluster.add("p1", "prefill")
    failed: list[str] = []

    def failing_once(worker: FakeWorker) -> Callable[[pb.PrefillRequest, Any], Any]:
        async def prefill(request: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:
            if not failed:  # whichever P the cost model picks first fails
                failed.append(worker.worker_id)
                await context.abort(grpc.StatusCode.UNAVAILABLE, "device lost")
            return await worker.default_prefill(request, context)
        return prefill

    p0.prefill, p1.prefill = failing_once(p0), failing_once(p1)
    responses = list(stub.Generate(request(LONG_PROMPT), timeout=10))
    assert [t for r in responses for t in r.token_ids] == tokens[:6]
    other = "p1" if failed == ["p0"] else "p0"
    t = responses[-1].timings
    assert (t.route_kind, t.prefill_worker) == ("remote", other)
    assert t.route_reason.startswith(f"retry: prefill on {failed[0]} failed; "), t.route_reason
    (decode,) = d0.decode_requests
    assert decode.handle.worker_id == other and decode.num_output_tokens_so_far == 1
    first_choice = p0 if failed == ["p0"] else p1
    wait_until(lambda: first_choice.aborts == [decode.request_id])


def test_a_prefill_failing_on_both_workers_falls_back_to_local_prefill(stub, cluster, tokens):
    d0, p0, p1 = cluster.add("d0", "decode"), cluster.add("p0", "prefill"), cluster.add("p1", "prefill")

    async def broken(request: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "device lost")

    p0.prefill = p1.prefill = broken
    responses = list(stub.Generate(request(LONG_PROMPT), timeout=10))
    assert [t for r in responses for t in r.token_ids] == tokens[:6]
    assert len(p0.prefill_requests) == len(p1.prefill_requests) == 1  # once each: one retry, no more
    (decode,) = d0.decode_requests
    assert not decode.HasField("handle") and responses[-1].timings.prefill_worker == ""


def test_a_lease_the_decode_worker_released_itself_is_not_released_again(stub, cluster, tokens):
    d0, p0 = cluster.add("d0", "decode"), cluster.add("p0", "prefill")

    async def releasing_decode(request: pb.DecodeRequest, context: Any) -> AsyncIterator[pb.DecodeResponse]:
        p0.releases.append(request.handle.lease_id)  # as a real D: released on P the moment its pull ended
        first = True
        async for response in d0.default_decode(request, context):
            if first:
                response.timings.lease_released = True
                first = False
            yield response

    d0.decode = releasing_decode
    responses = list(stub.Generate(request(LONG_PROMPT), timeout=10))
    assert [t for r in responses for t in r.token_ids] == tokens[:6]
    time.sleep(0.3)  # the router's control calls run in the background: give a wrong one time to land
    assert p0.releases == [d0.decode_requests[0].handle.lease_id] and p0.aborts == []


def test_decode_worker_failing_before_any_token_is_replaced(stub, cluster, tokens):
    d0, d1 = cluster.add("d0", "decode"), cluster.add("d1", "decode", running=1)
    p0 = cluster.add("p0", "prefill")
    d0.decode = fail_with(grpc.StatusCode.UNAVAILABLE, "going away")
    responses = list(stub.Generate(request(LONG_PROMPT), timeout=10))
    assert [t for r in responses for t in r.token_ids] == tokens[:6]
    assert responses[-1].timings.decode_worker == "d1"
    retry = d1.decode_requests[0]
    assert retry.handle.lease_id == d0.decode_requests[0].handle.lease_id  # the same lease, if still valid
    assert list(retry.token_ids) == list(d0.decode_requests[0].token_ids)
    wait_until(lambda: p0.releases == [retry.handle.lease_id])  # released once d1 answered, not before


def test_no_replacement_decode_worker_is_unavailable(stub, cluster):
    d0 = cluster.add("d0", "decode")
    d0.decode = fail_with(grpc.StatusCode.UNAVAILABLE, "gone")
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request(SHORT_PROMPT), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no other decode worker is available" in info.value.details()


def test_worker_invalid_argument_reaches_the_client_without_retry(stub, cluster):
    d0, d1 = cluster.add("d0", "decode"), cluster.add("d1", "decode", running=1)
    d0.decode = fail_with(grpc.StatusCode.INVALID_ARGUMENT, "prompt plus outputs so far must be shorter")
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request(SHORT_PROMPT), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "prompt plus outputs so far must be shorter"
    assert d1.decode_requests == []


def test_stop_string_truncates_text_finishes_stop_and_aborts_decode(stub, cluster, tokenizer, tokens):
    d0 = cluster.add("d0", "decode")

    async def endless(request: pb.DecodeRequest, context: Any) -> AsyncIterator[pb.DecodeResponse]:
        for token in tokens:
            yield pb.DecodeResponse(token_ids=[token])
        await asyncio.sleep(3600)

    d0.decode = endless
    full = tokenizer.decode(tokens)
    stop = "fox"
    responses = list(stub.Generate(request(SHORT_PROMPT, max_tokens=100, stop=[stop]), timeout=10))
    text = "".join(r.text for r in responses)
    assert text == full[: full.index(stop)]
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
    wait_until(lambda: d0.aborts == [d0.decode_requests[0].request_id] and d0.decode_cancelled.is_set())


def test_client_cancel_aborts_the_decode_worker(stub, cluster, tokens):
    d0 = cluster.add("d0", "decode")

    async def one_then_hang(request: pb.DecodeRequest, context: Any) -> AsyncIterator[pb.DecodeResponse]:
        yield pb.DecodeResponse(token_ids=tokens[:1])
        await asyncio.sleep(3600)

    d0.decode = one_then_hang
    call = stub.Generate(request(SHORT_PROMPT, max_tokens=50), timeout=10)
    assert list(next(call).token_ids) == tokens[:1]
    call.cancel()
    wait_until(lambda: d0.aborts == [d0.decode_requests[0].request_id] and d0.decode_cancelled.is_set())


def test_a_local_prefill_counts_as_the_decode_workers_queue_until_its_first_token(stub, cluster, tokens):
    d0 = cluster.add("d0", "decode")
    release = threading.Event()

    async def slow_prefill(request: pb.DecodeRequest, context: Any) -> AsyncIterator[pb.DecodeResponse]:
        while not release.is_set():  # D computing the prompt: no token yet
            await asyncio.sleep(0.01)
        yield pb.DecodeResponse(token_ids=tokens[:1])
        await asyncio.sleep(3600)

    d0.decode = slow_prefill
    relay = stub.running.relay
    call = stub.Generate(request(SHORT_PROMPT, max_tokens=50), timeout=10)
    wait_until(lambda: len(d0.decode_requests) == 1)
    # nothing cached on d0: the whole prompt
    assert relay.inflight_prefill_tokens["d0"] == len(d0.decode_requests[0].token_ids)
    release.set()
    assert list(next(call).token_ids) == tokens[:1]
    wait_until(lambda: "d0" not in relay.inflight_prefill_tokens)  # answered: D's own report takes over
    call.cancel()
    wait_until(lambda: d0.aborts == [d0.decode_requests[0].request_id])
    assert "d0" not in relay.inflight_prefill_tokens


def test_a_prompt_being_computed_is_priced_as_cached_on_its_worker_until_the_index_shows_it(
        stub, cluster, tokenizer, tokens):
    d0, d1 = cluster.add("d0", "decode"), cluster.add("d1", "decode")
    release = threading.Event()

    async def slow_prefill(request: pb.DecodeRequest, context: Any) -> AsyncIterator[pb.DecodeResponse]:
        while not release.is_set():  # computing the prompt: no token yet, nothing in the index
            await asyncio.sleep(0.01)
        yield pb.DecodeResponse(token_ids=tokens[:1], finish_reason=pb.FINISH_REASON_LENGTH)

    d0.decode = d1.decode = slow_prefill
    relay = stub.running.relay
    pending = relay.pending_prefixes
    first = stub.Generate(request(LONG_PROMPT, max_tokens=1), timeout=10)
    wait_until(lambda: len(d0.decode_requests) + len(d1.decode_requests) == 1)
    computing = "d0" if d0.decode_requests else "d1"
    prompt_ids = tokenizer.encode(LONG_PROMPT)
    hashes = hash_blocks(prompt_ids, BLOCK_SIZE, root_hash(bytes.fromhex(FINGERPRINT), BLOCK_SIZE, b""))
    assert pending.lookup(hashes) == {computing: len(hashes)}
    # long enough for its worker to have computed it at its learned rate: no backlog left, the prefix only pending
    wait_until(lambda: relay.inflight_prefills.backlogs(relay.directory._snapshot.workers, relay.routing.rates)
               == {computing: 0})
    second = stub.Generate(request(LONG_PROMPT, max_tokens=1), timeout=10)
    wait_until(lambda: len(d0.decode_requests) + len(d1.decode_requests) == 2)
    pending.grace_s = 0.0  # answered, the blocks are the index's at once
    release.set()
    reason = list(second)[-1].timings.route_reason
    assert list(first)[-1].finish_reason == pb.FINISH_REASON_LENGTH
    # the other decode worker computes the whole prompt; the one computing it only waits, then its tail
    assert f"{len(hashes) * BLOCK_SIZE} of {len(prompt_ids)} prompt tokens cached on {computing} ({computing} is " \
           f"computing {len(hashes) * BLOCK_SIZE} of them)" in reason, reason
    assert (d0 if computing == "d0" else d1).decode_requests[1].token_ids == prompt_ids
    wait_until(lambda: not pending.lookup(hashes) and len(pending) == 0)


def test_cancel_before_decode_answers_releases_the_lease(stub, cluster, tokens):
    d0, p0 = cluster.add("d0", "decode"), cluster.add("p0", "prefill")
    d0.decode = hang_forever
    call = stub.Generate(request(LONG_PROMPT, max_tokens=50), timeout=10)
    assert list(next(call).token_ids) == [tokens[0]]  # from P
    wait_until(lambda: len(d0.decode_requests) == 1)
    call.cancel()
    request_id = p0.prefill_requests[0].request_id
    wait_until(lambda: d0.aborts == [request_id])
    wait_until(lambda: p0.releases == [f"lease-{request_id}"])


def test_lease_is_left_to_its_ttl_when_the_decode_worker_may_still_read_it(stub, cluster, tokens):
    d0, p0 = cluster.add("d0", "decode"), cluster.add("p0", "prefill")
    d0.decode, d0.abort_error = hang_forever, grpc.StatusCode.INTERNAL
    call = stub.Generate(request(LONG_PROMPT, max_tokens=50), timeout=10)
    assert list(next(call).token_ids) == [tokens[0]]
    wait_until(lambda: len(d0.decode_requests) == 1)
    call.cancel()
    wait_until(lambda: d0.aborts == [p0.prefill_requests[0].request_id])
    time.sleep(0.2)
    assert p0.releases == []  # d0 did not confirm its abort: it might still be pulling those blocks


def test_cancel_during_prefill_aborts_the_prefill_worker(stub, cluster):
    d0, p0 = cluster.add("d0", "decode"), cluster.add("p0", "prefill")
    prefill_started = threading.Event()

    async def slow(request: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:
        prefill_started.set()
        await asyncio.sleep(3600)

    p0.prefill = slow
    call = stub.Generate(request(LONG_PROMPT), timeout=10)
    done = threading.Event()

    def consume() -> None:
        try:
            list(call)
        except grpc.RpcError:
            done.set()

    threading.Thread(target=consume, daemon=True).start()
    assert prefill_started.wait(5)
    call.cancel()
    assert done.wait(5)
    wait_until(lambda: p0.aborts == [p0.prefill_requests[0].request_id])
    assert d0.decode_requests == []


def test_client_deadline_is_deadline_exceeded_and_aborts(stub, cluster):
    d0 = cluster.add("d0", "decode")
    d0.decode = hang_forever
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request(SHORT_PROMPT), timeout=0.5))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: d0.aborts == [d0.decode_requests[0].request_id])


def test_router_request_timeout_is_deadline_exceeded(loop, model_dir, redis_server, cluster):
    d0 = cluster.add("d0", "decode")
    d0.decode = hang_forever
    running = loop.run(start_router(router_config(model_dir, redis_server.url, request_timeout_s=0.3)))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            with pytest.raises(grpc.RpcError) as info:
                list(pb_grpc.GenerationStub(channel).Generate(request(SHORT_PROMPT), timeout=10))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "exceeded its deadline" in info.value.details()
        wait_until(lambda: d0.aborts == [d0.decode_requests[0].request_id])
    finally:
        loop.run(running.stop(0.5))


def finishing(worker: FakeWorker) -> Callable[..., Any]:
    """The worker's default prefill, except that its first token ends the request (max_tokens=1)."""
    async def finished(request: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:
        response = await worker.default_prefill(request, context)
        response.finish_reason = pb.FINISH_REASON_LENGTH
        return response

    return finished


def test_first_token_that_finishes_skips_decode_and_releases_the_lease(stub, cluster, tokens):
    d0, p0 = cluster.add("d0", "decode"), cluster.add("p0", "prefill")
    p0.prefill = finishing(p0)
    responses = list(stub.Generate(request(LONG_PROMPT, max_tokens=1), timeout=10))
    assert [t for r in responses for t in r.token_ids] == [tokens[0]]
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH and responses[-1].usage.completion_tokens == 1
    assert d0.decode_requests == []
    wait_until(lambda: p0.releases == [f"lease-{p0.prefill_requests[0].request_id}"])


def test_routing_follows_the_kv_index_and_skips_draining_workers(stub, cluster, tokenizer):
    d0 = cluster.add("d0", "decode")
    cluster.add("d1", "decode")
    p0 = cluster.add("p0", "prefill")
    prompt_ids = tokenizer.encode(LONG_PROMPT)
    hashes = hash_blocks(prompt_ids, BLOCK_SIZE, root_hash(bytes.fromhex(FINGERPRINT), BLOCK_SIZE, b""))
    cluster.run(lambda registry: registry.index.publish("d1", hashes, []))
    final = list(stub.Generate(request(LONG_PROMPT), timeout=10))[-1]
    # d1 holds every full block: the uncached tail is under the threshold, so d1 prefills it locally.
    assert (final.timings.decode_worker, final.timings.route_kind) == ("d1", "local")
    assert p0.prefill_requests == [] and d0.decode_requests == []
    cluster.run(lambda registry: registry.add_draining("d1"))
    try:
        final = list(stub.Generate(request(LONG_PROMPT), timeout=10))[-1]
        assert (final.timings.decode_worker, final.timings.route_kind) == ("d0", "remote")
    finally:
        cluster.run(lambda registry: registry.remove_draining("d1"))


def test_a_prefix_cached_elsewhere_is_leased_for_the_decode_worker_and_released_after_its_answer(
        stub, cluster, tokenizer, tokens):
    d0, p0 = cluster.add("d0", "decode"), cluster.add("p0", "prefill")
    prompt_ids = tokenizer.encode(LONG_PROMPT)
    hashes = hash_blocks(prompt_ids, BLOCK_SIZE, root_hash(bytes.fromhex(FINGERPRINT), BLOCK_SIZE, b""))
    cluster.run(lambda registry: registry.index.publish("p0", hashes, []))
    responses = list(stub.Generate(request(LONG_PROMPT), timeout=10))
    # p0 holds every full block: importing them leaves d0 a tail under the threshold, so d0 prefills locally
    assert p0.prefill_requests == [] and [t for r in responses for t in r.token_ids] == tokens[:6]
    (leased,) = p0.lease_prefix_requests
    assert list(leased.token_ids) == prompt_ids and leased.min_tokens == BLOCK_SIZE
    sent = d0.decode_requests[0]
    assert sent.prefix_handle.lease_id == "prefix-1" and not sent.HasField("handle")
    t = responses[-1].timings
    assert t.route_kind == "local" and "tokens from p0)" in t.route_reason, t.route_reason
    wait_until(lambda: p0.releases == ["prefix-1"])  # D answered: its pull is over


def test_a_failed_prefix_lease_only_costs_the_reuse(stub, cluster, tokenizer, tokens):
    d0, p0 = cluster.add("d0", "decode"), cluster.add("p0", "prefill")
    p0.lease_prefix_error = grpc.StatusCode.UNAVAILABLE
    prompt_ids = tokenizer.encode(LONG_PROMPT)
    hashes = hash_blocks(prompt_ids, BLOCK_SIZE, root_hash(bytes.fromhex(FINGERPRINT), BLOCK_SIZE, b""))
    cluster.run(lambda registry: registry.index.publish("p0", hashes, []))
    responses = list(stub.Generate(request(LONG_PROMPT), timeout=10))
    assert [t for r in responses for t in r.token_ids] == tokens[:6] and len(p0.lease_prefix_requests) == 1
    assert not d0.decode_requests[0].HasField("prefix_handle") and p0.releases == []


def test_cache_salt_changes_the_hashes(stub, cluster, tokenizer):
    cluster.add("d0", "decode")
    d1 = cluster.add("d1", "decode")
    prompt_ids = tokenizer.encode(SHORT_PROMPT * 40)
    hashes = hash_blocks(prompt_ids, BLOCK_SIZE, root_hash(bytes.fromhex(FINGERPRINT), BLOCK_SIZE, b"tenant-a"))
    cluster.run(lambda registry: registry.index.publish("d1", hashes, []))
    salted = request(SHORT_PROMPT * 40)
    salted.cache_salt = "tenant-a"
    salted_final = list(stub.Generate(salted, timeout=10))[-1]
    assert salted_final.timings.decode_worker == "d1", salted_final.timings.route_reason
    n = len(prompt_ids)
    assert f"{n // BLOCK_SIZE * BLOCK_SIZE} of {n} prompt tokens cached on d1" in salted_final.timings.route_reason
    cluster.run(lambda registry: registry.add_draining("d0"))  # only d1, which holds the salted blocks, is left
    try:
        final = list(stub.Generate(request(SHORT_PROMPT * 40), timeout=10))[-1]
    finally:
        cluster.run(lambda registry: registry.remove_draining("d0"))
    assert final.timings.decode_worker == "d1"
    assert f"0 of {n} prompt tokens cached on d1" in final.timings.route_reason
    assert len(d1.decode_requests) == 2


def test_concurrent_streams_each_get_their_own_tokens(stub, cluster, tokens):
    from concurrent.futures import ThreadPoolExecutor

    cluster.add("d0", "decode")
    cluster.add("d1", "decode")
    p0 = cluster.add("p0", "prefill")

    def one(i: int) -> list[int]:
        prompt = LONG_PROMPT if i % 2 else SHORT_PROMPT
        responses = list(stub.Generate(request(prompt, max_tokens=3 + i % 5), timeout=20))
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        return [t for r in responses for t in r.token_ids]

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert results == [tokens[: 3 + i % 5] for i in range(32)]
    # The 16 long prompts start remote; as the burst's unanswered prefills queue up on p0 the router
    # prices that queue (Candidate.inflight_prefill_tokens) and may prefill some of them locally.
    assert 0 < len(p0.prefill_requests) <= 16
    wait_until(lambda: sorted(p0.releases) == sorted(f"lease-{r.request_id}" for r in p0.prefill_requests))


def test_generate_cli_streams_text_and_a_timing_line(cluster, tokenizer, tokens, loop, model_dir, redis_server):
    import io

    from router import generate_cli

    cluster.add("d0", "decode")
    cluster.add("p0", "prefill")
    running = loop.run(start_router(router_config(model_dir, redis_server.url)))
    try:
        out, err = io.StringIO(), io.StringIO()
        argv = [LONG_PROMPT, "--router", f"127.0.0.1:{running.port}", "--max-tokens", "6", "--temperature", "0"]
        assert generate_cli.main(argv, out=out, err=err) == 0, err.getvalue()
        text, timing = out.getvalue().rstrip("\n").rsplit("\n", 1)
        assert text == tokenizer.decode(tokens[:6])
        assert timing.startswith("[TTFT ") and "prefill p0" in timing and "decode d0" in timing
        assert "| queue 1.0 ms |" in timing  # P's wait in its engine queue
        assert "route remote" in timing and "KV 7 blocks 1.0 MB in 2.00 ms (0.50 GB/s, tcp)" in timing
        assert "tok/s" in timing and "+ 6 tokens (length)" in timing
    finally:
        loop.run(running.stop(0.5))


def test_generate_cli_reports_errors_without_a_traceback():
    from io import StringIO

    from router import generate_cli

    out, err = StringIO(), StringIO()
    assert generate_cli.main(["hi", "--router", f"127.0.0.1:{free_port()}", "--timeout", "5"], out=out, err=err) == 1
    assert "cannot reach the router at 127.0.0.1:" in err.getvalue() and "Traceback" not in err.getvalue()


# ---- layer-wise (--kv-layerwise): PrefillStream's handle starts Decode; FirstToken follows -----------


@pytest.fixture(scope="module")
def layerwise_stub(loop, model_dir, redis_server) -> Iterator[pb_grpc.GenerationStub]:
    running = loop.run(start_router(router_config(model_dir, redis_server.url, kv_layerwise=True)))
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        generation = pb_grpc.GenerationStub(channel)
        generation.running = running  # fresh_rates resets its learned rates before each test
        yield generation
    loop.run(running.stop(0.5))


def test_layerwise_decode_starts_on_the_handle_and_gets_the_first_token(layerwise_stub, cluster, tokenizer, tokens):
    d0, p0 = cluster.add("d0", "decode"), cluster.add("p0", "prefill")
    responses = list(layerwise_stub.Generate(request(LONG_PROMPT), timeout=10))
    assert [t for r in responses for t in r.token_ids] == tokens[:6]
    prompt_ids = tokenizer.encode(LONG_PROMPT)
    decode = d0.decode_requests[0]
    assert decode.first_token_pending and list(decode.token_ids) == prompt_ids  # no first token yet
    assert decode.handle.lease_id == f"lease-{p0.prefill_requests[0].request_id}"
    assert [(f.request_id, f.token_id, f.recompute) for f in d0.first_tokens] == [(decode.request_id, tokens[0], False)]
    assert responses[-1].timings.route_kind == "remote" and responses[-1].timings.prefill_worker == "p0"
    wait_until(lambda: p0.releases == [decode.handle.lease_id])  # D's first answer acked the pull


def test_layerwise_prefill_failing_after_the_handle_makes_decode_recompute(layerwise_stub, cluster, tokens):
    d0, p0 = cluster.add("d0", "decode"), cluster.add("p0", "prefill")

    async def dies(request: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker lost its device")

    p0.prefill_after_handle = dies
    responses = list(layerwise_stub.Generate(request(LONG_PROMPT), timeout=10))
    assert [t for r in responses for t in r.token_ids] == tokens[:6]  # all six from D, none twice
    assert [f.recompute for f in d0.first_tokens] == [True]
    assert len(d0.decode_requests) == 1  # the Decode already holding the handle carried on
    t = responses[-1].timings
    assert t.route_kind == "local" and "fallback: prefill on p0 failed (UNAVAILABLE)" in t.route_reason
    wait_until(lambda: p0.aborts == [p0.prefill_requests[0].request_id])


def test_layerwise_first_token_that_finishes_cancels_the_waiting_decode(layerwise_stub, cluster, tokens):
    d0, p0 = cluster.add("d0", "decode"), cluster.add("p0", "prefill")
    p0.prefill_after_handle = finishing(p0)
    responses = list(layerwise_stub.Generate(request(LONG_PROMPT, max_tokens=1), timeout=10))
    assert [t for r in responses for t in r.token_ids] == [tokens[0]]
    assert d0.first_tokens == []  # nothing to decode: D is stopped instead (its call cancelled, if it got
    # that far, and told to forget the request), then P's lease is released
    request_id = p0.prefill_requests[0].request_id
    wait_until(lambda: d0.aborts == [request_id])
    wait_until(lambda: p0.releases == [f"lease-{request_id}"])


def test_a_large_pool_prices_only_the_preselected(loop, model_dir, redis_server, cluster, tokenizer):
    """Past ``--preselect-above`` workers the relay prices the least loaded and the prefix holders, not everyone:
    the reason says so, and the idle decode worker among ten busy ones is chosen."""
    from router.routing.preselect import PreselectConfig

    idle = cluster.add("d-idle", "decode")
    busy = cluster.add("d-busy0", "decode", running=30)
    address = _address_of(cluster, busy)
    for i in range(1, 10):  # the same server: never called, only priced (or not)
        cluster.add(f"d-busy{i}", "decode", running=30 + i, address=address)
    prefill = cluster.add("p0", "prefill")
    config = router_config(model_dir, redis_server.url, preselect=PreselectConfig(above=4, holders=1,
                                                                                  least_loaded=1, sampled=0))
    running = loop.run(start_router(config))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            request = pb.GenerateRequest(prompt=LONG_PROMPT, sampling=pb.SamplingParams(max_tokens=3))
            final = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=30))[-1]
        assert "(1 pre-selected decode workers priced)" in final.timings.route_reason, final.timings.route_reason
        assert final.timings.decode_worker == "d-idle" and idle.decode_requests and not busy.decode_requests
        assert prefill.prefill_requests or final.timings.route_kind == "local"
    finally:
        loop.run(running.stop(0.5))


def _address_of(cluster: Cluster, worker: FakeWorker) -> str:
    async def read(registry: Registry) -> str:
        return next(info.grpc_address for info, _ in await registry.list_workers()
                    if info.worker_id == worker.worker_id)

    return cluster.run(read)
