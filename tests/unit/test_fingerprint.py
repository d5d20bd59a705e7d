"""The model fingerprint (the root of every KV block hash) tells apart any two checkpoints whose KV differs:
every tensor byte counts (not only a file's first and last MiB), and so does the RoPE configuration (K is
cached after RoPE)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.engine import Engine


@pytest.fixture(scope="module")
def wide_folder(tmp_path_factory) -> Path:
    """A Llama of ~9 MiB: a weight in the middle of its file lies outside the first and last MiB."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         architectures=["LlamaForCausalLM"], tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("wide")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def fingerprint(folder: Path) -> bytes:
    return Engine(EngineConfig(model=str(folder), num_blocks=8)).fingerprint


def test_one_weight_deep_inside_the_file_changes_the_fingerprint(wide_folder, tmp_path):
    edited = Path(shutil.copytree(wide_folder, tmp_path / "edited"))
    path = edited / "model.safetensors"
    tensors = load_file(path)
    tensors["model.embed_tokens.weight"][4096, 0] += 1.0  # ~6 MiB into a ~9 MiB file
    save_file(tensors, path, metadata={"format": "pt"})
    assert path.stat().st_size == (wide_folder / "model.safetensors").stat().st_size
    assert fingerprint(edited) != fingerprint(wide_folder)


def test_the_rope_configuration_changes_the_fingerprint(wide_folder, tmp_path):
    edited = Path(shutil.copytree(wide_folder, tmp_path / "rope"))
    config = json.loads((edited / "config.json").read_text())
    config["rope_parameters"] = {**(config.get("rope_parameters") or {}), "rope_type": "default",
                                 "rope_theta": 500000.0}
    (edited / "config.json").write_text(json.dumps(config))
    assert fingerprint(edited) != fingerprint(wide_folder)


def test_the_same_checkpoint_has_the_same_fingerprint(wide_folder, tmp_path):
    copy = Path(shutil.copytree(wide_folder, tmp_path / "copy"))
    assert fingerprint(copy) == fingerprint(wide_folder)
