"""Sampler: per-step sampling cost at real vocabularies, the current sampler next to the pre-change one.

    python -m bench sampler [--quick] [--vocabs 4096 49152 151936] [--batches 1 32 128] [--steps 8]
    python -m bench.sampler ...

A step is what the model runner does once the logits exist: build the SamplingBatch from its requests
(the current ``SamplingBatchBuilder``, which keeps penalty counts across steps, or the pre-change
``SamplingBatch.from_params`` over the requests' Python lists), call the sampler, read the token ids back
(plus the full-sort fallback for rows the candidates could not prove). Each request has a 256-token
prompt and 128 outputs to start with and gains the sampled token every step. Logits are synthetic and
LLM-like: N(0, 1.5^2) over the vocabulary plus a head of 40 tokens per row raised by 6 to 12. Modes:
greedy; temperature 0.8; top-k 50 + top-p 0.9 at temperature 0.8; top-p 0.9 alone at 0.8 (the mode whose
candidates can fall short); greedy with repetition 1.2, presence 0.5, frequency 0.5. The pre-change
sampler is ``bench/sampler_baseline.py``. Two torch threads; medians over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "sampler.json"  # --quick: sampler_quick.json
MODES = ("greedy", "temperature", "top-k+top-p", "top-p", "penalties")
PROMPT_TOKENS, OUTPUT_TOKENS, HEAD_TOKENS = 256, 128, 40


@dataclass(slots=True)
class Cell:
    vocab: int
    batch: int
    mode: str
    impl: str  # "new" or "old"
    build_ms: float  # median per step
    sample_ms: float  # median per step: sampler call + host read (+ fallback)
    total_ms: float  # median per step of build + sample
    fallback_rows: float  # mean per step: rows sampled again from a full sort
    steps: int


def _params(mode: str):
    from engine.sampling_params import SamplingParams

    return {
        "greedy": SamplingParams(temperature=0.0),
        "temperature": SamplingParams(temperature=0.8),
        "top-k+top-p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
        "top-p": SamplingParams(temperature=0.8, top_p=0.9),
        "penalties": SamplingParams(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.5,
                                    frequency_penalty=0.5),
    }[mode]


def _requests(batch: int, vocab: int, mode: str, gen: torch.Generator) -> list:
    from engine.core.request import Request

    requests = []
    for row in range(batch):
        prompt = torch.randint(0, vocab, (PROMPT_TOKENS,), generator=gen).tolist()
        request = Request(request_id=f"r{row}", prompt_token_ids=prompt, sampling_params=_params(mode), seed=row)
        for token in torch.randint(0, vocab, (OUTPUT_TOKENS,), generator=gen).tolist():
            request.append_output_token(token)
        requests.append(request)
    return requests


def _logits(batch: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    logits = torch.randn(batch, vocab, generator=gen) * 1.5  # [B, V]
    head = torch.randint(0, vocab, (batch, HEAD_TOKENS), generator=gen)  # [B, 40]
    boost = torch.rand(batch, HEAD_TOKENS, generator=gen) * 6 + 6  # [B, 40]
    return logits.scatter_add_(1, head, boost)  # [B, V]


def _new_step(vocab: int) -> Callable:
    from engine.sampler import Sampler
    from engine.sampling.builder import SamplingBatchBuilder

    builder, sampler = SamplingBatchBuilder(vocab, "cpu"), Sampler()

    def step(requests: list, logits: torch.Tensor) -> tuple[float, float, list[int], int]:
        started = time.perf_counter()
        batch = builder.build(requests)
        built = time.perf_counter()
        result = sampler(logits, batch, scratch=True)
        unproven = result.unproven
        token_ids, _ = sampler.read(result)  # as ModelRunner.execute: one read, then the fallback if any
        sampled = time.perf_counter()
        num_fallback = 0 if unproven is None else int(unproven.rows.sum())
        return built - started, sampled - built, token_ids, num_fallback

    return step


def _old_step(vocab: int) -> Callable:
    import bench.sampler_baseline as old
    from engine.sampling.builder import banned_tokens

    sampler = old.Sampler()

    def step(requests: list, logits: torch.Tensor) -> tuple[float, float, list[int], int]:
        started = time.perf_counter()
        batch = old.SamplingBatch.from_params(  # the pre-change ModelRunner._sampling_batch
            [r.sampling_params for r in requests], [r.seed for r in requests],
            [r.num_output_tokens for r in requests], [r.prompt_token_ids for r in requests],
            [r.output_token_ids for r in requests], [banned_tokens(r) for r in requests], vocab, "cpu")
        built = time.perf_counter()
        token_ids = sampler(logits, batch).token_ids.tolist()
        return built - started, time.perf_counter() - built, token_ids, 0

    return step


def measure(vocab: int, batch: int, mode: str, impl: str, steps: int, budget_s: float) -> Cell:
    """Two warm-up steps, then ``steps`` timed ones (fewer past ``budget_s``, at least 2)."""
    gen = torch.Generator().manual_seed(vocab * 1000 + batch)
    requests, logits = _requests(batch, vocab, mode, gen), _logits(batch, vocab, gen)
    step = (_new_step if impl == "new" else _old_step)(vocab)
    scratch = torch.empty_like(logits)  # [B, V] the step's logits (the new sampler writes penalties into them)
    builds, samples, fallbacks = [], [], []
    started = time.perf_counter()
    for index in range(steps + 2):
        scratch.copy_(logits)
        build_s, sample_s, token_ids, num_fallback = step(requests, scratch)
        for request, token in zip(requests, token_ids):
            request.append_output_token(token)
        if index >= 2:
            builds.append(build_s)
            samples.append(sample_s)
            fallbacks.append(num_fallback)
            if index >= 3 and time.perf_counter() - started > budget_s:
                break
    totals = [b + s for b, s in zip(builds, samples)]
    return Cell(vocab, batch, mode, impl, statistics.median(builds) * 1e3, statistics.median(samples) * 1e3,
                statistics.median(totals) * 1e3, statistics.mean(fallbacks), len(totals))


def run_grid(vocabs: list[int], batches: list[int], modes: list[str], *, steps: int, budget_s: float,
             progress: Callable[[str], None] = lambda line: None) -> list[Cell]:
    cells = []
    grid = [(v, b, m, i) for v in vocabs for b in batches for m in modes for i in ("new", "old")]
    for number, (vocab, batch, mode, impl) in enumerate(grid, start=1):
        cell = measure(vocab, batch, mode, impl, steps, budget_s)
        progress(f"[{number}/{len(grid)}] V={vocab} B={batch} {mode} {impl}: {cell.total_ms:.2f} ms/step "
                 f"({cell.steps} steps)")
        cells.append(cell)
    return cells


def report(cells: list[Cell]) -> dict:
    """Rows of the table (new vs old per vocab, batch and mode) and the issue's targets."""
    by_key = {(c.vocab, c.batch, c.mode, c.impl): c for c in cells}
    rows = []
    for (vocab, batch, mode, impl), new in by_key.items():
        if impl != "new":
            continue
        old = by_key[(vocab, batch, mode, "old")]
        greedy_new = by_key.get((vocab, batch, "greedy", "new"))
        greedy_old = by_key.get((vocab, batch, "greedy", "old"))
        rows.append({
            "vocab": vocab, "batch": batch, "mode": mode,
            "new_build_ms": new.build_ms, "new_sample_ms": new.sample_ms, "new_ms": new.total_ms,
            "old_ms": old.total_ms, "new_over_old": new.total_ms / old.total_ms,
            "new_over_new_greedy": new.total_ms / greedy_new.total_ms if greedy_new else None,
            "new_over_old_greedy": new.total_ms / greedy_old.total_ms if greedy_old else None,
            "old_over_old_greedy": old.total_ms / greedy_old.total_ms if greedy_old else None,
            "fallback_rows": new.fallback_rows,
        })
    return {"rows": rows, "targets": _targets(rows)}


