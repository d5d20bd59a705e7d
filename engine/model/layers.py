"""Building blocks shared by the Llama family: linear layers, RMSNorm, rotary embedding, gated MLP.

Each matches its Hugging Face counterpart's arithmetic so greedy outputs agree token for token (a linear layer's
product may round differently in its last bits: the parity suite holds it to that).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import RopeConfig
from engine.parallel.shard import TensorParallel

# On the CPU a product by a weight takes one of two forms, by its rows (tokens in the step). One or two rows: SPLIT
# batched products of slices of the weight's output features (torch's own product of one row runs a single thread's
# GEMV, 2.4x slower than the weights' memory traffic allows; SmolLM2's 121 products per token, weights cold: 44 ->
# 13 ms at one row). More rows: oneDNN's product on the weight packed once, at load, into its blocked layout
# (``pack_linears``): 41 -> 24 ms at 8 rows (the slices), 110 -> 50 ms at 32, 3.4 -> 2.9 s at 2,048
# (``python -m bench linear-forms``; docs/benchmarks.md). The packed copy costs the weights' size again in memory.
# Without a packed weight (a torch without oneDNN) the slices serve every row count.
SPLIT = 8
SLICED_MAX_ROWS = 2
PACK_ROWS = 32  # the batch size oneDNN is told to pack for (its layout serves every row count)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [T, in], ``weight`` [out, in], in the form fastest here (above);
    ``packed``: ``weight`` in oneDNN's layout (``pack_weight``). The slices' [T, out] is a view in column-major
    order for T > 1 (a copy to row-major would cost 3-4% of a batch's time; the model's ops take it as it is)."""
    rows, out = x.shape[0], weight.shape[0]
    if x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, weight, bias)
    if packed is not None and rows > SLICED_MAX_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # [T, out]
    if out % SPLIT or not weight.is_contiguous():
        return F.linear(x, weight, bias)
    slices = weight.view(SPLIT, out // SPLIT, weight.shape[1])  # [S, out / S, in]
    y = torch.bmm(slices, x.T.unsqueeze(0).expand(SPLIT, -1, -1))  # [S, out / S, T]
    y = y.view(1, out) if rows == 1 else y.permute(2, 0, 1).reshape(rows, out)  # [T, out], strides (1, T)
    return y if bias is None else y + bias


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [out, in] in oneDNN's blocked layout for ``linear``, or None where that product is not available
    (not the CPU, not float32, a torch built without oneDNN)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def pack_linears(model: nn.Module) -> int:
    """Pack every linear weight of ``model`` for ``linear`` (after its weights are loaded; a weight changed later
    must be packed again); the number packed."""
    count = 0
    for module in model.modules():
        if isinstance(module, (Linear, RowParallelLinear)):
            module.packed = pack_weight(module.weight)
            count += module.packed is not None
    return count


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose product is ``linear``'s."""

    packed: torch.Tensor | None = None  # set by ``pack_linears``
    int4: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None  # ``weight_quant.quantize_linears``

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is not None:
            return self.int4(x, self.bias)
        return linear(x, self.weight, self.bias, self.packed)


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

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions`` [T], [T, 1, d] each: looked up once per forward pass, used by every layer."""
        return self.cos[positions][:, None, :].to(dtype), self.sin[positions][:, None, :].to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x`` [T, heads, d] rotated (any heads: q's, k's, or both side by side)."""
        cos, sin = tables
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split across tensor-parallel ranks: each rank multiplies its
    slice (``weight`` [out, in / N]), an all-reduce sums the partial outputs, then the bias is added once."""

    packed: torch.Tensor | None = None  # set by ``pack_linears``

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in / N] -> [T, out]
        y = self.tp.all_reduce(linear(x, self.weight, packed=self.packed).contiguous())  # [T, out]: the ranks' sum
        return y if self.bias is None else y + self.bias


def row_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel | None) -> nn.Module:
    """``in_features`` is this rank's share; one rank: a plain ``nn.Linear`` (the arithmetic of before)."""
    if tp is None or tp.size == 1:
        return Linear(in_features, out_features, bias=bias)
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
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = row_linear(intermediate, hidden, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)  # [T, inter] each
        if self.act == "silu":
            gate = F.silu(gate)
        else:
            gate = F.gelu(gate, approximate="tanh" if self.act == "gelu_pytorch_tanh" else "none")
        return self.down_proj(gate * up)
