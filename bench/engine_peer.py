"""One engine of ``bench engines``, in a process of its own environment: Baton's ``LLM`` (Baton's venv), vLLM's
``LLM`` (``.venv-vllm``) or llama.cpp (``llama-cpp-python``, ``.venv-llama-cpp``).

    python -m bench.engine_peer < job.json

The job (JSON on stdin): ``engine``, ``model`` (what that engine loads: Baton a GGUF file or folder, vLLM a folder,
llama.cpp a GGUF file), ``threads``, ``max_model_len``, ``kv_tokens`` (KV room to reserve), ``max_batch`` and
``phases``: ``{"name", "prompts": [[token ids], ...], "max_tokens"}`` in the order to run them. Every phase is one
greedy ``generate`` of all its prompts at once (``ignore_eos``: each prompt gets exactly ``max_tokens``); llama.cpp's
Python binding holds one sequence per context, so it runs a phase's prompts one after another. Lines out:
``READY {"load_s", "warmup_s"}``, one ``PHASE {"name", "seconds", "output_tokens"}`` per phase, ``DONE``.

Only the standard library is imported here at the top: each engine's own package is imported by its runner, in
its own venv (Baton is installed there without its dependencies).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

Run = Callable[[list[list[int]], int], int]  # (prompts, max_tokens) -> output tokens produced


def baton(job: dict) -> Run:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    block_size = 16
    llm = LLM(job["model"], num_threads=job["threads"], block_size=block_size,
              num_blocks=-(-job["kv_tokens"] // block_size) + job["max_batch"], max_num_seqs=job["max_batch"],
              **job.get("options", {}))

    def run(prompts: list[list[int]], max_tokens: int) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params))

    return run


def vllm(job: dict) -> Run:
    from vllm import LLM, SamplingParams

    options = {"enforce_eager": True, **job.get("options", {})}
    llm = LLM(model=job["model"], dtype="float32", max_model_len=job["max_model_len"], max_num_seqs=job["max_batch"],
              seed=0, **options)

    def run(prompts: list[list[int]], max_tokens: int) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return run


def llama_cpp(job: dict) -> Run:
    from llama_cpp import Llama

    llm = Llama(model_path=job["model"], n_ctx=job["max_model_len"], n_threads=job["threads"],
                n_threads_batch=job["threads"], n_batch=512, verbose=False, **job.get("options", {}))

    def run(prompts: list[list[int]], max_tokens: int) -> int:
        produced = 0
        for prompt in prompts:  # one sequence per context: one prompt after another
            llm.reset()  # no reuse of the previous prompt's KV
            for produced_here, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1, reset=True), start=1):
                if produced_here == max_tokens:  # generate() never stops by itself: EOS is ignored
                    break
            produced += max_tokens
        return produced

    return run


ENGINES = {"baton": baton, "vllm": vllm, "llama.cpp": llama_cpp}


def emit(kind: str, payload: dict | None = None) -> None:
    print(kind if payload is None else f"{kind} {json.dumps(payload)}", flush=True)


def main() -> int:
    job = json.load(sys.stdin)
    started = time.perf_counter()
    run = ENGINES[job["engine"]](job)
    loaded = time.perf_counter()
    run([job["warmup"]], 4)  # the engine's first generate, apart (its cost is reported, not mixed into a phase)
    emit("READY", {"load_s": loaded - started, "warmup_s": time.perf_counter() - loaded, "pid": os.getpid()})
    for phase in job["phases"]:
        t0 = time.perf_counter()
        produced = run(phase["prompts"], phase["max_tokens"])
        emit("PHASE", {"name": phase["name"], "seconds": time.perf_counter() - t0, "output_tokens": produced})
    emit("DONE")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
