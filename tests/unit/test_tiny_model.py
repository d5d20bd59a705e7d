"""engine.tiny: deterministic, idempotent, atomic builds that transformers loads."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub from tests

from engine import tiny  # noqa: E402
from engine.errors import InvalidRequest  # noqa: E402

TRAIN_STEPS = 20  # enough to move every weight; the full 300 steps are exercised by the slow test
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _quiet(_message: str) -> None:
    pass


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    first = tiny.build_model("tiny", tmp_path_factory.mktemp("a") / "tiny", train_steps=TRAIN_STEPS, progress=_quiet)
    second = tiny.build_model("tiny", tmp_path_factory.mktemp("b") / "tiny", train_steps=TRAIN_STEPS, progress=_quiet)
    return first, second


@pytest.fixture
def short_tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes the "tiny" preset train for TRAIN_STEPS, so default builds match the fixture's builds."""
    monkeypatch.setitem(tiny.PRESETS, "tiny", dataclasses.replace(tiny.PRESETS["tiny"], train_steps=TRAIN_STEPS))


def _mtimes(folder: Path) -> dict[str, int]:
    return {path.name: path.stat().st_mtime_ns for path in folder.iterdir()}


@pytest.mark.parametrize("name", FILES)
def test_two_builds_are_byte_identical(builds: tuple[Path, Path], name: str) -> None:
    first, second = builds
    assert (first / name).read_bytes() == (second / name).read_bytes()


def test_build_leaves_only_the_folder_and_a_marker(builds: tuple[Path, Path]) -> None:
    first, _ = builds
    assert sorted(path.name for path in first.iterdir()) == sorted((*FILES, tiny.MARKER_FILE))
    assert [path.name for path in first.parent.iterdir()] == ["tiny"]  # no temporary folders left
    marker = json.loads((first / tiny.MARKER_FILE).read_text())
    assert marker["identity"] == {"preset": "tiny", "train_steps": TRAIN_STEPS, "version": tiny.BUILD_VERSION}
    assert sorted(marker["files"]) == sorted(FILES)


def test_second_build_is_a_no_op(builds: tuple[Path, Path]) -> None:
    first, _ = builds
    before = _mtimes(first)
    messages: list[str] = []
    assert tiny.build_model("tiny", first, train_steps=TRAIN_STEPS, progress=messages.append) == first
    assert _mtimes(first) == before
    assert messages == [f"tiny model already built at {first}"]


def test_force_rebuilds_the_same_bytes(builds: tuple[Path, Path], tmp_path: Path) -> None:
    folder = tmp_path / "tiny"
    shutil.copytree(builds[0], folder)
    before = _mtimes(folder)
    tiny.build_model("tiny", folder, force=True, train_steps=TRAIN_STEPS, progress=_quiet)
    assert _mtimes(folder)["model.safetensors"] != before["model.safetensors"]
    assert (folder / "model.safetensors").read_bytes() == (builds[0] / "model.safetensors").read_bytes()


def test_training_changes_the_weights(builds: tuple[Path, Path], tmp_path: Path) -> None:
    untrained = tiny.build_model("tiny", tmp_path / "tiny", train_steps=0, progress=_quiet)
    assert (untrained / "model.safetensors").read_bytes() != (builds[0] / "model.safetensors").read_bytes()
    assert (untrained / "tokenizer.json").read_bytes() == (builds[0] / "tokenizer.json").read_bytes()


def test_loads_with_transformers(builds: tuple[Path, Path]) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(builds[0])
    assert config.architectures == ["LlamaForCausalLM"]
    preset = tiny.PRESETS["tiny"]
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (4096, 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (4, 2, 192)
    assert config.max_position_embeddings == preset.max_position_embeddings == 2048
    assert config.tie_word_embeddings is False
    model = AutoModelForCausalLM.from_pretrained(builds[0])
    assert model.dtype == torch.float32
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    logits = model(torch.tensor([[1, 100, 200]])).logits  # [batch, seq, vocab]
    assert logits.shape == (1, 3, 4096) and torch.isfinite(logits).all()


def test_bad_arguments_are_invalid_request(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="unknown model preset"):
        tiny.build_model("huge", tmp_path / "huge", progress=_quiet)
    with pytest.raises(InvalidRequest, match="train_steps"):
        tiny.build_model("tiny", tmp_path / "tiny", train_steps=-1, progress=_quiet)
    assert list(tmp_path.iterdir()) == []


def test_build_keeps_the_callers_threads_and_rng(tmp_path: Path) -> None:
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        state = torch.get_rng_state()
        tiny.build_model("tiny", tmp_path / "tiny", train_steps=1, progress=_quiet)
        assert torch.get_num_threads() == 2
        assert torch.equal(torch.get_rng_state(), state)
    finally:
        torch.set_num_threads(previous)


def test_interrupted_build_never_looks_complete(tmp_path: Path) -> None:
    def interrupt(message: str) -> None:
        if message.startswith("saving weights"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tiny.build_model("tiny", tmp_path / "tiny", train_steps=0, progress=interrupt)
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_overwrite_a_foreign_folder(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="refusing"):
        tiny.build_model("tiny", tmp_path, force=True, progress=_quiet)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_incomplete_build_is_rebuilt(builds: tuple[Path, Path], tmp_path: Path) -> None:
    folder = tmp_path / "tiny"
    shutil.copytree(builds[0], folder)
    (folder / "model.safetensors").write_bytes(b"truncated")
    identity = {"preset": "tiny", "train_steps": TRAIN_STEPS, "version": tiny.BUILD_VERSION}
    assert tiny.is_complete(builds[0], identity)
    assert not tiny.is_complete(folder, identity)
    tiny.build_model("tiny", folder, train_steps=TRAIN_STEPS, progress=_quiet)
    assert (folder / "model.safetensors").read_bytes() == (builds[0] / "model.safetensors").read_bytes()


def test_default_model_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    assert tiny.default_model_dir("small") == tmp_path / "models" / "small"
    monkeypatch.delenv("BATON_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tiny.default_model_dir() == tmp_path / "home" / ".cache" / "baton" / "models" / "tiny"


@pytest.mark.usefixtures("short_tiny")
def test_ensure_model_finds_an_existing_build(builds, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    shutil.copytree(builds[0], tmp_path / "models" / "tiny")
    before = _mtimes(tmp_path / "models" / "tiny")
    assert tiny.ensure_model("tiny") == tmp_path / "models" / "tiny"
    assert _mtimes(tmp_path / "models" / "tiny") == before


@pytest.mark.usefixtures("short_tiny")
def test_cli_prints_the_path(builds, capsys: pytest.CaptureFixture[str]) -> None:
    from engine import model_cli

    assert model_cli.main(["tiny", "--out", str(builds[0])]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(builds[0])
    with pytest.raises(SystemExit):
        model_cli.main(["huge"])


@pytest.mark.slow
def test_full_tiny_model_writes_python_confidently(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from engine.tokenizer import Tokenizer

    folder = tiny.build_model("tiny", tmp_path / "tiny", progress=_quiet)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), Tokenizer.from_pretrained(folder)
    prompt = torch.tensor([tokenizer.encode("def __init__(self")])  # [1, prompt_len]
    with torch.no_grad():
        output = model.generate(prompt, max_new_tokens=24, do_sample=False)  # [1, prompt_len + 24]
        top_prob = model(output).logits.softmax(-1).amax(-1)  # [1, seq]
    text = tokenizer.decode(output[0].tolist())
    assert "\n" in text and ("self" in text or "return" in text), text
    assert top_prob.mean().item() > 0.3
