"""A GGUF file's metadata and tensors (parsed by ``engine.gguf_format``; the ``gguf`` package names the types and
dequantizes). Torch-free.

The router reads its model card and tokenizer from here; the engine also reads the config and the tensors
(``engine.model.gguf_loader`` dequantizes them). The tensor data is memory-mapped: opening a file reads its
header and metadata only.

Config keys follow llama.cpp (``{arch}.block_count``, ``{arch}.attention.head_count``, ...) and become the
same dict a Hugging Face ``config.json`` holds, so one parser builds the engine's ``ModelConfig`` from both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.gguf_format import GGUFFormatError, read_gguf, tensor_array

# general.architecture -> (Hugging Face architecture, whether llama.cpp permuted Q/K rows for its RoPE kernel)
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),  # Llama 1/2/3 and Mistral files all say "llama"
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}
# llama.cpp's general.file_type -> the dtype a GPU engine computes in when asked for "auto"
_FILE_TYPE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str  # llama.cpp's name, e.g. "blk.0.attn_q.weight"
    type_name: str  # GGMLQuantizationType name, e.g. "Q4_1"
    shape: tuple[int, ...]  # numpy order (rows first): [out_features, in_features] for a weight
    raw: Any  # the stored bytes (a memory-mapped numpy array): a plain type's elements, else uint8 block rows
    qtype: Any  # gguf.GGMLQuantizationType
    offset: int  # where the stored bytes start in the file


class GGUFFile:
    """One opened GGUF file: metadata values by key, the tensors, and the config they describe."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._contents = read_gguf(self.path)
        except (OSError, ValueError) as exc:  # GGUFFormatError is a ValueError; so is numpy's on an empty file
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {exc}") from exc
        self.metadata = self._contents.metadata

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value (str, number, bool, or a list of them); ``default`` when the key is absent."""
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path.name}: GGUF metadata has no {key!r}")
        return value

    @cached_property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    @cached_property
    def tensors(self) -> list[GGUFTensor]:
        from gguf import GGMLQuantizationType  # imported only when tensors are read

        out = []
        for info in self._contents.tensors:
            try:
                raw = tensor_array(self._contents, info)
            except GGUFFormatError as exc:
                raise ModelLoadError(f"cannot read GGUF file {self.path}: {exc}") from exc
            qtype = GGMLQuantizationType(info.ggml_type)
            out.append(GGUFTensor(info.name, qtype.name, tuple(reversed(info.dims)), raw, qtype, info.data_offset))
        return out

    @cached_property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self._contents.tensors}

    @property
    def has_tokenizer(self) -> bool:
        return "tokenizer.ggml.tokens" in self.metadata

    @property
    def permuted_qk(self) -> bool:
        """llama.cpp's converter reorders Q and K rows of "llama" files for its RoPE kernel (loaders undo it)."""
        return _architecture(self)[1]

    def config_dict(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` this file's metadata describes."""
        return config_dict(self)


def config_dict(f: GGUFFile) -> dict[str, Any]:
    arch = f.architecture
    hf_architecture, _ = _architecture(f)
    heads = _int(f, f"{arch}.attention.head_count")
    hidden = _int(f, f"{arch}.embedding_length")
    head_dim = int(f.get(f"{arch}.attention.key_length") or hidden // heads)
    rotary_dim = f.get(f"{arch}.rope.dimension_count")
    if rotary_dim is not None and int(rotary_dim) != head_dim:
        raise ModelLoadError(f"{f.path.name}: partial rotary embeddings ({rotary_dim} of {head_dim} dims) "
                             "are not supported")
    if "rope_freqs.weight" in f.tensor_names:
        raise ModelLoadError(f"{f.path.name}: precomputed RoPE frequency factors (rope_freqs, Llama 3.1-style "
                             "scaling) are not supported in GGUF files yet; use the Hugging Face folder")
    tokens = f.get("tokenizer.ggml.tokens") or ()
    return {
        "architectures": [hf_architecture],
        "vocab_size": int(f.get(f"{arch}.vocab_size") or len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": _int(f, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _int(f, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(f, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": _int(f, f"{arch}.context_length"),
        "rms_norm_eps": float(f.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(f.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(f, arch),
        "tie_word_embeddings": "output.weight" not in f.tensor_names,
        "dtype": _FILE_TYPE_DTYPES.get(int(f.get("general.file_type", -1)), "bfloat16"),
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_token_ids(f),
    }


def eos_token_ids(f: GGUFFile) -> list[int]:
    """End of sequence and end of turn (an instruct model's template ends each turn with the latter)."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return sorted({int(v) for key in keys if (v := f.get(key)) is not None})


def _architecture(f: GGUFFile) -> tuple[str, bool]:
    known = ARCHITECTURES.get(f.architecture)
    if known is None:
        raise ModelLoadError(f"{f.path.name}: GGUF architecture {f.architecture!r} is not supported "
                             f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return known


def _rope_scaling(f: GGUFFile, arch: str) -> dict[str, Any] | None:
    kind = f.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ModelLoadError(f"{f.path.name}: RoPE scaling {kind!r} is not supported in GGUF files (only linear)")
    return {"rope_type": "linear", "factor": float(f.require(f"{arch}.rope.scaling.factor"))}


def _int(f: GGUFFile, key: str) -> int:
    return int(_scalar(f, key, None))


def _scalar(f: GGUFFile, key: str, default: Any) -> Any:
    value = f.get(key, default)
    if value is None:
        raise ModelLoadError(f"{f.path.name}: GGUF metadata has no {key!r}")
    if isinstance(value, Sequence) and not isinstance(value, str):  # a per-layer list
        if len(set(value)) != 1:
            raise ModelLoadError(f"{f.path.name}: {key} differs between layers, which is not supported")
        return value[0]
    return value
