"""How an engine is set up from its config: device, dtype, model fingerprint, cache size (the attention backend:
``engine.attention.select``).
Plain functions of the config and the model (the ``Engine`` constructor calls them once)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequest
from engine.kv_quant import SCALE_BYTES, KVQuant
from engine.model.config import ModelConfig, RopeConfig
from kv_transfer.hashing import model_fingerprint

logger = logging.getLogger(__name__)

_CPU_KV_CACHE_BYTES = 1 << 30
# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEPT_FREE_BYTES = 1 << 30
_MMAP_ABOVE_BYTES = 32 << 20  # glibc's largest mmap threshold


def keep_freed_memory() -> bool:
    """glibc's malloc keeps what the engine frees for its next step instead of handing it back: allocations up to
    32 MiB come from the heap (glibc's default serves those above 128 KiB from a fresh mmap until its moving
    threshold catches up), and up to 1 GiB free at the heap's top is not trimmed. Otherwise a step's large
    temporaries (a chunk's MLP activations, a batch's gathered KV) are new pages faulted in step after step:
    SmolLM2's prefill of 8 prompts of 512 tokens 665 -> 745 tokens/s, TTFT at 4,096 tokens 10.9 -> 9.9 s, batch 32
    +5% (vLLM's CPU build preloads tcmalloc for the same reason). Larger allocations still get their own mmap
    (none in a step of the bench's shapes; in the heap their holes would fragment it). Process-wide; False where
    the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_ABOVE_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEPT_FREE_BYTES))


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> str | None:
    if dtype != "auto":
        if dtype not in ("float32", "float16", "bfloat16"):
            raise InvalidRequest(f"dtype must be auto|float32|float16|bfloat16, got {dtype!r}")
        return dtype
    return "bfloat16" if device.type == "cuda" else "float32"  # bf16 on a GPU, whatever the checkpoint holds


def fingerprint(config: ModelConfig, weights_id: str, quant: KVQuant | None = None, weights: str = "auto") -> bytes:
    """The model, its KV dtype and its weights' format (a quantized cache's blocks, or the KV of 4-bit weights, are
    not interchangeable with full-precision ones)."""
    dtype = config.dtype if quant is None else f"{config.dtype}+kv-{quant.name}"
    dtype = dtype if weights == "auto" else f"{dtype}+w-{weights}"
    return model_fingerprint(
        architecture=config.architecture, hidden_size=config.hidden_size, num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype,
        vocab_size=config.vocab_size, rope=rope_text(config.rope), weights_id=weights_id,
    )


def rope_text(rope: RopeConfig) -> str:
    """The RoPE configuration as the fingerprint's canonical text (K is cached after RoPE)."""
    return ":".join(str(getattr(rope, name)) for name in rope.__slots__)


def default_num_blocks(config: EngineConfig, model: ModelConfig, max_model_len: int, device: torch.device,
                        quant: KVQuant | None = None) -> int:
    row_bytes = (model.head_dim * torch.empty((), dtype=getattr(torch, model.dtype)).element_size() if quant is None
                 else model.head_dim + SCALE_BYTES)
    kv_heads = model.num_kv_heads // config.tensor_parallel_size  # one rank's (the budget is per rank, per device)
    bytes_per_block = 2 * model.num_layers * config.block_size * kv_heads * row_bytes
    if config.kv_cache_memory_bytes:
        budget = config.kv_cache_memory_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - (1 - config.gpu_memory_utilization) * total)
    else:
        budget = _CPU_KV_CACHE_BYTES
    useful = config.max_num_seqs * -(-max_model_len // config.block_size)  # more than this never fills
    num_blocks = min(budget // bytes_per_block, useful)
    if num_blocks < -(-max_model_len // config.block_size):
        logger.warning("KV cache holds only %d blocks; one request may not reach max_model_len", num_blocks)
    return max(int(num_blocks), 1)
