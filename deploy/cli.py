"""The one console script, ``baton``: a thin dispatcher to each component's own ``main``.

Subcommands import their module only when chosen, so ``baton router`` never loads torch.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module:function taking argv, one-line help). Later issues add up/generate/admin/...
_COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("deploy.up:main", "start the local platform: redis, router, prefill and decode workers"),
    "deploy": ("deploy.commands:main", "render a BatonGraphDeployment spec; print the CRD; run the operator"),
    "model": ("engine.model_cli:main", "build the tiny or small offline checkpoint, or locate smollm2 (a GGUF)"),
    "demo": ("engine.demo:main", "stream an offline generation from the engine (no servers)"),
    "bench": ("bench.__main__:main", "run benchmarks (throughput, kv-transfer, serve, compare, ...)"),
    "simulate": ("sim.cli:main", "replay a trace against modelled GPUs with the real router (discrete-event)"),
    "router": ("router.main:main", "run the router (public Generate API, routing, orchestration)"),
    "generate": ("router.generate_cli:main", "stream a generation from a running router, with timings"),
    "admin": ("router.admin.cli:main", "inspect workers and pools, scale, drain, and plan pool sizes from SLOs"),
    "prefill": ("prefill_node.main:main", "run a prefill worker"),
    "decode": ("decode_node.main:main", "run a decode worker"),
}


# (command, subcommand) -> module:function, where the subcommand lives in another package than its command:
# `baton simulate check` runs the simulator beside real processes, which is the benches' business.
_NESTED: dict[tuple[str, str], str] = {("simulate", "check"): "bench.sim_check:main"}


def _usage() -> str:
    width = max(len(name) for name in _COMMANDS)
    lines = ["usage: baton <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in _COMMANDS.items()]
    lines += ["", "run `baton <command> --help` for a command's options"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    entry = _COMMANDS.get(argv[0])
    if entry is None:
        print(f"baton: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    nested = _NESTED.get((argv[0], argv[1])) if len(argv) > 1 else None
    module, function = (nested or entry[0]).split(":")
    return int(getattr(importlib.import_module(module), function)(argv[2:] if nested else argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
