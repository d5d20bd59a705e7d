"""Rank 0's side of tensor parallelism: start the other ranks, meet them, drive them step by step, stop them.

Each rank r > 0 is a child process (``python -m engine.parallel.rank SPEC r``; SPEC is a ``RankSpec`` as JSON)
that loads its share of the weights, maps its slice of the KV cache and then runs, in lockstep with rank 0, the
forward pass of every step rank 0 announces. Rank 0 runs the scheduler, the sampler and everything else.

Control: a rank reads fixed-size headers (an op and the step's sizes, five little-endian int64) from its stdin,
a pipe from rank 0; the step itself, ``StepInputs``'s packed int64 buffer, comes by a broadcast over the
group. The pipe is also how a rank learns that rank 0 is gone (end of file: it exits) and one way rank 0 learns
that a rank is gone (a broken pipe); a collective fails at once when a peer's connection closes. Every wait is
bounded: meeting by ``start_timeout_s`` (a rank that exits or reports a load failure ends it at once), each
collective by the group's timeout (``timeout_s``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import struct
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.errors import TensorParallelError
from engine.parallel.shard import TensorParallel
from engine.step_inputs import StepHeader

logger = logging.getLogger(__name__)

OP_STEP = 1
HEADER = struct.Struct("<5q")  # op, tokens, logit rows, sequences, block-table width
_POLL_S = 0.05
_STOP_GRACE_S = 5.0
_MEET_S = 60.0  # the longest forming the groups may take once every rank is ready


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSpec:
    """What a rank process needs to build its share of the engine; its command line carries it as JSON."""

    model: str  # the resolved checkpoint (a folder or a .gguf file)
    dtype: str
    device: str  # cpu, or cuda (rank r uses cuda:r)
    attention_backend: str
    kv_cache_dtype: str
    block_size: int
    num_blocks: int  # the pool's blocks (each rank's cache holds one more: the pad block)
    world_size: int
    timeout_s: float  # each collective
    start_timeout_s: float  # meeting: every rank loaded and in the group
    kv_path: str = ""  # the shared KV file (CPU); "": each rank allocates its own cache on its device
    store_port: int = 0
    num_threads: int | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        return cls(**json.loads(text))


def new_groups(store: dist.Store, tp: TensorParallel, device: torch.device, timeout_s: float) -> tuple:
    """(the group the steps are broadcast over: gloo, host memory; the group the all-reduces run over: NCCL on
    CUDA, else the same gloo group). Private groups over ``store``, never torch's global one."""
    timeout = datetime.timedelta(seconds=timeout_s)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = timeout
    cpu = dist.ProcessGroupGloo(dist.PrefixStore("tp-gloo", store), tp.rank, tp.size, options)
    if device.type != "cuda":
        return cpu, cpu
    nccl_options = dist.ProcessGroupNCCL.Options()  # never run here (no GPU)
    nccl_options._timeout = timeout
    return cpu, dist.ProcessGroupNCCL(dist.PrefixStore("tp-nccl", store), tp.rank, tp.size, nccl_options)


class TPLeader:
    """Rank 0's handle on ranks 1..N-1: ``start`` them (they load while rank 0 does), ``connect`` once rank 0's
    share is loaded, then ``step`` before each forward pass; ``close`` stops them (also when garbage-collected)."""

    def __init__(self, spec: RankSpec, tp: TensorParallel) -> None:
        self.tp, self.timeout_s, self.start_timeout_s = tp, spec.timeout_s, spec.start_timeout_s
        self.cpu_group = None
        self.failed: TensorParallelError | None = None
        self._store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=spec.start_timeout_s),
                                    wait_for_workers=False)
        spec = dataclasses.replace(spec, store_port=self._store.port)
        self.procs = [subprocess.Popen([sys.executable, "-m", "engine.parallel.rank", spec.to_json(), str(rank)],
                                       stdin=subprocess.PIPE) for rank in range(1, spec.world_size)]
        self._finalizer = weakref.finalize(self, _stop, self.procs)
        logger.info("tensor parallelism: started ranks 1..%d (pids %s)", spec.world_size - 1,
                    ", ".join(str(p.pid) for p in self.procs))

    @property
    def size(self) -> int:
        """The ranks in the group, this one included."""
        return self.tp.size

    def connect(self, device: torch.device) -> None:
        """Wait (at most ``start_timeout_s``) for every rank to load its share, then form the group with them."""
        deadline = time.monotonic() + self.start_timeout_s
        for rank, proc in enumerate(self.procs, 1):
            while not self._store.check([f"ready/{rank}"]):
                if self._store.check([f"failed/{rank}"]):
                    raise TensorParallelError(f"tensor-parallel rank {rank} could not start: "
                                              f"{self._store.get(f'failed/{rank}').decode(errors='replace')}")
                if proc.poll() is not None:
                    raise TensorParallelError(f"tensor-parallel rank {rank} exited with code {proc.returncode} "
                                              "before it was ready (its log is above)")
                if time.monotonic() > deadline:
                    raise TensorParallelError(f"tensor-parallel rank {rank} was not ready within "
                                              f"{self.start_timeout_s} s")
                time.sleep(_POLL_S)
        # every rank is loaded and joining: forming the groups takes moments, so a rank that dies now is not
        # waited for the whole start-up timeout
        self._store.set_timeout(datetime.timedelta(seconds=min(self.start_timeout_s, _MEET_S)))
        self.cpu_group, self.tp.group = new_groups(self._store, self.tp, device, self.timeout_s)
        logger.info("tensor parallelism: %d ranks in lockstep", self.tp.size)

    def step(self, host: torch.Tensor, header: StepHeader) -> None:
        """Announce a step to every rank and broadcast its packed inputs (``host`` [total] int64, CPU)."""
        self.check()
        message = HEADER.pack(OP_STEP, header.num_tokens, header.num_rows, header.num_seqs, header.width)
        try:
            for proc in self.procs:
                proc.stdin.write(message)
                proc.stdin.flush()
            self.cpu_group.broadcast(host, 0).wait()
        except (OSError, RuntimeError) as exc:
            raise self.failure(exc) from exc

    def failure(self, exc: BaseException) -> TensorParallelError:
        """The error that ends the engine when a collective or the control pipe failed: which rank is gone if
        one is (a dying rank is reaped for up to a second), else the failure itself. Every later step refuses."""
        if self.failed is None:
            deadline = time.monotonic() + 1.0
            while not (gone := self._gone()) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
            self.failed = TensorParallelError(gone or f"a tensor-parallel collective failed: {exc}")
            logger.error("%s", self.failed)
        return self.failed

    def check(self) -> None:
        """Raise if a rank has exited (the engine loop calls this between steps, too)."""
        if self.failed is None and (gone := self._gone()):
            self.failed = TensorParallelError(gone)
            logger.error("%s", self.failed)
        if self.failed is not None:
            raise self.failed

    def close(self) -> None:
        """Stop every rank: end of file on its pipe, then a kill after a grace period."""
        self._finalizer()

    def _gone(self) -> str | None:
        for rank, proc in enumerate(self.procs, 1):
            if proc.poll() is not None:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.returncode}"
        return None


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            proc.stdin.close()
        except OSError:
            pass
    deadline = time.monotonic() + _STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(_STOP_GRACE_S)
