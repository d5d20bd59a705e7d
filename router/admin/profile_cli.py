"""``baton admin profile``: pick the workers, run ``router.admin.profile`` on each, store the curves for ``plan``.

By default one up worker of each role present is profiled (``--worker`` picks them): a prefill worker gives
the prefill curve, a decode worker the decode curve — and the prefill curve too when no prefill worker is
profiled (a decode-only cluster prefills locally). Curves go to the router (``Admin/StoreProfile``, which
writes ``{ns}:profile:{role}``) unless ``--no-store``, and to ``-o FILE`` in the ``plan --profile`` format.
Progress goes to stderr, one line per measured point.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

import grpc
from google.protobuf.json_format import MessageToDict

from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc
from router.admin.profile import Model, ProfileConfig, WorkerProfiler, fits

_DEFAULTS = ProfileConfig()


class ProfileError(Exception):
    """The profile cannot run: no such worker, nothing to measure."""


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(","))
    if not values or any(v <= 0 for v in values) or list(values) != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"need increasing positive integers, got {text!r}")
    return values


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    join = lambda xs: ",".join(map(str, xs))  # noqa: E731
    p.add_argument("--worker", action="append", default=None, metavar="ID",
                   help="worker to profile (repeatable; default: one up worker of each role)")
    p.add_argument("-o", "--output", type=Path, default=None, help="also write the curves to this JSON file")
    p.add_argument("--no-store", action="store_true", help="do not store the curves in the router's Redis")
    p.add_argument("--prompt-lens", type=_ints, default=_DEFAULTS.prompt_lens,
                   help=f"prefill prompt lengths (default: {join(_DEFAULTS.prompt_lens)})")
    p.add_argument("--batch-sizes", type=_ints, default=_DEFAULTS.batch_sizes,
                   help=f"decode batch sizes (default: {join(_DEFAULTS.batch_sizes)})")
    p.add_argument("--contexts", type=_ints, default=_DEFAULTS.context_lens,
                   help=f"decode context lengths (default: {join(_DEFAULTS.context_lens)})")
    p.add_argument("--decode-tokens", type=int, default=_DEFAULTS.decode_tokens,
                   help="tokens per stream at each decode point (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=_DEFAULTS.repeats,
                   help="prefill runs per prompt length, median taken (default: %(default)s)")


def run_profile(args: argparse.Namespace, admin: pb_grpc.AdminStub, generation: pb_grpc.GenerationStub,
                out: TextIO, call: dict[str, Any], progress: TextIO | None = None) -> None:
    progress = progress or sys.stderr
    info = generation.ModelInfo(pb.ModelInfoRequest(), timeout=args.timeout)
    model = Model(vocab_size=info.vocab_size, max_model_len=info.max_model_len, block_size=info.block_size or 16)
    config = ProfileConfig(prompt_lens=args.prompt_lens, repeats=max(1, args.repeats), batch_sizes=args.batch_sizes,
                           context_lens=args.contexts, decode_tokens=max(2, args.decode_tokens))
    targets = _targets(admin.ListWorkers(pb.ListWorkersRequest(), **call).workers, args.worker)
    curves: dict[str, Any] = {}
    for worker in targets:
        if worker.has_load and worker.num_running + worker.num_waiting > 0:
            print(f"warning: {worker.worker_id} is serving {worker.num_running + worker.num_waiting} requests; "
                  "drain it first for clean numbers", file=progress, flush=True)
        curves.update(_profile_one(worker, model, config, need_prefill="prefill" not in
                                   {w.role for w in targets}, progress=progress))
    request = pb.StoreProfileRequest(measured_on=",".join(w.worker_id for w in targets), **curves)
    if args.output is not None:
        args.output.write_text(json.dumps(_file_format(request), indent=2) + "\n", encoding="utf-8")
    keys = [] if args.no_store else list(admin.StoreProfile(request, **call).keys)
    if args.json:
        out.write(json.dumps({**_file_format(request), "stored": keys}, indent=2, sort_keys=True) + "\n")
        return
    for role, curve in _file_format(request).items():
        out.write(f"{role}: " + json.dumps(curve) + "\n")
    out.write(f"stored in {', '.join(keys)}\n" if keys else "not stored\n")


def _targets(workers, wanted: list[str] | None) -> list[pb.AdminWorker]:
    by_id = {w.worker_id: w for w in workers}
    if wanted:
        missing = [w for w in wanted if w not in by_id]
        if missing:
            raise ProfileError(f"no live worker {', '.join(missing)} (see baton admin status)")
        return [by_id[w] for w in wanted]
    chosen: dict[str, pb.AdminWorker] = {}
    for w in sorted(workers, key=lambda w: (w.state != pb.WORKER_STATE_UP, w.num_running + w.num_waiting)):
        chosen.setdefault(w.role, w)
    if not chosen:
        raise ProfileError("no workers registered: nothing to profile")
    return [chosen[role] for role in ("prefill", "decode") if role in chosen]


def _profile_one(worker: pb.AdminWorker, model: Model, config: ProfileConfig, *, need_prefill: bool,
                 progress: TextIO) -> dict[str, Any]:
    kv_tokens = worker.num_total_blocks * model.block_size if worker.num_total_blocks else None
    grid = fits(config, model, kv_tokens)
    print(f"profiling {worker.role} worker {worker.worker_id} at {worker.grpc_address}", file=progress, flush=True)
    say = lambda line: print(f"  {line}", file=progress, flush=True)  # noqa: E731
    with grpc.insecure_channel(worker.grpc_address) as channel:
        profiler = WorkerProfiler(pb_grpc.WorkerStub(channel), worker.role, model, grid, say)
        curves: dict[str, Any] = {}
        if worker.role == "prefill" or need_prefill:
            if not grid.prompt_lens:
                raise ProfileError(f"no prompt length fits max_model_len {model.max_model_len}")
            curves["prefill_curve"] = profiler.prefill_curve()
        if worker.role == "decode":
            if not grid.batch_sizes or not grid.context_lens:
                raise ProfileError(f"no decode point fits {worker.worker_id}'s KV cache ({kv_tokens} tokens) "
                                   f"and max_model_len {model.max_model_len}")
            curves["decode_curve"] = profiler.decode_curve(kv_tokens)
    return curves


def _file_format(request: pb.StoreProfileRequest) -> dict[str, Any]:
    """The ``plan --profile`` JSON: ``{"prefill": {...}, "decode": {...}}`` (the curves measured)."""
    out = {}
    for role, field in (("prefill", "prefill_curve"), ("decode", "decode_curve")):
        if request.HasField(field):
            out[role] = MessageToDict(getattr(request, field), preserving_proto_field_name=True)
    if "kv_tokens_per_worker" in out.get("decode", {}):  # int64 comes out of MessageToDict as a string
        out["decode"]["kv_tokens_per_worker"] = int(out["decode"]["kv_tokens_per_worker"])
    return out
