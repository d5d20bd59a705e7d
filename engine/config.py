"""Engine configuration: one frozen dataclass per component (STYLE.md rule 3)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.speculation import SpeculativeConfig
from engine.errors import InvalidRequest

DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # decode batch sizes captured as CUDA graphs


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfig:
    """The paged KV cache: block geometry and how many blocks exist."""

    block_size: int = 16
    num_blocks: int
    enable_prefix_caching: bool = True
    num_host_blocks: int = 0  # the host tier below the pool (0: none)
    num_store_slots: int = 0  # the store tier's write slots (0: no store tier)
    store_write_through: bool = False  # every committed block goes to the store (else: what leaves the worker)


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """Iteration-level batching limits."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int
    # Chunked prefill: a prompt longer than the step's leftover budget is split across steps.
    enable_chunked_prefill: bool = True
    # What a preempted request loses: "recompute" frees its blocks (full ones stay in the prefix cache);
    # "swap" copies them all to the host tier first and back when it resumes (falls back to recompute when the
    # host tier has no room)
    preemption_mode: str = "recompute"
    # Every layer attends within this window (Mistral): a running request's blocks wholly before it are freed
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """What a user chooses; the engine derives the component configs from it."""

    model: str | None = None  # a HF folder, a .gguf file, or a name (tiny, small, smollm2); None: tiny
    dtype: str = "auto"  # auto: bfloat16 on CUDA (float16 for a GPU without bf16: pass it), float32 on CPU
    device: str = "auto"  # auto: cuda when available, else cpu
    attention_backend: str = "auto"  # auto | torch | flashinfer
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from kv_cache_memory_bytes / gpu_memory_utilization
    kv_cache_memory_bytes: int | None = None  # CPU default: 1 GiB
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    max_num_waiting: int | None = None  # admission control: more queued requests are refused (None: unbounded)
    num_threads: int | None = None  # torch intra-op threads on CPU; None: torch's default
    kv_host_blocks: int = 0  # host-memory tier below the KV pool, in blocks (pinned on CUDA); 0: none
    # the shared store tier's host slots, for writes and as many for reads (0: no store tier; the shell connects)
    kv_store_buffer_blocks: int = 0
    kv_store_write: str = "evict"  # evict: blocks leaving the worker go to the store; through: every committed one
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | int8 | fp8: 8-bit values + a scale per row
    weights: str = "auto"  # auto (the model's dtype) | int4: linear weights in 4 bits (engine/model/weight_quant.py)
    speculative_config: SpeculativeConfig | None = None  # speculative decoding (n-gram drafts); None: off
    preemption_mode: str = "recompute"  # recompute | swap (needs kv_host_blocks: the swap space)
    # CUDA graphs for decode steps of up to max(cuda_graph_sizes) sequences (capped by max_num_seqs); CUDA only
    cuda_graph_sizes: tuple[int, ...] = DEFAULT_GRAPH_SIZES
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly
    # tensor parallelism: the model's heads and MLP split across this many rank processes (engine/parallel/)
    tensor_parallel_size: int = 1
    tp_timeout_s: float = 300.0  # the longest a rank waits for another in a step (each collective)
    tp_start_timeout_s: float = 600.0  # the longest rank 0 waits for the others to load their shares

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise InvalidRequest(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise InvalidRequest(f"preemption_mode must be recompute|swap, got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and not self.kv_host_blocks:
            raise InvalidRequest("preemption_mode=swap swaps into the host tier: give it kv_host_blocks")
        if self.kv_store_buffer_blocks < 0:
            raise InvalidRequest(f"kv_store_buffer_blocks must be >= 0, got {self.kv_store_buffer_blocks}")
        if self.kv_store_write not in ("evict", "through"):
            raise InvalidRequest(f"kv_store_write must be evict|through, got {self.kv_store_write!r}")
        if self.kv_host_blocks < 0:
            raise InvalidRequest(f"kv_host_blocks must be >= 0, got {self.kv_host_blocks}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise InvalidRequest(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1:
            raise InvalidRequest(f"cuda_graph_sizes must be positive batch sizes, got {list(self.cuda_graph_sizes)}")
        if self.kv_cache_dtype not in ("auto", "int8", "fp8"):
            raise InvalidRequest(f"kv_cache_dtype must be auto|int8|fp8, got {self.kv_cache_dtype!r}")
        if min(self.tp_timeout_s, self.tp_start_timeout_s) <= 0:
            raise InvalidRequest(f"tp_timeout_s and tp_start_timeout_s must be > 0, got {self.tp_timeout_s}, "
                                 f"{self.tp_start_timeout_s}")
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            raise InvalidRequest(f"attention_backend must be auto|torch|flashinfer, got {self.attention_backend!r}")
