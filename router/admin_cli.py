"""``baton admin``: workers and pools, scale, drain / undrain, and an SLO plan that shows its reasoning.

Talks to the router's ``baton.v1.Admin`` service; ``--token`` (or ``$BATON_ADMIN_TOKEN``) is sent as
``authorization: Bearer <token>``. Tables are aligned, colored only on a terminal; ``--json`` for scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import grpc
from google.protobuf.json_format import MessageToDict

from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc
from router.config import DEFAULT_ROUTER_ADDRESS
from router.generate_cli import describe_error

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STATE = {pb.WORKER_STATE_UP: ("up", "32"), pb.WORKER_STATE_DRAINING: ("draining", "33")}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton admin", description="Workers and pools, scale, drain / undrain, and an SLO plan that shows "
        "its reasoning, through the router's baton.v1.Admin service.")
    parser.add_argument("--router", default=os.environ.get("BATON_ROUTER", DEFAULT_ROUTER_ADDRESS),
                        help="router address HOST:PORT (default: $BATON_ROUTER or %(default)s)")
    parser.add_argument("--token", default=os.environ.get("BATON_ADMIN_TOKEN") or None,
                        help="admin bearer token (default: $BATON_ADMIN_TOKEN)")
    parser.add_argument("--json", action="store_true", help="print the raw responses as JSON")
    parser.add_argument("--timeout", type=float, default=10.0, help="per-call deadline in seconds (default: 10)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("status", help="every worker with its load, and the pools (desired vs actual)")
    scale = commands.add_parser("scale", help="set a pool's desired size")
    scale.add_argument("role", choices=["prefill", "decode"])
    scale.add_argument("size", type=int)
    for name, text in (("drain", "stop routing new requests to a worker"), ("undrain", "route to it again")):
        commands.add_parser(name, help=text).add_argument("worker_id")
    plan = commands.add_parser("plan", help="recommend pool sizes for SLOs and traffic, with the reasoning")
    plan.add_argument("--ttft-p90", type=float, required=True, metavar="MS", help="TTFT p90 target (ms)")
    plan.add_argument("--itl-p90", type=float, required=True, metavar="MS", help="ITL p90 target (ms)")
    plan.add_argument("--rate", type=float, required=True, help="requests per second")
    plan.add_argument("--isl", type=float, required=True, help="mean prompt tokens")
    plan.add_argument("--osl", type=float, required=True, help="mean output tokens")
    plan.add_argument("--profile", type=Path, default=None,
                      help="JSON {prefill: {prompt_lens, tokens_per_s}, decode: {batch_sizes, itl_ms}} "
                      "(default: the profile stored in Redis)")
    plan.add_argument("--prefill-correction", type=float, default=None, help="measured / predicted TTFT")
    plan.add_argument("--decode-correction", type=float, default=None, help="measured / predicted ITL")
    plan.add_argument("--apply", action="store_true", help="set both pools' desired sizes to the plan")
    return parser


def plan_request(args: argparse.Namespace) -> pb.PlanRequest:
    request = pb.PlanRequest(ttft_p90_ms=args.ttft_p90, itl_p90_ms=args.itl_p90, rate=args.rate, isl=args.isl,
                             osl=args.osl, apply=args.apply)
    if args.prefill_correction is not None:
        request.prefill_correction = args.prefill_correction
    if args.decode_correction is not None:
        request.decode_correction = args.decode_correction
    if args.profile is not None:
        raw = json.loads(args.profile.read_text(encoding="utf-8"))
        request.prefill_curve.CopyFrom(pb.PrefillCurve(**raw["prefill"]))
        request.decode_curve.CopyFrom(pb.DecodeCurve(**raw["decode"]))
    return request


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, right: Sequence[int] = ()) -> list[str]:
    """Aligned columns; ``right`` lists the numeric columns. Cells may hold ANSI colors (not counted)."""
    cells = [list(headers)] + [list(r) for r in rows]
    widths = [max(_visible_len(row[i]) for row in cells) for i in range(len(headers))]

    def fmt(row: list[str]) -> str:
        padded = [" " * (w - _visible_len(c)) + c if i in right else c + " " * (w - _visible_len(c))
                  for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(padded).rstrip()

    return [fmt(row) for row in cells]


class Printer:
    def __init__(self, out: TextIO, *, color: bool) -> None:
        self.out, self.color = out, color

    def paint(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color else text

    def lines(self, lines: Sequence[str]) -> None:
        self.out.write("".join(line + "\n" for line in lines))

    def status(self, workers: pb.ListWorkersResponse, pools: pb.GetPoolsResponse) -> None:
        rows = [self._worker_row(w) for w in workers.workers]
        headers = ["WORKER", "ROLE", "ADDRESS", "STATE", "RUN", "WAIT", "KV USED", "FREE/TOTAL", "LOAD AGE"]
        self.lines(table(headers, rows, right=(4, 5, 6, 7, 8)) if rows else ["no workers registered"])
        self.out.write("\n")
        pool_rows = [[p.role, str(p.desired) if p.HasField("desired") else "-", str(p.actual), str(p.draining)]
                     for p in pools.pools]
        self.lines(table(["POOL", "DESIRED", "ACTUAL", "DRAINING"], pool_rows, right=(1, 2, 3)))

    def plan(self, response: pb.PlanResponse) -> None:
        rows = [[t.pool, t.name, _number(t.value), t.unit, t.note] for t in response.terms]
        self.lines(table(["POOL", "TERM", "VALUE", "UNIT", "NOTE"], rows, right=(2,)))
        verdict = "" if response.feasible else self.paint("  (SLO not reachable: best effort)", "31")
        applied = "  applied" if response.applied else ""
        self.out.write(f"\nplan: {self.paint(str(response.prefill), '1')} prefill, "
                       f"{self.paint(str(response.decode), '1')} decode{verdict}{applied}\n")

    def _worker_row(self, w: pb.AdminWorker) -> list[str]:
        state, code = _STATE.get(w.state, ("?", "31"))
        load = [str(w.num_running), str(w.num_waiting), f"{w.kv_cache_usage:.0%}",
                f"{w.num_free_blocks}/{w.num_total_blocks}", f"{w.load_age_ms / 1e3:.1f}s"]
        if not w.has_load:
            load = ["-", "-", "-", f"-/{w.num_total_blocks}", "-"]
        return [w.worker_id, w.role, w.grpc_address, self.paint(state, code), *load]


def run(args: argparse.Namespace, stub: pb_grpc.AdminStub, printer: Printer) -> None:
    call: dict[str, Any] = {"timeout": args.timeout, "metadata": _metadata(args.token)}
    if args.command == "status":
        workers, pools = stub.ListWorkers(pb.ListWorkersRequest(), **call), stub.GetPools(pb.GetPoolsRequest(), **call)
        if args.json:
            return _dump(printer.out, {"workers": _dict(workers).get("workers", []), "pools": _dict(pools)["pools"]})
        return printer.status(workers, pools)
    if args.command == "scale":
        response = stub.ScalePool(pb.ScalePoolRequest(role=args.role, size=args.size), **call)
        if args.json:
            return _dump(printer.out, _dict(response))
        before = str(response.previous_desired) if response.HasField("previous_desired") else "unset"
        return printer.lines([f"{args.role} pool: desired {before} -> {response.pool.desired} "
                              f"(actual {response.pool.actual})"])
    if args.command in ("drain", "undrain"):
        method = stub.Drain if args.command == "drain" else stub.Undrain
        response = method(pb.DrainRequest(worker_id=args.worker_id), **call)
        if args.json:
            return _dump(printer.out, {"worker_id": args.worker_id, "changed": response.changed})
        done = f"{args.command}ed" if response.changed else f"already {args.command}ed"
        return printer.lines([f"{args.worker_id}: {done}"])
    response = stub.Plan(plan_request(args), **call)
    return _dump(printer.out, _dict(response)) if args.json else printer.plan(response)


def main(argv: list[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    args = build_parser().parse_args(argv)
    printer = Printer(out, color=out.isatty() and "NO_COLOR" not in os.environ)
    try:
        with grpc.insecure_channel(args.router) as channel:
            run(args, pb_grpc.AdminStub(channel), printer)
    except grpc.RpcError as exc:
        print(f"baton admin: error: {describe_error(exc, args.router)}", file=err)
        return 1
    except (OSError, ValueError, KeyError, TypeError) as exc:  # unreadable or malformed --profile file
        print(f"baton admin: error: {exc!r}", file=err)
        return 2
    return 0


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def _dict(message: Any) -> dict[str, Any]:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _dump(out: TextIO, value: Any) -> None:
    out.write(json.dumps(value, indent=2, sort_keys=True) + "\n")


def _number(value: float) -> str:
    return f"{value:.0f}" if value == int(value) else f"{value:.3g}"


def _visible_len(text: str) -> int:
    return len(_ANSI.sub("", text))


if __name__ == "__main__":
    sys.exit(main())
