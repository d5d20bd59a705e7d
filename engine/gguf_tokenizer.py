"""A tokenizer built from a GGUF file's metadata alone (tokens, merges, token types, special ids, template).

Built as ``transformers`` builds it for the same file (``from_pretrained(..., gguf_file=...)``), so the two
encode every text to the same ids: a byte-level BPE over the vocabulary and merges; tokens the file marks
as control (type 3) become special added tokens, user-defined ones (type 4) plain added tokens; the split
regex follows ``tokenizer.ggml.pre`` where transformers knows one, else GPT-2's. Torch-free.
"""

from __future__ import annotations

from functools import lru_cache

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from engine.errors import ModelLoadError
from engine.gguf_file import GGUFFile, eos_token_ids

_CONTROL, _USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex (as transformers' GGUF tokenizer mapping has them); others: GPT-2's
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                "pad_token": "padding_token_id"}


def build_backend(f: GGUFFile) -> tokenizers.Tokenizer:
    kind = f.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{f.path.name}: GGUF tokenizer {kind!r} is not supported yet (supported: gpt2, the "
                             "byte-level BPE of Llama 3, Qwen, SmolLM); use the model's Hugging Face folder")
    tokens = list(f.require("tokenizer.ggml.tokens"))
    types = list(f.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=_byte_level_vocab(tokens), merges=[tuple(m.split(" ", 1)) for m in f.require("tokenizer.ggml.merges")],
        dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
    ))
    backend.pre_tokenizer = _pre_tokenizer(f.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, tokens, types)
    if f.get("tokenizer.ggml.add_bos_token", False) and (bos := f.get("tokenizer.ggml.bos_token_id")) is not None:
        bos_token = tokens[int(bos)]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B", special_tokens=[(bos_token, int(bos))])
    return backend


def special_token_strings(f: GGUFFile) -> dict[str, str]:
    """bos/eos/unk/pad token strings, as the chat template sees them."""
    tokens = f.require("tokenizer.ggml.tokens")
    ids = {name: f.get(f"tokenizer.ggml.{key}") for name, key in _SPECIAL_IDS.items()}
    return {name: tokens[int(i)] for name, i in ids.items() if i is not None and 0 <= int(i) < len(tokens)}


def special_ids(f: GGUFFile) -> tuple[int | None, frozenset[int]]:
    """(BOS id, the ids that end a generation: end of sequence and end of turn)."""
    bos = f.get("tokenizer.ggml.bos_token_id")
    return (None if bos is None else int(bos)), frozenset(eos_token_ids(f))


def chat_template(f: GGUFFile) -> str | None:
    template = f.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(f"{f.path.name}: tokenizer.chat_template must be a string")
    return template


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's regex, then bytes
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """Token -> id; a token written with characters outside the byte alphabet is respelled in it."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    return {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
            for index, token in enumerate(tokens)}


def _add_special_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens (special, skipped when decoding) and user-defined ones (kept whole, decoded)."""
    alphabet = set(bytes_to_unicode().values())
    control = [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types)
               if kind == _CONTROL and set(t) <= alphabet]  # else a mislabel that would grow the vocabulary
    backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types)
                        if kind == _USER_DEFINED and t in vocab])


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))
