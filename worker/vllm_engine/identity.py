"""What a vLLM engine's KV is, from the config vLLM built: the model fingerprint (the engine and its KV block are
part of it, so a vLLM worker's KV is never offered to a Baton-engine worker, nor the reverse; so is the KV
connector, so a router pairs only vLLM workers that move KV alike) and the shape of one
token's KV. Used by the worker (``VLLMEngine``) and by Baton's KV connector inside vLLM's engine core (both must
name the same bytes alike). No vLLM import: it reads the config it is given."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kv_transfer.hashing import model_fingerprint


@dataclass(frozen=True, slots=True)
class VLLMKVIdentity:
    fingerprint: bytes
    dtype: str  # torch's name, without "torch."
    vllm_block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int


def vllm_kv_identity(config: Any) -> VLLMKVIdentity:
    """``config``: vLLM's ``VllmConfig``."""
    model = config.model_config
    hf = model.hf_config
    block_size = config.cache_config.block_size
    num_layers = model.get_num_layers(config.parallel_config)
    num_kv_heads, head_dim = model.get_num_kv_heads(config.parallel_config), model.get_head_size()
    dtype = str(model.dtype).removeprefix("torch.")
    rope = repr(sorted((getattr(hf, "rope_parameters", None) or {}).items()))
    transfer = config.kv_transfer_config
    connector = (transfer.kv_connector if transfer is not None else None) or "none"
    fingerprint = model_fingerprint(
        architecture=(hf.architectures or ["?"])[0], hidden_size=hf.hidden_size, num_layers=num_layers,
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=f"{dtype}+vllm-block{block_size}+{connector}",
        vocab_size=model.get_vocab_size(), rope=rope, weights_id=weights_id(Path(model.model)))
    return VLLMKVIdentity(fingerprint, dtype, block_size, num_layers, num_kv_heads, head_dim)


def weights_id(folder: Path) -> str:
    """A digest of the checkpoint's weight files (their bytes): two folders share KV only with the same weights."""
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            digest.update(hashlib.file_digest(f, "blake2b").digest())
    return digest.hexdigest()
