"""OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``) as ``pb.GenerateRequest``. No I/O.

The HTTP front converts here, then takes the very path gRPC takes (``Frontend.prepare`` -> ``Relay``), so
both APIs validate, tokenize and generate alike. Every rejection is an ``InvalidParam`` (an
``InvalidRequest``) that names the offending parameter; unknown fields are ignored, as OpenAI's own
server does, but known features Baton lacks (``n`` > 1, ``echo``, tools, ...) are rejected, never
silently dropped. Logprobs: completions take ``logprobs: n``, chat ``logprobs: true`` with an optional
``top_logprobs: n`` (n in [0, 20], the engine's limit); either becomes ``SamplingParams.logprobs = n``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequest
from proto import baton_pb2 as pb


class InvalidParam(InvalidRequest):
    """A bad request body; ``param`` is the OpenAI parameter at fault (the error's ``param``)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


class Endpoint(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenAIRequest:
    endpoint: Endpoint
    generate: pb.GenerateRequest  # what Frontend.prepare takes, as from a gRPC client
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk carries the usage
    max_tokens_given: bool  # False: chat gets the rest of the context (completions keep the default 16)
    logprobs: int | None = None  # top-n logprobs per token asked for (0: the sampled token's only); None: none


# OpenAI (and vLLM's extra) sampling parameters: name -> (proto field, JSON types accepted).
_NUMBERS = (int, float)
_SCALARS: dict[str, tuple[str, tuple[type, ...]]] = {
    "temperature": ("temperature", _NUMBERS), "top_p": ("top_p", _NUMBERS), "seed": ("seed", (int,)),
    "presence_penalty": ("presence_penalty", _NUMBERS), "frequency_penalty": ("frequency_penalty", _NUMBERS),
    "top_k": ("top_k", (int,)), "min_p": ("min_p", _NUMBERS), "repetition_penalty": ("repetition_penalty", _NUMBERS),
    "min_tokens": ("min_tokens", (int,)),
}
# Known OpenAI features Baton does not implement: present and not null/false -> 400.
_UNSUPPORTED = ("logit_bias", "tools", "tool_choice", "functions", "function_call",
                "echo", "suffix", "audio", "prediction")
_INT32_MAX = 2**31 - 1
MAX_LOGPROBS = 20  # engine.sampling_params' limit on top-n logprobs


def parse(endpoint: Endpoint, body: object, request_id: str) -> OpenAIRequest:
    """A validated ``OpenAIRequest``; raises ``InvalidParam`` naming the parameter at fault."""
    if not isinstance(body, Mapping):
        raise InvalidParam(None, "the request body must be a JSON object")
    _check_unsupported(body)
    request = pb.GenerateRequest(request_id=request_id, model=_optional(body, "model", str) or "")
    if endpoint is Endpoint.CHAT:
        request.chat.CopyFrom(_chat(body))
    else:
        _set_prompt(request, body)
    max_tokens_given = _set_sampling(request.sampling, body)
    logprobs = _chat_logprobs(body) if endpoint is Endpoint.CHAT else _completion_logprobs(body)
    if logprobs is not None:
        request.sampling.logprobs = logprobs
    stream = bool(_optional(body, "stream", bool))
    options = _optional(body, "stream_options", Mapping) or {}
    if options and not stream:
        raise InvalidParam("stream_options", "stream_options is only allowed when stream is true")
    include_usage = bool(_optional(options, "include_usage", bool, name="stream_options.include_usage"))
    return OpenAIRequest(endpoint=endpoint, generate=request, stream=stream, include_usage=include_usage,
                         max_tokens_given=max_tokens_given, logprobs=logprobs)


@dataclass(frozen=True, slots=True)
class TokenizeBody:
    """vLLM's ``/tokenize`` body: a ``prompt`` (a string) or chat ``messages``, the ``model``, and whether each
    token's text is wanted too (``return_token_strs``)."""

    request: pb.TokenizeRequest
    model: str
    token_strs: bool


def parse_tokenize(body: object) -> TokenizeBody:
    """``{"prompt": str}`` or ``{"messages": [...]}`` as vLLM's ``/tokenize`` takes them; the options vLLM has that
    change the tokens (``add_special_tokens``, ``add_generation_prompt``) are accepted at their defaults only."""
    if not isinstance(body, Mapping):
        raise InvalidParam(None, "the request body must be a JSON object")
    request = pb.TokenizeRequest()
    if "messages" in body:
        request.chat.CopyFrom(_chat(body))
        _default_only(body, "add_generation_prompt", True)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise InvalidParam("prompt", "prompt must be a non-empty string (or send messages for a chat)")
        request.prompt = prompt
        _default_only(body, "add_special_tokens", True)
    return TokenizeBody(request, _optional(body, "model", str) or "", bool(_optional(body, "return_token_strs", bool)))


def parse_detokenize(body: object) -> tuple[list[int], str]:
    """vLLM's ``/detokenize`` body: (its ``tokens``, its ``model``); the range is checked against the vocabulary
    by ``Frontend.detokenize``."""
    if not isinstance(body, Mapping):
        raise InvalidParam(None, "the request body must be a JSON object")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not tokens or not all(_is_int(t) for t in tokens):
        raise InvalidParam("tokens", "tokens must be a non-empty list of token ids")
    return tokens, _optional(body, "model", str) or ""


def _default_only(body: Mapping[str, Any], key: str, default: bool) -> None:
    if _optional(body, key, bool) not in (None, default):
        raise InvalidParam(key, f"{key}={not default} is not supported (the tokens are what generation would use)")


def _check_unsupported(body: Mapping[str, Any]) -> None:
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, False):
            raise InvalidParam(name, f"{name} is not supported by this server")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise InvalidParam("n", f"n must be 1 (one choice per request), got {n!r}")
    best_of = body.get("best_of")
    if best_of is not None and (not _is_int(best_of) or best_of != 1):
        raise InvalidParam("best_of", f"best_of must be 1, got {best_of!r}")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise InvalidParam("response_format", "only response_format {\"type\": \"text\"} is supported")


def _completion_logprobs(body: Mapping[str, Any]) -> int | None:
    if body.get("top_logprobs") is not None:
        raise InvalidParam("top_logprobs", "top_logprobs is a chat parameter; completions take logprobs: n")
    return _top_n(body, "logprobs")


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    wanted = bool(_optional(body, "logprobs", bool))
    top_n = _top_n(body, "top_logprobs")
    if top_n is not None and not wanted:
        raise InvalidParam("top_logprobs", "top_logprobs requires logprobs to be true")
    return (top_n or 0) if wanted else None


def _top_n(body: Mapping[str, Any], name: str) -> int | None:
    value = _optional(body, name, (int,))
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise InvalidParam(name, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
    return value


def _set_prompt(request: pb.GenerateRequest, body: Mapping[str, Any]) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidParam("prompt", "prompt must not be empty")
        request.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        request.token_ids.ids.extend(prompt)  # range checked by Frontend against the vocabulary
    elif prompt is None:
        raise InvalidParam("prompt", "prompt is required")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise InvalidParam("prompt", f"prompt must be one string or one token list; got a batch of {len(prompt)}")
    else:
        raise InvalidParam("prompt", "prompt must be a non-empty string or a non-empty list of token ids")


def _chat(body: Mapping[str, Any]) -> pb.Chat:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidParam("messages", "messages must be a non-empty list of {role, content} objects")
    chat = pb.Chat()
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidParam(f"messages[{i}]", f"messages[{i}] must be an object with a string role")
        chat.messages.add(role=message["role"], content=_content(message.get("content"), i))
    return chat


def _content(content: object, index: int) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts joined."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, Mapping) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise InvalidParam(f"messages[{index}].content", "only text content parts are supported")
        return "".join(p["text"] for p in content)
    raise InvalidParam(f"messages[{index}].content", f"messages[{index}].content must be a string or text parts")


def _set_sampling(sampling: pb.SamplingParams, body: Mapping[str, Any]) -> bool:
    """Fill ``sampling``; True when the client set max_tokens / max_completion_tokens."""
    for name, (field, kinds) in _SCALARS.items():
        value = _optional(body, name, kinds)
        if value is not None:
            setattr(sampling, field, _in_range(name, value, field))
    max_tokens = _optional(body, "max_completion_tokens", (int,))
    max_tokens = max_tokens if max_tokens is not None else _optional(body, "max_tokens", (int,))
    if max_tokens is not None:
        if not 1 <= max_tokens <= _INT32_MAX:  # the engine re-checks >= 1; this keeps the proto field in range
            raise InvalidParam("max_tokens", f"max_tokens must be >= 1, got {max_tokens}")
        sampling.max_tokens = max_tokens
    sampling.stop.extend(_stop(body.get("stop")))
    stop_ids = _optional(body, "stop_token_ids", list) or []
    if not all(_is_int(t) and 0 <= t <= _INT32_MAX for t in stop_ids):
        raise InvalidParam("stop_token_ids", "stop_token_ids must be a list of non-negative integers")
    sampling.stop_token_ids.extend(stop_ids)
    sampling.ignore_eos = bool(_optional(body, "ignore_eos", bool))
    return max_tokens is not None


def _in_range(name: str, value: int | float, field: str) -> int | float:
    """Reject integers the proto field cannot hold (the engine validates the meaningful range)."""
    if field == "seed" and not 0 <= value < 2**63:
        raise InvalidParam(name, f"seed must be an integer in [0, 2**63), got {value}")
    if field in ("top_k", "min_tokens") and not 0 <= value <= _INT32_MAX:
        raise InvalidParam(name, f"{name} must be in [0, {_INT32_MAX}], got {value}")
    return value


def _stop(stop: object) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidParam("stop", "stop must be a non-empty string or a list of non-empty strings")
    return stops


def _optional(body: Mapping[str, Any], key: str, kinds: type | tuple[type, ...], *, name: str | None = None) -> Any:
    """``body[key]`` if present and not null, checked to be one of ``kinds`` (a bool is never a number)."""
    value = body.get(key)
    if value is None:
        return None
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        expected = " or ".join(_JSON_NAMES.get(k, k.__name__) for k in kinds)
        raise InvalidParam(name or key, f"{name or key} must be {expected}, got {type(value).__name__}")
    return value


_JSON_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "an array",
               Mapping: "an object"}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