def _targets(rows: list[dict]) -> list[dict]:
    out = []
    for row in rows:
        if row["batch"] == 32 and row["vocab"] == 49152:
            out.append({"target": f"B32 V49152 {row['mode']} < 30 ms", "value_ms": row["new_ms"],
                        "met": row["new_ms"] < 30.0})
        if row["batch"] == 32 and row["vocab"] == 151936 and row["mode"] in ("top-k+top-p", "penalties"):
            ratio = row["new_over_new_greedy"]
            out.append({"target": f"B32 V151936 {row['mode']} <= 2x greedy", "ratio_to_new_greedy": ratio,
                        "ratio_to_old_greedy": row["new_over_old_greedy"], "met": ratio is not None and ratio <= 2})
    return out


def _table(result: dict) -> str:
    lines = ["| vocab | batch | mode | new build ms | new sample ms | new ms | old ms | new/old | new/greedy "
             "| new/old greedy | old/old greedy | fallback rows |", "|" + "---|" * 12]
    for r in result["rows"]:
        ratios = [f"{r[k]:.2f}" if r[k] is not None else "-" for k in
                  ("new_over_new_greedy", "new_over_old_greedy", "old_over_old_greedy")]
        lines.append(f"| {r['vocab']} | {r['batch']} | {r['mode']} | {r['new_build_ms']:.2f} | "
                     f"{r['new_sample_ms']:.2f} | {r['new_ms']:.2f} | {r['old_ms']:.2f} | {r['new_over_old']:.3f} | "
                     f"{' | '.join(ratios)} | {r['fallback_rows']:.2f} |")
    for t in result["targets"]:
        lines.append(f"target {t['target']}: {'met' if t['met'] else 'NOT met'} "
                     f"({', '.join(f'{k}={v:.2f}' for k, v in t.items() if isinstance(v, float))})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sampler", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: V 4096/49152, B 1/32, 3 steps")
    p.add_argument("--vocabs", type=int, nargs="+", default=[4096, 49152, 151936])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--budget-s", type=float, default=6.0, help="per cell: stop timing steps after this")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.quick:
        args.vocabs, args.batches, args.steps, args.budget_s = [4096, 49152], [1, 32], 3, 1.0
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    with torch.inference_mode():
        cells = run_grid(args.vocabs, args.batches, args.modes, steps=args.steps, budget_s=args.budget_s,
                         progress=lambda line: print(line, file=sys.stderr, flush=True))
    result = report(cells)
    result["config"] = {"threads": args.threads, "steps": args.steps, "torch": torch.__version__,
                        "load_1min_before": load_before, "load_1min_after": os.getloadavg()[0]}
    result["cells"] = [asdict(c) for c in cells]
    path = RESULTS.with_name("sampler_quick.json") if args.quick else RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(_table(result))
    print(f"load average (1 min) before {load_before:.2f}, after {result['config']['load_1min_after']:.2f}; "
          f"results in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
