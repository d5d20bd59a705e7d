"""Token coalescing (``router.coalesce``): a client slower than the decode stream gets the tokens that queued up
in fewer messages, every token exactly and in order; a client that keeps up gets one message per token.

``coalesced`` is checked on its own against a plain async stream; the router's behaviour through a real router
gRPC server and a real redis-server, with a scripted worker (as ``test_router_relay``), and a client made slow
the way a real one is: a small HTTP/2 window it fills and reads slowly, so the router's writes wait.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from engine.text_stream import TextStream
from engine.tokenizer import Tokenizer
from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc
from router.coalesce import coalesced, take_text
from router.server import start_router
from tests.unit.test_router_relay import (  # noqa: F401 - module fixtures, used by name
    Cluster, loop, model_dir, redis_server, router_config, tokenizer,
)

PASSAGE = " the quick brown fox jumps over the lazy dog while the relay carries every token to the client"
SLOW_CLIENT_OPTIONS = (("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0))  # a 1 KiB window


async def _responses(n: int, gap_s: float = 0.0, error: Exception | None = None) -> AsyncIterator[pb.DecodeResponse]:
    for i in range(n):
        yield pb.DecodeResponse(token_ids=[i])
        await asyncio.sleep(gap_s)
    if error is not None:
        raise error


def _batches(source: AsyncIterator[Any], consume_s: float, max_pending: int = 256) -> tuple[list[list[int]], Any]:
    async def run() -> tuple[list[list[int]], Any]:
        out, error = [], None
        try:
            async for batch in coalesced(source, max_pending):
                out.append(batch.token_ids)
                await asyncio.sleep(consume_s)
        except RuntimeError as exc:
            error = exc
        return out, error
    return asyncio.run(run())


def test_a_slow_consumer_gets_everything_in_order_in_fewer_batches():
    batches, _ = _batches(_responses(200, gap_s=0.0005), consume_s=0.01)
    assert [t for batch in batches for t in batch] == list(range(200))
    assert len(batches) < 100


def test_a_consumer_that_keeps_up_gets_one_batch_per_response():
    batches, _ = _batches(_responses(20, gap_s=0.01), consume_s=0.0)
    assert batches == [[i] for i in range(20)]


def test_an_error_comes_after_the_responses_before_it():
    batches, error = _batches(_responses(30, error=RuntimeError("worker gone")), consume_s=0.005)
    assert [t for batch in batches for t in batch] == list(range(30)) and str(error) == "worker gone"


def test_the_queue_is_bounded_the_reader_waits_for_the_consumer():
    pulled = itertools.count()

    async def counted() -> AsyncIterator[pb.DecodeResponse]:
        for i in range(100):
            next(pulled)
            yield pb.DecodeResponse(token_ids=[i])

    async def run() -> tuple[list[int], int, int]:
        batches = coalesced(counted(), max_pending=8)
        first = (await anext(batches)).token_ids
        await asyncio.sleep(0.05)  # the consumer is busy: the reader may read 8 ahead of it, no more
        pulled_meanwhile = next(pulled)
        rest = [t async for batch in batches for t in batch.token_ids]
        return [*first, *rest], len(first), pulled_meanwhile

    tokens, first, pulled_meanwhile = asyncio.run(run())
    assert tokens == list(range(100)) and first <= 8 and pulled_meanwhile == first + 8


def test_take_text_ends_a_batch_at_the_token_that_completes_a_stop_string(tokenizer):
    ids = tokenizer.encode(PASSAGE, add_special_tokens=False)
    stop_at = next(i for i in range(len(ids)) if "fox" in tokenizer.decode(ids[: i + 1]))
    text = TextStream(tokenizer, [], stop=["fox"])
    taken, piece, stopped = take_text(text, ids, has_stops=True)
    assert (taken, stopped) == (stop_at + 1, True) and piece == tokenizer.decode(ids[:stop_at + 1]).split("fox")[0]


# ---- through the router --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def router(loop, model_dir, redis_server) -> Iterator[str]:
    running = loop.run(start_router(router_config(model_dir, redis_server.url)))
    yield f"127.0.0.1:{running.port}"
    loop.run(running.stop(0.5))


@pytest.fixture
def stream_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(PASSAGE, add_special_tokens=False)
    return [ids[i % len(ids)] for i in range(600)]


@pytest.fixture
def worker(loop, redis_server, stream_ids) -> Iterator[Any]:
    cluster = Cluster(loop, redis_server.url, stream_ids)
    decode = cluster.add("d0", "decode")
    yield decode
    cluster.close()


def _burst(ids: list[int], gap_s: float = 0.0):
    async def decode(request: pb.DecodeRequest, context: Any) -> AsyncIterator[pb.DecodeResponse]:
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            yield pb.DecodeResponse(token_ids=[token], finish_reason=pb.FINISH_REASON_LENGTH if last else 0)
            if gap_s:
                await asyncio.sleep(gap_s)
    return decode


def _generate(address: str, options: tuple = (), read_gap_s: float = 0.0, **sampling: Any) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(max_tokens=600, **sampling))
    out = []
    with grpc.insecure_channel(address, options=options) as channel:
        for response in pb_grpc.GenerationStub(channel).Generate(request, timeout=30):
            out.append(response)
            time.sleep(read_gap_s)
    return out


def test_a_slow_grpc_client_gets_every_token_in_order_in_fewer_messages(router, worker, stream_ids, tokenizer: Tokenizer):
    worker.decode = _burst(stream_ids)
    responses = _generate(router, SLOW_CLIENT_OPTIONS, read_gap_s=0.002)
    tokens = [t for r in responses for t in r.token_ids]
    assert tokens == stream_ids
    assert "".join(r.text for r in responses) == tokenizer.decode(stream_ids)
    assert len(responses) < len(stream_ids) // 2  # one per token (plus the final) without coalescing
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH and not responses[-1].token_ids
    assert responses[-1].usage.completion_tokens == len(stream_ids)


def test_a_slow_client_with_a_stop_string_ends_at_the_same_token(router, worker, stream_ids, tokenizer: Tokenizer):
    # "zebra" first appears 400 tokens in: past the slow client's first kilobyte, inside a coalesced batch
    ids = [*stream_ids[:400], *tokenizer.encode(" a zebra crossing", add_special_tokens=False), *stream_ids[:150]]
    stop_at = next(i for i in range(len(ids)) if "zebra" in tokenizer.decode(ids[: i + 1]))
    worker.decode = _burst(ids)
    slow = _generate(router, SLOW_CLIENT_OPTIONS, read_gap_s=0.002, stop=["zebra"])
    fast = _generate(router, stop=["zebra"])
    for responses in (slow, fast):
        assert [t for r in responses for t in r.token_ids] == ids[: stop_at + 1]
        assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
        assert responses[-1].usage.completion_tokens == stop_at + 1
    assert len(slow) < 400 // 2


def test_a_client_that_keeps_up_gets_one_message_per_token(router, worker, stream_ids):
    worker.decode = _burst(stream_ids[:25], gap_s=0.02)  # a decode step every 20 ms: the router keeps up
    responses = _generate(router)
    assert [list(r.token_ids) for r in responses[:-1]] == [[t] for t in stream_ids[:25]]
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.slow
def test_a_stalled_sse_client_gets_the_text_in_fewer_chunks(loop, model_dir, redis_server, worker, stream_ids,
                                                            tokenizer: Tokenizer):
    """The OpenAI front writes one chunk per relay response, so it coalesces alike; but here the kernel takes
    ~4 MB of a stalled client's stream before the router's writes wait, hence 20,000 tokens (~3.9 MB of SSE)."""
    ids = [stream_ids[i % len(stream_ids)] for i in range(20_000)]
    worker.decode = _burst(ids)
    running = loop.run(start_router(router_config(model_dir, redis_server.url), http_port=0))
    try:
        body = json.dumps({"prompt": "Hello", "max_tokens": len(ids), "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", running.http_server.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: baton\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            time.sleep(6)  # a client that reads nothing for a while
            data = b"".join(iter(lambda: sock.recv(1 << 16), b""))
    finally:
        loop.run(running.stop(0.5))
    chunks = [json.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(ids)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) < len(ids)  # one per token without coalescing
