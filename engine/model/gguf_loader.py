"""GGUF weights: each tensor dequantized at load (with the ``gguf`` package's own codecs) into the engine's
dtype, renamed from llama.cpp's names to Hugging Face's, with llama.cpp's Q/K row permutation undone.

llama.cpp's converter reorders the rows of Q and K in "llama" files so that its RoPE kernel can rotate
adjacent pairs; Baton (like Hugging Face) rotates the two halves of each head, so the rows go back.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from engine.errors import ModelLoadError
from engine.gguf_file import GGUFFile, GGUFTensor
from engine.model.config import ModelConfig
from engine.model.loader import WeightSink
from engine.model.progress import Progress

# The stored types this loader is tested on; any other type the gguf package can decode loads too, and one
# it cannot is refused naming the type.
TESTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
PLAIN_CODECS = ("F32", "F16")  # views or casts in the gguf package's ``dequantize``, no block codec
CHUNK_BYTES = 16 << 20  # stored bytes dequantized at once (bounds the float32 temporaries of a large tensor)
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_gguf(f: GGUFFile, config: ModelConfig, sink: WeightSink) -> None:
    for tensor in Progress(f.tensors, f"dequantizing {f.path.name}", unit="tensors"):
        key = hf_name(tensor.name)
        values = dequantize(tensor)  # [rows, cols] or [n], float32
        if f.permuted_qk and key.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            heads = config.num_heads if ".q_proj." in key else config.num_kv_heads
            values = unpermute_rows(values, heads)
        sink.put(key, torch.from_numpy(values), stored=memoryview(np.ascontiguousarray(tensor.raw)).cast("B"))


def hf_name(name: str) -> str:
    """llama.cpp tensor name -> Hugging Face name; an unknown one is refused."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ModelLoadError(f"GGUF tensor {name!r} is not one this loader knows (a Llama-family decoder)")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """The tensor as float32 in numpy order (a weight is [out_features, in_features]). A quantized one goes through
    the ``gguf`` package's own block codec (``dequantize_rows``), handed ``CHUNK_BYTES`` of rows at a time: its
    ``dequantize`` cuts a tensor into groups of a few rows, which took 2 of SmolLM2's 5 s of loading here."""
    import gguf

    codec = getattr(gguf.quants, tensor.type_name, None)
    if tensor.type_name in PLAIN_CODECS or not callable(getattr(codec, "dequantize_rows", None)):
        try:
            values = gguf.quants.dequantize(tensor.raw, tensor.qtype)
        except (NotImplementedError, KeyError) as exc:
            raise ModelLoadError(f"GGUF tensor {tensor.name!r} is stored as {tensor.type_name}, which cannot be "
                                 f"dequantized here (tested: {', '.join(TESTED_TYPES)})") from exc
        values = np.asarray(values, dtype=np.float32).reshape(tensor.shape)
        return values if values.flags.writeable else values.copy()  # torch wants writeable memory
    rows = tensor.raw.reshape(-1, tensor.raw.shape[-1])
    out = np.empty((len(rows), tensor.shape[-1]), np.float32)
    step = max(1, CHUNK_BYTES // max(1, rows.shape[1]))
    for start in range(0, len(rows), step):
        out[start:start + step] = codec.dequantize_rows(np.asarray(rows[start:start + step]))
    return out.reshape(tensor.shape)


def unpermute_rows(values: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute``: per head, rows (pairs interleaved) -> (first halves, second halves)."""
    rows = values.shape[0]
    # [heads, rows/heads/2, 2, ...] -> [heads, 2, rows/heads/2, ...]: llama.cpp's reshape, transposed back
    return values.reshape(num_heads, rows // num_heads // 2, 2, *values.shape[1:]).swapaxes(1, 2).reshape(
        values.shape)
