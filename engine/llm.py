"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

from engine.config import EngineConfig
from engine.core.outputs import RequestDelta
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


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
    detok: object | None
    stop: tuple[str, ...]


class LLM:
    """Offline batch generation. Extra keyword arguments are EngineConfig fields."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_args))
        self.tokenizer = _load_tokenizer(self.engine.model_path)
        if self.tokenizer is not None and not self.engine.eos_token_ids:
            self.engine.eos_token_ids = self.tokenizer.eos_token_ids
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        states: dict[str, _Live] = {}
        try:
            for prompt, p in zip(prompts, params):
                request_id, states[request_id] = self._add(prompt, p)
        except Exception:
            for request_id in states:
                self.engine.abort(request_id)
            raise
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                self._apply(states[delta.request_id], delta, done)
            if progress:
                progress(len(done), len(states))
        return [done[request_id] for request_id in states]

    def _add(self, prompt: Prompt, params: SamplingParams) -> tuple[str, _Live]:
        request_id = str(next(self._ids))
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt must not be empty")
            if self.tokenizer is None:
                raise InvalidRequest("this model folder has no tokenizer; pass token ids instead of text")
            token_ids, text = self.tokenizer.encode(prompt), prompt
        else:
            token_ids, text = list(prompt), None
        request = self.engine.add_request(request_id, token_ids, params)
        detok = None
        if self.tokenizer is not None:
            from engine.tokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer, token_ids)
        out = RequestOutput(request_id, text, request.prompt_token_ids, [CompletionOutput(0, "", [], None)])
        return request_id, _Live(out, detok, params.stop)

    def _apply(self, state: _Live, delta: RequestDelta, done: dict[str, RequestOutput]) -> None:
        completion = state.output.outputs[0]
        completion.token_ids.extend(delta.new_token_ids)
        if delta.new_logprobs:
            completion.logprobs = (completion.logprobs or []) + list(delta.new_logprobs)
        if state.detok is not None:
            completion.text += state.detok.step(delta.new_token_ids)
            if state.stop and delta.finish_reason is None and _truncate_at_stop(completion, state.stop):
                self.engine.abort(delta.request_id)
                completion.finish_reason = "stop"
        if delta.finish_reason is not None and completion.finish_reason is None:
            completion.finish_reason = delta.finish_reason.value
        if completion.finish_reason is not None:
            state.output.num_cached_tokens = delta.num_cached_tokens
            done[delta.request_id] = state.output


def _truncate_at_stop(completion: CompletionOutput, stops: tuple[str, ...]) -> bool:
    hits = [(completion.text.find(s), s) for s in stops if s in completion.text]
    if not hits:
        return False
    index, stop = min(hits)
    completion.text = completion.text[:index]
    completion.stop_reason = stop
    return True


def _load_tokenizer(folder):
    if not (folder / "tokenizer.json").is_file():
        return None
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(folder)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
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
