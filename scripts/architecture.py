"""Draws docs/architecture.md's two pictures: the packages with their import arrows, and one request's path.

    .venv/bin/python scripts/architecture.py    # writes docs/images/packages.png and docs/images/request-path.png

The package arrows come from tests/unit/test_import_arrows.py (loaded by path, so there is one table): the
layers are a longest-path ranking of its ``ALLOWED`` (a package sits one layer above the highest package it may
import), the arrows are ``package_arrows()`` read from the code today, and a ``KNOWN`` exception is red and
dashed. The request path is ``HOPS`` and ``FALLBACKS`` below: edit them there. Output is byte-for-byte
reproducible (Agg, no timestamp or version in the PNG), so a rerun changes a file only when the picture changed.
"""

from __future__ import annotations

import enum
import importlib.util
import sys
import textwrap
from dataclasses import dataclass
from graphlib import TopologicalSorter
from pathlib import Path
from types import ModuleType

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

ROOT = Path(__file__).resolve().parents[1]
ARROWS_TEST = ROOT / "tests" / "unit" / "test_import_arrows.py"
OUT_DIR = ROOT / "docs" / "images"

# One request, top to bottom: (from lifeline, to lifeline, what the hop is). From == to: a step inside one box.
# As the code does it today (router/relay.py): the router releases P's lease once D's first answer says the pull
# is done (DESIGN.md's ReleaseLease from D is not built), and a failed Prefill is not retried on another P.
LIFELINES = ("client", "router", "Redis", "P", "D")
HOPS: list[tuple[str, str, str]] = [
    ("client", "router", "POST /v1/chat/completions (OpenAI HTTP)  or  gRPC Generation/Generate"),
    ("router", "Redis", "KV index lookup: the prompt's block hashes"),
    ("Redis", "router", "prefix holders: cached leading blocks per worker"),
    ("router", "router", "cost model picks P and D (queue, prefill rate, link GB/s, ITL)"),
    ("router", "P", "Worker/Prefill  (or PrefillStream, layer-wise)"),
    ("P", "P", "computes the prompt, samples the first token, pins its blocks under a transfer lease"),
    ("P", "router", "first token + KVHandle (lease id, blocks, data-plane URI)"),
    ("router", "client", "first token (TTFT)"),
    ("router", "D", "Worker/Decode(handle)"),
    ("D", "D", "reserves blocks (reuses any prefix it already caches)"),
    ("D", "P", "pulls the KV blocks it lacks from P: data-plane READ over tcp | cma | ucx | nccl"),
    ("D", "P", "Worker/ReleaseLease the moment the pull ends: P frees the lease (blocks stay in its cache)"),
    ("D", "router", "first DecodeResponse (lease_released: the router only learns of it)"),
    ("D", "router", "decodes in its continuous batch, streams token ids"),
    ("router", "client", "text streamed (detokenized, stop strings applied)"),
    ("P", "Redis", "block events (stored / removed), batched"),
    ("D", "Redis", "block events (stored / removed), batched"),
]
FALLBACKS: list[tuple[str, str, str]] = [
    ("P", "router", "Prefill fails (P gone, error, overloaded)"),
    ("router", "P", "retried once on another P: the cost model re-run without the failed one"),
    ("router", "D", "that fails too (or the model picks local): Worker/Decode, no handle: D prefills locally"),
    ("D", "D", "pull fails (P gone, lease expired, hash mismatch): D prefills locally"),
    ("router", "D", "D fails before its first token: Decode retried once on another D"),
    ("router", "D", "D fails after tokens were streamed: migrated to another D (prompt + tokens sent, same seed)"),
]


class ArrowKind(enum.Enum):
    ALLOWED = "allowed by ALLOWED"
    KNOWN = "known exception (KNOWN)"
    FORBIDDEN = "not allowed (test_import_arrows fails)"


@dataclass(frozen=True, slots=True, kw_only=True)
class PackagePlan:
    layers: tuple[tuple[str, ...], ...]  # bottom layer first, each left to right
    modules: dict[str, int]  # package -> its number of modules (0: not there yet)
    arrows: dict[tuple[str, str], ArrowKind]  # (importer, imported) -> how it is drawn
    notes: dict[tuple[str, str], str]  # arrow -> what is written beside it
    exceptions: dict[tuple[str, str], str]  # each KNOWN arrow drawn -> what removes it


