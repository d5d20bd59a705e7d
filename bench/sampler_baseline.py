"""PRE-CHANGE REFERENCE, for ``bench/sampler.py`` only: ``engine/sampler.py`` as it was at commit 5e0f680,
before issue 17 part 4 (dense [B, V] penalty counts rebuilt from padded Python lists each step, full-vocabulary
sorts for top-k / top-p, noise hashed for every vocabulary entry). Kept verbatim below this note, so the
benchmark can time it side by side with the current sampler in the same run; nothing in the engine imports it.

Its original docstring:

Batched sampler for one engine step: penalties, bans, greedy, temperature, min-p, top-k, top-p.

Semantics follow vLLM v1. Randomness is a counter-based hash of (seed, output position, token id)
computed with int64 torch ops, so a seeded draw depends on nothing else (not the batch, not a generator's
state) and CPU and CUDA produce the same uniforms bit for bit. Nothing here calls ``.item()`` or
otherwise waits for the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)


def _as_int64(value: int) -> int:
    """The signed int64 with the same 64 bits as the unsigned constant ``value``."""
    return value - (1 << 64) if value >= (1 << 63) else value


_GOLDEN_GAMMA = _as_int64(0x9E3779B97F4A7C15)  # splitmix64 increment
_MIX_1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX_2 = _as_int64(0x94D049BB133111EB)


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingBatch:
    """Per-row sampling inputs for one step; B = rows being sampled. Built by the model runner."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor | None  # [B] int64 in [1, V]; V means disabled; None: no row uses top-k
    top_p: torch.Tensor | None  # [B] float32 in (0, 1]; None: no row uses top-p
    min_p: torch.Tensor | None  # [B] float32; None: no row uses min-p
    seeds: torch.Tensor  # [B] int64 per-request seed
    positions: torch.Tensor  # [B] int64 index of the token being sampled among the request's outputs
    repetition_penalty: torch.Tensor | None  # [B] float32; None: no row uses penalties (nor the 4 below)
    presence_penalty: torch.Tensor | None  # [B] float32
    frequency_penalty: torch.Tensor | None  # [B] float32
    prompt_token_ids: torch.Tensor | None  # [B, Lp] int64, padded with V
    output_token_ids: torch.Tensor | None  # [B, Lo] int64, padded with V
    banned_rows: torch.Tensor | None  # [N] int64 row of each banned (row, token) pair
    banned_tokens: torch.Tensor | None  # [N] int64 token whose logit is set to -inf in that row
    max_num_logprobs: int | None  # None: no row wants logprobs; else the max top-n over rows
    all_greedy: bool

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
        """Builds the tensors from plain Python; banned ids outside [0, vocab_size) are ignored."""
        _check_lengths(len(params), seeds=seeds, positions=positions, prompt_token_ids=prompt_token_ids,
                       output_token_ids=output_token_ids, banned=banned)
        random = [not _is_greedy(p) for p in params]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=_optional([min(p.top_k or vocab_size, vocab_size) if r else vocab_size
                             for p, r in zip(params, random)], vocab_size, torch.int64, device),
            top_p=_optional([p.top_p if r else 1.0 for p, r in zip(params, random)], 1.0, torch.float32, device),
            min_p=_optional([p.min_p if r else 0.0 for p, r in zip(params, random)], 0.0, torch.float32, device),
            seeds=torch.tensor(list(seeds), dtype=torch.int64, device=device),
            positions=torch.tensor(list(positions), dtype=torch.int64, device=device),
            **_penalty_fields(params, prompt_token_ids, output_token_ids, vocab_size, device),
            **_banned_fields(banned, vocab_size, device),
            max_num_logprobs=max(logprobs) if logprobs else None,
            all_greedy=not any(random),
        )


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32 logprob of the sampled token under the raw model distribution
    top_logprob_ids: torch.Tensor | None  # [B, n] int64 top-n tokens of the raw distribution
    top_logprobs: torch.Tensor | None  # [B, n] float32, descending


