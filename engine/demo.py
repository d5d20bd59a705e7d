"""``baton demo``: stream one generation from the offline engine, with a timing line at the end."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from engine.model_source import MODEL_HELP

_DEFAULT_PROMPT = "class Parser:\n    def __init__(self"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="baton demo", description=__doc__)
    parser.add_argument("prompt", nargs="?", default=_DEFAULT_PROMPT)
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from engine.engine import Engine
    from engine.config import EngineConfig
    from engine.errors import BatonError
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import IncrementalDetokenizer, Tokenizer

    try:
        engine = Engine(EngineConfig(model=args.model))
        tokenizer = Tokenizer.from_model(engine.gguf or engine.model_path)
        engine.eos_token_ids = engine.eos_token_ids or tokenizer.eos_token_ids
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens
        )
        prompt_ids = tokenizer.encode(args.prompt)
        engine.add_request("demo", prompt_ids, params)
    except BatonError as exc:
        print(f"baton demo: {exc}", file=sys.stderr)
        return 2
    return _stream(engine, tokenizer, IncrementalDetokenizer(tokenizer, prompt_ids), args.prompt)


def _stream(engine, tokenizer, detok, prompt: str) -> int:
    print(f"\n{prompt}", end="", flush=True)
    started = time.perf_counter()
    first_token_s = None
    num_tokens = 0
    finish = None
    while engine.has_unfinished():
        for delta in engine.step():
            first_token_s = first_token_s or time.perf_counter() - started
            num_tokens += len(delta.new_token_ids)
            print(detok.step(delta.new_token_ids), end="", flush=True)
            finish = delta.finish_reason or finish
    total_s = time.perf_counter() - started
    decode_rate = (num_tokens - 1) / max(total_s - first_token_s, 1e-9)
    print(f"\n\n[{num_tokens} tokens, finish={finish.value}, TTFT {first_token_s * 1e3:.1f} ms, "
          f"decode {decode_rate:.1f} tok/s]")
    return 0
