"""Offline throughput: Baton's engine vs transformers ``generate`` with static batches, same run.

    python -m bench.throughput [--model small|smollm2|PATH] [--requests 128] [--concurrency 32 64]
                               [--hf-batch 32] [--threads 2] [--device auto|cpu|cuda] [--compare-eager] [--llama-cpp]

Every side: the same checkpoint (default the "small" preset; ``--model smollm2`` is the real
SmolLM2-135M-Instruct GGUF, which transformers and Baton both dequantize to float32), greedy, ignore_eos,
each request's own output length, the same torch threads. The baseline pads each static batch (left padding)
and runs it to the batch's longest output; only each request's own tokens count as useful. KV use = slots
holding real tokens / slots reserved, averaged over decode steps. ``--llama-cpp`` (a GGUF model and the
``llama-cpp-python`` package) adds llama.cpp on the same file and threads: it runs the *quantized* weights,
one sequence at a time (its Python API decodes one sequence per context).

``--device`` puts both Baton and the transformers baseline on the same device in the same dtype (float32 on the
CPU, bfloat16 on CUDA: Baton's default there). On CUDA Baton decodes through CUDA graphs; ``--compare-eager``
adds a row of Baton with ``enforce_eager`` (no graphs) in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from workload.synthetic import SyntheticRequest, sharegpt_like

RESULTS_DIR = Path(__file__).parent / "results"


@dataclass(slots=True)
class RunResult:
    system: str
    concurrency: int
    generated_tokens: int
    seconds: float
    kv_slots_used_frac: float

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds


def run_baton(model_dir: Path, requests: list[SyntheticRequest], concurrency: int, threads: int, device: str,
              eager: bool = False) -> RunResult:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(
        model=str(model_dir), max_num_seqs=concurrency, max_num_batched_tokens=2048, num_threads=threads,
        device=device, enforce_eager=eager,
    ))
    for i, r in enumerate(requests):
        engine.add_request(str(i), r.prompt_token_ids,
                           SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True))
    generated, used, reserved, steps = 0, 0, 0, 0
    block_size = engine.cache_config.block_size
    pool = engine.kv_cache_manager.pool
    started = time.perf_counter()
    while engine.has_unfinished():
        deltas = engine.step()
        generated += sum(len(d.new_token_ids) for d in deltas)
        used += sum(r.num_computed_tokens for r in engine.scheduler.running)
        reserved += (pool.num_blocks - pool.num_free_blocks) * block_size
        steps += 1
        if steps % 50 == 0:
            print(f"  baton c={concurrency}: {generated} tokens, {time.perf_counter() - started:.0f} s", flush=True)
    seconds = time.perf_counter() - started
    pool.check_invariants()
    return RunResult("baton-eager" if eager else "baton", concurrency, generated, seconds, used / max(reserved, 1))


def run_hf(model_dir: Path, requests: list[SyntheticRequest], batch_size: int, threads: int, device: str) -> RunResult:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32  # Baton's default on each
    if model_dir.is_file():  # a GGUF: transformers dequantizes it to float32, as Baton does
        model = AutoModelForCausalLM.from_pretrained(model_dir.parent, gguf_file=model_dir.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(device=device, dtype=dtype).eval()
    generated, used, reserved = 0, 0, 0
    started = time.perf_counter()
    for b in range(0, len(requests), batch_size):
        batch = requests[b : b + batch_size]
        useful, batch_used, batch_reserved = _hf_batch(model, batch)
        generated += useful
        used += batch_used
        reserved += batch_reserved
        print(f"  hf batch {b // batch_size + 1}: {generated} tokens, {time.perf_counter() - started:.0f} s",
              flush=True)
    return RunResult("transformers", batch_size, generated, time.perf_counter() - started, used / reserved)


def run_llama_cpp(gguf: Path, requests: list[SyntheticRequest], threads: int) -> RunResult:
    """llama.cpp through llama-cpp-python on the same file: one sequence at a time, greedy, past EOS."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise SystemExit("--llama-cpp needs llama-cpp-python: pip install llama-cpp-python==0.3.36 (it builds from "
                         "source, ~10 min on 2 cores; where the CPU advertises AMX that the VM does not allow, add "
                         "CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
                         "-DGGML_AVX512=ON'), see docs/benchmarks.md") from None

    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    llm = Llama(model_path=str(gguf), n_ctx=longest + 8, n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False)
    generated = 0
    started = time.perf_counter()
    for i, r in enumerate(requests):
        llm.reset()
        llm.eval(r.prompt_token_ids)
        for _ in range(r.max_tokens):
            token = llm.sample(temp=0.0)
            llm.eval([token])
            generated += 1
        if (i + 1) % 16 == 0:
            print(f"  llama.cpp: {i + 1}/{len(requests)} requests, {generated} tokens, "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
    # One sequence at a time: its KV holds exactly its own tokens.
    return RunResult("llama.cpp", 1, generated, time.perf_counter() - started, 1.0)


def _hf_batch(model, batch: list[SyntheticRequest]) -> tuple[int, int, int]:
    import torch

    max_prompt = max(len(r.prompt_token_ids) for r in batch)
    max_new = max(r.max_tokens for r in batch)
    ids = torch.zeros((len(batch), max_prompt), dtype=torch.int64)  # [B, P] left padded
    mask = torch.zeros_like(ids)
    for i, r in enumerate(batch):
        ids[i, max_prompt - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
        mask[i, max_prompt - len(r.prompt_token_ids):] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.shape[1] == max_prompt + max_new
    useful = sum(r.max_tokens for r in batch)
    # Time-averaged slot use over the decode steps: step t holds B * (P + t) slots.
    used = sum(sum(len(r.prompt_token_ids) + min(t, r.max_tokens) for r in batch) for t in range(1, max_new + 1))
    reserved = sum(len(batch) * (max_prompt + t) for t in range(1, max_new + 1))
    return useful, used, reserved


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="small (default), tiny, smollm2, a .gguf or a HF folder")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto",
                        help="auto (cuda when there is one; default), cpu or cuda[:N]: Baton and the transformers "
                        "baseline both run there")
    parser.add_argument("--compare-eager", action="store_true",
                        help="also run Baton with enforce_eager (no CUDA graphs), at the first concurrency")
    parser.add_argument("--skip-hf", action="store_true", help="only run Baton (no baseline, no ratio)")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also run llama.cpp (llama-cpp-python) on the same GGUF file and threads")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from engine.model.loader import read_model_config
    from engine.model_source import resolve_model

    source = resolve_model(args.model)
    model_dir = source.path
    vocab_size = read_model_config(source).vocab_size
    if args.llama_cpp and not source.is_gguf:
        raise SystemExit("--llama-cpp needs a GGUF model (e.g. --model smollm2)")
    requests = sharegpt_like(args.requests, vocab_size=vocab_size, seed=args.seed)
    print(f"workload: {len(requests)} requests, {sum(len(r.prompt_token_ids) for r in requests)} prompt tokens, "
          f"{sum(r.max_tokens for r in requests)} output tokens; model {model_dir}", flush=True)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    results = [run_baton(model_dir, requests, c, args.threads, device) for c in args.concurrency]
    if args.compare_eager:
        results.append(run_baton(model_dir, requests, args.concurrency[0], args.threads, device, eager=True))
    if not args.skip_hf:
        results.append(run_hf(model_dir, requests, args.hf_batch, args.threads, device))
    if args.llama_cpp:
        results.append(run_llama_cpp(model_dir, requests, args.threads))
    _report(results, args)
    return 0


def _report(results: list[RunResult], args: argparse.Namespace) -> None:
    baseline = next((r for r in results if r.system == "transformers"), None)
    print(f"\n{'system':<14}{'conc':>6}{'tokens':>9}{'seconds':>9}{'tok/s':>9}{'vs HF':>8}{'KV used':>9}")
    for r in results:
        ratio = f"{r.tokens_per_s / baseline.tokens_per_s:.2f}x" if baseline else "-"
        print(f"{r.system:<14}{r.concurrency:>6}{r.generated_tokens:>9}{r.seconds:>9.1f}{r.tokens_per_s:>9.1f}"
              f"{ratio:>8}{r.kv_slots_used_frac * 100:>8.1f}%")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    payload = {"args": vars(args), "results": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results]}
    name = "throughput.json" if args.model == "small" else f"throughput-{Path(args.model).stem}.json"
    (RESULTS_DIR / name).write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {RESULTS_DIR / name}")


if __name__ == "__main__":
    raise SystemExit(main())