def load_arrows_module(path: Path = ARROWS_TEST) -> ModuleType:
    spec = importlib.util.spec_from_file_location("baton_import_arrows", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    root = str(Path(path).resolve().parents[2])  # it imports tests.packaging (pyproject's package list)
    if root not in sys.path:
        sys.path.insert(0, root)
    spec.loader.exec_module(module)
    return module


def layer_ranks(allowed: dict[str, set[str]]) -> dict[str, int]:
    """Longest path down ALLOWED: 0 for a package that may import none of ours, else 1 + its highest import."""
    ranks: dict[str, int] = {}
    for package in TopologicalSorter(allowed).static_order():  # what a package may import comes first
        ranks[package] = 1 + max((ranks[dep] for dep in allowed.get(package, ())), default=-1)
    return ranks


def package_plan(arrows: ModuleType) -> PackagePlan:
    """What the package picture draws: every arrow package_arrows() finds in the code today, and nothing else."""
    found = arrows.package_arrows()
    kinds = {arrow: _kind(arrow, arrows) for arrow in sorted(found)}
    ranks = layer_ranks(arrows.ALLOWED)
    notes = {}
    if ("router", "engine") in kinds:
        names = ", ".join(sorted(m.removeprefix("engine.") for m in arrows.ROUTER_ENGINE_MODULES))
        notes[("router", "engine")] = "router -> engine:\ntorch-free modules only\n" + textwrap.fill(names, 24)
    if ("sim", "engine") in kinds:
        names = ", ".join(sorted(m.removeprefix("engine.") for m in arrows.SIM_ENGINE_MODULES))
        notes[("sim", "engine")] = "sim -> engine:\ntorch-free modules only\n" + textwrap.fill(names, 24)
    modules = {p: sum(not f.name.endswith(("_pb2.py", "_pb2_grpc.py")) for f in (arrows.ROOT / p).rglob("*.py"))
               for p in arrows.OURS}
    exceptions = {arrow: arrows.KNOWN[arrow] for arrow, kind in kinds.items() if kind is ArrowKind.KNOWN}
    return PackagePlan(layers=_order_layers(arrows.OURS, ranks, kinds), modules=modules, arrows=kinds, notes=notes,
                       exceptions=exceptions)


def _kind(arrow: tuple[str, str], arrows: ModuleType) -> ArrowKind:
    if arrow[1] in arrows.ALLOWED[arrow[0]]:
        return ArrowKind.ALLOWED
    return ArrowKind.KNOWN if arrow in arrows.KNOWN else ArrowKind.FORBIDDEN


def _order_layers(ours, ranks, kinds) -> tuple[tuple[str, ...], ...]:
    """Each layer left to right by the mean position of what its packages import below (fewer crossings)."""
    layers: list[list[str]] = [[] for _ in range(max(ranks.values()) + 1)]
    for package in ours:
        layers[ranks[package]].append(package)
    where = {p: (i + 1) / (len(layers[0]) + 1) for i, p in enumerate(layers[0])}
    for layer in layers[1:]:
        def centre(package: str) -> float:
            below = [where[b] for (a, b) in kinds if a == package and b in where]
            return round(sum(below) / len(below), 6) if below else 0.5  # ties keep the order of OURS
        layer.sort(key=centre)
        where |= {p: (i + 1) / (len(layer) + 1) for i, p in enumerate(layer)}
    return tuple(tuple(layer) for layer in layers)


# ---- the package picture ------------------------------------------------------------------------------
WIDTH_IN, HEIGHT_IN, DPI = 14.0, 9.0, 100  # 1400 x 900 px; one data unit is one inch on both axes
MIDDLE_IN = 7.2  # the boxes' middle column (the right margin holds notes)
BOX_W, BOX_H = 2.2, 0.66
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#7f7f7f")
BENDS = (0.0, 0.1, -0.1, 0.2, -0.2, 0.3, -0.3, 0.45, -0.45, 0.6, -0.6)  # arc3 rads an arrow may take, plainest first
STYLE = {ArrowKind.ALLOWED: dict(linestyle="-", linewidth=1.5),
         ArrowKind.KNOWN: dict(linestyle=(0, (5, 3)), linewidth=2.2, color="#d62728"),
         ArrowKind.FORBIDDEN: dict(linestyle="-", linewidth=3.0, color="#d62728")}


def draw_packages(plan: PackagePlan, path: Path) -> dict[tuple[str, str], ArrowKind]:
    """Writes the picture; returns the arrows it drew, with how each was drawn."""
    fig, ax = _canvas("Baton packages and their import arrows, read from the code by tests/unit/test_import_arrows.py")
    centres = _box_centres(plan.layers)
    colour = {p: PALETTE[i % len(PALETTE)] for i, p in enumerate(sorted(centres))}
    for rank, layer in enumerate(plan.layers):
        ax.text(0.25, centres[layer[0]][1], f"layer {rank}", fontsize=10, color="#888888", va="center")
    drawn = {}
    for arrow, kind in plan.arrows.items():
        start, end, rad = _route(arrow, plan.arrows, centres)
        style = {"color": colour[arrow[0]], **STYLE[kind]}
        ax.add_patch(FancyArrowPatch(start, end, connectionstyle=f"arc3,rad={rad}", arrowstyle="-|>",
                                     mutation_scale=16, shrinkA=0, shrinkB=0, zorder=2, **style))
        if arrow in plan.notes:
            _note(ax, plan.notes[arrow], _on_curve(start, end, rad, 0.5), colour[arrow[0]])
        drawn[arrow] = kind
    for package, (x, y) in centres.items():
        _package_box(ax, package, x, y, plan.modules.get(package, 0), colour[package])
    _package_legend(ax, plan)
    _save(fig, path)
    return drawn


def _note(ax, text: str, at: tuple[float, float], colour: str) -> None:
    """A note in the right margin, level with the point of the arrow it is about, a thin line to it."""
    ax.annotate(text, xy=at, xytext=(WIDTH_IN - 2.2, at[1]), fontsize=9.5, va="center", color=colour, zorder=4,
                bbox=dict(boxstyle="round,pad=0.3", facecolor="white", edgecolor=colour),
                arrowprops=dict(arrowstyle="-", color=colour, linewidth=0.8, shrinkA=0, shrinkB=2))


def _canvas(title: str) -> tuple[Figure, object]:
    fig = Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, WIDTH_IN)
    ax.set_ylim(0, HEIGHT_IN)
    ax.axis("off")
    ax.text(WIDTH_IN / 2, HEIGHT_IN - 0.35, title, ha="center", va="center", fontsize=15, weight="bold")
    return fig, ax


