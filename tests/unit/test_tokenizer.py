"""engine.tokenizer against transformers' AutoTokenizer, on a folder that engine.tiny builds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub from tests

from engine.errors import InvalidRequest, ModelLoadError  # noqa: E402
from engine.tiny import build_model  # noqa: E402
from engine.tokenizer import IncrementalDetokenizer, Tokenizer  # noqa: E402

TEXTS = [
    "héllo wörld — 你好 🎉",
    "def f(x):\n    return x * 2\n",
    "  leading and trailing spaces  ",
    "",
    "tabs\tand\r\nwindows newlines",
    "<s> literal specials </s> inside text",
    "family emoji 👩‍👩‍👧 and flags 🇫🇷",
    "Ünïcödé ✓ ∑ ≈ 日本語 한국어 العربية",
]
# Multi-byte characters whose bytes the byte-level BPE splits over several tokens.
STREAM_TEXT = "def greet():\n    return 'héllo wörld — 你好 🎉 👩‍👩‍👧 日本語 한국어'\n" * 3
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi — 你好"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Random weights are enough here: only the tokenizer files are used.
    return build_model("tiny", tmp_path_factory.mktemp("tokenizer") / "tiny", train_steps=0, progress=lambda _: None)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture
def folder_copy(model_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tokenizer files that a test may break."""
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
    for name in names:
        shutil.copy(model_dir / name, tmp_path / name)
    return tmp_path


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, hf_tokenizer, text: str, add_special_tokens: bool) -> None:
    expected = hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips_and_matches_transformers(tokenizer, hf_tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text.replace("<s>", "").replace("</s>", "")
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids, skip_special_tokens=False)


def test_special_ids_and_vocab_size(tokenizer, hf_tokenizer) -> None:
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == frozenset({hf_tokenizer.eos_token_id}) == frozenset({2})
    assert tokenizer.vocab_size == len(hf_tokenizer) == 4096
    assert tokenizer.encode("x")[0] == tokenizer.bos_token_id


@pytest.mark.parametrize(("eos_token_id", "expected"), [(7, {2, 7}), ([2, 9, 11], {2, 9, 11}), (None, {2})])
def test_eos_ids_are_the_union_with_generation_config(folder_copy: Path, eos_token_id, expected) -> None:
    path = folder_copy / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": eos_token_id}))
    assert Tokenizer.from_pretrained(folder_copy).eos_token_ids == frozenset(expected)


def test_chat_template_matches_transformers(tokenizer, hf_tokenizer) -> None:
    text = tokenizer.apply_chat_template(MESSAGES)
    assert text == "<s><|system|>\nYou are terse.</s>\n<|user|>\nSay hi — 你好</s>\n<|assistant|>\n"
    assert text == hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    no_prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert no_prompt == hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)


def test_encode_chat_matches_transformers_and_has_one_bos(tokenizer, hf_tokenizer) -> None:
    ids = tokenizer.encode_chat(MESSAGES)
    expected = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    expected_ids = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ids == list(expected_ids)
    assert ids.count(tokenizer.bos_token_id) == 1


def test_chat_template_raise_exception_is_invalid_request(tokenizer) -> None:
    with pytest.raises(InvalidRequest, match="roles must be"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "beep"}])


@pytest.mark.parametrize("messages", [[], "hi", [{"content": "no role"}], [["user", "hi"]]])
def test_malformed_messages_are_invalid_request(tokenizer, messages) -> None:
    with pytest.raises(InvalidRequest, match="messages"):
        tokenizer.apply_chat_template(messages)


def test_missing_chat_template_is_invalid_request(folder_copy: Path) -> None:
    config_path = folder_copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(InvalidRequest, match="chat_template"):
        Tokenizer.from_pretrained(folder_copy).apply_chat_template(MESSAGES)


def test_chat_template_jinja_file_wins(folder_copy: Path) -> None:
    (folder_copy / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert Tokenizer.from_pretrained(folder_copy).apply_chat_template(MESSAGES) == "[You are terse.][Say hi — 你好]"


def test_missing_folder_is_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nope")


def test_missing_tokenizer_json_is_named(folder_copy: Path) -> None:
    (folder_copy / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_pretrained(folder_copy)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_malformed_file_is_model_load_error(folder_copy: Path, name: str) -> None:
    (folder_copy / name).write_text("{not json")
    with pytest.raises(ModelLoadError, match=name):
        Tokenizer.from_pretrained(folder_copy)


def test_invalid_input_is_invalid_request(tokenizer) -> None:
    with pytest.raises(InvalidRequest, match="str"):
        tokenizer.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="token ids"):
        tokenizer.decode([5, tokenizer.vocab_size])
    with pytest.raises(InvalidRequest, match="token ids"):
        tokenizer.decode([-1])


def _stream(tokenizer: Tokenizer, ids: list[int], chunk: int, prompt: list[int] | None = None) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt or ())
    deltas = [detokenizer.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    assert detokenizer.text == "".join(deltas)
    return deltas


def test_stream_text_splits_characters_across_tokens(tokenizer) -> None:
    # The precondition the detokenizer tests rely on: some single tokens decode to half a character.
    ids = tokenizer.encode(STREAM_TEXT, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([token]) for token in ids)


@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_deltas_concatenate_to_decode(tokenizer, chunk: int) -> None:
    ids = tokenizer.encode(STREAM_TEXT, add_special_tokens=False)
    deltas = _stream(tokenizer, ids, chunk)
    assert "".join(deltas) == tokenizer.decode(ids) == STREAM_TEXT
    assert not any("\ufffd" in delta for delta in deltas)
    assert "" in deltas  # something was held back while a character was incomplete


def test_incremental_with_prompt_context(tokenizer) -> None:
    prompt = tokenizer.encode("print('🎉")  # ends mid-line; the output continues it
    output = tokenizer.encode(" 你好 done')\n", add_special_tokens=False)
    deltas = _stream(tokenizer, output, 1, prompt)
    assert "".join(deltas) == tokenizer.decode(output) == " 你好 done')\n"


def test_incremental_skips_special_tokens(tokenizer) -> None:
    ids = tokenizer.encode("héllo") + [2]
    assert "".join(_stream(tokenizer, ids, 1)) == "héllo"


def test_finish_flushes_an_incomplete_character(tokenizer) -> None:
    ids = tokenizer.encode("ok 🎉", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    text = "".join(detokenizer.step([token]) for token in ids[:-1])  # the emoji's last byte never comes
    assert text == "ok "
    assert detokenizer.finish() == tokenizer.decode(ids[:-1])[len("ok ") :]
    assert detokenizer.text.startswith("ok ") and detokenizer.text.endswith("\ufffd")


def test_incremental_cost_does_not_grow_with_length(tokenizer, monkeypatch) -> None:
    decoded_lengths: list[int] = []
    real_decode = tokenizer.decode

    def spy(token_ids, skip_special_tokens=True):
        decoded_lengths.append(len(token_ids))
        return real_decode(token_ids, skip_special_tokens)

    ids = tokenizer.encode(STREAM_TEXT * 10, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("a long prompt " * 50))
    monkeypatch.setattr(tokenizer, "decode", spy)
    for token in ids:
        detokenizer.step([token])
    assert len(ids) > 500
    assert max(decoded_lengths) <= 12


def test_tokenizer_module_never_imports_torch() -> None:
    code = (
        "import sys, engine.tokenizer, engine.tiny; "
        "bad = {'torch', 'transformers'} & set(sys.modules); assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr
