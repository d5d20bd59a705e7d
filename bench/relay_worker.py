"""A synthetic fast decode worker for ``bench relay``: a real process serving ``baton.v1.Worker`` over real gRPC,
registered in Redis the way real workers register (``kv_transfer.registry``: the same keys, the same heartbeat),
whose "engine" is no model at all: ``Decode`` streams the request's ``max_tokens`` tokens, one per message as a
real decode step sends them, as fast as the stream takes them (or one every ``--token-interval-ms``).

    python -m bench.relay_worker --redis-url URL --port P --worker-id d0 --model DIR [--no-uvloop]
        [--token-interval-ms 0] [--tokens-per-message 1]

The tokens cycle through a real English passage tokenized with ``--model``'s tokenizer, so the router's
incremental detokenization does the work it does for real text. What it measures is Baton's plumbing (the
router's relay, gRPC, the event loop), not an engine: a real decode worker adds its engine step per token.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import AsyncIterator

import grpc

from engine.tokenizer import Tokenizer
from kv_transfer.registry import HeartbeatTask, Registry, connect
from kv_transfer.workers import WorkerInfo, WorkerLoad
from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc, event_loop

PASSAGE = ("A smart router sends each prompt to a compute-heavy prefill pool; the prefill worker computes the "
           "prompt's paged KV cache and hands it, like a baton in a relay, to a memory-bound decode pool. Tokens "
           "stream back to the client through gRPC and an OpenAI-compatible HTTP front. ")
FINGERPRINT = "5e" * 16  # no model: any fixed fingerprint the router's scheme check accepts
TOTAL_BLOCKS = 1 << 20  # never the reason a request is refused


def token_cycle(tokenizer: Tokenizer) -> list[int]:
    """The token ids every stream cycles through."""
    return tokenizer.encode(PASSAGE, add_special_tokens=False)


def text_lengths(tokenizer: Tokenizer, num_tokens: int) -> list[int]:
    """Characters of text in the first k tokens of a stream, for k = 0 .. ``num_tokens`` (a client of the SSE
    stream counts tokens from its text with it)."""
    ids = token_cycle(tokenizer)
    stream = [ids[i % len(ids)] for i in range(num_tokens)]
    return [len(tokenizer.decode(stream[:k])) for k in range(num_tokens + 1)]


class SyntheticDecoder(pb_grpc.WorkerServicer):
    """``Decode`` without a model: ``max_tokens`` tokens from a fixed cycle, the last one with the finish reason."""

    def __init__(self, token_ids: list[int], *, interval_s: float, tokens_per_message: int) -> None:
        self._ids, self._interval_s, self._per_message = token_ids, interval_s, tokens_per_message
        self.running, self.aborts = 0, 0

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[pb.DecodeResponse]:
        count = request.sampling.max_tokens - request.num_output_tokens_so_far
        start, ids, step = request.num_output_tokens_so_far, self._ids, self._per_message
        self.running += 1
        try:
            for sent in range(0, count, step):
                chunk = [ids[(start + i) % len(ids)] for i in range(sent, min(sent + step, count))]
                if sent + step < count:
                    yield pb.DecodeResponse(token_ids=chunk)
                else:
                    yield pb.DecodeResponse(token_ids=chunk, finish_reason=pb.FINISH_REASON_LENGTH,
                                            timings=pb.Timings(decode_worker="synthetic"))
                if self._interval_s:
                    await asyncio.sleep(self._interval_s)
        finally:
            self.running -= 1

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        self.aborts += 1
        return pb.AbortResponse(found=False)

    async def ReleaseLease(self, request, context) -> pb.ReleaseLeaseResponse:
        return pb.ReleaseLeaseResponse(found=False)

    async def Stats(self, request, context) -> pb.StatsResponse:
        return pb.StatsResponse(role="decode", num_running=self.running, num_total_blocks=TOTAL_BLOCKS,
                                num_free_blocks=TOTAL_BLOCKS)

    async def Prefill(self, request, context) -> pb.PrefillResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "a synthetic decode worker does not prefill")


async def serve(args: argparse.Namespace) -> None:
    tokenizer = Tokenizer.from_pretrained(args.model)
    decoder = SyntheticDecoder(token_cycle(tokenizer),
                               interval_s=args.token_interval_ms / 1e3, tokens_per_message=args.tokens_per_message)
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(decoder, server)
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    redis = connect(args.redis_url)
    info = WorkerInfo(worker_id=args.worker_id, role="decode", grpc_address=f"127.0.0.1:{port}",
                      kv_uri="tcp://127.0.0.1:1", model_fingerprint=FINGERPRINT,
                      layout_json='{"block_size": 16}', total_blocks=TOTAL_BLOCKS)

    def load() -> WorkerLoad:
        return WorkerLoad(running=decoder.running, waiting=0, free_blocks=TOTAL_BLOCKS, queued_prefill_tokens=0)

    heartbeat = HeartbeatTask(Registry(redis, args.ns), info, load)
    heartbeat.start()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print(f"synthetic decode worker {args.worker_id} ready: grpc=127.0.0.1:{port} loop={event_loop.loop_name()}",
          flush=True)
    await stop.wait()
    await heartbeat.stop()
    await server.stop(0.5)
    await redis.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.relay_worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--ns", default="baton")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--worker-id", default="d0")
    parser.add_argument("--model", required=True, help="a folder with tokenizer.json (the router's model)")
    parser.add_argument("--token-interval-ms", type=float, default=0.0,
                        help="pause per message of each stream (default: none, as fast as the stream takes them)")
    parser.add_argument("--tokens-per-message", type=int, default=1)
    event_loop.add_argument(parser)
    args = parser.parse_args(argv)
    event_loop.run(serve(args), use_uvloop=event_loop.wanted(args.uvloop, os.environ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
