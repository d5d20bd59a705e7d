"""Write a Hugging Face checkpoint folder as a GGUF file the way llama.cpp's converter does (tests only).

llama.cpp's tensor names, its Q/K row permutation for "llama" files, its metadata keys, and (when the folder
has a ``tokenizer.json`` byte-level BPE) the tokenizer as metadata. Each tensor is stored as the requested
type with the ``gguf`` package's own quantizers; 1-D tensors (norms, biases) stay F32 as llama.cpp keeps them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3"}
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py), written out from its definition."""
    return weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:]).swapaxes(
        1, 2).reshape(weights.shape)


def gguf_name(key: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    if key in globals_:
        return globals_[key]
    _, _, layer, *rest = key.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def write_gguf(folder: Path, out: Path, qtype: str = "F32", *, extra_tensors: dict[str, np.ndarray] | None = None,
               with_tokenizer: bool = True) -> Path:
    import gguf

    config = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCH[config["architectures"][0]]
    writer = gguf.GGUFWriter(str(out), arch)
    _write_config(writer, config)
    if with_tokenizer and (folder / "tokenizer.json").is_file():
        _write_tokenizer(writer, folder)
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    for key, value in sorted(tensors.items()):
        value = value.astype(np.float32)
        if arch == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in key else config["num_key_value_heads"]
            value = llama_cpp_permute(value, heads)
        _add_tensor(writer, gguf_name(key), value, qtype if value.ndim == 2 else "F32")
    for name, value in (extra_tensors or {}).items():
        _add_tensor(writer, name, value.astype(np.float32), "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tensor(writer, name: str, value: np.ndarray, qtype: str) -> None:
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    writer.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)


def _write_config(writer, config: dict) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(0)


def _write_tokenizer(writer, folder: Path) -> None:
    """A byte-level BPE ``tokenizer.json`` (what ``baton model tiny`` builds) as llama.cpp metadata."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in added and added[i].get("special") else 1 for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    special = json.loads((folder / "tokenizer_config.json").read_text())
    writer.add_bos_token_id(vocab[special["bos_token"]])
    writer.add_eos_token_id(vocab[special["eos_token"]])
    writer.add_add_bos_token(spec.get("post_processor") is not None)
    if special.get("chat_template"):
        writer.add_chat_template(special["chat_template"])