class Sampler:
    """Picks one token per row. Stateless: one instance serves every step."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()  # [B, V]; may alias the caller's tensor, so only out-of-place ops on it
        raw_logprobs = logits.log_softmax(dim=-1) if batch.max_num_logprobs is not None else None  # [B, V]
        logits = apply_penalties(logits, batch) if batch.repetition_penalty is not None else logits
        if batch.banned_rows is not None:
            logits = ban_tokens(logits, batch.banned_rows, batch.banned_tokens)  # [B, V]
        greedy = logits.argmax(dim=-1)  # [B]
        if batch.all_greedy:
            return _output(greedy, raw_logprobs, batch.max_num_logprobs)
        sampled = _sample_random(logits, batch)  # [B]
        token_ids = torch.where(batch.temperature < SAMPLING_EPS, greedy, sampled)  # [B]
        return _output(token_ids, raw_logprobs, batch.max_num_logprobs)


# --- penalties and bans (applied to the raw logits, before greedy) ---


def token_bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How often each vocab id occurs in each row of ``token_ids`` [B, L] (padded with vocab_size)."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))  # [B, V + 1]; column V counts padding
    return counts[:, :vocab_size]  # [B, V]


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """For tokens ``seen`` [B, V] in prompt or output: positive logits / penalty, others * penalty."""
    row_penalty = torch.where(seen, penalty[:, None], 1.0)  # [B, V]
    return torch.where(logits > 0, logits / row_penalty, logits * row_penalty)  # [B, V]


def apply_frequency_presence_penalties(
    logits: torch.Tensor, output_counts: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor
) -> torch.Tensor:
    """logit -= frequency * count_in_output + presence * (count_in_output > 0)."""
    logits = logits - frequency[:, None] * output_counts  # [B, V]
    return logits - presence[:, None] * (output_counts > 0)  # [B, V]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition, frequency and presence penalties, as vLLM v1 applies them. logits [B, V]."""
    vocab_size = logits.shape[-1]
    prompt_counts = token_bin_counts(batch.prompt_token_ids, vocab_size)  # [B, V]
    output_counts = token_bin_counts(batch.output_token_ids, vocab_size)  # [B, V]
    seen = (prompt_counts > 0) | (output_counts > 0)  # [B, V]
    logits = apply_repetition_penalty(logits, seen, batch.repetition_penalty)  # [B, V]
    return apply_frequency_presence_penalties(
        logits, output_counts, batch.frequency_penalty, batch.presence_penalty)  # [B, V]


