"""The router's output text per token (``engine.text_stream.TextStream``) beside the detokenizer alone, as outputs
grow: a stream whose cost per token rises with the output's length copies what it already sent.

For each length, the same token ids (a sentence repeated) go one token per step through a bare
``IncrementalDetokenizer`` (the baseline: what any stream must pay) and through ``TextStream`` with a stop string
(held back and searched each step), best of ``--runs`` each. Reports microseconds per token and the ratio;
writes ``bench/results/text_stream.json`` (or ``--out``).

    python -m bench.text_stream [--model smollm2] [--tokens 2000 8000 32000] [--runs 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

from engine.model_source import resolve_model
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.text_stream import TextStream

RESULTS = Path(__file__).parent / "results" / "text_stream.json"
SENTENCE = "The quick brown fox jumps over the lazy dog. Streams of text, one token at a time, to a client. "
STOP = "\n\nUser:"


def load(model: str) -> Tokenizer:
    from engine.gguf_file import GGUFFile
    from engine.llm import load_tokenizer

    source = resolve_model(model)
    tokenizer = load_tokenizer(GGUFFile(source.path) if source.is_gguf else source.path)
    if tokenizer is None:
        raise SystemExit(f"{model} has no tokenizer")
    return tokenizer


def per_token_s(make: Callable[[], tuple[Callable, Callable]], ids: list[int], runs: int) -> float:
    """Best of ``runs``: seconds per token, fed one token per step (``make()`` -> (feed, finish)), then finished."""
    best = float("inf")
    for _ in range(runs):
        feed, finish = make()
        start = time.perf_counter()
        for token in ids:
            feed([token])
        finish()
        best = min(best, time.perf_counter() - start)
    return best / len(ids)


def bare(tokenizer: Tokenizer) -> tuple[Callable, Callable]:
    detokenizer = IncrementalDetokenizer(tokenizer, [1])
    return detokenizer.step, detokenizer.finish


def stream(tokenizer: Tokenizer) -> tuple[Callable, Callable]:
    text = TextStream(tokenizer, [1], [STOP])
    return text.add, text.finish


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, nargs="+", default=[2000, 8000, 32000])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    tokenizer = load(args.model)
    sentence = tokenizer.encode(SENTENCE)
    rows = []
    print(f"{'tokens':>7} {'detokenizer us':>15} {'TextStream us':>14} {'ratio':>6}")
    for n in args.tokens:
        ids = (sentence * (n // len(sentence) + 1))[:n]
        base_s = per_token_s(lambda: bare(tokenizer), ids, args.runs)
        text_s = per_token_s(lambda: stream(tokenizer), ids, args.runs)
        rows.append({"tokens": n, "detokenizer_us": base_s * 1e6, "text_stream_us": text_s * 1e6,
                     "ratio": text_s / base_s})
        print(f"{n:>7} {base_s * 1e6:>15.1f} {text_s * 1e6:>14.1f} {text_s / base_s:>6.2f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": platform.platform(), "model": args.model, "runs": args.runs,
                                    "results": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