def _box_centres(layers) -> dict[str, tuple[float, float]]:
    """Layers bottom to top, each spread across the width around the middle."""
    bottom, top = 1.75, HEIGHT_IN - 1.2
    step = (top - bottom) / max(len(layers) - 1, 1)
    centres = {}
    for rank, layer in enumerate(layers):
        gap = min(6.4, 11.0 / len(layer))
        for i, package in enumerate(layer):
            centres[package] = (MIDDLE_IN + (i - (len(layer) - 1) / 2) * gap, bottom + rank * step)
    for lower, upper in zip(layers, layers[1:]):
        if len(lower) == len(upper) == 1 and centres[lower[0]][0] == centres[upper[0]][0]:
            # a lone package right above another lone one: the two move apart, so the upper one's arrows pass
            (x, y), (_, y_upper) = centres[lower[0]], centres[upper[0]]
            centres[lower[0]], centres[upper[0]] = (x + 0.65 * BOX_W, y), (x - 0.65 * BOX_W, y_upper)
    return centres


def _route(arrow, arrows, centres) -> tuple[tuple[float, float], tuple[float, float], float]:
    """Where an arrow leaves its importer, where it reaches its import, and how much it bends: of the plainest
    choices, the one that crosses the fewest boxes (an arrow passes behind a box, so it should not)."""
    starts, ends = _ports(arrow, arrows, centres)
    choices = [(i + j, start, end, rad) for i, start in enumerate(starts) for j, end in enumerate(ends)
               for rad in BENDS]
    _, start, end, rad = min(choices, key=lambda c: (_hits(c[1], c[2], c[3], arrow, centres), c[0], abs(c[3])))
    return start, end, rad


