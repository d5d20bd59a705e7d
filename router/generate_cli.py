"""``baton generate "prompt"``: stream a completion from the router, then one line of timings."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

import grpc

from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc
from proto import tls
from router.config import DEFAULT_ROUTER_ADDRESS

_FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton generate", description="Stream a completion from a Baton router.")
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--router", default=os.environ.get("BATON_ROUTER", DEFAULT_ROUTER_ADDRESS),
                        help="router address HOST:PORT (default: $BATON_ROUTER or %(default)s)")
    parser.add_argument("--chat", action="store_true", help="send the prompt as one user message of a chat")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens to generate at most (router default 16)")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 1.0)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None, help="make sampling reproducible")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    parser.add_argument("--model", default="", help="model name to check against the served one")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--no-timings", action="store_true", help="omit the timing line")
    tls.add_arguments(parser)  # --tls-ca: verify the router; + --tls-cert/--tls-key: mTLS
    return parser


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(stop=args.stop, ignore_eos=args.ignore_eos)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        if (value := getattr(args, name)) is not None:
            setattr(sampling, name, value)
    request = pb.GenerateRequest(sampling=sampling, model=args.model)
    if args.chat:
        request.chat.messages.add(role="user", content=args.prompt)
    else:
        request.prompt = args.prompt
    return request


def format_timings(final: pb.GenerateResponse) -> str:
    """One line: TTFT, the prefill's wait in the engine queue, where prefill and decode ran, KV moved,
    decode speed, tokens and finish reason."""
    t, usage = final.timings, final.usage
    prefill = t.prefill_worker or f"local on {t.decode_worker or '?'}"
    predicted = f" (predicted {t.predicted_ttft_ms:.1f} ms)" if t.predicted_ttft_ms else ""
    parts = [f"TTFT {t.ttft_ms:.1f} ms{predicted}", f"queue {t.queue_ms:.1f} ms", f"prefill {prefill}",
             f"decode {t.decode_worker or '?'}",
             f"route {t.route_kind or '?'} ({t.route_reason})" if t.route_reason else f"route {t.route_kind or '?'}"]
    if t.transfer_blocks or t.transfer_bytes:
        via = (f", {t.transport}" if t.transport else "") + (", streamed by layer" if t.kv_layerwise else "")
        if t.kv_layerwise and t.kv_first_layer_unix_ms and t.prefill_end_unix_ms > t.kv_first_layer_unix_ms:
            via += f", first layer in {t.prefill_end_unix_ms - t.kv_first_layer_unix_ms:.1f} ms before P finished"
        parts.append(f"KV {t.transfer_blocks} blocks {_bytes(t.transfer_bytes)} in {t.transfer_ms:.2f} ms "
                     f"({t.transfer_gbps:.2f} GB/s{via})")
    else:
        parts.append("KV 0 blocks moved")
    parts.append(f"decode {t.decode_tokens_per_s:.1f} tok/s")
    if t.spec_draft_tokens:
        parts.append(f"speculative: {t.spec_accepted_tokens} of {t.spec_draft_tokens} drafts accepted")
    if t.migrations:
        parts.append(f"migrated {t.migrations}x (waited {t.migration_ms:.0f} ms)")
    cached = f", {usage.cached_prompt_tokens} cached" if usage.cached_prompt_tokens else ""
    parts.append(f"{usage.prompt_tokens} prompt{cached} + {usage.completion_tokens} tokens "
                 f"({_FINISH_NAMES.get(final.finish_reason, 'unfinished')})")
    parts.append(f"e2e {t.e2e_ms:.0f} ms")
    return "[" + " | ".join(parts) + "]"


def _bytes(num_bytes: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes} B"


def describe_error(exc: grpc.RpcError, address: str, tls_config: tls.TlsConfig | None = None) -> str:
    code, details = exc.code(), exc.details() or ""
    if code != grpc.StatusCode.UNAVAILABLE:
        return f"{code.name}: {details}"
    lowered = details.lower()
    if "connection refused" in lowered:
        return f"cannot reach the router at {address} (is `baton up` or `baton router` running?): {details}"
    if tls_config is not None and tls_config.enabled:
        return (f"no TLS connection to the router at {address}: {details} (check that it serves TLS, that --tls-ca "
                "signed its certificate, and for mTLS that --tls-cert/--tls-key are a client certificate it trusts)")
    if any(word in lowered for word in ("socket closed", "handshake", "ssl", "reset")):
        return (f"the router at {address} closed the connection: {details} "
                "(does it serve TLS? then pass --tls-ca, and --tls-cert/--tls-key for mTLS)")
    if "connect" in lowered or "refused" in lowered:
        return f"cannot reach the router at {address} (is `baton up` or `baton router` running?): {details}"
    return f"{code.name}: {details}"


def stream(
    stub: pb_grpc.GenerationStub, request: pb.GenerateRequest, timeout_s: float | None, out: TextIO
) -> pb.GenerateResponse | None:
    """Write text deltas to ``out`` as they arrive; return the last message (with usage and timings)."""
    final = None
    call = stub.Generate(request, timeout=timeout_s)
    try:
        for response in call:
            if response.text:
                out.write(response.text)
                out.flush()
            if response.finish_reason:
                final = response
    except KeyboardInterrupt:
        call.cancel()
        raise
    return final


def main(argv: list[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    parser = build_parser()
    args = parser.parse_args(argv)
    tls_config = tls.from_args_or_exit(parser, args)
    try:
        with tls.channel(args.router, tls_config) as channel:
            final = stream(pb_grpc.GenerationStub(channel), build_request(args), args.timeout, out)
    except grpc.RpcError as exc:
        print(f"\nbaton generate: error: {describe_error(exc, args.router, tls_config)}", file=err)
        return 1
    except KeyboardInterrupt:
        print("\nbaton generate: cancelled", file=err)
        return 130
    out.write("\n")
    if final is not None and not args.no_timings:
        out.write(format_timings(final) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
