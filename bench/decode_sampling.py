"""Decode throughput on a real model per sampling mode: how much of a decode step sampling takes.

    python -m bench decode-sampling [--model smollm2] [--batch 32] [--prompt-tokens 128] [--max-tokens 64]

One engine, one batch of ``--batch`` requests per mode (``--prompts text``: windows of ``--prompt-tokens``
tokens of standard-library source, tokenized by the model's own tokenizer; ``random``: random ids, which give
the model flat, uncertain distributions: the worst case for top-p), greedy or sampled, ``ignore_eos``, decoded
to ``--max-tokens``. Reported per mode: decode tokens/s over the steps
after the prefill, the median step time, and the median time the runner spends building the sampling batch
plus sampling plus reading the tokens back (timed around those calls; on a CPU they are synchronous), as a
share of the step. The issue's target: sampling under 10% of a SmolLM2 decode step at batch 32 in every mode.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "decode_sampling.json"
MODES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top-k+top-p": dict(temperature=0.8, top_k=50, top_p=0.9),
    "top-p": dict(temperature=0.8, top_p=0.9),
    "penalties": dict(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5),
}


class _TimedSampling:
    """Wraps the runner's sampling-batch builder and sampler; adds up the seconds each step spends in them."""

    def __init__(self, runner) -> None:
        self._builder, self._sampler = runner.sampling, runner.sampler
        self.step_s = 0.0
        runner.sampling, runner.sampler = self, self

    def build_rows(self, rows):
        started = time.perf_counter()
        batch = self._builder.build_rows(rows)
        self.step_s += time.perf_counter() - started
        return batch

    def forget(self, request_ids) -> None:
        self._builder.forget(request_ids)

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        out = self._sampler(*args, **kwargs)
        self.step_s += time.perf_counter() - started
        return out

    def read(self, output):
        started = time.perf_counter()
        out = self._sampler.read(output)
        self.step_s += time.perf_counter() - started
        return out


def run_mode(engine, mode: str, prompts: list[list[int]], max_tokens: int) -> dict:
    from engine.sampling_params import SamplingParams

    timed = _TimedSampling(engine.runner)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=1, **MODES[mode])
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{mode}-{i}", prompt, params)
    steps, sampling = [], []
    while engine.has_unfinished():
        timed.step_s = 0.0
        started = time.perf_counter()
        output = engine.step()
        if len(output) == len(prompts):  # every request sampled: a decode step (the first may mix a prefill)
            steps.append(time.perf_counter() - started)
            sampling.append(timed.step_s)
    engine.runner.sampling, engine.runner.sampler = timed._builder, timed._sampler
    decode = steps[1:]  # the first full step may still carry the last prefill chunk
    step_s = statistics.median(decode)
    return {"mode": mode, "decode_tokens_per_s": len(prompts) / step_s, "step_ms": step_s * 1e3,
            "sampling_ms": statistics.median(sampling[1:]) * 1e3,
            "sampling_share": statistics.median(s / t for s, t in zip(sampling[1:], decode)), "steps": len(decode)}


def _prompts(engine, args: argparse.Namespace, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    if args.prompts == "random":
        vocab = engine.model_config.vocab_size
        return [[rng.randrange(32, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]
    import sysconfig

    from engine.llm import load_tokenizer

    tokenizer = load_tokenizer(engine.gguf or engine.model_path)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    ids = [t for path in rng.sample(files, 40) for t in tokenizer.encode(path.read_text(errors="replace")[:6000])]
    starts = [rng.randrange(0, len(ids) - args.prompt_tokens) for _ in range(args.batch)]
    return [ids[start:start + args.prompt_tokens] for start in starts]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode_sampling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--prompts", choices=("text", "random"), default="text")
    args = p.parse_args(argv)
    from engine.config import EngineConfig
    from engine.engine import Engine

    engine = Engine(EngineConfig(model=args.model, max_num_seqs=args.batch, num_threads=args.threads,
                                 enable_prefix_caching=False))
    vocab = engine.model_config.vocab_size
    load_before = os.getloadavg()[0]
    rows = []
    for index, mode in enumerate(args.modes):
        prompts = _prompts(engine, args, seed=index)
        rows.append(run_mode(engine, mode, prompts, args.max_tokens))
        r = rows[-1]
        print(f"{mode:<12} {r['decode_tokens_per_s']:7.1f} tok/s  step {r['step_ms']:6.1f} ms  sampling "
              f"{r['sampling_ms']:5.2f} ms ({r['sampling_share'] * 100:4.1f}%)", file=sys.stderr, flush=True)
    result = {"args": vars(args), "rows": rows, "load_1min_before": load_before,
              "load_1min_after": os.getloadavg()[0], "vocab_size": vocab}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print("| mode | decode tok/s | vs greedy | step ms | sampling ms | sampling share of the step |")
    print("|---|---|---|---|---|---|")
    greedy = next((r for r in rows if r["mode"] == "greedy"), rows[0])
    for r in rows:
        print(f"| {r['mode']} | {r['decode_tokens_per_s']:.1f} | {r['decode_tokens_per_s'] / greedy['decode_tokens_per_s']:.2f}x "
              f"| {r['step_ms']:.1f} | {r['sampling_ms']:.2f} | {r['sampling_share'] * 100:.1f}% |")
    print(f"load average (1 min) before {load_before:.2f}, after {result['load_1min_after']:.2f}; results in {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
