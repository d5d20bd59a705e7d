"""Linear weights kept in 4 bits (``EngineConfig.weights = "int4"``, ``--weights int4``): an option, never a silent
change of results.

Each weight is quantized per output row in groups of ``GROUP`` input features, asymmetrically (16 levels between
the group's min and max, GGUF's Q4_1 scheme), and multiplied by torch's int4 CPU kernel, which takes bfloat16
activations: a layer's input is rounded to bfloat16 and its output comes back in the model's dtype. On this machine
that makes SmolLM2's 121 products per token 2.9x faster at one row (14 -> 5 ms, weights cold) and about even at 32
rows (``python -m bench linear-forms``; agreement with float32 weights: ``python -m bench weight-agreement``).
The embedding, norms and the KV cache keep the model's dtype. CPU only, one rank (the kernel's packing is the
CPU's; a row-parallel shard would be quantized on its own groups).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.errors import InvalidRequest
from engine.model.layers import Linear

WEIGHT_FORMATS = ("auto", "int4")
GROUP = 32  # input features per scale and zero point
_INNER_K_TILES = 2  # the CPU kernel's packing parameter (its layout; any of 2, 4, 8)


class Int4Weight:
    """One weight [out, in] quantized and packed for ``torch.ops.aten._weight_int4pack_mm_for_cpu``."""

    def __init__(self, weight: torch.Tensor) -> None:
        out_features, in_features = weight.shape
        groups = weight.detach().float().view(out_features, in_features // GROUP, GROUP)  # [out, in / G, G]
        low, high = groups.amin(-1), groups.amax(-1)  # [out, in / G]
        scale = ((high - low) / 15).clamp(min=1e-10)
        levels = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15)  # [out, in / G, G] in 0..15
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            levels.to(torch.int32).view(out_features, in_features), _INNER_K_TILES)
        # the kernel's convention: w = (q - 8) * scale + zero, so zero = low + 8 * scale; [in / G, out, 2]
        self.scales_and_zeros = torch.stack((scale, low + 8 * scale), -1).transpose(0, 1).contiguous().bfloat16()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [T, in] -> [T, out] in ``x``'s dtype."""
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP,
                                                       self.scales_and_zeros).to(x.dtype)
        return y if bias is None else y + bias


def check_weight_format(name: str, device: torch.device, tensor_parallel_size: int) -> None:
    if name not in WEIGHT_FORMATS:
        raise InvalidRequest(f"weights must be {'|'.join(WEIGHT_FORMATS)}, got {name!r}")
    if name == "int4" and (device.type != "cpu" or tensor_parallel_size > 1):
        raise InvalidRequest("weights int4 runs on the CPU with one rank (tensor_parallel_size 1)")


def quantize_linears(model: nn.Module, name: str) -> int:
    """Every linear layer of ``model`` whose input features are a multiple of ``GROUP`` multiplies by its weight in
    ``name``'s format from now on (``auto``: nothing changes); the number quantized."""
    if name == "auto":
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.in_features % GROUP == 0:
            module.int4, module.packed = Int4Weight(module.weight), None  # the oneDNN copy is not read again
            count += 1
    return count
