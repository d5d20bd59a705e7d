"""Building blocks shared by the Llama family: RMSNorm, rotary embedding, gated MLP.

Each matches its Hugging Face counterpart's arithmetic so greedy outputs agree token for token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import RopeConfig
from engine.parallel.shard import TensorParallel


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size]
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with llama3 or linear scaling as configured."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, looked up per token."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.rope = head_dim, max_positions, rope
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        if not self.cos.is_meta:
            self.reset_tables(self.cos.device)

    def reset_tables(self, device: torch.device) -> None:
        """(Re)compute the tables in float32 on ``device`` (after a meta-device construction)."""
        inv_freq = rope_inv_freq(self.head_dim, self.rope)  # [d/2]
        positions = torch.arange(self.max_positions, dtype=torch.float32)[:, None]  # [P, 1]
        freqs = positions * inv_freq[None, :]  # [P, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, d]
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; q [T, h, d]; k [T, kvh, d]
        cos = self.cos[positions][:, None, :].to(q.dtype)  # [T, 1, d]
        sin = self.sin[positions][:, None, :].to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split across tensor-parallel ranks: each rank multiplies its
    slice (``weight`` [out, in / N]), an all-reduce sums the partial outputs, then the bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in / N] -> [T, out]
        y = self.tp.all_reduce(F.linear(x, self.weight))  # [T, out]: the sum of every rank's partial product
        return y if self.bias is None else y + self.bias


def row_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel | None) -> nn.Module:
    """``in_features`` is this rank's share; one rank: a plain ``nn.Linear`` (the arithmetic of before)."""
    if tp is None or tp.size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate and up fused into one GEMM (``gate_up_proj``). Under tensor parallelism
    gate/up are column-parallel (this rank's ``intermediate`` columns) and down is row-parallel."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, act: str, tp: TensorParallel | None = None) -> None:
        super().__init__()
        if act not in ("silu", "gelu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported hidden_act {act!r}")
        intermediate //= tp.size if tp else 1  # this rank's columns
        self.intermediate = intermediate
        self.act = act
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = row_linear(intermediate, hidden, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)  # [T, inter] each
        if self.act == "silu":
            gate = F.silu(gate)
        else:
            gate = F.gelu(gate, approximate="tanh" if self.act == "gelu_pytorch_tanh" else "none")
        return self.down_proj(gate * up)
