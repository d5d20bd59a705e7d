"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``. Torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequest

_MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` is greedy.

    ``seed`` makes sampling reproducible whatever the batch: randomness is drawn from
    (seed, output position, token id), never from a stateful generator. Unseeded requests get a
    random seed when they enter the engine.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept lists (or None) from callers, store tuples (the object is frozen and hashable).
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple(self.stop, "stop")
        object.__setattr__(self, "stop", stop)
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def _validate(self) -> None:
        _check(_finite(self.temperature) and self.temperature >= 0.0,
               "temperature", f"must be >= 0, got {self.temperature}")
        _check(self.top_k is None or (_is_int(self.top_k) and self.top_k >= 1),
               "top_k", f"must be None (disabled) or >= 1, got {self.top_k}")
        _check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0.0,
               "repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63),
               "seed", f"must be None or an integer in [0, 2**63), got {self.seed}")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "must be non-negative integers")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= _MAX_LOGPROBS),
               "logprobs", f"must be None or in [0, {_MAX_LOGPROBS}], got {self.logprobs}")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", f"must be a bool, got {self.ignore_eos!r}")


def _is_int(value: object) -> bool:
    """An int that is not a bool (``True`` must not pass as ``max_tokens=1``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _as_tuple(value: object, name: str) -> tuple:
    """A caller's list (any iterable) as a tuple; None means empty."""
    if value is None:
        return ()
    try:
        return tuple(value)
    except TypeError:
        raise InvalidRequest(f"{name} must be a list, got {value!r}") from None


def _finite(value: object) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidRequest(f"{name} {message}")
