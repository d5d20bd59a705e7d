"""Engine configuration: one frozen dataclass per component (STYLE.md rule 3)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import InitVar, dataclass

from engine.core.config_dicts import check_keys
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
    # speculative decoding (n-gram or draft-model drafts); None: off. vLLM's dict is made a SpeculativeConfig
    speculative_config: SpeculativeConfig | Mapping | None = None
    preemption_mode: str = "recompute"  # recompute | swap (needs kv_host_blocks: the swap space)
    # CUDA graphs for decode steps of up to max(cuda_graph_sizes) sequences (capped by max_num_seqs); CUDA only
    cuda_graph_sizes: tuple[int, ...] = DEFAULT_GRAPH_SIZES
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly
    # vLLM's compilation_config (an int mode or a dict), read into cuda_graph_sizes and enforce_eager, not kept
    compilation_config: InitVar[int | Mapping | None] = None
    kv_transfer_config: InitVar[Mapping | None] = None  # vLLM's; refused: the platform disaggregates, not LLM
    # tensor parallelism: the model's heads and MLP split across this many rank processes (engine/parallel/)
    tensor_parallel_size: int = 1
    tp_timeout_s: float = 300.0  # the longest a rank waits for another in a step (each collective)
    tp_start_timeout_s: float = 600.0  # the longest rank 0 waits for the others to load their shares

    def __post_init__(self, compilation_config: int | Mapping | None, kv_transfer_config: Mapping | None) -> None:
        self._read_vllm_configs(compilation_config, kv_transfer_config)
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

    def _read_vllm_configs(self, compilation_config: int | Mapping | None, kv_transfer_config: Mapping | None) -> None:
        """vLLM's nested configs, given as vLLM users pass them (dicts), made Baton's fields or refused."""
        if kv_transfer_config is not None:
            raise InvalidRequest(KV_TRANSFER_REFUSED)
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", _speculative(self.speculative_config))
        if compilation_config is not None:
            sizes, eager = _compilation(compilation_config, self.cuda_graph_sizes, self.enforce_eager)
            object.__setattr__(self, "cuda_graph_sizes", sizes)
            object.__setattr__(self, "enforce_eager", eager)


KV_TRANSFER_REFUSED = (
    "kv_transfer_config: Baton's offline engine (LLM, EngineConfig) does not disaggregate prefill and decode; "
    "Baton's platform does: `baton up` (a router, prefill and decode workers on one machine), or `baton prefill` "
    "and `baton decode` workers with --kv-transport (see docs/operations.md)")
# vLLM's cudagraph_mode values Baton honours: no graphs, or full graphs of decode-only steps (what it captures)
CUDAGRAPH_MODES = {"NONE": True, "FULL_DECODE_ONLY": False}  # name -> enforce_eager


def _speculative(value: object) -> SpeculativeConfig:
    if isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, Mapping):
        return SpeculativeConfig.from_dict(value)
    raise InvalidRequest(f"speculative_config must be a dict or a SpeculativeConfig, got a {type(value).__name__}")


def _compilation(value: object, sizes: tuple[int, ...], eager: bool) -> tuple[tuple[int, ...], bool]:
    """(cuda_graph_sizes, enforce_eager) from vLLM's compilation_config: an int (the compilation mode) or a dict
    with mode (or level, its old name), cudagraph_capture_sizes, max_cudagraph_capture_size, cudagraph_mode."""
    where = "compilation_config"
    raw = {"mode": value} if _is_int(value) else value
    if not isinstance(raw, Mapping):
        raise InvalidRequest(f"{where} must be an int (the compilation mode) or a dict, got a {type(value).__name__}")
    check_keys(where, raw, ("mode", "level", "cudagraph_capture_sizes", "max_cudagraph_capture_size",
                            "cudagraph_mode"))
    for key in ("mode", "level"):  # level: vLLM's old name of mode
        if raw.get(key) is not None and not _is_int(raw[key]):
            raise InvalidRequest(f"{where}: {key} must be an int (0: no compilation), got {raw[key]!r}")
        if raw.get(key):
            raise InvalidRequest(f"{where}: {key} {raw[key]!r} compiles the model (torch.compile), which Baton's "
                                 "engine does not: it runs eagerly, with CUDA graphs for decode steps "
                                 "(cuda_graph_sizes, enforce_eager); pass 0 or leave it out")
    found = _capture_sizes(raw, where)
    if found is not None and sizes not in (DEFAULT_GRAPH_SIZES, found):
        raise InvalidRequest(f"{where} captures {list(found)}, cuda_graph_sizes {list(sizes)}: give the sizes once")
    return found or sizes, _cudagraph_mode(raw.get("cudagraph_mode"), eager, where)


def _capture_sizes(raw: Mapping, where: str) -> tuple[int, ...] | None:
    sizes, largest = raw.get("cudagraph_capture_sizes"), raw.get("max_cudagraph_capture_size")
    if sizes is not None and (isinstance(sizes, (str, bytes)) or not isinstance(sizes, (list, tuple))
                              or not sizes or not all(_is_int(s) and s >= 1 for s in sizes)):
        raise InvalidRequest(f"{where}: cudagraph_capture_sizes must be a list of positive batch sizes, got "
                             f"{sizes!r} (enforce_eager=True runs without CUDA graphs)")
    if largest is not None and not (_is_int(largest) and largest >= 1):
        raise InvalidRequest(f"{where}: max_cudagraph_capture_size must be a positive batch size, got {largest!r}")
    if largest is None:
        return None if sizes is None else tuple(sizes)
    if sizes is not None:
        if max(sizes) != largest:
            raise InvalidRequest(f"{where}: max_cudagraph_capture_size {largest} is not the largest of "
                                 f"cudagraph_capture_sizes {list(sizes)}")
        return tuple(sizes)
    return tuple(s for s in DEFAULT_GRAPH_SIZES if s < largest) + (largest,)


def _cudagraph_mode(mode: object, eager: bool, where: str) -> bool:
    """enforce_eager given vLLM's cudagraph_mode (a name, or 0 for NONE)."""
    if mode is None:
        return eager
    name = "NONE" if mode == 0 and _is_int(mode) else str(mode).upper()
    if name not in CUDAGRAPH_MODES:
        raise InvalidRequest(f"{where}: cudagraph_mode {mode!r} is not one Baton captures (accepted: NONE, no "
                             "graphs; FULL_DECODE_ONLY, full CUDA graphs of decode-only steps)")
    if eager and not CUDAGRAPH_MODES[name]:
        raise InvalidRequest(f"{where}: cudagraph_mode {mode!r} asks for CUDA graphs, enforce_eager=True for none")
    return eager or CUDAGRAPH_MODES[name]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
