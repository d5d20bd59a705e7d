"""The packages' import arrows (DESIGN.md "Repository layout"), read from every module's source, lazy imports inside
functions included, so the picture cannot rot: proto and kv_transfer lowest, engine on kv_transfer, the worker
roles on engine, the router on proto, kv_transfer and engine's torch-free modules only, deploy on them all; the
simulator on the router's policy, engine's torch-free block pool and ``workload`` (traces and synthetic workloads,
which the benches read too, below both); bench on top of everything, the simulator included (``bench.sim_check``
runs it beside real processes).
Inside the router, routing imports nothing of the serving core but its typed errors, and the OpenAI front and
the admin side never import each other."""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.packaging import top_level_packages

ROOT = Path(__file__).resolve().parents[2]
OURS = top_level_packages()  # pyproject.toml's list
ALLOWED: dict[str, set[str]] = {
    "proto": set(),
    "kv_transfer": set(),
    "engine": {"kv_transfer"},
    "worker": {"engine", "kv_transfer", "proto"},
    "prefill_node": {"worker", "engine", "kv_transfer", "proto"},
    "decode_node": {"worker", "engine", "kv_transfer", "proto"},
    "router": {"proto", "kv_transfer", "engine"},
    "workload": set(),  # traces, synthetic workloads, percentiles, plot setup: read by bench and sim
    "deploy": set(OURS) - {"deploy", "bench", "sim", "workload"},  # `baton up` starts them all, takes their options
    "bench": set(OURS) - {"bench"},  # bench.sim_check runs the simulator beside real processes
    # `baton simulate` runs the router's own policy and planner against modelled workers (engine's BlockPool), on
    # the workloads and trace loader of `workload`; only bench imports it (deploy.cli dispatches to it by name)
    "sim": {"router", "engine", "kv_transfer", "workload"},
}
# Arrows that exist today and go against the picture, each with what removes it. The test fails on any other
# arrow, and on one of these that is gone (so the list only shrinks).
KNOWN: dict[tuple[str, str], str] = {}
# What the router may import of the engine: modules that import neither torch nor transformers at import time.
ROUTER_ENGINE_MODULES = {
    "engine.errors", "engine.tokenizer", "engine.text_stream", "engine.sampling_params", "engine.model_source",
    "engine.gguf_file", "engine.gguf_tokenizer",
}


# What the simulator may import of the engine: the torch-free block pool and typed errors.
SIM_ENGINE_MODULES = {"engine.core.block_pool", "engine.errors"}


def imports_of(package: str) -> dict[str, set[str]]:
    """Module path -> the modules of ours it imports (absolute names)."""
    out: dict[str, set[str]] = defaultdict(set)
    for path in sorted((ROOT / package).rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, node, path.name == "__init__.py")
                names = [_submodule_or_base(base, alias.name) for alias in node.names]
            else:
                continue
            out[module] |= {name for name in names if name.split(".")[0] in OURS}
    return out


def _submodule_or_base(base: str, name: str) -> str:
    """``from base import name``: the module ``base.name`` when that is a module of ours, else ``base``."""
    path = ROOT.joinpath(*base.split("."), name)
    return f"{base}.{name}" if path.with_suffix(".py").is_file() or path.is_dir() else base


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
    return ".".join([*parts, *([node.module] if node.module else [])])


def package_arrows() -> dict[tuple[str, str], list[str]]:
    arrows: dict[tuple[str, str], list[str]] = defaultdict(list)
    for package in OURS:
        for module, imported in imports_of(package).items():
            for name in imported:
                if (target := name.split(".")[0]) != package:
                    arrows[(package, target)].append(f"{module} imports {name}")
    return arrows


def test_every_package_imports_only_what_the_layout_allows():
    arrows = package_arrows()
    wrong = {arrow: where for arrow, where in arrows.items()
             if arrow[1] not in ALLOWED[arrow[0]] and arrow not in KNOWN}
    assert not wrong, wrong
    gone = sorted(set(KNOWN) - set(arrows))
    assert not gone, f"these arrows are gone: remove them from KNOWN: {gone}"


def test_the_router_imports_only_the_engines_torch_free_modules():
    used = {name for imported in imports_of("router").values() for name in imported if name.startswith("engine")}
    assert used <= ROUTER_ENGINE_MODULES, used - ROUTER_ENGINE_MODULES


def test_the_simulator_imports_only_the_engines_torch_free_block_pool():
    used = {name for imported in imports_of("sim").values() for name in imported if name.startswith("engine")}
    assert used <= SIM_ENGINE_MODULES, used - SIM_ENGINE_MODULES


@pytest.mark.parametrize(("part", "forbidden"), [
    ("router.routing", ("router.",)),  # the policy never reaches back into the flow, the fronts or the admin side
    ("router.openai", ("router.admin",)),
    ("router.admin", ("router.openai", "router.relay", "router.server")),
])
def test_router_parts_keep_their_arrows(part, forbidden):
    def allowed(name: str) -> bool:
        return name == part or name.startswith((part + ".", "router.errors"))

    wrong = {module: sorted(n for n in imported if n.startswith(forbidden) and not allowed(n))
             for module, imported in imports_of("router").items() if module.startswith(part)}
    assert not any(wrong.values()), {m: names for m, names in wrong.items() if names}


# The pure policy: prices workers from plain values (kv_transfer.workers), never reaches Redis or the network.
PURE_ROUTING = ("router.routing.policy", "router.routing.cost_model", "router.routing.rates",
                "router.routing.in_progress")
IO_MODULES = ("kv_transfer.registry", "kv_transfer.redis_index", "kv_transfer.tcp", "kv_transfer.conn_pool", "proto")


def test_the_pure_routing_modules_import_no_io():
    modules = imports_of("router")
    assert set(PURE_ROUTING) <= set(modules), set(PURE_ROUTING) - set(modules)
    wrong = {m: sorted(n for n in modules[m] if n.startswith(IO_MODULES)) for m in PURE_ROUTING}
    assert not any(wrong.values()), wrong


def test_kv_transfer_imports_nothing_heavy_at_package_import():
    tree = ast.parse((ROOT / "kv_transfer" / "__init__.py").read_text())
    imported = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert not imported  # the lowest layer's package import costs nothing (its modules are imported by name)


def test_the_reader_sees_lazy_and_relative_imports(tmp_path, monkeypatch):
    """The checker itself: an import inside a function and a relative import both count."""
    package = tmp_path / "router"
    (package / "routing").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "routing" / "__init__.py").write_text("")
    (package / "relay.py").write_text("")
    (package / "routing" / "bad.py").write_text("def f():\n    import torch\n    from ..relay import x\n"
                                                "    from engine.engine import Engine\n    from router import relay\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert imports_of("router")["router.routing.bad"] == {"router.relay", "engine.engine"}
