"""Starting a tensor-parallel engine's other ranks (rank 0 is the engine's own process), and the combinations
of features refused under tensor parallelism, each with its reason."""

from __future__ import annotations

import os

import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequest
from engine.kv_quant import KVQuant
from engine.model.config import ModelConfig
from engine.parallel import kv_memory
from engine.parallel.leader import RankSpec, TPLeader
from engine.parallel.shard import TensorParallel, check_divisible
from engine.runner import cache_shape


def check_supported(config: EngineConfig, model: ModelConfig, device: torch.device) -> None:
    """Refuse, before anything loads, a degree that does not split the model evenly and the combinations not
    built under tensor parallelism (both CUDA only: CPU runs every feature)."""
    check_divisible(config.tensor_parallel_size, num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                    intermediate_size=model.intermediate_size)
    if device.type != "cuda":
        return
    if not config.enforce_eager:  # never run here (no GPU)
        raise InvalidRequest("tensor parallelism on CUDA runs eagerly: CUDA graphs would have to be captured and "
                             "replayed by every rank in lockstep, which is not built; pass --enforce-eager")
    if config.kv_host_blocks:  # never run here (no GPU)
        raise InvalidRequest("--kv-host-blocks with tensor parallelism needs every rank's cache in one process's "
                             "reach (shared host memory: CPU only); on CUDA each rank's cache is on its own GPU")


def launch(config: EngineConfig, model_path: str, model: ModelConfig, num_blocks: int, quant: KVQuant | None,
           device: torch.device, tp: TensorParallel) -> tuple[TPLeader, torch.Tensor | None]:
    """Start ranks 1..N-1 and wait (bounded) until they hold their shares: (the leader, every rank's cache
    ``[N, *cache_shape]`` in shared memory on CPU, or None on CUDA). Rank 0's model is already loaded."""
    shape, dtype = cache_shape(model, num_blocks, config.block_size, quant, tp.size)
    kv_ranks, path = kv_memory.create((tp.size, *shape), dtype) if device.type == "cpu" else (None, None)
    spec = RankSpec(
        model=model_path, dtype=model.dtype, device=device.type, attention_backend=config.attention_backend,
        kv_cache_dtype=config.kv_cache_dtype, block_size=config.block_size, num_blocks=num_blocks,
        world_size=tp.size, timeout_s=config.tp_timeout_s,
        start_timeout_s=config.tp_start_timeout_s, kv_path=str(path or ""),
        num_threads=config.num_threads or max(1, (os.cpu_count() or 1) // tp.size),
    )
    leader = TPLeader(spec, tp)
    try:
        leader.connect(device)
    except BaseException:
        leader.close()
        raise
    finally:
        kv_memory.unlink(path)  # every rank has mapped it (or failed): the memory lives as long as the mappings
    return leader, kv_ranks
