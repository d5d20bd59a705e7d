"""Layer-wise KV streaming vs send-after-prefill (issue 5), two processes on 127.0.0.1.

The prefill process (this one) runs a real engine on the "small" preset (8 layers, hidden 512; or
``--model``) with a tcp KV server over its paged cache; a decode process pulls each prompt's blocks into
its own KV buffer (it runs no model: its decode step is the same in both modes, so it is left out). Each
prompt is admitted with ``hold_blocks`` and ``max_tokens=1`` (a prefill worker's request), its lease is
created at admission (``Engine.step(on_scheduled=...)``, before any layer runs), and then:

- ``after``: send-after-prefill, today's path: the pull starts once the prefill step has finished;
- ``layerwise``: the pull starts at admission and the server streams each layer's blocks once the
  engine's per-layer hook (``on_layer`` -> ``LayerProgress.complete``) says it is computed.

Per run: prefill seconds (the step), transfer seconds (the decode side's pull, connect to last byte) and
the time from prefill start to "the decode side has all the KV" — TTFT-to-first-decode-token minus D's one
decode step, which is the same in both modes. Modes alternate (who goes first rotates); medians over runs.
The same random prompt per size for both modes; prefix caching is off so no run reuses another's KV.
Prints a table and writes ``bench/results/layerwise.json``.

    python -m bench.layerwise [--tokens 1024 2048 4080] [--runs 5] [--model DIR] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.leases import LeaseTable
from kv_transfer.progress import LayerProgress
from kv_transfer.tcp import TcpServer
from kv_transfer.transport import pull

MODES = ("after", "layerwise")
RESULTS = Path(__file__).parent / "results" / "layerwise.json"


# ---- the decode process: JSON lines on stdin/stdout, one pull per line ----------------------------


async def decode_main() -> None:
    """Read ``{"layout", "num_blocks"}``, then pull requests ``{"uri", "lease_id", "block_ids"}``;
    answer each with its timings on this host's monotonic clock (shared with the prefill process)."""
    loop = asyncio.get_running_loop()
    setup = json.loads(await loop.run_in_executor(None, sys.stdin.readline))
    layout = KVLayout.from_json(setup["layout"])
    buffer = KVBuffer.allocate(layout, setup["num_blocks"])
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        job = json.loads(line)
        started = time.monotonic()
        dst_ids = list(range(len(job["block_ids"])))
        stats = await pull(job["uri"], layout, job["lease_id"], job["block_ids"], buffer, dst_ids)
        finished = time.monotonic()
        print(json.dumps({"started": started, "finished": finished, "seconds": stats.seconds,
                          "num_bytes": stats.num_bytes}), flush=True)


