"""SmolLM2-135M-Instruct (the GGUF that ``make install`` installs) and its reference: ``transformers`` loading the
same file (it dequantizes to float32) and decoding greedily, one prompt at a time, with its own KV cache.

The prompts mix lengths (2 to ~700 tokens), plain text, code and chats; each reference continuation keeps the
gap between its top two logits at every step, so a comparison can stop honestly at a near tie (where either
token is a correct greedy choice and float rounding decides).
"""

from __future__ import annotations

import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path

MAX_TOKENS = 32  # greedy tokens compared per prompt (vLLM's parity tests compare 32 too); 64 doubled the cost
NEAR_TIE = 1e-4  # top-1 minus top-2 logit below this: the comparison may stop there
CHATS = {
    "capital": [{"role": "user", "content": "What is the capital of France?"}],
    "code": [{"role": "user", "content": "Write a Python function that reverses a string."}],
    "turns": [{"role": "system", "content": "You are a concise assistant."},
              {"role": "user", "content": "Name a primary colour."},
              {"role": "assistant", "content": "Red."},
              {"role": "user", "content": "Name another one, and say why it is primary."}],
}
TEXTS = ["Hi", "The quick brown fox", "def fibonacci(n):"]


def _stdlib_excerpt(name: str, num_chars: int) -> str:
    """A long, fixed prompt: the start of a standard-library file (same Python version -> same text)."""
    return (Path(sysconfig.get_paths()["stdlib"]) / name).read_text(encoding="utf-8")[:num_chars]


def prompts(tokenizer) -> list[list[int]]:
    """The eight prompts as token ids (chats through the model's own template)."""
    out = [tokenizer.encode_chat(chat) for chat in CHATS.values()]
    out += [tokenizer.encode(text) for text in TEXTS]
    out += [tokenizer.encode(_stdlib_excerpt("textwrap.py", 1200)), tokenizer.encode(_stdlib_excerpt("json/decoder.py", 2600))]
    return out


@dataclass(frozen=True)
class Continuation:
    token_ids: list[int]
    margins: list[float]  # top-1 minus top-2 logit at each generated position


def transformers_model(gguf: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


def reference(model, prompt: list[int], max_tokens: int = MAX_TOKENS) -> Continuation:
    """Greedy decoding by hand (argmax of the logits, no generation config, EOS not special)."""
    import torch

    tokens: list[int] = []
    margins: list[float] = []
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_tokens):
            top2 = out.logits[0, -1].topk(2)  # values [2], indices [2]
            tokens.append(int(top2.indices[0]))
            margins.append(float(top2.values[0] - top2.values[1]))
            out = model(torch.tensor([[tokens[-1]]]), cache=out.past_key_values, use_cache=True)
    return Continuation(tokens, margins)


def assert_greedy_matches(got: list[int], ref: Continuation, label: str) -> int:
    """``got`` equals the reference token for token, up to the first near tie (then it warns). Returns how many
    positions were compared."""
    cut = next((i for i, margin in enumerate(ref.margins) if margin < NEAR_TIE), len(ref.token_ids))
    assert got[:cut] == ref.token_ids[:cut], f"{label}: first difference at {_first_difference(got, ref.token_ids)}"
    assert len(got) == len(ref.token_ids), f"{label}: {len(got)} tokens, expected {len(ref.token_ids)}"
    if cut < len(ref.token_ids):
        warnings.warn(f"{label}: compared {cut} of {len(ref.token_ids)} tokens; transformers' top two logits are "
                      f"{ref.margins[cut]:.2e} apart at position {cut}", stacklevel=2)
    return cut


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
