"""Speculative decoding (n-gram drafts) vs plain decoding, same engine, same run.

    python -m bench.speculative [--model smollm2] [--requests 8] [--concurrency 1 4] [--max-tokens 128]
                                [--spec-tokens 4] [--threads 2]

Two chat workloads on the real model: **repetitive** (code editing and retrieval: "repeat / rename in this code"
over stdlib functions, where the answer copies the prompt) and **open** (questions with free answers). Each
(workload, concurrency) runs plain and with ``--speculative-config`` n-gram drafts, alternating, greedy, and
the outputs are checked to be identical. Reported: tokens/s (output tokens over the run's wall clock, prefills
included: they are the same in both modes), mean inter-token latency per request (first token to last), and
acceptance (accepted / drafted). A plot beside the JSON in bench/results/.
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from workload.plots import pyplot

RESULTS_DIR = Path(__file__).parent / "results"
OPEN_QUESTIONS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between a comet and an asteroid?",
    "Give me three ideas for a weekend trip in the mountains, with a sentence on each.",
    "Explain how a bicycle stays upright when it moves.",
    "Describe the water cycle to a ten-year-old.",
    "Why do leaves change colour in autumn?",
    "Write a limerick about a cat who learns to code.",
    "What makes a good cup of tea? Answer in a paragraph.",
]


@dataclass(slots=True)
class Run:
    workload: str
    concurrency: int
    speculative: bool
    output_tokens: int
    seconds: float
    tokens_per_s: float
    mean_itl_ms: float
    drafted: int
    accepted: int


def repetitive_prompts(count: int) -> list[str]:
    """Code editing / retrieval: each answer mostly copies its prompt (stdlib sources, offline and fixed)."""
    import json.encoder
    import textwrap
    import string

    functions = [textwrap.TextWrapper._split, textwrap.dedent, json.encoder.py_encode_basestring,
                 string.capwords, textwrap.indent, textwrap.TextWrapper._fix_sentence_endings]
    asks = ["Repeat the following code exactly, with no comment:", "Rename the variable `text` to `s` in this code "
            "and print the whole result, with no comment:"]
    out = []
    for i in range(count):
        source = inspect.getsource(functions[i % len(functions)])[:800]
        out.append(f"{asks[i % len(asks)]}\n\n{source}")
    return out


def run(llm, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[list[list[int]], dict]:
    from engine.sampling_params import SamplingParams

    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=max_tokens)
    queue, outputs, first, last = list(enumerate(prompts)), {}, {}, {}
    before = engine.stats()
    started = time.perf_counter()
    while queue or engine.has_unfinished():
        while queue and len(engine.scheduler.running) + len(engine.scheduler.waiting) < concurrency:
            i, prompt = queue.pop(0)
            engine.add_request(str(i), prompt, params)
        for delta in engine.step():
            now = time.perf_counter()
            first.setdefault(delta.request_id, now)
            last[delta.request_id] = now
            outputs.setdefault(int(delta.request_id), []).extend(delta.new_token_ids)
    seconds = time.perf_counter() - started
    after = engine.stats()
    tokens = [outputs[i] for i in range(len(prompts))]
    itl = [(last[str(i)] - first[str(i)]) / (len(t) - 1) for i, t in enumerate(tokens) if len(t) > 1]
    return tokens, {"seconds": seconds, "itl_ms": 1e3 * sum(itl) / max(len(itl), 1),
                    "drafted": after.spec_draft_tokens - before.spec_draft_tokens,
                    "accepted": after.spec_accepted_tokens - before.spec_accepted_tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--spec-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    from engine import LLM
    from engine.core.speculation import SpeculativeConfig

    common = dict(num_threads=args.threads, max_num_seqs=max(args.concurrency))
    plain = LLM(args.model, **common)
    spec = LLM(args.model, speculative_config=SpeculativeConfig(num_speculative_tokens=args.spec_tokens), **common)
    chat = lambda text: plain.tokenizer.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    workloads = {"repetitive": [chat(p) for p in repetitive_prompts(args.requests)],
                 "open": [chat(OPEN_QUESTIONS[i % len(OPEN_QUESTIONS)]) for i in range(args.requests)]}
    runs: list[Run] = []
    for name, prompts in workloads.items():
        for concurrency in args.concurrency:
            results = {}
            for speculative, llm in ((False, plain), (True, spec)):
                tokens, m = run(llm, prompts, concurrency, args.max_tokens)
                results[speculative] = tokens
                num_tokens = sum(map(len, tokens))
                runs.append(Run(name, concurrency, speculative, num_tokens, m["seconds"], num_tokens / m["seconds"],
                                m["itl_ms"], m["drafted"], m["accepted"]))
                print(_row(runs[-1]), flush=True)
            if results[False] != results[True]:
                raise SystemExit(f"outputs differ with speculation on ({name}, concurrency {concurrency})")
    _report(runs, args)
    return 0


def _row(r: Run) -> str:
    acceptance = f"{r.accepted / r.drafted:6.1%}" if r.drafted else "     -"
    return (f"{r.workload:<11}{r.concurrency:>5}  {'ngram' if r.speculative else 'off':<6}{r.output_tokens:>8}"
            f"{r.seconds:>9.1f}{r.tokens_per_s:>11.1f}{r.mean_itl_ms:>10.1f}  {acceptance}")


def _report(runs: list[Run], args: argparse.Namespace) -> None:
    print(f"\n{'workload':<11}{'conc':>5}  {'spec':<6}{'tokens':>8}{'seconds':>9}{'tokens/s':>11}{'ITL ms':>10}"
          f"  {'accept':>6}  speedup")
    for r in runs:
        base = next(b for b in runs if (b.workload, b.concurrency, b.speculative) == (r.workload, r.concurrency, False))
        print(f"{_row(r)}  {r.tokens_per_s / base.tokens_per_s:.2f}x")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / "speculative.json"
    out.write_text(json.dumps({"args": vars(args), "runs": [asdict(r) for r in runs]}, indent=2))
    _plot(runs, RESULTS_DIR / "speculative.png")
    print(f"\nwrote {out}")


def _plot(runs: list[Run], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = sorted({(r.workload, r.concurrency) for r in runs})
    for offset, speculative in ((-0.2, False), (0.2, True)):
        values = [next(r.tokens_per_s for r in runs if (r.workload, r.concurrency, r.speculative) ==
                       (w, c, speculative)) for w, c in labels]
        ax.bar([i + offset for i in range(len(labels))], values, width=0.4, label="n-gram drafts" if speculative
               else "plain")
    ax.set_xticks(range(len(labels)), [f"{w}\nconcurrency {c}" for w, c in labels])
    ax.set_ylabel("output tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
