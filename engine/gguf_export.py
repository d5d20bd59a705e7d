"""A GGUF checkpoint as a Hugging Face folder, for engines that load only folders (vLLM's CPU build).

The weights are dequantized to float32 exactly as Baton's own loader does (``engine.model.gguf_loader``: the
``gguf`` package's codecs, llama.cpp's Q/K row permutation undone), so Baton's engine on the GGUF file and another
engine on the folder compute with the same numbers. ``config.json`` is the one the file's metadata describes
(``engine.gguf_file.config_dict``), the tokenizer is Baton's reading of the file's vocabulary and merges, and the chat
template and special tokens go to ``tokenizer_config.json``. The folder is cached next to the built presets, named
by the file and its size and modification time; a complete export carries a marker and is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine.gguf_file import GGUFFile

MARKER_FILE = ".baton-export-complete"
EXPORT_VERSION = 1  # bump when the exported bytes change


def export_folder(gguf_path: str | Path, out_dir: Path | None = None,
                  progress: Callable[[str], None] = print) -> Path:
    """The Hugging Face folder of ``gguf_path`` (exported on first use)."""
    path = Path(gguf_path).resolve()
    out = out_dir or export_dir(path)
    if (out / MARKER_FILE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        progress(f"exporting {path.name} as a Hugging Face folder (float32) to {out}")
        _write(GGUFFile(path), tmp)
        (tmp / MARKER_FILE).write_text(json.dumps({"source": str(path), "version": EXPORT_VERSION}))
        tmp.chmod(0o755)
        try:
            os.rename(tmp, out)
        except OSError:  # another process exported it meanwhile
            if not (out / MARKER_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def export_dir(path: Path, kind: str = "hf") -> Path:
    """Where an export of the GGUF file ``path`` is cached: its name, size, modification time and the export
    version in the folder's name, so a changed file gets a fresh export."""
    cache_dir = os.environ.get("BATON_CACHE_DIR")
    root = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "baton"
    stat = path.stat()
    tag = hashlib.blake2b(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{EXPORT_VERSION}".encode(), digest_size=6)
    return root / "models" / f"{path.stem}-{kind}-{tag.hexdigest()}"


def _write(f: GGUFFile, out: Path) -> None:
    from safetensors.numpy import save_file

    from engine import gguf_tokenizer
    from engine.model.gguf_loader import dequantize, hf_name, unpermute_rows

    # llama.cpp's architecture names of the families Baton reads (llama, qwen2, qwen3) are transformers' model types
    config = dict(f.config_dict(), model_type=f.architecture, dtype="float32")
    if config.get("rope_scaling") is None:
        config.pop("rope_scaling", None)
    tensors: dict[str, np.ndarray] = {}
    for tensor in f.tensors:
        key, values = hf_name(tensor.name), dequantize(tensor)
        if f.permuted_qk and key.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            heads = config["num_attention_heads"] if ".q_proj." in key else config["num_key_value_heads"]
            values = unpermute_rows(values, heads)
        tensors[key] = np.ascontiguousarray(values, dtype=np.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gguf_tokenizer.build_backend(f).save(str(out / "tokenizer.json"))
    specials = gguf_tokenizer.special_token_strings(f)
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config[
        "max_position_embeddings"], "chat_template": gguf_tokenizer.chat_template(f), **specials}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
