"""Which attention backend runs a model: torch (any device, and every quantized cache) or flashinfer (CUDA)."""

from __future__ import annotations

import logging

import torch

from engine.attention.base import AttentionBackend
from engine.errors import InvalidRequest
from engine.kv_quant import KVQuant
from engine.model.config import ModelConfig

logger = logging.getLogger(__name__)


def pick_backend(name: str, device: torch.device, model: ModelConfig, quant: KVQuant | None) -> AttentionBackend:
    if quant is not None:
        if name == "flashinfer":
            raise InvalidRequest(f"attention_backend=flashinfer does not read a {quant.name} KV cache (torch does)")
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(quant)
    if name == "flashinfer" or (name == "auto" and device.type == "cuda"):
        from engine.attention.flashinfer_backend import FlashInferBackend, flashinfer_available, kernel_refusal

        refusal = kernel_refusal(model.head_dim) or (
            None if flashinfer_available() else "needs a CUDA GPU and the flashinfer-python package")
        if refusal is None and (name == "flashinfer" or model.dtype != "float32"):  # auto: no fp32 kernels
            return FlashInferBackend(device)
        if name == "flashinfer":
            raise InvalidRequest(f"attention_backend=flashinfer: {refusal}")
        logger.info("attention: torch backend (flashinfer %s)", refusal or "has no float32 kernels")
    from engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()
