"""What the simulator models a worker on: GPU kinds, links between workers, model shapes (presets from public
specs; every figure is a field, so a preset can be replaced by a measured one).

GPUs (dense BF16 tensor FLOP/s, HBM bandwidth, HBM capacity; NVIDIA's data sheets, SXM parts):
H100 989 TFLOP/s, 3.35 TB/s, 80 GB; H200 989 TFLOP/s, 4.8 TB/s, 141 GB; B200 2,250 TFLOP/s, 8 TB/s, 180 GB.
Links (one direction, per GPU): NVLink 4 900 GB/s both ways -> 450; RDMA at 400 Gb/s (NDR InfiniBand / a
ConnectX-7 per GPU) -> 50 GB/s; TCP over 100 GbE -> 12.5 GB/s. Models: the shapes of SmolLM2-135M, Llama-3-8B
and Llama-3-70B (Llama 3.1's 131,072-token context), bf16. A worker is ``tp`` GPUs (tensor parallel): FLOP/s,
bandwidth and memory scale by ``tp`` (ideal; its collectives are not modelled). For the calibration against this
machine (``baton simulate check``): the ``tiny`` model ``baton model tiny`` builds (float32) and a ``loopback`` link
(Baton's tcp transport between two processes here: raw TCP's 2.8 GB/s, NOTES.md; the check replaces its latency
with the one it measures), with the KV pool given in blocks (a worker's ``--num-blocks``), not left by a GPU.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kv_transfer.layout import KVLayout


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuSpec:
    name: str
    bf16_tflops: float  # dense, peak
    hbm_tb_per_s: float
    memory_gb: float


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSpec:
    name: str
    gb_per_s: float  # one direction, what one pull can get
    latency_s: float  # per transfer (connection setup, first byte)

    def transfer_s(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / (self.gb_per_s * 1e9) if num_bytes > 0 else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    max_model_len: int
    dtype: str = "bfloat16"
    dtype_bytes: int = 2

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer's matmuls: q, k, v, o and the gated MLP (norms left out)."""
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q_dim + 2 * kv_dim) + q_dim * self.hidden_size
        return attention + 3 * self.hidden_size * self.intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        embeddings = self.lm_head_params * (1 if self.tied_embeddings else 2)
        return self.num_layers * self.layer_params + embeddings

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def fingerprint(self) -> bytes:
        """Stands in for the model fingerprint (the simulator loads no weights): a digest of the preset."""
        return hashlib.blake2b(f"baton-sim|{self}".encode(), digest_size=16).digest()

    def kv_layout(self, block_size: int) -> KVLayout:
        return KVLayout(model_fingerprint=self.fingerprint, dtype=self.dtype, block_size=block_size,
                        num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)


GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec(name="H100", bf16_tflops=989.0, hbm_tb_per_s=3.35, memory_gb=80.0),
    GpuSpec(name="H200", bf16_tflops=989.0, hbm_tb_per_s=4.8, memory_gb=141.0),
    GpuSpec(name="B200", bf16_tflops=2250.0, hbm_tb_per_s=8.0, memory_gb=180.0),
)}
LINKS: dict[str, LinkSpec] = {k.name: k for k in (
    LinkSpec(name="nvlink", gb_per_s=450.0, latency_s=5e-6),
    LinkSpec(name="rdma", gb_per_s=50.0, latency_s=20e-6),
    LinkSpec(name="tcp", gb_per_s=12.5, latency_s=200e-6),
    LinkSpec(name="loopback", gb_per_s=2.8, latency_s=1e-3),
)}
MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec(name="smollm2-135m", num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
              intermediate_size=1536, vocab_size=49152, tied_embeddings=True, max_model_len=8192),
    ModelSpec(name="llama-3-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
              intermediate_size=14336, vocab_size=128256, tied_embeddings=False, max_model_len=131072),
    ModelSpec(name="llama-3-70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, head_dim=128,
              intermediate_size=28672, vocab_size=128256, tied_embeddings=False, max_model_len=131072),
    ModelSpec(name="tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
              intermediate_size=192, vocab_size=4096, tied_embeddings=False, max_model_len=2048, dtype="float32",
              dtype_bytes=4),
)}


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerShape:
    """One modelled worker: ``tp`` GPUs of a kind serving a model, and the KV pool left beside the weights."""

    gpu: GpuSpec
    model: ModelSpec
    tp: int
    block_size: int
    memory_utilization: float = 0.9  # of HBM the engine may use (vLLM's gpu_memory_utilization)
    kv_blocks: int | None = None  # the KV pool in blocks when set (a real worker's --num-blocks), else what HBM leaves

    def __post_init__(self) -> None:
        if self.tp < 1 or self.block_size < 1 or not 0 < self.memory_utilization <= 1:
            raise ValueError(f"WorkerShape: tp and block_size >= 1, memory_utilization in (0, 1]: {self}")
        if self.num_blocks < 1:
            raise ValueError(f"{self.model.name} ({self.model.weight_bytes / 1e9:.0f} GB of weights) leaves no KV "
                             f"pool on {self.tp} x {self.gpu.name}: raise --tp")

    @property
    def layout(self) -> KVLayout:
        return self.model.kv_layout(self.block_size)

    @property
    def kv_pool_bytes(self) -> int:
        usable = self.gpu.memory_gb * 1e9 * self.tp * self.memory_utilization
        return max(int(usable) - self.model.weight_bytes, 0)

    @property
    def num_blocks(self) -> int:
        if self.kv_blocks is not None:
            return self.kv_blocks
        return self.kv_pool_bytes // self.layout.bytes_per_block


def default_tp(gpu: GpuSpec, model: ModelSpec, *, weights_share: float = 0.7) -> int:
    """The fewest GPUs (a power of two, at most 8) whose memory holds the weights in ``weights_share`` of it."""
    for tp in (1, 2, 4, 8):
        if model.weight_bytes <= weights_share * gpu.memory_gb * 1e9 * tp:
            return tp
    raise ValueError(f"{model.name} does not fit 8 x {gpu.name}")


def workers_per_host(gpus_per_host: int, tp: int) -> int:
    """Workers of ``tp`` GPUs on one host (at least one: a worker wider than a host spans hosts)."""
    return max(1, gpus_per_host // tp)
