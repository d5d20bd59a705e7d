"""``baton admin``: workers and pools, scale, drain / undrain, profile, and an SLO plan that shows its reasoning.

Talks to the router's ``baton.v1.Admin`` service; ``--token`` (or ``$BATON_ADMIN_TOKEN``) is sent as
``authorization: Bearer <token>``. Tables are aligned, colored only on a terminal; ``--json`` for scripts.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import grpc
from google.protobuf.json_format import MessageToDict, ParseDict, ParseError

from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc
from router.config import DEFAULT_ROUTER_ADDRESS
from router.admin.kube import KubeError, add_kube_arguments, kube_target, scale_deployment
from router.admin.profile_cli import ProfileError, add_profile_arguments, run_profile
from proto import tls
from router.generate_cli import describe_error

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STATE = {pb.WORKER_STATE_UP: ("up", "32"), pb.WORKER_STATE_DRAINING: ("draining", "33")}


def _add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", default=os.environ.get("BATON_ROUTER", DEFAULT_ROUTER_ADDRESS),
                        help="router address HOST:PORT (default: $BATON_ROUTER or %(default)s)")
    parser.add_argument("--token", default=os.environ.get("BATON_ADMIN_TOKEN") or None,
                        help="admin bearer token (default: $BATON_ADMIN_TOKEN)")
    parser.add_argument("--json", action="store_true", help="print the raw responses as JSON")
    parser.add_argument("--timeout", type=float, default=10.0, help="per-call deadline in seconds (default: 10)")
    tls.add_arguments(parser)


def _after_the_verb() -> argparse.ArgumentParser:
    """The connection options again, for each command: ``baton admin status --json`` as well as ``baton admin
    --json status`` (kubectl-style). Their defaults are suppressed, so one given before the verb stands."""
    common = argparse.ArgumentParser(add_help=False)
    _add_connection_arguments(common)
    for action in common._actions:
        if action.help:
            action.help = action.help.replace("%(default)s", str(action.default))  # what stands when not given
        action.default = argparse.SUPPRESS
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton admin", description="Workers and pools, scale, drain / undrain, and an SLO plan that shows "
        "its reasoning, through the router's baton.v1.Admin service. Options go before or after the command.")
    _add_connection_arguments(parser)
    common = _after_the_verb()
    commands = parser.add_subparsers(dest="command", required=True)
    add_command = functools.partial(commands.add_parser, parents=[common])
    status = add_command("status", help="every worker with its load, the pools (desired vs actual) and "
                                 "the cluster's recent TTFT / ITL")
    status.add_argument("--window", type=float, default=300.0, metavar="S",
                        help="traffic look-back in seconds (default: %(default)s)")
    scale = add_command("scale", help="set a pool's desired size")
    scale.add_argument("role", choices=["prefill", "decode"])
    scale.add_argument("size", type=int)
    add_kube_arguments(scale)
    for name, text in (("drain", "stop routing new requests to a worker"), ("undrain", "route to it again")):
        add_command(name, help=text).add_argument("worker_id")
    plan = add_command("plan", help="recommend pool sizes for SLOs and traffic, with the reasoning")
    plan.add_argument("--ttft-p90", type=float, required=True, metavar="MS", help="TTFT p90 target (ms)")
    plan.add_argument("--itl-p90", type=float, required=True, metavar="MS", help="ITL p90 target (ms)")
    plan.add_argument("--rate", type=float, default=None, help="requests per second")
    plan.add_argument("--isl", type=float, default=None, help="mean prompt tokens")
    plan.add_argument("--osl", type=float, default=None, help="mean output tokens")
    plan.add_argument("--from-traffic", action="store_true",
                      help="take rate / isl / osl and the corrections from the router's observed traffic")
    plan.add_argument("--window", type=float, default=300.0, metavar="S",
                      help="with --from-traffic: look back this many seconds (default: %(default)s)")
    plan.add_argument("--profile", type=Path, default=None,
                      help="JSON {prefill: {prompt_lens, tokens_per_s}, decode: {batch_sizes, itl_ms}} "
                      "(default: the profile stored in Redis)")
    plan.add_argument("--prefill-correction", type=float, default=None, help="measured / predicted TTFT")
    plan.add_argument("--decode-correction", type=float, default=None, help="measured / predicted ITL")
    plan.add_argument("--apply", action="store_true", help="set both pools' desired sizes to the plan")
    add_profile_arguments(add_command(
        "profile", help="measure workers' prefill tok/s vs prompt length and decode ITL vs batch and context, "
        "and store the curves for plan"))
    return parser


def plan_request(args: argparse.Namespace) -> pb.PlanRequest:
    if not args.from_traffic and None in (args.rate, args.isl, args.osl):
        raise ValueError("plan needs --rate, --isl and --osl, or --from-traffic")
    request = pb.PlanRequest(ttft_p90_ms=args.ttft_p90, itl_p90_ms=args.itl_p90, rate=args.rate or 0.0,
                             isl=args.isl or 0.0, osl=args.osl or 0.0, apply=args.apply,
                             from_traffic=args.from_traffic, traffic_window_s=args.window)
    if args.prefill_correction is not None:
        request.prefill_correction = args.prefill_correction
    if args.decode_correction is not None:
        request.decode_correction = args.decode_correction
    if args.profile is not None:  # the curves the file has; a missing one comes from Redis
        raw = json.loads(args.profile.read_text(encoding="utf-8"))
        if not {"prefill", "decode"} & set(raw):
            raise ValueError(f"{args.profile}: expected a 'prefill' and/or 'decode' curve")
        if "prefill" in raw:
            ParseDict(raw["prefill"], request.prefill_curve)
        if "decode" in raw:
            ParseDict(raw["decode"], request.decode_curve)
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

    def status(self, workers: pb.ListWorkersResponse, pools: pb.GetPoolsResponse,
               traffic: pb.TrafficWindow | None) -> None:
        rows = [self._worker_row(w) for w in workers.workers]
        headers = ["WORKER", "ROLE", "ADDRESS", "STATE", "RUN", "WAIT", "KV USED", "FREE/TOTAL", "LOAD AGE",
                   "PREFIX HIT", "KV GB/S", "RESTARTS"]
        self.lines(table(headers, rows, right=(4, 5, 6, 7, 8, 9, 10, 11)) if rows else ["no workers registered"])
        self.out.write("\n")
        pool_rows = [[p.role, str(p.desired) if p.HasField("desired") else "-", str(p.actual), str(p.draining)]
                     for p in pools.pools]
        self.lines(table(["POOL", "DESIRED", "ACTUAL", "DRAINING"], pool_rows, right=(1, 2, 3)))
        if traffic is not None:
            self.out.write("\n")
            self.lines(traffic_lines(traffic))

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
        hit = f"{w.prefix_cache_hit_rate:.0%}" if w.HasField("prefix_cache_hit_rate") else "-"
        gbps = f"{w.transfer_gbps:.2f}" if w.HasField("transfer_gbps") else "-"
        restarts = self.paint(str(w.restarts), "33") if w.restarts else "0"
        return [w.worker_id, w.role, w.grpc_address, self.paint(state, code), *load, hit, gbps, restarts]


def traffic_lines(t: pb.TrafficWindow) -> list[str]:
    """The cluster's recent traffic and latency percentiles, as the router saw them."""
    head = f"traffic, last {t.window_s:.0f} s: {t.num_requests} requests finished, {t.rate:.3g}/s arriving"
    if t.num_requests:
        head += f", mean isl {t.mean_isl:.0f}, osl {t.mean_osl:.0f}"
    rows = [[name, str(p.count), _number(p.p50_ms), _number(p.p90_ms), _number(p.p99_ms)]
            for name, field in (("TTFT ms", "ttft"), ("ITL ms", "itl")) if t.HasField(field)
            for p in (getattr(t, field),)]
    return [head] + (table(["LATENCY", "N", "P50", "P90", "P99"], rows, right=(1, 2, 3, 4)) if rows else [])