class DecodeProcess:
    """The decode side, a child process; one pull at a time."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, layout: KVLayout, num_blocks: int) -> DecodeProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.layerwise", "--decode-worker",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        decode = cls(proc)
        decode._send({"layout": layout.to_json(), "num_blocks": num_blocks})
        return decode

    def _send(self, doc: dict) -> None:
        self.proc.stdin.write(json.dumps(doc).encode() + b"\n")

    async def pull(self, uri: str, lease_id: str, block_ids: list[int], timeout_s: float = 120.0) -> dict:
        self._send({"uri": uri, "lease_id": lease_id, "block_ids": block_ids})
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        if not line:
            raise RuntimeError("the decode process exited (see its stderr above)")
        return json.loads(line)

    async def stop(self) -> None:
        self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


# ---- the prefill process ---------------------------------------------------------------------------


class PrefillSide:
    """A real engine, its KV cache served over tcp, leases and per-lease layer progress."""

    def __init__(self, engine, layout: KVLayout, executor: ThreadPoolExecutor) -> None:
        import torch

        self.engine, self.layout, self.executor = engine, layout, executor
        self.leases = LeaseTable(default_ttl_s=600.0)  # created at admission: it must outlive the prefill
        self.progress: dict[str, LayerProgress] = {}
        buffer = KVBuffer(layout, engine.runner.kv_cache.view(torch.uint8).numpy())
        self.server = TcpServer(buffer=buffer, resolve=self.leases.resolver(time.monotonic),
                                progress=self.progress.get)
        self.uri = ""
        self._count = 0

    async def run(self, mode: str, prompt: list[int], decode: DecodeProcess) -> dict:
        """One prompt: prefill it, have the decode process pull its KV; the run's timings."""
        from engine.sampling_params import SamplingParams

        loop = asyncio.get_running_loop()
        self._count += 1
        request_id = f"{mode}-{self._count}"
        self.engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                                hold_blocks=True)
        progress = LayerProgress(self.layout.num_layers)
        admitted: asyncio.Future = loop.create_future()

        def on_scheduled(output) -> None:  # the engine thread, before any layer runs
            blocks = next(s.block_ids for s in output.seqs if s.request.request_id == request_id)
            loop.call_soon_threadsafe(admitted.set_result, list(blocks))

        on_layer = progress.complete if mode == "layerwise" else None
        step = loop.run_in_executor(self.executor, _timed_step, self.engine, on_scheduled, on_layer)
        block_ids = await admitted
        lease_id = self.leases.create(block_ids, now=time.monotonic()).lease_id
        if mode == "layerwise":
            self.progress[lease_id] = progress
            pulled = asyncio.ensure_future(decode.pull(self.uri, lease_id, block_ids))
            started, ended, deltas = await step
            result = await pulled
        else:
            started, ended, deltas = await step
            result = await decode.pull(self.uri, lease_id, block_ids)
        self._finish(lease_id, deltas)
        return {"mode": mode, "prefill_s": ended - started, "transfer_s": result["seconds"],
                "start_to_kv_s": result["finished"] - started, "after_prefill_s": result["finished"] - ended,
                "num_bytes": result["num_bytes"]}

    def _finish(self, lease_id: str, deltas) -> None:
        self.progress.pop(lease_id, None)
        self.leases.release(lease_id)
        (delta,) = deltas
        assert delta.finished and delta.held_block_ids, "a max_tokens=1 prompt finishes in its prefill step"
        self.engine.release_blocks(list(delta.held_block_ids))


def _timed_step(engine, on_scheduled, on_layer):
    started = time.monotonic()
    deltas = engine.step(on_scheduled=on_scheduled, on_layer=on_layer)
    return started, time.monotonic(), deltas


