"""OpenAI's ``logprobs`` objects from the token ids and ``pb.Logprobs`` a Generate stream carries. No I/O.

- completions (``logprobs: n``): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, where each
  ``top_logprobs`` entry maps the n most likely tokens' text, and the sampled token's, to their logprobs
  (so up to n + 1 entries, as OpenAI documents) and ``text_offset`` is each token's offset in the text.
- chat (``logprobs: true, top_logprobs: n``): ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}],
  "refusal": null}``.

A token's text is the tokenizer's decoding of that token alone (special tokens included) and ``bytes`` its
UTF-8 encoding. Logprobs are of the model's raw distribution (the engine's convention), the workers' floats
unchanged. Streaming takes the entries of the tokens added since the last ``take``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.tokenizer import Tokenizer
from proto import baton_pb2 as pb


class LogprobsBuilder:
    def __init__(self, tokenizer: Tokenizer, *, chat: bool) -> None:
        self._tokenizer, self._chat = tokenizer, chat
        self._pending: list[tuple[int, pb.Logprobs]] = []
        self._text_offset = 0  # completions: chars of the token texts already taken
        self._texts: dict[int, str] = {}  # token id -> its text (top lists repeat tokens)

    def add(self, token_ids: Sequence[int], logprobs: Sequence[pb.Logprobs]) -> None:
        self._pending.extend(zip(token_ids, logprobs))

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def take(self) -> dict[str, Any]:
        """The logprobs object of the tokens added since the last call."""
        entries, self._pending = self._pending, []
        return self._chat_object(entries) if self._chat else self._completion_object(entries)

    def _text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _completion_object(self, entries: list[tuple[int, pb.Logprobs]]) -> dict[str, Any]:
        tokens = [self._text(token_id) for token_id, _ in entries]
        offsets = []
        for text in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for _, lp in entries],
            "top_logprobs": [self._top_dict(token_id, lp) for token_id, lp in entries],
            "text_offset": offsets,
        }

    def _top_dict(self, token_id: int, logprobs: pb.Logprobs) -> dict[str, float]:
        top = {self._text(t.token_id): t.logprob for t in logprobs.top}
        top.setdefault(self._text(token_id), logprobs.logprob)
        return top

    def _chat_object(self, entries: list[tuple[int, pb.Logprobs]]) -> dict[str, Any]:
        content = [
            {**self._chat_token(token_id, lp.logprob),
             "top_logprobs": [self._chat_token(t.token_id, t.logprob) for t in lp.top]}
            for token_id, lp in entries
        ]
        return {"content": content, "refusal": None}

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