def ban_tokens(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """A copy of logits [B, V] with each (rows[i], tokens[i]) set to -inf."""
    return logits.index_put((rows, tokens), logits.new_full((), float("-inf")))  # [B, V]


# --- random rows: temperature, min-p, top-k, top-p, then the exponential race ---


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Token ids [B] sampled from the processed distribution of each row (greedy rows: discarded)."""
    temperature = torch.where(batch.temperature < SAMPLING_EPS, 1.0, batch.temperature)  # [B]
    logits = logits / temperature[:, None]  # [B, V]
    if batch.min_p is not None:
        logits = apply_min_p(logits, batch.min_p)  # [B, V]
    if batch.top_k is not None or batch.top_p is not None:
        logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)  # [B, V]
    probs = logits.softmax(dim=-1)  # [B, V]
    return exponential_race(probs, batch.seeds, batch.positions)  # [B]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p). logits [B, V]."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]  # [B, 1]; min_p 0 -> -inf
    return logits.masked_fill(logits < threshold, float("-inf"))  # [B, V]


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Masks to -inf what top-k, then top-p (on the renormalised top-k set) drop. logits [B, V].

    Both drop a prefix of the ascending sort; the cut is applied as a logit threshold, so tokens tied
    with the lowest kept one are kept too and the result never depends on how the sort orders ties.
    """
    sorted_logits = logits.sort(dim=-1).values  # [B, V] ascending
    if top_k is not None:
        sorted_logits = _mask_top_k(sorted_logits, top_k)  # [B, V]
    if top_p is not None:
        sorted_logits = _mask_top_p(sorted_logits, top_p)  # [B, V]
    dropped = sorted_logits == float("-inf")  # [B, V] a prefix of each row
    lowest_kept = sorted_logits.masked_fill(dropped, float("inf")).amin(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(logits < lowest_kept, float("-inf"))  # [B, V]


def _mask_top_k(sorted_logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keeps logits >= the k-th largest (ties at the k-th are kept). sorted_logits [B, V] ascending."""
    vocab_size = sorted_logits.shape[-1]
    kth_index = vocab_size - top_k.clamp(1, vocab_size)  # [B]
    kth = sorted_logits.gather(-1, kth_index[:, None])  # [B, 1]
    return sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))  # [B, V]


def _mask_top_p(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keeps the smallest top set with mass >= top_p, and always the top token. sorted ascending."""
    mass_up_to = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V] mass of a token and all smaller
    drop = mass_up_to <= (1.0 - top_p)[:, None]  # [B, V]
    drop[:, -1] = False  # [B, V]
    return sorted_logits.masked_fill(drop, float("-inf"))  # [B, V]


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """argmax(probs / E), E ~ Exp(1) per cell: a draw from probs [B, V]. Returns token ids [B]."""
    exponential = uniform_noise(seeds, positions, probs.shape[-1]).log_().neg_()  # [B, V], > 0
    return (probs / exponential).argmax(dim=-1)  # [B]


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u(seed, position, token) in (0, 1), float32 [B, V], from int64 ops only (same bits on any device).

    Row r's cells are the splitmix64 stream seeded by a hash of (seed, position); the 23 top bits of
    each output make u, so the stream's last xorshift (it only changes lower bits) is skipped.
    """
    row_key = _mix64(_mix64(seeds + _GOLDEN_GAMMA) + (positions + 1) * _GOLDEN_GAMMA)  # [B]
    token_steps = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device) * _GOLDEN_GAMMA  # [V]
    cells = row_key[:, None] + token_steps  # [B, V]
    _mix64_high_bits_(cells, torch.empty_like(cells))  # [B, V] in place
    high = cells >> 41  # [B, V] top 23 bits as a signed integer in [-2**22, 2**22)
    return high.float().mul_(2.0**-23).add_(0.5 + 2.0**-24)  # [B, V] odd multiples of 2**-24, exact


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer (out of place); int64 multiply wraps mod 2**64 like uint64's."""
    x = x.clone()
    scratch = torch.empty_like(x)
    _mix64_high_bits_(x, scratch)
    _xor_shift_right_(x, 31, scratch)
    return x


def _mix64_high_bits_(x: torch.Tensor, scratch: torch.Tensor) -> None:
    """splitmix64's finalizer in place, less its last ``x ^= x >>> 31`` (bits 33..63 are already final)."""
    _xor_shift_right_(x, 30, scratch)
    x.mul_(_MIX_1)
    _xor_shift_right_(x, 27, scratch)
    x.mul_(_MIX_2)


def _xor_shift_right_(x: torch.Tensor, shift: int, scratch: torch.Tensor) -> None:
    """x ^= x >>> shift in place. ``>>`` on int64 is arithmetic, so the sign copies are masked off."""
    torch.bitwise_right_shift(x, shift, out=scratch)
    scratch.bitwise_and_((1 << (64 - shift)) - 1)
    x.bitwise_xor_(scratch)


# --- output and batch building ---


def _output(token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None, num_logprobs: int | None) -> SamplerOutput:
    if raw_logprobs is None or num_logprobs is None:
        return SamplerOutput(token_ids, None, None, None)
    sampled = raw_logprobs.gather(-1, token_ids[:, None]).squeeze(-1)  # [B]
    top_logprobs, top_ids = raw_logprobs.topk(min(num_logprobs, raw_logprobs.shape[-1]), dim=-1)  # [B, n] x2
    return SamplerOutput(token_ids, sampled, top_ids, top_logprobs)


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


def _penalty_fields(params: Sequence[SamplingParams], prompt_token_ids: Sequence[Sequence[int]],
                    output_token_ids: Sequence[Sequence[int]], vocab_size: int,
                    device: torch.device | str) -> dict[str, torch.Tensor | None]:
    names = ("repetition_penalty", "presence_penalty", "frequency_penalty")
    if not any(p.needs_penalties for p in params):
        return dict.fromkeys((*names, "prompt_token_ids", "output_token_ids"))
    fields = {name: torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device)
              for name in names}  # each [B]
    fields["prompt_token_ids"] = _padded(prompt_token_ids, vocab_size, device)  # [B, Lp]
    fields["output_token_ids"] = _padded(output_token_ids, vocab_size, device)  # [B, Lo]
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