def _ports(arrow, arrows, centres) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The places an arrow may leave from and arrive at (a box's facing edge, else its side), the arrows of one
    box spread along its edges in the order of their other ends."""
    (ax_, ay), (bx, by) = centres[arrow[0]], centres[arrow[1]]
    side = 1 if bx > ax_ else -1
    if abs(ay - by) < 1e-6:  # same layer: side to side, the two directions apart
        lift = 0.12 * side
        return [(ax_ + side * BOX_W / 2, ay + lift)], [(bx - side * BOX_W / 2, by + lift)]
    down = 1 if by < ay else -1
    leaving = sorted((b for a, b in arrows if a == arrow[0] and centres[b][1] != ay), key=lambda p: centres[p][0])
    arriving = sorted((a for a, b in arrows if b == arrow[1] and centres[a][1] != by), key=lambda p: centres[p][0])
    starts = _edge_and_flank(ax_, ay, -down, side, leaving.index(arrow[1]), len(leaving))
    return starts, _edge_and_flank(bx, by, down, -side, arriving.index(arrow[0]), len(arriving))


def _edge_and_flank(x: float, y: float, facing: int, side: int, i: int, n: int) -> list[tuple[float, float]]:
    """The i-th of n ports on the box edge facing up (+1) or down (-1), and on its side towards left (-1) or right."""
    along = _spread(i if side > 0 else n - 1 - i, n, BOX_H)
    return [(x + _spread(i, n, BOX_W), y + facing * BOX_H / 2), (x + side * BOX_W / 2, y + facing * along)]


def _spread(i: int, n: int, length: float) -> float:
    """The offset from the middle of the i-th of n points spread along 80% of an edge."""
    return ((i + 1) / (n + 1) - 0.5) * length * 0.8


def _on_curve(a, b, rad: float, t: float) -> tuple[float, float]:
    """The point at t on matplotlib's arc3 curve from a to b (a quadratic Bezier)."""
    cx, cy = (a[0] + b[0]) / 2 + rad * (b[1] - a[1]), (a[1] + b[1]) / 2 - rad * (b[0] - a[0])
    return tuple((1 - t) ** 2 * p + 2 * t * (1 - t) * c + t ** 2 * q for p, c, q in zip(a, (cx, cy), b))


def _hits(a, b, rad: float, arrow, centres) -> int:
    """How many points of the curve lie in a box (its own two boxes: strictly inside) or off the drawing."""
    def bad(x: float, y: float) -> int:
        off = not (0.9 < x < WIDTH_IN - 0.2 and 1.2 < y < HEIGHT_IN - 0.7)
        return off + sum(abs(x - cx) < BOX_W / 2 + margin and abs(y - cy) < BOX_H / 2 + margin
                         for p, (cx, cy) in centres.items() for margin in [-0.02 if p in arrow else 0.1])
    return sum(bad(*_on_curve(a, b, rad, t / 40)) for t in range(1, 40))


def _package_box(ax, package: str, x: float, y: float, modules: int, colour: str) -> None:
    there = modules > 0
    ax.add_patch(FancyBboxPatch((x - BOX_W / 2, y - BOX_H / 2), BOX_W, BOX_H, boxstyle="round,pad=0.02",
                                facecolor=_tint(colour) if there else "#f2f2f2", zorder=3, linewidth=2,
                                edgecolor=colour if there else "#bbbbbb", linestyle="-" if there else "--"))
    ax.text(x, y + 0.1, package, ha="center", va="center", fontsize=13, weight="bold", zorder=4,
            color="black" if there else "#999999")
    ax.text(x, y - 0.17, f"{modules} modules" if there else "no modules yet", ha="center", va="center",
            fontsize=9, color="#555555" if there else "#999999", zorder=4)


def _tint(colour: str) -> str:
    """The colour mixed 12% into white, opaque (arrows pass behind the boxes)."""
    return "#" + "".join(f"{round(255 - 0.12 * (255 - int(colour[i:i + 2], 16))):02x}" for i in (1, 3, 5))


def _package_legend(ax, plan: PackagePlan) -> None:
    handles = [Line2D([], [], color="#444444", **STYLE[ArrowKind.ALLOWED]),
               Line2D([], [], **STYLE[ArrowKind.KNOWN]), Line2D([], [], **STYLE[ArrowKind.FORBIDDEN])]
    labels = ["import allowed by ALLOWED (colour: the importing package)",
              ArrowKind.KNOWN.value + ("" if plan.exceptions else ": none today"), ArrowKind.FORBIDDEN.value]
    ax.legend(handles, labels, loc="lower left", bbox_to_anchor=(0.01, 0.0), fontsize=10, frameon=False,
              title="an arrow points from a package to one it imports", title_fontsize=10, alignment="left")
    known = [f"{a} -> {b}: {reason}" for (a, b), reason in sorted(plan.exceptions.items())]
    ax.text(WIDTH_IN - 0.2, 0.2, "\n".join(known), ha="right", va="bottom", fontsize=9.5, color="#d62728")


def _save(fig: Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, metadata={"Software": None})


# ---- the request path ---------------------------------------------------------------------------------
ROW_IN = 0.32
TITLES = {"client": "client", "router": "router", "Redis": "Redis\nKV index", "P": "P\nprefill worker",
          "D": "D\ndecode worker"}


def draw_request_path(path: Path, hops=HOPS, fallbacks=FALLBACKS) -> list[tuple[str, str, str]]:
    """Writes the sequence diagram; returns the hops it drew, in order (the main path, then the fallbacks)."""
    fig, ax = _canvas("One request's path through Baton (remote prefill)")
    xs = {name: 1.3 + i * (WIDTH_IN - 2.6) / (len(LIFELINES) - 1) for i, name in enumerate(LIFELINES)}
    top = HEIGHT_IN - 1.35
    bottom = top - ROW_IN * (len(hops) + len(fallbacks) + 1.5)
    for name, x in xs.items():
        ax.plot([x, x], [bottom, top + 0.3], color="#bbbbbb", linewidth=1.2, linestyle="--", zorder=1)
        ax.text(x, top + 0.55, TITLES.get(name, name), ha="center", va="center", fontsize=12, weight="bold",
                bbox=dict(boxstyle="round,pad=0.35", facecolor="#e8eef7", edgecolor="#4a6fa5"))
    drawn = []
    for i, hop in enumerate(hops):
        _hop(ax, xs, top - i * ROW_IN, hop, str(i + 1), light=False)
        drawn.append(hop)
    y = top - (len(hops) + 0.5) * ROW_IN
    ax.plot([0.3, WIDTH_IN - 0.3], [y, y], color="#999999", linewidth=0.8)
    ax.text(0.3, y - 0.05, "when something fails (lighter arrows)", fontsize=10, style="italic", color="#777777",
            va="top", bbox=dict(facecolor="white", edgecolor="none", pad=1))
    for i, hop in enumerate(fallbacks):
        _hop(ax, xs, y - (i + 1) * ROW_IN, hop, "abcdefghij"[i % 10], light=True)
        drawn.append(hop)
    _save(fig, path)
    return drawn


def _hop(ax, xs: dict[str, float], y: float, hop: tuple[str, str, str], number: str, *, light: bool) -> None:
    source, target, label = hop
    colour = "#9a9a9a" if light else "#222222"
    style = dict(color=colour, linewidth=1.3 if light else 1.6, linestyle=(0, (4, 2)) if light else "-",
                 arrowstyle="-|>", mutation_scale=14, shrinkA=0, shrinkB=0, zorder=3)
    x0, x1 = xs[source], xs[target]
    text = dict(fontsize=10, color="#777777" if light else "#111111", zorder=4, style="italic" if light else "normal",
                bbox=dict(boxstyle="round,pad=0.12", facecolor="white", edgecolor="none", alpha=0.9))
    if source == target:  # a step inside one box: a loop beside its lifeline, the label past it
        side = 1 if x0 < WIDTH_IN / 2 else -1
        ax.add_patch(FancyArrowPatch((x0 + side * 0.1, y + 0.08), (x0 + side * 0.1, y - 0.08),
                                     connectionstyle=f"bar,fraction={-side * 1.6}", **style))
        ax.text(x0 + side * 0.42, y, label, ha="left" if side > 0 else "right", va="center", **text)
    else:
        ax.add_patch(FancyArrowPatch((x0, y), (x1, y), **style))
        _place(ax.text((x0 + x1) / 2, y + 0.05, label, ha="center", va="bottom", **text), x0, x1)
    ax.plot([x0], [y], marker="o", markersize=14, color=colour, zorder=5)
    ax.text(x0, y, number, ha="center", va="center", fontsize=8, weight="bold", color="white", zorder=6)


def _place(label, x0: float, x1: float) -> None:
    """Centres a label over its arrow when it fits there, else starts it just past the arrow's numbered end and
    lets it run on in the arrow's direction (never over the number), inside the picture."""
    fig = label.figure
    box = label.get_window_extent(fig.canvas.get_renderer())
    width = (box.x1 - box.x0) / fig.dpi
    if width > abs(x1 - x0) - 0.5:
        direction = 1 if x1 > x0 else -1
        centre = x0 + direction * (0.2 + width / 2)
        label.set_x(min(max(centre, 0.15 + width / 2), WIDTH_IN - 0.15 - width / 2))


def write_pictures(out_dir: Path = OUT_DIR, arrows_test: Path = ARROWS_TEST) -> list[Path]:
    packages, request_path = out_dir / "packages.png", out_dir / "request-path.png"
    draw_packages(package_plan(load_arrows_module(arrows_test)), packages)
    draw_request_path(request_path)
    return [packages, request_path]


def main() -> None:
    for path in write_pictures():
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


if __name__ == "__main__":
    main()
