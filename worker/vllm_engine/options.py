"""The vLLM engine's settings (``worker.vllm_engine.cli.vllm_options`` makes them from the worker's flags)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class VLLMOptions:
    model: str  # a Hugging Face folder
    index_block_size: int = 16  # Baton's index granularity (the router hashes prompts in these blocks)
    block_size: int = 128  # vLLM's own KV block (its CPU attention takes multiples of 32)
    dtype: str = "float32"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    num_blocks: int | None = None  # in index blocks (as Baton's --num-blocks); None: vLLM sizes the cache
    kv_cache_gib: float = 1.0  # VLLM_CPU_KVCACHE_SPACE
    cpus: str | None = None  # VLLM_CPU_OMP_THREADS_BIND (e.g. "0", "0-1"); None: vLLM's default
    lease_ttl_s: float = 30.0  # how long a prefill's blocks wait for their reader (NixlConnector kv_lease_duration)
    side_channel_host: str = "127.0.0.1"  # where decoders reach this worker's NIXL handshake
    enforce_eager: bool = True
    max_num_waiting: int | None = None
    kv_connector: str = "nixl"  # nixl (vLLM's NixlConnector) | baton (worker.vllm_engine.connector)
    kv_transports: str = "cma,tcp"  # --vllm-kv-connector baton: Baton's transports, in order of preference
    nixl_progress_delay_us: int = 1000  # NIXL's progress thread's pause between polls; 0: none (plugin.py)
