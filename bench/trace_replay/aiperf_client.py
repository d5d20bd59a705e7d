"""NVIDIA's aiperf as the client: the scaled slice written as a Mooncake trace, aiperf run on it against the
OpenAI front, its records read back as outcomes. aiperf is not a dependency (``make aiperf``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from workload.trace import Scale
from bench.trace_replay.outcomes import Outcome
from bench.trace_replay.slice import ReplayRequest
from bench.trace_replay.up import ROOT


def scaled_trace_lines(requests: list[ReplayRequest], scale: Scale) -> list[str]:
    """The scaled slice as a Mooncake-format trace for aiperf (one hash id per ``scale.block_tokens`` tokens, so
    ``--prompt-input-tokens-block-size`` is ``scale.block_tokens``): lengths as our replay sends them (cut ones
    included), timestamps in ms from the first request. aiperf refuses a hash id met at two sizes (a partial last
    block here, full or of another length there; scaling makes more of them), so each (id, size) of a partial last
    block gets an id of its own past the trace's: no reuse is lost, since only full blocks are ever cached."""
    top = max((i for r in requests for i in r.hash_ids), default=0)
    partial_ids: dict[tuple[int, int], int] = {}
    lines = []
    for r in requests:
        blocks = -(-len(r.prompt) // scale.block_tokens)
        ids = list(r.hash_ids[:blocks])
        tail = len(r.prompt) % scale.block_tokens
        if tail and ids:
            ids[-1] = partial_ids.setdefault((ids[-1], tail), top + 1 + len(partial_ids))
        lines.append(json.dumps({"timestamp": round(r.arrival_s * 1e3), "input_length": len(r.prompt),
                                 "output_length": r.max_tokens, "hash_ids": ids}))
    return lines


def hf_cache_for(model_dir: Path, cache: Path, repo: str = "baton/model") -> str:
    """A private Hugging Face cache holding ``model_dir``'s tokenizer as repo ``repo``: aiperf 0.13 loads a
    tokenizer from a local folder only online, and its decoding worker processes force offline mode, where it
    looks a name up in the cache. Nothing is downloaded."""
    if not (model_dir / "tokenizer.json").is_file():
        raise ValueError(f"--client aiperf needs a Hugging Face folder with tokenizer.json, not {model_dir}")
    snapshot = cache / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        if (model_dir / name).exists():
            shutil.copyfile(model_dir / name, snapshot / name)
    (snapshot.parents[1] / "refs").mkdir(exist_ok=True)
    (snapshot.parents[1] / "refs" / "main").write_text("local")
    return repo


def aiperf_binary(given: str | None) -> str:
    for candidate in (given, str(ROOT / ".venv-aiperf" / "bin" / "aiperf"), shutil.which("aiperf")):
        if candidate and Path(candidate).exists():
            return candidate
    raise FileNotFoundError("aiperf is not installed: `make aiperf` installs it into .venv-aiperf "
                            "(or give --aiperf PATH)")


def aiperf_outcomes(records: list[dict]) -> tuple[list[Outcome], float]:
    """Outcomes from aiperf's ``profile_export.jsonl`` records (profiling phase): TTFT, server-reported usage
    (prompt and cached tokens), errors; the duration from the first request's start to the last one's end."""
    outcomes, starts, ends = [], [], []
    for i, rec in enumerate(records):
        meta, metrics = rec.get("metadata", {}), rec.get("metrics", {})
        if meta.get("benchmark_phase", "profiling") != "profiling":
            continue

        def value(name: str, default=0):
            return (metrics.get(name) or {}).get("value", default)

        i = meta.get("session_num", i)  # the line of the scaled trace (aiperf's session per request)
        starts.append(meta.get("request_start_ns", 0))
        ends.append(meta.get("request_end_ns", 0))
        error = rec.get("error")
        if error or "time_to_first_token" not in metrics:
            code = (error or {}).get("code", "") if isinstance(error, dict) else ""
            prompt = value("error_isl") or value("input_sequence_length")  # what aiperf meant to send
            outcomes.append(Outcome(index=i, ok=False, prompt_tokens=int(prompt),
                                    error=f"HTTP {code}" if code else "error"))
            continue
        outcomes.append(Outcome(index=i, ok=True, prompt_tokens=int(value("usage_prompt_tokens")),
                                cached_tokens=int(value("usage_prompt_cache_read_tokens")),
                                output_tokens=int(value("usage_completion_tokens") or value("output_token_count")),
                                ttft_s=value("time_to_first_token") / 1e3, e2e_s=value("request_latency") / 1e3,
                                itl_ms=float(value("inter_token_latency") or 0.0)))
    duration = (max(ends) - min(starts)) / 1e9 if starts and ends else 0.0
    return outcomes, duration


def replay_aiperf(binary: str, http_port: int, model_name: str, model_dir: Path, requests: list[ReplayRequest],
                  scale: Scale, work: Path, *, request_timeout_s: float,
                  max_run_s: float) -> tuple[list[Outcome], float]:
    work.mkdir(parents=True, exist_ok=True)
    trace_file = work / "scaled_trace.jsonl"
    trace_file.write_text("\n".join(scaled_trace_lines(requests, scale)) + "\n")
    cache = work / "hf"
    repo = hf_cache_for(model_dir, cache)
    out = work / "aiperf"
    cmd = [binary, "profile", "--model", model_name, "--tokenizer", repo, "--url", f"http://127.0.0.1:{http_port}",
           "--endpoint-type", "completions", "--streaming", "--custom-dataset-type", "mooncake_trace",
           "--input-file", str(trace_file), "--prompt-input-tokens-block-size", str(scale.block_tokens),
           "--fixed-schedule", "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
           "--request-timeout-seconds", str(request_timeout_s), "--output-artifact-dir", str(out),
           "--random-seed", "0"]
    env = dict(os.environ, HF_HOME=str(cache), HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)  # aiperf runs in its own environment
    with (work / "aiperf.log").open("wb") as log:
        try:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=max_run_s + 120,
                           start_new_session=True, check=False)
        except subprocess.TimeoutExpired:
            print(f"aiperf ran past {max_run_s + 120:.0f} s; stopped", file=sys.stderr)
    export = out / "profile_export.jsonl"
    if not export.exists():
        raise RuntimeError(f"aiperf wrote no records (log: {work / 'aiperf.log'})")
    records = [json.loads(line) for line in export.read_text().splitlines() if line.strip()]
    return aiperf_outcomes(records)
