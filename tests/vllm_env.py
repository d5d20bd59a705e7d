"""What the tests that run vLLM need: vLLM's own environment (``make vllm`` builds ``.venv-vllm``; or
``$BATON_VLLM_PYTHON``), vLLM alone as the reference (its offline ``LLM``, greedy, in a process of that environment),
and worker processes started in their own process group (a vLLM worker's engine runs in child processes of its
own; the group is stopped whole), and a way to slow those engine processes down so that a test can act mid-stream on
any machine."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_SCRIPT = '''
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    job = json.load(sys.stdin)
    llm = LLM(model=job["model"], dtype="float32", enforce_eager=True, max_model_len=job["max_model_len"],
              max_num_seqs=8, enable_prefix_caching=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=job["ignore_eos"]) for n in job["max_tokens"]]
    outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
    print("REFERENCE " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
'''


def vllm_python() -> str | None:
    python = os.environ.get("BATON_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    return python if Path(python).is_file() else None


requires_vllm = pytest.mark.skipif(vllm_python() is None, reason="vLLM's environment is not built (`make vllm`)")


def vllm_alone(model: Path, prompts: list[list[int]], max_tokens: int | list[int], *, cpus: str = "0-1",
               max_model_len: int = 2048, ignore_eos: bool = True, timeout_s: float = 300) -> list[list[int]]:
    """vLLM's offline ``LLM`` on ``model``: each prompt's greedy continuation (no prefix cache, no other engine)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=cpus, HF_HUB_OFFLINE="1")
    per_prompt = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    job = {"model": str(model), "prompts": prompts, "max_tokens": per_prompt, "max_model_len": max_model_len,
           "ignore_eos": ignore_eos}
    done = subprocess.run([vllm_python(), "-c", REFERENCE_SCRIPT], input=json.dumps(job), capture_output=True,
                          check=False, text=True, timeout=timeout_s, cwd=ROOT, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REFERENCE ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM's reference run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("REFERENCE "))


def stop_group(popen: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM a process started with ``start_new_session`` and everything in its group; SIGKILL what is left."""
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(popen.pid, sig)
        except ProcessLookupError:
            return
        try:
            popen.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        try:  # the leader is gone; its children may linger a moment
            os.killpg(popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@contextlib.contextmanager
def throttled(pids: list[int], *, run_s: float = 0.002, stop_s: float = 0.02) -> Iterator[Callable[[], None]]:
    """Slow ``pids`` about tenfold (SIGSTOP for ``stop_s``, SIGCONT for ``run_s``, over and over) until the block
    ends or the function it gives is called, then let them run: a vLLM engine that could decode a whole stream
    between two looks of a test (a fast machine, or its worker's event loop busy relaying) decodes it over seconds,
    and the worker itself, not slowed, answers at once."""
    if not pids:  # slowing nothing would let the test race the machine's speed again, unseen
        raise ValueError("no processes to throttle")
    done = threading.Event()

    def cycle() -> None:
        while not done.is_set():
            signal_all(pids, signal.SIGSTOP)
            time.sleep(stop_s)
            signal_all(pids, signal.SIGCONT)
            time.sleep(run_s)

    thread = threading.Thread(target=cycle, name="throttle", daemon=True)

    def release() -> None:
        done.set()
        thread.join()
        signal_all(pids, signal.SIGCONT)

    thread.start()
    try:
        yield release
    finally:
        release()
