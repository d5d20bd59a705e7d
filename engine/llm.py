"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.core.config_dicts import check_keys
from engine.core.outputs import RequestDelta
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from engine.text_stream import TextStream

if TYPE_CHECKING:
    from engine.gguf_file import GGUFFile
    from engine.tokenizer import Tokenizer

# What ``generate`` takes per prompt, as vLLM does: text, token ids, or vLLM's prompt dicts.
Prompt = str | Sequence[int] | Mapping[str, Any]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = True


@dataclass(slots=True)
class _Live:
    output: RequestOutput
    text: TextStream | None  # None: the model has no tokenizer (token ids only)


class LLM:
    """Offline batch generation. Extra keyword arguments are EngineConfig fields (``tensor_parallel_size=2``
    starts a second rank process: ``close()`` it, or use the LLM as a context manager); nested configs also as
    vLLM's dicts (``speculative_config={"method": "ngram", "num_speculative_tokens": 3}``, ``compilation_config``)."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        fields = [name for name in inspect.signature(EngineConfig).parameters if name != "model"]
        check_keys("LLM", engine_args, fields, noun="argument")  # not a TypeError from deep inside
        self.engine = Engine(EngineConfig(model=model, **engine_args))
        self.tokenizer = load_tokenizer(self.engine.gguf or self.engine.model_path)
        if self.tokenizer is not None and not self.engine.eos_token_ids:
            self.engine.eos_token_ids = self.tokenizer.eos_token_ids
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's tensor-parallel ranks, if any (they also stop when this process ends)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns in prompt order. Interrupted (an exception, Ctrl-C, an error
        in ``progress``), it aborts its requests, so the engine is ready for the next call."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        states: dict[str, _Live] = {}
        done: dict[str, RequestOutput] = {}
        try:
            for prompt, p in zip(prompts, params):
                request_id, states[request_id] = self._add(prompt, p)
            while len(done) < len(states):
                for delta in self.engine.step():
                    self._apply(states[delta.request_id], delta, done)
                if progress:
                    progress(len(done), len(states))
        except BaseException:
            for request_id in states.keys() - done.keys():
                self.engine.abort(request_id)
            raise
        return [done[request_id] for request_id in states]

    def _add(self, prompt: Prompt, params: SamplingParams) -> tuple[str, _Live]:
        request_id = str(next(self._ids))
        token_ids, text = self._tokenize(prompt)
        request = self.engine.add_request(request_id, token_ids, params)
        stream = None if self.tokenizer is None else TextStream(self.tokenizer, token_ids, params.stop)
        out = RequestOutput(request_id, text, request.prompt_token_ids, [CompletionOutput(0, "", [], None)])
        return request_id, _Live(out, stream)

    def _tokenize(self, prompt: Prompt) -> tuple[list[int], str | None]:
        text, token_ids = _parse_prompt(prompt)
        if token_ids is not None:
            return token_ids, text
        if not text:
            raise InvalidRequest("prompt must not be empty")
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer; pass token ids instead of text")
        return self.tokenizer.encode(text), text

    def _apply(self, state: _Live, delta: RequestDelta, done: dict[str, RequestOutput]) -> None:
        completion = state.output.outputs[0]
        completion.token_ids.extend(delta.new_token_ids)
        if delta.new_logprobs:
            if completion.logprobs is None:
                completion.logprobs = []
            completion.logprobs.extend(delta.new_logprobs)
        finished = delta.finish_reason is not None
        if state.text is not None:
            state.text.add(delta.new_token_ids)
            if finished and not state.text.stopped:
                state.text.finish()  # held-back text; a stop string it completes
            if state.text.stopped and completion.finish_reason is None:
                completion.finish_reason, completion.stop_reason = "stop", state.text.stop_string
                if not finished:
                    self.engine.abort(delta.request_id)
                    finished = True
        if finished and completion.finish_reason is None:
            completion.finish_reason = delta.finish_reason.value
        if finished:
            if state.text is not None:
                completion.text = state.text.text  # joined once: grown per step it was copied whole each time
            state.output.num_cached_tokens = delta.num_cached_tokens
            done[delta.request_id] = state.output


def load_tokenizer(model: Path | GGUFFile) -> Tokenizer | None:
    """The tokenizer of a checkpoint folder or (opened) GGUF file; None when it has none (token ids only)."""
    from engine.tokenizer import Tokenizer

    if isinstance(model, Path):
        has_tokenizer = model.is_file() or (model / "tokenizer.json").is_file()
    else:
        has_tokenizer = model.has_tokenizer
    return Tokenizer.from_model(model) if has_tokenizer else None


def _parse_prompt(prompt: object) -> tuple[str | None, list[int] | None]:
    """(text, None) or (text or None, token ids) from one prompt in any accepted form."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, Mapping):
        return _parse_prompt_dict(prompt)
    if isinstance(prompt, Sequence) and all(_is_token(t) for t in prompt):
        return None, list(prompt)
    raise InvalidRequest(
        f"a prompt must be a str, a list of token ids, {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}; "
        f"got {_describe(prompt)}"
    )


def _parse_prompt_dict(prompt: Mapping) -> tuple[str | None, list[int] | None]:
    unknown = sorted(map(str, prompt.keys() - {"prompt", "prompt_token_ids"}))
    if unknown:
        raise InvalidRequest(f"prompt dict has unsupported keys {unknown}; use 'prompt' or 'prompt_token_ids'")
    text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    if token_ids is not None:
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence) or not all(
                _is_token(t) for t in token_ids):
            raise InvalidRequest(f"'prompt_token_ids' must be a list of ints, got {_describe(token_ids)}")
        if text is not None and not isinstance(text, str):
            raise InvalidRequest(f"'prompt' must be a str, got {_describe(text)}")
        return text, list(token_ids)
    if not isinstance(text, str):
        raise InvalidRequest(f"'prompt' must be a str, got {_describe(text)}")
    return text, None


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe(value: object) -> str:
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {', '.join(kinds) or 'nothing'}"
    return f"a {type(value).__name__}"


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise InvalidRequest(f"prompts must be a prompt or a list of prompts, got {_describe(prompts)}")
    prompts = list(prompts)
    if prompts and all(_is_token(t) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise InvalidRequest(f"got {len(params)} sampling params for {n} prompts")
    return params
