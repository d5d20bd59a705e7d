"""Speculative decoding's core (no torch): n-gram prompt-lookup drafts, verification, acceptance books.

A running decode normally computes one token per step. With speculation on, the scheduler appends up to
``num_speculative_tokens`` draft tokens to it: the tokens that followed the most recent earlier occurrence of
the sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``: vLLM's n-gram
"prompt lookup"). One forward pass computes the target's logits at every one of those positions, and the
sampler draws the target's token at each exactly as it would without speculation: from the same logits (same
prefix) and the same (seed, output position) noise. ``accepted`` keeps the drafts up to the first one that
differs from the target's token there, plus the target's token after them; so the stream is the same token
for token with speculation on or off, greedy or seeded, on any worker. Rejected drafts' KV slots are simply
recomputed over later (the request's computed length counts only accepted tokens), and blocks allocated past
what the request now needs go back to the pool.

Auto-off: a request whose drafts keep failing (``min_acceptance`` of its drafted tokens after
``probe_tokens``) stops drafting: each draft row costs a forward row, which a CPU pays in full.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from engine.core.config_dicts import check_keys, check_types
from engine.errors import InvalidRequest

SEARCH_WINDOW = 4096  # tokens of the sequence's tail searched for an earlier occurrence
DRAFT_SLOT = -1  # a draft token the draft model has yet to choose (never reaches the model)


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` shape: method "ngram" (prompt lookup, no draft model), or "draft_model"
    with ``model`` (a smaller checkpoint with the target's vocabulary; the method is implied by ``model``)."""

    method: str = ""  # "" -> "draft_model" with a model, else "ngram"
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    min_acceptance: float = 0.1  # a request whose drafts are accepted less than this stops drafting
    probe_tokens: int = 32  # ... once it drafted this many tokens

    def __post_init__(self) -> None:
        if not self.method:
            object.__setattr__(self, "method", "draft_model" if self.model else "ngram")
        if self.method not in ("ngram", "draft_model"):
            raise InvalidRequest(f"speculative method {self.method!r} is not supported (ngram, draft_model)")
        if (self.method == "draft_model") != (self.model is not None):
            raise InvalidRequest("speculative method draft_model needs a model, and only it takes one")
        if self.num_speculative_tokens < 1:
            raise InvalidRequest(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidRequest("speculative config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                 f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @staticmethod
    def from_dict(raw: Mapping) -> SpeculativeConfig:
        """The dict vLLM users pass (``--speculative-config``, ``LLM(speculative_config=...)``): Baton's fields,
        and vLLM's keys of features Baton lacks only where they restate vLLM's default, which is Baton's too."""
        where = "speculative_config"
        fields = dict(raw)
        if "method" in fields and fields["method"] is None:
            del fields["method"]  # vLLM's default: implied by the model
        for key, default in VLLM_DEFAULTS.items():
            if key in fields and fields.pop(key) != default:
                raise InvalidRequest(f"{where}: {key!r} is vLLM's; Baton has only its default {default!r} "
                                     f"(got {raw[key]!r})")
        check_keys(where, fields, SpeculativeConfig.__dataclass_fields__)
        check_types(where, SpeculativeConfig, fields)
        return SpeculativeConfig(**fields)


# vLLM's speculative keys Baton has no use for, taken only with the value that restates what Baton does (any other
# value is refused, never ignored). Left out, so refused whatever their value as unknown keys: those whose vLLM
# default is not what Baton does (rejection_sample_method "standard" is a probabilistic test, Baton's is equality
# under the same noise), or defers to the target or the draft's checkpoint in ways Baton's draft does not promise
# to match (enforce_eager, quantization, kv_cache_dtype, max_model_len, draft_tensor_parallel_size, revision, ...).
VLLM_DEFAULTS: dict[str, object] = {
    "draft_sample_method": "greedy",  # Baton's draft model chooses its drafts greedily
    "parallel_drafting": False,  # drafts come one after another
    "use_heterogeneous_vocab": False,  # the draft must share the target's vocabulary
    "disable_padded_drafter_batch": False,  # EAGLE only
    "num_speculative_tokens_per_batch_size": None,  # one num_speculative_tokens at every batch size
}


def ngram_drafts(token_ids: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``num_tokens`` tokens that followed the most recent earlier occurrence of the sequence's last n
    tokens, for the longest n in [min_n, max_n] that occurred; [] when none did."""
    tail = np.asarray(token_ids[-SEARCH_WINDOW:], dtype=np.int64)  # [L]
    for n in range(min(max_n, len(tail) - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tail[:-1], n)  # [L - n, n] every earlier n-gram
        hits = np.flatnonzero((windows == tail[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the token after the most recent earlier occurrence
            return tail[start : start + num_tokens].tolist()
    return []


def accepted(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a speculative step yields: ``sampled[j]`` is the target's token at the j-th position (after
    the drafts before it); the drafts are kept while they equal it, then the target's own token follows."""
    num = 0
    while num < len(drafts) and drafts[num] == sampled[num]:
        num += 1
    return list(sampled[: num + 1])


class Speculator:
    """Drafts for the scheduler, and the acceptance books (per request for auto-off, and in total)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._books: dict[str, list[int]] = {}  # request id -> [drafted, accepted]
        self._off: set[str] = set()
        self.num_drafted = self.num_accepted = self.num_steps = 0  # in total, since start

    def drafts(self, request, room: int) -> list[int]:
        """Drafts for a running decode of ``request``, at most ``room`` of them (budget, length, max_tokens)."""
        config = self.config
        room = min(room, config.num_speculative_tokens)
        if room < 1 or request.request_id in self._off or request.sampling_params.needs_penalties:
            return []
        if config.method == "draft_model":
            return [DRAFT_SLOT] * room  # slots the draft model fills in the step (engine/spec_draft.py)
        return ngram_drafts(request.all_token_ids, room, config.prompt_lookup_min, config.prompt_lookup_max)

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        books = self._books.setdefault(request_id, [0, 0])
        books[0] += num_drafted
        books[1] += num_accepted
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_steps += 1
        if books[0] >= self.config.probe_tokens and books[1] < self.config.min_acceptance * books[0]:
            self._off.add(request_id)

    def forget(self, request_id: str) -> tuple[int, int]:
        """A finished request's (drafted, accepted) tokens; its books are dropped."""
        self._off.discard(request_id)
        drafted, accepted_ = self._books.pop(request_id, (0, 0))
        return drafted, accepted_
