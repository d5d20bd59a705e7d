"""SamplingBatch: per-row sampling inputs for one step, as tensors, plus how the sampler splits the rows
(decided here, on the host, from the params: the sampler never reads a device value to decide)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling.penalties import SeenTokens
from engine.sampling_params import SamplingParams

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
TOP_P_CANDIDATES = 1024  # candidates of a row with top-p or min-p but no top-k
TOP_K_MARGIN = 16  # a top-k row's candidates: k + max(k // 2, this), room for ties at the k-th logit
FULL_SORT_FRACTION = 4  # candidates beyond V / this: sort the whole row instead


@dataclass(frozen=True, slots=True)
class RowSet:
    """Some of a batch's B rows: ``index`` [R] int64, or None when they are all of them (or, size 0, none)."""

    index: torch.Tensor | None
    size: int

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """The set's rows of a [B, ...] tensor."""
        return rows if self.index is None else rows.index_select(0, self.index)  # [R, ...]

    def put(self, into: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``into`` [B] with the set's rows replaced by ``values`` [R] (out of place)."""
        return values if self.index is None else into.index_copy(0, self.index, values)  # [B]


@dataclass(frozen=True, slots=True, kw_only=True)
class RowGroups:
    """Which path each row takes. Greedy rows: argmax; plain rows (random, no filter): the race over the
    whole vocabulary; filtered rows (top-k / top-p / min-p): the race over their candidates."""

    any_greedy: bool
    plain: RowSet
    filtered: RowSet
    num_candidates: int  # K, the filtered rows' candidates (V: a full sort)
    needs_mass: bool  # some filtered row has top-p and neither top-k nor min-p (needs the row's total mass)


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingBatch:
    """Per-row sampling inputs for one step; B = rows being sampled. Built by the model runner."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor | None  # [B] int64 in [1, V]; V means disabled; None: no row uses top-k
    top_p: torch.Tensor | None  # [B] float32 in (0, 1]; None: no row uses top-p
    min_p: torch.Tensor | None  # [B] float32; None: no row uses min-p
    seeds: torch.Tensor  # [B] int64 per-request seed
    positions: torch.Tensor  # [B] int64 index of the token being sampled among the request's outputs
    repetition_penalty: torch.Tensor | None  # [B] float32; None: no row uses penalties (nor the 3 below)
    presence_penalty: torch.Tensor | None  # [B] float32
    frequency_penalty: torch.Tensor | None  # [B] float32
    seen_tokens: SeenTokens | None  # [B, W] each row's distinct prompt/output tokens and output counts
    prompt_token_ids: torch.Tensor | None  # [B, Lp] int64, padded with V (``from_params`` only)
    output_token_ids: torch.Tensor | None  # [B, Lo] int64, padded with V (``from_params`` only)
    banned_rows: torch.Tensor | None  # [N] int64 row of each banned (row, token) pair
    banned_tokens: torch.Tensor | None  # [N] int64 token whose logit is set to -inf in that row
    max_num_logprobs: int | None  # None: no row wants logprobs; else the max top-n over rows
    all_greedy: bool
    groups: RowGroups

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        positions: Sequence[int],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        banned: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatch:
        """Builds the tensors from plain Python, penalties counted from scratch (the runner keeps them
        incrementally: ``SamplingBatchBuilder``); banned ids outside [0, vocab_size) are ignored."""
        _check_lengths(len(params), seeds=seeds, positions=positions, prompt_token_ids=prompt_token_ids,
                       output_token_ids=output_token_ids, banned=banned)
        penalised = [p.needs_penalties for p in params]
        seen = None
        if any(penalised):
            empty: list[int] = []
            seen = SeenTokens.from_lists([p if on else empty for p, on in zip(prompt_token_ids, penalised)],
                                         [o if on else empty for o, on in zip(output_token_ids, penalised)], device)
        padded = {"prompt_token_ids": None, "output_token_ids": None}
        if seen is not None:
            padded = {"prompt_token_ids": _padded(prompt_token_ids, vocab_size, device),  # [B, Lp]
                      "output_token_ids": _padded(output_token_ids, vocab_size, device)}  # [B, Lo]
        return cls.build(params, seeds, positions, banned, seen, vocab_size, device, **padded)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int], positions: Sequence[int],
              banned: Sequence[Sequence[int]], seen_tokens: SeenTokens | None, vocab_size: int,
              device: torch.device | str, **padded: torch.Tensor | None) -> SamplingBatch:
        """The batch, given each penalised row's seen tokens (None when no row has penalties)."""
        random = [not _is_greedy(p) for p in params]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        any_random = any(random)
        top_k = [min(p.top_k or vocab_size, vocab_size) if r else vocab_size for p, r in zip(params, random)]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            **(_filter_fields(params, random, top_k, vocab_size, device) if any_random else _NO_FILTERS),
            seeds=torch.tensor(list(seeds), dtype=torch.int64, device=device),
            positions=torch.tensor(list(positions), dtype=torch.int64, device=device),
            **_penalty_fields(params, seen_tokens, device),
            prompt_token_ids=padded.get("prompt_token_ids"), output_token_ids=padded.get("output_token_ids"),
            **_banned_fields(banned, vocab_size, device),
            max_num_logprobs=max(logprobs) if logprobs else None,
            all_greedy=not any_random,
            groups=row_groups(params, top_k, vocab_size, device) if any_random else _ALL_GREEDY,
        )


