"""A tensor-parallel rank process (rank r > 0): ``python -m engine.parallel.rank SPEC RANK``.

It loads its share of the weights (``engine/parallel/shard.py``), maps its slice of the KV cache, tells rank 0
it is ready (through the rendezvous store; or why it could not start), joins the group, and then runs the
forward pass of each step rank 0 announces on its stdin (see ``engine/parallel/leader.py``), until end of file.
Its hidden states are dropped: only rank 0 computes logits. It ignores SIGINT (Ctrl-C stops rank 0, which
stops it); it dies with rank 0 in any case, since rank 0's end closes the pipe.
"""

from __future__ import annotations

import datetime
import logging
import signal
import sys
from dataclasses import dataclass
from typing import BinaryIO

import torch
import torch.distributed as dist
from torch import nn

from engine.attention.base import AttentionBackend, ForwardBatch
from engine.attention.select import pick_backend
from engine.engine_setup import keep_freed_memory
from engine.kv_quant import kv_quant
from engine.model.loader import load_model, open_gguf, read_model_config
from engine.model_source import resolve_model
from engine.parallel import kv_memory
from engine.parallel.leader import HEADER, OP_STEP, RankSpec, new_groups
from engine.parallel.shard import TensorParallel
from engine.runner import cache_shape
from engine.step_inputs import StepHeader, unpack

logger = logging.getLogger("engine.parallel.rank")


@dataclass(slots=True)
class RankRuntime:
    tp: TensorParallel
    model: nn.Module
    kv_layers: list[torch.Tensor]  # per layer: [num_blocks + 1, 2, block_size, kv_heads / N, row]
    backend: AttentionBackend
    device: torch.device
    block_size: int
    cpu_group: object = None


def load(spec: RankSpec, rank: int) -> RankRuntime:
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    device = torch.device(f"cuda:{rank}" if spec.device == "cuda" else spec.device)
    if device.type == "cpu":
        keep_freed_memory()
    tp = TensorParallel(rank, spec.world_size)
    source = resolve_model(spec.model)
    gguf = open_gguf(source) if source.is_gguf else None
    config = read_model_config(source, spec.dtype, gguf)
    model, _ = load_model(source, config, device, gguf, tp)
    quant = kv_quant(spec.kv_cache_dtype)
    shape, dtype = cache_shape(config, spec.num_blocks, spec.block_size, quant, spec.world_size)
    if spec.kv_path:
        kv = kv_memory.attach(spec.kv_path, (spec.world_size, *shape), dtype)[rank]
    else:
        kv = torch.zeros(shape, dtype=dtype, device=device)  # never run here (no GPU)
    backend = pick_backend(spec.attention_backend, device, config, quant)
    return RankRuntime(tp, model, list(kv.unbind(0)), backend, device, spec.block_size)


def serve(runtime: RankRuntime, control: BinaryIO) -> None:
    """Run every announced step until rank 0 closes the pipe."""
    while (message := _read_exactly(control, HEADER.size)) is not None:
        op, *sizes = HEADER.unpack(message)
        if op != OP_STEP:
            raise RuntimeError(f"unknown control op {op}")
        header = StepHeader(*sizes)
        host = torch.empty(header.total, dtype=torch.int64)
        runtime.cpu_group.broadcast(host, 0).wait()
        with torch.inference_mode():
            input_ids, _, batch = unpack(host, header, runtime.device, runtime.block_size)
            metadata = runtime.backend.build_metadata(batch)
            runtime.model(input_ids, ForwardBatch(batch.positions, runtime.kv_layers, runtime.backend, metadata))


def _read_exactly(stream: BinaryIO, num_bytes: int) -> bytes | None:
    data = b""
    while len(data) < num_bytes:
        chunk = stream.read(num_bytes - len(data))
        if not chunk:
            return None  # rank 0 is gone or done
        data += chunk
    return data


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec, rank = RankSpec.from_json(argv[0]), int(argv[1])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(name)s %(levelname)s %(message)s")
    timeout = datetime.timedelta(seconds=spec.start_timeout_s)
    store = dist.TCPStore("127.0.0.1", spec.store_port, None, False, timeout)
    try:
        runtime = load(spec, rank)
    except Exception as exc:
        store.set(f"failed/{rank}", f"{type(exc).__name__}: {exc}")
        raise
    store.set(f"ready/{rank}", "1")
    runtime.cpu_group, runtime.tp.group = new_groups(store, runtime.tp, runtime.device, spec.timeout_s)
    logger.info("rank %d of %d ready", rank, spec.world_size)
    try:
        serve(runtime, sys.stdin.buffer)
    except RuntimeError as exc:  # a collective failed: rank 0 or another rank is gone
        logger.error("rank %d stops: %s", rank, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
