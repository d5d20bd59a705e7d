"""Tokenizer and incremental detokenizer over a Hugging Face tokenizer folder.

Torch-free and transformers-free: the router imports this module. Encoding uses the folder's
``tokenizer.json`` through the ``tokenizers`` package, so it matches
``transformers.AutoTokenizer`` for fast tokenizers; chat templates render in a sandboxed Jinja
environment set up like transformers' (``raise_exception``, ``tojson``, ``strftime_now``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from engine.errors import InvalidRequest, ModelLoadError

if TYPE_CHECKING:
    from engine.gguf_file import GGUFFile

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# Prompt tokens decoded ahead of the output, so the first output token gets its leading space right.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True, slots=True, kw_only=True)
class SpecialTokens:
    """Special token strings (as the chat template sees them) and the ids the engine needs."""

    strings: Mapping[str, str]  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}
    bos_token_id: int | None
    eos_token_ids: frozenset[int]


class Tokenizer:
    """Text <-> token ids, plus chat templates. Build it with :meth:`from_pretrained`."""

    def __init__(self, backend: tokenizers.Tokenizer, specials: SpecialTokens, chat_template: str | None) -> None:
        self._backend = backend
        self._specials = specials
        self._template = None if chat_template is None else _compile_template(chat_template)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = specials.bos_token_id
        self.eos_token_ids: frozenset[int] = specials.eos_token_ids

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        if not folder.is_dir():
            raise ModelLoadError(f"tokenizer folder {folder} does not exist or is not a directory")
        backend = _load_backend(folder / TOKENIZER_FILE)
        config = _read_json(folder / TOKENIZER_CONFIG_FILE, required=False)
        specials = _load_specials(folder, config, backend)
        return cls(backend, specials, _load_chat_template(folder, config))

    @classmethod
    def from_model(cls, model: str | Path | GGUFFile) -> Tokenizer:
        """The tokenizer of a Hugging Face folder (``tokenizer.json``) or of a GGUF file (its metadata; pass the
        opened ``GGUFFile`` when there is one, so the file is not read twice)."""
        if isinstance(model, (str, Path)) and not Path(model).is_file():
            return cls.from_pretrained(model)
        return cls.from_gguf(model)

    @classmethod
    def from_gguf(cls, gguf: str | Path | GGUFFile) -> Tokenizer:
        """Everything from the file's metadata: vocabulary, merges, special tokens, chat template."""
        from engine import gguf_tokenizer
        from engine.gguf_file import GGUFFile

        f = gguf if isinstance(gguf, GGUFFile) else GGUFFile(gguf)
        bos_id, eos_ids = gguf_tokenizer.special_ids(f)
        specials = SpecialTokens(strings=gguf_tokenizer.special_token_strings(f), bos_token_id=bos_id,
                                 eos_token_ids=eos_ids)
        return cls(gguf_tokenizer.build_backend(f), specials, gguf_tokenizer.chat_template(f))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequest(f"text to encode must be a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(token_ids)
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise InvalidRequest(f"token ids must be in [0, {self.vocab_size}), got min {min(ids)} max {max(ids)}")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise InvalidRequest("this model's tokenizer has no chat_template; send a plain prompt instead")
        _check_messages(messages)
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._specials.strings
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"chat template rejected the messages: {exc}") from exc

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Render and encode a chat like ``transformers`` ``apply_chat_template(tokenize=True)``.

        The template already writes the special tokens it wants (e.g. ``bos_token``), so encoding
        adds none; calling ``encode(apply_chat_template(...))`` would add a second BOS.
        """
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing stream of output token ids into text deltas.

    Keeps a small window ``ids[prefix_offset:]`` (as vLLM / TGI do): each step decodes the window
    twice, so the cost per step does not grow with the sequence. A delta is held back while the
    decoded tail ends in U+FFFD, i.e. while a multi-byte character is still incomplete.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window = list(prompt_token_ids[max(len(prompt_token_ids) - _PROMPT_CONTEXT_TOKENS, 0) :])
        self._prefix_offset = 0  # the window's first token: context for the leading space
        self._read_offset = len(self._window)  # tokens before this are already emitted as text
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return "".join(self._chunks)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Adds output tokens; returns the text they complete (possibly empty)."""
        self._window.extend(new_token_ids)
        emitted_text = self._decode(self._prefix_offset, self._read_offset)
        window_text = self._decode(self._prefix_offset, len(self._window))
        if len(window_text) <= len(emitted_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = window_text[len(emitted_text) :]
        self._advance()
        self._chunks.append(delta)
        return delta

    def finish(self) -> str:
        """Emits whatever is held back (an incomplete character decodes to U+FFFD) at end of stream."""
        emitted_text = self._decode(self._prefix_offset, self._read_offset)
        window_text = self._decode(self._prefix_offset, len(self._window))
        delta = window_text[len(emitted_text) :]
        self._advance()
        if delta:
            self._chunks.append(delta)
        return delta

    def _advance(self) -> None:
        # Slide the window: what was unread becomes the context for the next step.
        del self._window[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._window)

    def _decode(self, start: int, stop: int) -> str:
        return self._tokenizer.decode(self._window[start:stop], self._skip_special_tokens)


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"missing {path.name} in {path.parent}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _load_backend(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise ModelLoadError(f"missing {path.name} in {path.parent} (only fast tokenizers are supported)")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a plain Exception on malformed files
        raise ModelLoadError(f"cannot load {path}: {exc}") from exc


def _token_content(value: object) -> str | None:
    """A special token as saved by transformers: a plain string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _load_specials(folder: Path, config: dict[str, Any], backend: tokenizers.Tokenizer) -> SpecialTokens:
    merged = {**_read_json(folder / SPECIAL_TOKENS_MAP_FILE, required=False), **config}
    strings = {name: token for name in _SPECIAL_TOKEN_NAMES if (token := _token_content(merged.get(name)))}
    bos = strings.get("bos_token")
    eos_ids = set(_generation_eos_ids(folder))
    if (eos_id := _token_id(backend, strings.get("eos_token"))) is not None:
        eos_ids.add(eos_id)
    return SpecialTokens(strings=strings, bos_token_id=_token_id(backend, bos), eos_token_ids=frozenset(eos_ids))


def _token_id(backend: tokenizers.Tokenizer, token: str | None) -> int | None:
    return None if token is None else backend.token_to_id(token)


def _generation_eos_ids(folder: Path) -> list[int]:
    value = _read_json(folder / GENERATION_CONFIG_FILE, required=False).get("eos_token_id")
    values = value if isinstance(value, list) else [value]
    if not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in values):
        raise ModelLoadError(f"{GENERATION_CONFIG_FILE} in {folder}: eos_token_id must be an int or a list of ints")
    return [v for v in values if v is not None]


def _load_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """``chat_template.jinja`` (transformers >= 4.50 saves it there) or the config's entry."""
    jinja_file = folder / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(f"{TOKENIZER_CONFIG_FILE} in {folder}: chat_template must be a string")
    return template


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(f"chat_template is not valid Jinja: {exc}") from exc


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    # transformers' tojson: no HTML escaping, unlike Jinja's built-in filter.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{index}] must be an object with a string 'role'")