_NO_FILTERS = {"top_k": None, "top_p": None, "min_p": None}
_ALL_GREEDY = RowGroups(any_greedy=True, plain=RowSet(None, 0), filtered=RowSet(None, 0), num_candidates=1,
                        needs_mass=False)


def _filter_fields(params: Sequence[SamplingParams], random: list[bool], top_k: list[int], vocab_size: int,
                   device: torch.device | str) -> dict[str, torch.Tensor | None]:
    """top_k / top_p / min_p [B] each, or None where no random row uses it (greedy rows: disabled)."""
    return {
        "top_k": _optional(top_k, vocab_size, torch.int64, device),
        "top_p": _optional([p.top_p if r else 1.0 for p, r in zip(params, random)], 1.0, torch.float32, device),
        "min_p": _optional([p.min_p if r else 0.0 for p, r in zip(params, random)], 0.0, torch.float32, device),
    }


def row_groups(params: Sequence[SamplingParams], top_k: Sequence[int], vocab_size: int,
               device: torch.device | str) -> RowGroups:
    """Splits the rows by path and picks the filtered rows' candidate count (see RowGroups)."""
    greedy = [_is_greedy(p) for p in params]
    filtered = [not g and (k < vocab_size or p.top_p < 1.0 or p.min_p > 0.0)
                for p, g, k in zip(params, greedy, top_k)]
    plain = [not g and not f for g, f in zip(greedy, filtered)]
    needs = [k + max(k // 2, TOP_K_MARGIN) if k < vocab_size else TOP_P_CANDIDATES
             for k, f in zip(top_k, filtered) if f]
    num_candidates = min(max(needs, default=1), vocab_size)
    if num_candidates * FULL_SORT_FRACTION > vocab_size:
        num_candidates = vocab_size
    needs_mass = any(f and k >= vocab_size and p.min_p <= 0.0 and p.top_p < 1.0
                     for p, f, k in zip(params, filtered, top_k))
    return RowGroups(any_greedy=any(greedy), plain=_row_set(plain, device), filtered=_row_set(filtered, device),
                     num_candidates=num_candidates, needs_mass=needs_mass)


def _row_set(member: list[bool], device: torch.device | str) -> RowSet:
    rows = [row for row, inside in enumerate(member) if inside]
    if len(rows) == len(member):
        return RowSet(None, len(rows))
    return RowSet(torch.tensor(rows, dtype=torch.int64, device=device) if rows else None, len(rows))


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < SAMPLING_EPS


def _check_lengths(num_rows: int, **columns: Sequence[object]) -> None:
    for name, column in columns.items():
        if len(column) != num_rows:
            raise ValueError(f"{name} has {len(column)} rows, expected {num_rows}")


def _optional(values: list, disabled: float, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor | None:
    """A [B] tensor of ``values``, or None when every row has the ``disabled`` value."""
    if all(value == disabled for value in values):
        return None
    return torch.tensor(values, dtype=dtype, device=device)  # [B]


def _penalty_fields(params: Sequence[SamplingParams], seen_tokens: SeenTokens | None,
                    device: torch.device | str) -> dict[str, object]:
    names = ("repetition_penalty", "presence_penalty", "frequency_penalty")
    if seen_tokens is None:
        return dict.fromkeys((*names, "seen_tokens"))
    fields: dict[str, object] = {name: torch.tensor([getattr(p, name) for p in params], dtype=torch.float32,
                                                    device=device) for name in names}  # each [B]
    fields["seen_tokens"] = seen_tokens
    return fields


def _padded(rows: Sequence[Sequence[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    """Rows of token ids as one [B, L] int64 tensor, right-padded with ``pad``."""
    width = max((len(row) for row in rows), default=0)
    flat = [token for row in rows for token in (*row, *([pad] * (width - len(row))))]
    return torch.tensor(flat, dtype=torch.int64, device=device).view(len(rows), width)  # [B, L]


def _banned_fields(banned: Sequence[Sequence[int]], vocab_size: int,
                   device: torch.device | str) -> dict[str, torch.Tensor | None]:
    pairs = [(row, token) for row, tokens in enumerate(banned) for token in tokens if 0 <= token < vocab_size]
    if not pairs:
        return {"banned_rows": None, "banned_tokens": None}
    rows, tokens = torch.tensor(pairs, dtype=torch.int64, device=device).unbind(dim=1)  # [N] x2
    return {"banned_rows": rows, "banned_tokens": tokens}