def run(args: argparse.Namespace, stub: pb_grpc.AdminStub, printer: Printer, channel: grpc.Channel) -> None:
    call: dict[str, Any] = {"timeout": args.timeout, "metadata": _metadata(args.token)}
    if args.command == "status":
        workers, pools = stub.ListWorkers(pb.ListWorkersRequest(), **call), stub.GetPools(pb.GetPoolsRequest(), **call)
        traffic = _traffic_or_none(stub, args.window, call)
        if args.json:
            extra = {} if traffic is None else {"traffic": _dict(traffic)}
            return _dump(printer.out, {"workers": _dict(workers).get("workers", []), "pools": _dict(pools)["pools"],
                                       **extra})
        return printer.status(workers, pools, traffic)
    if args.command == "profile":
        return run_profile(args, stub, pb_grpc.GenerationStub(channel), printer.out, call)
    if args.command == "scale":
        response = stub.ScalePool(pb.ScalePoolRequest(role=args.role, size=args.size), **call)
        if args.kube:
            try:
                patched = scale_deployment(kube_target(args), args.size)
            except KubeError as exc:
                raise KubeError(f"{exc} (the {args.role} pool's desired size in Redis is now {args.size})") from exc
            printer.lines([f"kubernetes: {patched.namespace}/{patched.name} replicas -> {patched.replicas}"])
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
    parser = build_parser()
    args = parser.parse_args(argv)
    tls_config = tls.from_args_or_exit(parser, args)
    printer = Printer(out, color=out.isatty() and "NO_COLOR" not in os.environ)
    try:
        with tls.channel(args.router, tls_config) as channel:
            run(args, pb_grpc.AdminStub(channel), printer, channel)
    except grpc.RpcError as exc:
        print(f"baton admin: error: {describe_error(exc, args.router, tls_config)}", file=err)
        return 1
    except (KubeError, ProfileError) as exc:
        print(f"baton admin: error: {exc}", file=err)
        return 1
    except (OSError, ValueError, KeyError, TypeError, ParseError) as exc:  # unreadable or malformed --profile
        print(f"baton admin: error: {exc}", file=err)
        return 2
    return 0


def _traffic_or_none(stub: pb_grpc.AdminStub, window_s: float, call: dict[str, Any]) -> pb.TrafficWindow | None:
    try:
        return stub.GetTraffic(pb.GetTrafficRequest(window_s=window_s), **call)
    except grpc.RpcError as exc:  # an older router without GetTraffic: status without the traffic part
        if exc.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT):
            return None
        raise


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
