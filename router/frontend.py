"""Validation and tokenization of public requests: proto in, a typed ``Job`` out. No I/O.

Every rejection is an ``InvalidRequest`` whose message names the offending field.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass

from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from proto import baton_pb2 as pb
from router.convert import sampling_from_proto, with_seed

MAX_REQUEST_ID_CHARS = 128


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """A validated, tokenized request, ready to route."""

    request_id: str  # as the client knows it (assigned when the client sent none)
    worker_request_id: str  # unique per router request: what workers see, and what Abort names
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # seed always set
    cache_salt: str = ""
    priority: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelLimits:
    name: str
    vocab_size: int
    max_model_len: int


class Frontend:
    def __init__(self, tokenizer: Tokenizer, limits: ModelLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits

    def prepare(self, request: pb.GenerateRequest) -> Job:
        self.check_model(request.model)
        params = with_seed(sampling_from_proto(request.sampling if request.HasField("sampling") else None))
        field, token_ids = self._prompt_ids(request, request.WhichOneof("input"))
        self._check_length(field, token_ids)
        request_id, worker_request_id = _request_ids(request.request_id)
        return Job(
            request_id=request_id, worker_request_id=worker_request_id, prompt_token_ids=tuple(token_ids),
            params=params, cache_salt=request.cache_salt, priority=request.priority,
        )

    def tokenize(self, request: pb.TokenizeRequest) -> list[int]:
        return self._prompt_ids(request, request.WhichOneof("input"))[1]

    def detokenize(self, ids: list[int]) -> str:
        """The text of ``ids`` (each checked against the vocabulary), special tokens included."""
        self._check_token_ids(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _prompt_ids(self, request: pb.GenerateRequest | pb.TokenizeRequest, kind: str | None) -> tuple[str, list[int]]:
        if kind == "prompt":
            if not request.prompt:
                raise InvalidRequest("prompt must not be empty")
            ids = self.tokenizer.encode(request.prompt)
        elif kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            if not messages:
                raise InvalidRequest("chat.messages must not be empty")
            ids = self.tokenizer.encode_chat(messages)
        elif kind == "token_ids":
            ids = list(request.token_ids.ids)
            self._check_token_ids(ids)
        else:
            raise InvalidRequest("input is required: set one of prompt, token_ids, chat")
        if not ids:
            raise InvalidRequest(f"{kind} encodes to no tokens")
        return kind, ids

    def check_model(self, model: str) -> None:
        if model and model != self.limits.name:
            raise InvalidRequest(f"model {model!r} is not served here; this router serves {self.limits.name!r}")

    def _check_token_ids(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequest("token_ids must not be empty")
        vocab = self.limits.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequest(f"token_ids must be in [0, {vocab}), got min {min(ids)} max {max(ids)}")

    def _check_length(self, field: str, ids: list[int]) -> None:
        limit = self.limits.max_model_len
        if len(ids) >= limit:
            raise InvalidRequest(
                f"{field} has {len(ids)} tokens; it must be shorter than max_model_len ({limit}) "
                "to leave room for an output token"
            )


def _request_ids(client_id: str) -> tuple[str, str]:
    """(client-visible id, worker id). Client ids may repeat, so workers get a unique suffix."""
    if len(client_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(client_id)}")
    if not client_id:
        generated = uuid.uuid4().hex
        return generated, generated
    return client_id, f"{client_id}-{secrets.token_hex(4)}"
