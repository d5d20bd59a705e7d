"""The real model, SmolLM2-135M-Instruct from its GGUF: greedy output equals ``transformers`` on the same file
token for token (batched, chunked prefill, prefix-cache hits), its tokenizer equals transformers', its chat
template is the model's own, and the chat ends at the template's end-of-turn token."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.model_source import resolve_model
from engine.tokenizer import Tokenizer
from tests.smollm2 import CHATS, MAX_TOKENS, assert_greedy_matches

CHUNK_TOKENS = 128  # the step's token budget: the longer prompts prefill in several chunks
TEXTS = [
    "Hello, world!", "naïve café — Straße, 東京, Ελληνικά, עברית", "emoji 🚀🎉 and a family 👩‍👩‍👧 and flags 🇫🇷",
    "def f(x):\n    return x ** 2  # comment\n\n\n\tindented\twith\ttabs", "   leading,   inner    runs, trailing   ",
    "\n\n\n\r\n  \u00a0nbsp \u200bzero-width", "digits 1234567890 3.14159 2026-12-01 1e-9",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>text<file_sep>more<repo_name>",
    "I'm sure they'll've done it. DON'T SHOUT", "",
]


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", max_num_batched_tokens=CHUNK_TOKENS, num_blocks=512, max_num_seqs=16)


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    path = resolve_model("smollm2").path
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.timeout(600)  # transformers' reference is computed in its setup: 2-3 minutes beside another worker
def test_greedy_equals_transformers_batched_chunked_and_from_the_prefix_cache(llm, smollm2_reference):
    ref = smollm2_reference
    assert max(map(len, ref.prompts)) > 4 * CHUNK_TOKENS  # the longest prompts really prefill in chunks
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for run in ("cold", "cached"):
        outs = llm.generate(ref.prompts, params)  # all eight in one batch
        for i, (out, expected) in enumerate(zip(outs, ref.continuations)):
            assert_greedy_matches(out.outputs[0].token_ids, expected, f"{run} prompt {i} ({len(ref.prompts[i])} tokens)")
        if run == "cached":  # every full block of every prompt came from the prefix cache
            assert [o.num_cached_tokens for o in outs] == [len(p) // 16 * 16 if len(p) % 16 else len(p) - 16
                                                           for p in ref.prompts]
    pool = llm.engine.kv_cache_manager.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("text", TEXTS)
def test_the_tokenizer_equals_transformers(hf_tokenizer, llm, text):
    ours = llm.tokenizer
    for special in (True, False):
        assert ours.encode(text, add_special_tokens=special) == hf_tokenizer.encode(text, add_special_tokens=special)
    ids = hf_tokenizer.encode(text)
    assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("name", sorted(CHATS))
def test_the_chat_template_is_the_models_own(hf_tokenizer, llm, name):
    chat = CHATS[name]
    expected = hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert llm.tokenizer.apply_chat_template(chat) == expected
    assert "<|im_start|>assistant\n" in expected
    assert llm.tokenizer.encode_chat(chat) == hf_tokenizer.encode(expected, add_special_tokens=False)


def test_a_chat_answer_names_paris_and_ends_at_the_end_of_turn_token(llm):
    tokenizer = llm.tokenizer
    out = llm.generate({"prompt_token_ids": tokenizer.encode_chat(CHATS["capital"])},
                       SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason == "stop"
    assert out.token_ids[-1] == tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]
    assert tokenizer.eos_token_ids == {out.token_ids[-1]}


def test_the_tokenizer_needs_nothing_but_the_file(tmp_path):
    """Copied alone into an empty folder, the GGUF still gives the tokenizer and the template."""
    import shutil

    alone = shutil.copy(resolve_model("smollm2").path, tmp_path / "model.gguf")
    tokenizer = Tokenizer.from_model(alone)
    assert tokenizer.vocab_size == 49152 and tokenizer.bos_token_id == 1
    assert tokenizer.apply_chat_template(CHATS["capital"]).startswith("<|im_start|>system\n")
