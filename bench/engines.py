"""Engines side by side: Baton's ``LLM``, vLLM's ``LLM`` and llama.cpp on the same weights, prompts and threads.

    python -m bench engines [--model smollm2|PATH] [--peers vllm,llama.cpp] [--threads 2] [--repeat 2]
                            [--prefill 8x512] [--stream-tokens 128] [--batches 1 8 32 64] [--batch-shape 256+64]
                            [--ttft 256 1024 4096] [--seed 0] [--baton-weights int4] [--quick]

Each engine runs in a process of its own environment (``bench/engine_peer.py``): Baton in this venv, vLLM from
``.venv-vllm`` (``make vllm``), llama.cpp from ``.venv-llama-cpp`` (``make llama-cpp``), the same thread count each
(Baton's torch threads, vLLM's ``VLLM_CPU_OMP_THREADS_BIND``, llama.cpp's ``n_threads``). Every engine runs the same
phases in the same order, all greedy with ``ignore_eos``, on seeded random token ids drawn afresh for every phase and
repetition (a benchmark that repeats its prompts measures the prefix cache):

- **prefill**: N uncached prompts of L tokens, one output token each: prompt tokens / s;
- **one stream**: one 16-token prompt, ``--stream-tokens`` new tokens: new tokens / s;
- **batch B**: B prompts of P tokens with O new tokens each, all submitted at once: (prompt + new tokens) / s;
- **TTFT at L**: one prompt of L tokens, one new token: seconds.

Each figure is the best of ``--repeat`` repetitions; the first repetition's batch figure is also kept ("first batch
after start": the engine's first real batch after a 4-token warm-up). Peak RSS is the sum over the engine's
processes (vLLM's engine core is a child process), sampled every 0.1 s. Weights: float32 everywhere, from one
checkpoint: a GGUF file is dequantized once for vLLM (a Hugging Face folder, ``engine/gguf_export.py``) and for
llama.cpp (an F32 GGUF, ``bench/gguf_f32.py``); llama.cpp also runs the file's own quantized weights, in a row that
says so, and ``--baton-weights int4`` adds a row of Baton with its linear weights in 4 bits (``--weights int4``).
llama.cpp's Python binding holds one sequence per context, so its batch phases run their prompts one after
another (said in its rows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from workload.plots import pyplot

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).parent / "results"
PYTHONS = {"baton": Path(sys.executable), "vllm": ROOT / ".venv-vllm" / "bin" / "python",
           "llama.cpp": ROOT / ".venv-llama-cpp" / "bin" / "python"}
MAKE_TARGET = {"vllm": "make vllm", "llama.cpp": "make llama-cpp"}
STREAM_PROMPT_TOKENS = 16
LOW_TOKEN_ID = 100  # random prompts avoid the lowest ids (special and control tokens in most vocabularies)


@dataclass(slots=True)
class Workload:
    prefill: tuple[int, int]  # (prompts, tokens each)
    stream_tokens: int
    batches: tuple[int, ...]
    batch_shape: tuple[int, int]  # (prompt tokens, new tokens) per request
    ttft: tuple[int, ...]
    repeat: int
    seed: int

    def phases(self, vocab: int, repetition: int) -> list[dict]:
        """The phases of one repetition, on token ids no other phase or repetition uses (seeded)."""
        rng = np.random.default_rng([self.seed, repetition])

        def prompts(count: int, length: int) -> list[list[int]]:
            return rng.integers(LOW_TOKEN_ID, vocab, size=(count, length)).tolist()

        phases = [{"name": "prefill", "prompts": prompts(*self.prefill), "max_tokens": 1},
                  {"name": "stream", "prompts": prompts(1, STREAM_PROMPT_TOKENS), "max_tokens": self.stream_tokens}]
        prompt_tokens, new_tokens = self.batch_shape
        phases += [{"name": f"batch{b}", "prompts": prompts(b, prompt_tokens), "max_tokens": new_tokens}
                   for b in self.batches]
        phases += [{"name": f"ttft{n}", "prompts": prompts(1, n), "max_tokens": 1} for n in self.ttft]
        return phases

    def kv_tokens(self) -> int:
        """KV room for the largest phase."""
        prompt_tokens, new_tokens = self.batch_shape
        return max([self.prefill[0] * (self.prefill[1] + 1), max(self.batches) * (prompt_tokens + new_tokens),
                    *[n + 1 for n in self.ttft]])


@dataclass(slots=True)
class Side:
    """One engine on one kind of weights."""
    name: str  # the row's label
    engine: str  # baton | vllm | llama.cpp
    model: str
    weights: str  # what it computes with
    sequential: bool = False  # batch phases run one prompt at a time
    options: dict = field(default_factory=dict)


@dataclass(slots=True)
class Result:
    side: str
    engine: str
    weights: str
    sequential: bool
    load_s: float = 0.0
    warmup_s: float = 0.0
    peak_rss_mib: float = 0.0
    runs: list[dict] = field(default_factory=list)  # every phase of every repetition, in order
    error: str = ""


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from engine.model_source import resolve_model

    source = resolve_model(args.model)
    workload = _workload(args)
    sides, skipped = _sides(args, source)
    config = model_config(source)
    vocab, max_len = config["vocab_size"], config.get("max_position_embeddings", 2048)
    max_len = min(max_len, max(max(workload.ttft), sum(workload.batch_shape), workload.prefill[1]) + 64)
    jobs = [workload.phases(vocab, r) for r in range(workload.repeat)]
    print(f"engines: {', '.join(s.name for s in sides)}; {args.threads} threads; model {source.path}")
    for note in skipped:
        print(f"  skipped: {note}")
    results = []
    for side in sides:
        print(f"== {side.name} ({side.weights})", flush=True)
        results.append(run_side(side, workload, jobs, threads=args.threads, max_len=max_len, timeout_s=args.timeout_s))
    table = summarize(results, workload)
    print(format_table(table, workload))
    out = Path(args.out or RESULTS_DIR / "engines.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "workload": asdict(workload), "skipped": skipped,
                               "results": [asdict(r) for r in results], "table": table}, indent=1))
    print(f"results: {out}")
    if args.plot:
        if plot(table, workload, Path(args.plot)):
            print(f"plot: {args.plot}")
    return 0 if all(not r.error for r in results) else 1


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench engines", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 | tiny | small | a GGUF file | a Hugging Face folder")
    p.add_argument("--peers", default="vllm,llama.cpp", help="comma-separated: vllm, llama.cpp (empty: Baton alone)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=2, help="repetitions; each figure is the best one")
    p.add_argument("--prefill", default="8x512", help="uncached prompts x tokens each, one new token")
    p.add_argument("--stream-tokens", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--batch-shape", default="256+64", help="prompt tokens + new tokens of each batch request")
    p.add_argument("--ttft", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a small smoke run: 2x64 prefill, 16 stream tokens, "
                   "batches 1 4 of 32+8, TTFT at 64, one repetition")
    p.add_argument("--llama-cpp-quantized", action=argparse.BooleanOptionalAction, default=True,
                   help="also run llama.cpp on the GGUF file's own quantized weights (a row that says so)")
    p.add_argument("--vllm-compile", action="store_true", help="vLLM with torch.compile (default: eager, as "
                   "Baton's vLLM workers run it; docs/benchmarks.md compares the two)")
    p.add_argument("--baton-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an EngineConfig field for Baton's side (JSON value), e.g. max_num_batched_tokens=4096; "
                   "repeatable")
    p.add_argument("--baton-weights", default="auto", choices=["auto", "int4"],
                   help="also run Baton with its linear weights in this format (a row that says so; "
                   "`python -m bench weight-agreement` measures how its results differ)")
    p.add_argument("--timeout-s", type=float, default=3600, help="per engine")
    p.add_argument("--out", help="results JSON (default bench/results/engines.json)")
    p.add_argument("--plot", help="write a plot (PNG) here, e.g. docs/images/engines.png")
    return p.parse_args(argv)


def _workload(args: argparse.Namespace) -> Workload:
    if args.quick:
        return Workload((2, 64), 16, (1, 4), (32, 8), (64,), 1, args.seed)
    count, length = (int(x) for x in args.prefill.split("x"))
    prompt_tokens, new_tokens = (int(x) for x in args.batch_shape.split("+"))
    return Workload((count, length), args.stream_tokens, tuple(args.batches), (prompt_tokens, new_tokens),
                    tuple(args.ttft), args.repeat, args.seed)


def _sides(args: argparse.Namespace, source) -> tuple[list[Side], list[str]]:
    """What runs: Baton on the checkpoint as given, then each peer on the same float32 weights."""
    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.baton_option)}
    sides = [Side("Baton", "baton", str(source.path), "float32", options=options)]
    if args.baton_weights != "auto":
        sides.append(Side(f"Baton ({args.baton_weights} weights)", "baton", str(source.path),
                          f"{args.baton_weights} weights, bfloat16 products", options={**options,
                                                                                       "weights": args.baton_weights}))
    skipped = []
    for peer in [p.strip() for p in args.peers.split(",") if p.strip()]:
        if peer not in MAKE_TARGET:
            raise SystemExit(f"unknown peer {peer!r}: vllm or llama.cpp")
        if not PYTHONS[peer].is_file():
            skipped.append(f"{peer}: its environment is not built ({MAKE_TARGET[peer]})")
            continue
        if peer == "vllm":
            from engine.gguf_export import export_folder

            folder = export_folder(source.path) if source.is_gguf else Path(source.path)
            sides.append(Side("vLLM", "vllm", str(folder), "float32",
                              options={"enforce_eager": False} if args.vllm_compile else {}))
        elif not source.is_gguf:
            skipped.append("llama.cpp: it loads GGUF files only; give --model a GGUF file (e.g. smollm2)")
        else:
            from bench.gguf_f32 import export_f32

            sides.append(Side("llama.cpp", "llama.cpp", str(export_f32(source.path)), "float32", sequential=True))
            if args.llama_cpp_quantized:
                sides.append(Side("llama.cpp (file's weights)", "llama.cpp", str(source.path), _file_type(source.path),
                                  sequential=True))
    return sides, skipped


def _file_type(gguf_path) -> str:
    from engine.gguf_file import GGUFFile

    types = sorted({t.type_name for t in GGUFFile(gguf_path).tensors})
    return "+".join(types) + " (the file's own)"


def model_config(source) -> dict:
    """The checkpoint's config.json as a dict (a GGUF file's: what its metadata describes)."""
    if source.is_gguf:
        from engine.gguf_file import GGUFFile

        return GGUFFile(source.path).config_dict()
    from engine.model.config import read_config_json

    return read_config_json(Path(source.path))


def run_side(side: Side, workload: Workload, jobs: list[list[dict]], *, threads: int, max_len: int,
             timeout_s: float) -> Result:
    result = Result(side.name, side.engine, side.weights, side.sequential)
    phases = [phase for job in jobs for phase in job]
    job = {"engine": side.engine, "model": side.model, "threads": threads, "max_model_len": max_len,
           "kv_tokens": workload.kv_tokens(), "max_batch": max(max(workload.batches), workload.prefill[0]),
           "options": side.options, "warmup": list(range(LOW_TOKEN_ID, LOW_TOKEN_ID + 8)), "phases": phases}
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE=str(_vllm_kv_gib(workload)))
    log_path = RESULTS_DIR / f"engines-{side.engine}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        child = subprocess.Popen([str(PYTHONS[side.engine]), "-m", "bench.engine_peer"], cwd=ROOT, env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        sampler = RssSampler(child.pid)
        sampler.start()
        deadline = threading.Timer(timeout_s, child.kill)
        deadline.start()
        try:
            child.stdin.write(json.dumps(job))
            child.stdin.close()
            _read(child, result, len(phases))
            child.wait()
        finally:
            deadline.cancel()
            sampler.stop()
            if child.poll() is None:
                child.kill()
                child.wait()
    result.peak_rss_mib = sampler.peak_bytes / 2**20
    if child.returncode != 0 or len(result.runs) != len(phases):
        result.error = f"exit {child.returncode} after {len(result.runs)} of {len(phases)} phases (log: {log_path})"
        print(f"  {side.name} failed: {result.error}", flush=True)
    return result


def _read(child: subprocess.Popen, result: Result, num_phases: int) -> None:
    for line in child.stdout:
        kind, _, payload = line.strip().partition(" ")
        if kind == "READY":
            ready = json.loads(payload)
            result.load_s, result.warmup_s = ready["load_s"], ready["warmup_s"]
            print(f"  loaded in {result.load_s:.1f} s, warm-up generate {result.warmup_s:.1f} s", flush=True)
        elif kind == "PHASE":
            run = json.loads(payload)
            result.runs.append(run)
            print(f"  [{len(result.runs)}/{num_phases}] {run['name']}: {run['seconds']:.2f} s", flush=True)


def _vllm_kv_gib(workload: Workload) -> int:
    return 4 if workload.kv_tokens() > 8192 else 2


class RssSampler:
    """Peak of the summed RSS of a process and its descendants, from /proc, every ``period_s``."""

    def __init__(self, pid: int, period_s: float = 0.1) -> None:
        self.pid, self.period_s, self.peak_bytes = pid, period_s, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._done.wait(self.period_s):
            self.peak_bytes = max(self.peak_bytes, tree_rss_bytes(self.pid))


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (an engine's children and theirs), from the parent pid in each ``/proc/*/stat``
    (``/proc/*/task/*/children`` needs a kernel option some sandboxes lack: there it reads as no children)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                text = (entry / "stat").read_text()
            except OSError:  # the process ended meanwhile
                continue
            children.setdefault(int(text[text.rindex(")") + 2:].split()[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def tree_rss_bytes(pid: int) -> int:
    total = 0
    for current in [pid, *descendants(pid)]:
        try:
            status = Path(f"/proc/{current}/status").read_text()
            total += int(next(l.split()[1] for l in status.splitlines() if l.startswith("VmRSS:"))) * 1024
        except (OSError, StopIteration):  # gone meanwhile, or a kernel thread without VmRSS
            continue
    return total


# ---- the table ---------------------------------------------------------------------------------------------------
def summarize(results: list[Result], workload: Workload) -> list[dict]:
    """One row per side: every metric's best over the repetitions (TTFT: the least), and the first batch's."""
    prompt_tokens, new_tokens = workload.batch_shape
    per_request = {f"batch{b}": b * (prompt_tokens + new_tokens) for b in workload.batches}
    rows = []
    for r in results:
        row = {"side": r.side, "engine": r.engine, "weights": r.weights, "sequential": r.sequential,
               "load_s": r.load_s, "warmup_s": r.warmup_s, "peak_rss_mib": r.peak_rss_mib, "error": r.error}
        by_name: dict[str, list[float]] = {}
        for run in r.runs:
            by_name.setdefault(run["name"], []).append(run["seconds"])
        if "prefill" in by_name:
            row["prefill_tok_s"] = workload.prefill[0] * workload.prefill[1] / min(by_name["prefill"])
        if "stream" in by_name:
            row["stream_tok_s"] = workload.stream_tokens / min(by_name["stream"])
        for name, tokens in per_request.items():
            if name in by_name:
                row[f"{name}_tok_s"] = tokens / min(by_name[name])
                row[f"{name}_first_tok_s"] = tokens / by_name[name][0]
        for n in workload.ttft:
            if f"ttft{n}" in by_name:
                row[f"ttft{n}_s"] = min(by_name[f"ttft{n}"])
        rows.append(row)
    return rows


def columns(workload: Workload) -> list[tuple[str, str, bool]]:
    """(key, header, higher is better)"""
    cols = [("prefill_tok_s", f"prefill tok/s ({workload.prefill[0]}x{workload.prefill[1]})", True),
            ("stream_tok_s", "one stream tok/s", True)]
    cols += [(f"batch{b}_tok_s", f"batch {b} tok/s", True) for b in workload.batches]
    cols += [(f"ttft{n}_s", f"TTFT {n} s", False) for n in workload.ttft]
    return cols


def format_table(rows: list[dict], workload: Workload) -> str:
    """Markdown: each engine's figures, then Baton's ratio to it (higher is better for Baton, TTFT included)."""
    cols = columns(workload)
    head = ["engine", "weights", *[h for _, h, _ in cols], "peak RSS MiB", "load s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    baton = rows[0]
    for row in rows:
        cells = [row["side"] + (" (one sequence at a time)" if row["sequential"] else ""), row["weights"]]
        for key, _, higher in cols:
            value = row.get(key)
            if value is None:
                cells.append("-")
                continue
            text = f"{value:.3g}" if value < 100 else f"{value:.0f}"
            if row is not baton and baton.get(key):
                ratio = baton[key] / value if higher else value / baton[key]
                text += f" (Baton {ratio:.2f}x)"
            cells.append(text)
        cells += [f"{row['peak_rss_mib']:.0f}", f"{row['load_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    first = [f"{row['side']} {row.get(f'batch{b}_first_tok_s', 0):.0f} vs best {row.get(f'batch{b}_tok_s', 0):.0f}"
             for row in rows for b in workload.batches[-2:-1] if row.get(f"batch{b}_tok_s")]
    if first and workload.repeat > 1:
        lines.append("")
        lines.append(f"first batch {workload.batches[-2]} after start (tok/s): " + "; ".join(first))
    return "\n".join(lines)


def plot(rows: list[dict], workload: Workload, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None

    cols = columns(workload)
    fig, ax = plt.subplots(figsize=(11, 4.2))
    width = 0.8 / len(rows)
    baton = rows[0]
    for i, row in enumerate(rows):
        ratios = []
        for key, _, higher in cols:
            if row.get(key) and baton.get(key):
                ratios.append(row[key] / baton[key] if higher else baton[key] / row[key])
            else:
                ratios.append(0.0)
        label = f"{row['side']} ({row['weights']})" + (", one sequence at a time" if row["sequential"] else "")
        ax.bar(np.arange(len(cols)) + i * width, ratios, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(np.arange(len(cols)) + width * (len(rows) - 1) / 2)
    ax.set_xticklabels([h.removesuffix(" tok/s").removesuffix(" s") for _, h, _ in cols], rotation=20, ha="right")
    ax.set_ylabel("speed relative to Baton (higher = faster)")
    ax.set_title("Engines on the same float32 weights, prompts and threads (TTFT as 1 / time)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
