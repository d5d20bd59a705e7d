"""scripts/architecture.py draws docs/architecture.md's pictures: the package arrows it draws are the ones the code
has (read independently here, and on a made-up tree the script cannot know), every KNOWN exception is drawn as
one, the layers are the longest-path ranking of ALLOWED, and every hop of the request path is drawn."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.unit import test_import_arrows as import_arrows

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("architecture_script", ROOT / "scripts" / "architecture.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_both_pictures_are_written_and_a_rerun_gives_the_same_bytes(script, tmp_path):
    first = script.write_pictures(tmp_path / "first")
    again = script.write_pictures(tmp_path / "again")
    assert [p.name for p in first] == ["packages.png", "request-path.png"]
    for one, other in zip(first, again):
        assert one.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and one.stat().st_size > 10_000
        assert one.read_bytes() == other.read_bytes(), one.name


def test_the_committed_pictures_are_the_ones_the_code_draws_today(script, tmp_path):
    """docs/images/ holds what ``make docs`` draws from the code now: a package or arrow added since fails this."""
    for fresh in script.write_pictures(tmp_path):
        committed = ROOT / "docs" / "images" / fresh.name
        assert fresh.read_bytes() == committed.read_bytes(), f"{committed} is stale: run `make docs` and commit it"


def test_the_package_picture_draws_the_arrows_of_the_code_today(script, tmp_path):
    drawn = script.draw_packages(script.package_plan(script.load_arrows_module()), tmp_path / "packages.png")
    arrows = import_arrows.package_arrows()  # computed here, not by the script
    assert set(drawn) == set(arrows)
    for (importer, imported), kind in drawn.items():
        if imported in import_arrows.ALLOWED[importer]:
            assert kind is script.ArrowKind.ALLOWED
        elif (importer, imported) in import_arrows.KNOWN:
            assert kind is script.ArrowKind.KNOWN
        else:
            assert kind is script.ArrowKind.FORBIDDEN


MADE_UP_TREE = {  # path -> source: one allowed arrow of each kind, two known exceptions, one forbidden arrow
    "kv_transfer/__init__.py": "",
    "kv_transfer/hashing.py": "",
    "kv_transfer/bad.py": "def f():\n    import router.relay\n",
    "engine/__init__.py": "",
    "engine/tokenizer.py": "from kv_transfer import hashing\n",
    "router/__init__.py": "",
    "router/relay.py": "from engine.tokenizer import Tokenizer\n",
    "prefill_node/__init__.py": "",
    "prefill_node/main.py": "import decode_node.node\n",
    "decode_node/__init__.py": "",
    "decode_node/node.py": "from prefill_node import main\n",
}


def test_on_a_made_up_tree_the_picture_draws_that_trees_arrows(script, tmp_path, monkeypatch):
    for path, source in MADE_UP_TREE.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(source)
    arrows = script.load_arrows_module()
    known = {("prefill_node", "decode_node"): "made up", ("decode_node", "prefill_node"): "made up too"}
    monkeypatch.setattr(arrows, "ROOT", tmp_path)
    monkeypatch.setattr(arrows, "KNOWN", known)
    plan = script.package_plan(arrows)
    drawn = script.draw_packages(plan, tmp_path / "packages.png")
    kind = script.ArrowKind
    assert drawn == {("engine", "kv_transfer"): kind.ALLOWED, ("router", "engine"): kind.ALLOWED,
                     ("prefill_node", "decode_node"): kind.KNOWN, ("decode_node", "prefill_node"): kind.KNOWN,
                     ("kv_transfer", "router"): kind.FORBIDDEN}
    assert plan.exceptions == known
    assert "torch-free" in plan.notes[("router", "engine")]
    assert plan.modules["worker"] == 0 and plan.modules["engine"] == 2  # a package not there yet is still drawn
    assert (tmp_path / "packages.png").stat().st_size > 0


def test_the_layers_are_the_longest_path_ranking_of_allowed(script):
    assert script.layer_ranks({"a": set(), "b": {"a"}, "c": {"a", "b"}, "d": {"a"}}) == {"a": 0, "b": 1, "c": 2, "d": 1}
    ranks = script.layer_ranks(import_arrows.ALLOWED)
    assert ranks["proto"] == ranks["kv_transfer"] == 0
    assert ranks["engine"] < ranks["worker"] < ranks["prefill_node"] == ranks["decode_node"] < ranks["deploy"]
    assert all(ranks[importer] > ranks[imported]
               for importer, allowed in import_arrows.ALLOWED.items() for imported in allowed)
    plan = script.package_plan(script.load_arrows_module())
    assert {p: rank for rank, layer in enumerate(plan.layers) for p in layer} == ranks


def test_the_request_path_draws_every_hop(script, tmp_path):
    drawn = script.draw_request_path(tmp_path / "request-path.png")
    assert drawn == script.HOPS + script.FALLBACKS
    assert {end for hop in drawn for end in hop[:2]} <= set(script.LIFELINES)
    text = " ".join(label for _, _, label in script.HOPS)
    for hop in ("/v1/chat/completions", "Generation/Generate", "KV index lookup", "cost model picks P and D",
                "Worker/Prefill", "PrefillStream", "transfer lease", "Worker/Decode(handle)", "reserves blocks",
                "tcp | cma | ucx | nccl", "Worker/ReleaseLease", "streams token ids", "block events"):
        assert hop in text, hop
    made_up = [("client", "router", "hello"), ("router", "router", "think")]
    assert script.draw_request_path(tmp_path / "other.png", hops=made_up, fallbacks=[]) == made_up