def _build_engine(args):
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.tiny import ensure_model

    model = args.model or str(ensure_model("small"))
    max_tokens = max(args.tokens)
    block_size = 16
    config = EngineConfig(model=model, device="cpu", block_size=block_size, num_blocks=-(-max_tokens // block_size) + 8,
                          max_num_seqs=1, max_num_batched_tokens=max_tokens + 1, enable_prefix_caching=False,
                          num_threads=args.threads)
    engine = Engine(config)
    mc = engine.model_config
    layout = KVLayout(model_fingerprint=engine.fingerprint, dtype=mc.dtype, block_size=block_size,
                      num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim)
    return engine, layout


async def bench(args) -> dict:
    engine, layout = _build_engine(args)
    if max(args.tokens) >= engine.max_model_len:
        raise SystemExit(f"--tokens must be < max_model_len ({engine.max_model_len})")
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    prompts = {n: rng.integers(0, vocab, n).tolist() for n in args.tokens}
    with ThreadPoolExecutor(1, thread_name_prefix="engine") as executor:
        side = PrefillSide(engine, layout, executor)
        side.uri = await side.server.start("127.0.0.1", 0)
        decode = await DecodeProcess.start(layout, engine.cache_config.num_blocks)
        try:
            print(f"warm-up: {min(args.tokens)} tokens, both modes", flush=True)
            for mode in MODES:
                await side.run(mode, prompts[min(args.tokens)], decode)
            runs = await _measure(side, decode, prompts, args.runs)
        finally:
            await decode.stop()
            await side.server.stop()
    return {"runs": runs, "summary": summarize(runs, args.tokens), "layout": json.loads(layout.to_json()),
            "machine": _machine(), "config": {"tokens": args.tokens, "runs": args.runs, "threads": args.threads,
                                              "model": args.model or "small"}}


async def _measure(side: PrefillSide, decode: DecodeProcess, prompts: dict[int, list[int]], num_runs: int) -> list:
    runs = []
    for num_tokens, prompt in prompts.items():
        for i in range(num_runs):
            order = MODES if i % 2 == 0 else MODES[::-1]
            for mode in order:
                run = await side.run(mode, prompt, decode)
                run["num_tokens"] = num_tokens
                runs.append(run)
                print(f"[{num_tokens} tokens, run {i + 1}/{num_runs}] {mode:9s} prefill {run['prefill_s']:.3f} s, "
                      f"transfer {run['transfer_s'] * 1e3:.1f} ms, prefill start -> KV at D "
                      f"{run['start_to_kv_s']:.3f} s", flush=True)
    return runs


def mode_medians(runs: list[dict], num_tokens: int, keys: tuple[str, ...]) -> dict:
    """``{mode}_{key}``: the median of each key over one prompt length's runs of each mode; and num_bytes."""
    row: dict = {"num_tokens": num_tokens}
    for mode in MODES:
        mine = [r for r in runs if r["num_tokens"] == num_tokens and r["mode"] == mode]
        for key in keys:
            row[f"{mode}_{key}"] = statistics.median(r[key] for r in mine)
        row["num_bytes"] = mine[0]["num_bytes"]
    return row


def summarize(runs: list[dict], sizes: list[int]) -> list[dict]:
    rows = []
    for n in sizes:
        row = mode_medians(runs, n, ("prefill_s", "transfer_s", "start_to_kv_s", "after_prefill_s"))
        row["gain_s"] = row["after_start_to_kv_s"] - row["layerwise_start_to_kv_s"]
        row["gain_pct"] = 100 * row["gain_s"] / row["after_start_to_kv_s"]
        # The same gain without the prefill's run-to-run noise: what is left after the step ends.
        row["tail_gain_s"] = row["after_after_prefill_s"] - row["layerwise_after_prefill_s"]
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    mode_cells = f"{'prefill s':>9} {'xfer ms':>8} {'start->KV s':>11} {'tail ms':>8}"
    print(f"\n{'tokens':>6} {'KV MiB':>7} | {mode_cells} | {mode_cells} | {'gain ms':>8} {'gain':>6} {'tail gain ms':>12}")
    print(f"{'':15}| {'send-after-prefill':^40} | {'layer-wise streaming':^40} |")
    for r in rows:
        cells = []
        for mode in MODES:
            cells.append(f"{r[f'{mode}_prefill_s']:9.3f} {r[f'{mode}_transfer_s'] * 1e3:8.1f} "
                         f"{r[f'{mode}_start_to_kv_s']:11.3f} {r[f'{mode}_after_prefill_s'] * 1e3:8.1f}")
        print(f"{r['num_tokens']:6d} {r['num_bytes'] / 2**20:7.1f} | {cells[0]} | {cells[1]} | "
              f"{r['gain_s'] * 1e3:8.1f} {r['gain_pct']:5.1f}% {r['tail_gain_s'] * 1e3:12.1f}")
    print("medians; tail: prefill step end -> KV at D (negative: the KV landed before the step's sampling "
          "ended); gain: of prefill start -> KV at D; tail gain: of tail (free of prefill noise)")


def _machine() -> dict:
    return {"cpus": os.cpu_count(), "load_avg_1_5_15": os.getloadavg(), "python": platform.python_version(),
            "platform": platform.platform()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.layerwise", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4080], help="prompt lengths")
    parser.add_argument("--runs", type=int, default=5, help="runs per mode and prompt length")
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: the small preset)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the prefill engine")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--decode-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.decode_worker:
        asyncio.run(decode_main())
        return
    print(f"load average before: {os.getloadavg()}", flush=True)
    result = asyncio.run(bench(args))
    print_table(result["summary"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
