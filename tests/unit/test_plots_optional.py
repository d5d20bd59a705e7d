"""matplotlib is optional (the ``bench`` extra): without it ``workload.plots.pyplot()`` says so, naming the extra, and the
plotting functions return their "no plot" value instead of raising; no package imports it at import time (``baton``
itself must start without it); with it, plots are drawn on the Agg backend."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from tests.unit.test_import_arrows import OURS

ROOT = Path(__file__).resolve().parents[2]

# The helper and two real plotting functions (a bench report's and the simulator's) on small reports, in a fresh
# interpreter; with "without", matplotlib is made unimportable first (None in sys.modules: `import matplotlib` raises
# ImportError, as when it is not installed)
SCRIPT = """
import json, sys
if sys.argv[2] == "without":
    sys.modules["matplotlib"] = None
from pathlib import Path
from workload.plots import pyplot
from bench.relay_report import plot as relay_plot
from sim.metrics import RequestRecord
from sim.report import plot as sim_plot

out = Path(sys.argv[1])
rows = [{"path": path, "api": "grpc", "loop": "uvloop", "router_processes": processes, "concurrency": concurrency,
         "tokens_per_s": 8000.0, "tokens_per_router_core_s": 8889.0 if processes else None}
        for path, processes in (("direct", 0), ("router", 1)) for concurrency in (1, 16)]
records = [RequestRecord(request_id=f"r{i}", arrival_s=0.1 * i, prompt_tokens=64, output_tokens=8,
                         first_token_s=0.1 * i + 0.05 * (i + 1), finished_s=0.1 * i + 1.0) for i in range(4)]
runs = [({"policy": "cost", "time_scale": 1.0, "summary": {"request_rate": rate, "slo_attainment": 0.9}}, records)
        for rate in (1.0, 2.0)]
plt = pyplot()
print(json.dumps({"pyplot": plt and plt.__name__, "backend": plt and plt.get_backend().lower(),
                  "matplotlib_loaded": sys.modules.get("matplotlib") is not None,
                  "relay": str(relay_plot({"cpus": 2, "rows": rows}, out / "relay.png")),
                  "sim": str(sim_plot(runs, out / "sim.png"))}))
"""


def _run(out: Path, matplotlib: str) -> tuple[dict, list[str]]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(out), matplotlib], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr.splitlines()


def test_without_matplotlib_no_plot_is_drawn_and_the_message_names_the_extra(tmp_path):
    result, stderr = _run(tmp_path, "without")
    assert result == {"pyplot": None, "backend": None, "matplotlib_loaded": False, "relay": "None", "sim": "None"}
    assert len(stderr) == 3  # one line per plot asked for
    assert all("matplotlib is not installed" in line and "baton[bench]" in line for line in stderr)
    assert list(tmp_path.iterdir()) == []


def test_with_matplotlib_the_same_calls_draw_on_agg(tmp_path):
    result, stderr = _run(tmp_path, "with")
    assert result == {"pyplot": "matplotlib.pyplot", "backend": "agg", "matplotlib_loaded": True,
                      "relay": str(tmp_path / "relay.png"), "sim": str(tmp_path / "sim.png")}
    assert not any("not installed" in line for line in stderr)
    for name in ("relay.png", "sim.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def _module_level_imports(tree: ast.AST):
    """Import statements run when the module is imported: everything but function bodies (class bodies run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _module_level_imports(node)


def test_no_package_imports_matplotlib_at_import_time():
    found = []
    for package in OURS:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in _module_level_imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if any(name.split(".")[0] == "matplotlib" for name in names):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
