"""A quantized KV cache (``--kv-cache-dtype int8|fp8``): 8-bit values with one float32 scale per (token, head).

Each cached row (one token's key or value for one KV head) is stored as ``head_dim`` 8-bit values followed by
their scale's 4 bytes, so the cache is ``[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim + 4]``
uint8: a block stays one contiguous segment per layer, and every transport, the host tier and the staging pool
move the quantized bytes and the scales together without knowing. The scale is the row's absolute maximum over
the format's largest value (127 for int8, 448 for float8 e4m3), so each row uses the format's whole range; a
row is quantized once, when its token is written, and dequantized where attention reads the cache. Against a
16-bit cache a row shrinks from 2 * head_dim bytes to head_dim + 4 (head_dim 64: 128 -> 68 bytes, 1.9x).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_BYTES = 4  # one float32 per row
FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
LAYOUT_DTYPES = {"int8": "int8", "fp8": "float8_e4m3fn"}  # the KVLayout names of the stored values


@dataclass(frozen=True, slots=True)
class KVQuant:
    name: str  # "int8" | "fp8"

    @property
    def storage(self) -> torch.dtype:
        return FORMATS[self.name][0]

    @property
    def layout_dtype(self) -> str:
        return LAYOUT_DTYPES[self.name]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d] float -> [..., d + 4] uint8: the quantized row, then its scale."""
        limit = FORMATS[self.name][1]
        scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / limit  # [..., 1]
        scaled = x.float() / scale
        values = scaled.round().clamp(-limit, limit).to(self.storage) if self.name == "int8" else scaled.to(self.storage)
        return torch.cat((values.view(torch.uint8), scale.view(torch.uint8)), dim=-1)

    def unpack(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[..., d + 4] uint8 -> [..., d] in ``dtype``."""
        head_dim = rows.shape[-1] - SCALE_BYTES
        values = rows[..., :head_dim].view(self.storage).float()  # [..., d]
        scale = rows[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
        return (values * scale).to(dtype)


def kv_quant(name: str) -> KVQuant | None:
    """``--kv-cache-dtype``: "auto" (the model's dtype: None), "int8" or "fp8"."""
    if name == "auto":
        return None
    if name not in FORMATS:
        raise ValueError(f"kv_cache_dtype must be auto|{'|'.join(FORMATS)}, got {name!r}")
    return KVQuant(name)
