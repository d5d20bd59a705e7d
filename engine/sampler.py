"""Batched sampler for one engine step: penalties, bans, greedy, temperature, min-p, top-k, top-p.

Semantics follow vLLM v1. Randomness is ``engine.sampling.noise`` (scheme ``NOISE_SCHEME``): a
counter-based hash of (seed, output position, token id), so a seeded draw depends on nothing else (not
the batch, not a generator's state) and CPU and CUDA produce the same uniforms bit for bit.

Cost at real vocabularies: penalties touch only each row's seen tokens (``engine.sampling.penalties``);
top-k / top-p / min-p rows sort and race only their K largest logits (``engine.sampling.filters``), and
noise is hashed only at those K ids, which gives the very uniforms, hence the very token, of the race over
the whole vocabulary. Where K candidates cannot prove a row's kept set (ties past the k-th logit, top-p
mass beyond them) the row is marked in ``SamplerOutput.unproven`` and ``Sampler.finish`` samples it again
from a full sort; deciding that needs the flags on the host, so the runner reads them with the tokens.
Nothing in ``Sampler.__call__`` calls ``.item()`` or otherwise waits for the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling.batch import SAMPLING_EPS, RowSet, SamplingBatch
from engine.sampling.filters import Filters, apply_min_p, apply_top_k_top_p, filter_candidates
from engine.sampling.noise import NOISE_SCHEME, candidate_race, exponential_race, uniform_noise
from engine.sampling.penalties import apply_frequency_presence_penalties, apply_repetition_penalty, penalise_seen
from engine.sampling.penalties import token_bin_counts
from engine.sampling.select import argmax

__all__ = [
    "NOISE_SCHEME", "SAMPLING_EPS", "Sampler", "SamplerOutput", "SamplingBatch", "Unproven",
    "apply_frequency_presence_penalties", "apply_min_p", "apply_penalties", "apply_repetition_penalty",
    "apply_top_k_top_p", "ban_tokens", "exponential_race", "token_bin_counts", "uniform_noise",
]


@dataclass(frozen=True, slots=True)
class Unproven:
    """Rows whose token came from candidates that could not prove the kept set; what ``finish`` needs."""

    rows: torch.Tensor  # [B] bool
    logits: torch.Tensor  # [B, V] float32 after penalties and bans, before temperature
    batch: SamplingBatch
    raw_logprobs: torch.Tensor | None  # [B, V]


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32 logprob of the sampled token under the raw model distribution
    top_logprob_ids: torch.Tensor | None  # [B, n] int64 top-n tokens of the raw distribution
    top_logprobs: torch.Tensor | None  # [B, n] float32, descending
    unproven: Unproven | None = None  # None: every token is final


class Sampler:
    """Picks one token per row. Stateless: one instance serves every step."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, *, scratch: bool = False) -> SamplerOutput:
        """Sync-free; rows flagged in ``unproven`` (if any) are final only after ``finish``. ``scratch``: the
        caller never reads ``logits`` again, so penalties and bans may write into them (no [B, V] copy)."""
        writable = scratch or logits.dtype != torch.float32
        logits = logits.float()  # [B, V]; aliases the caller's tensor when it is float32 already
        raw_logprobs = logits.log_softmax(dim=-1) if batch.max_num_logprobs is not None else None  # [B, V]
        logits, writable = _penalties_and_bans(logits, batch, writable)  # [B, V]
        if batch.all_greedy:
            return _output(argmax(logits), raw_logprobs, batch.max_num_logprobs)
        token_ids, unproven = _sample_rows(logits, batch, writable)  # [B], [B] bool or None
        output = _output(token_ids, raw_logprobs, batch.max_num_logprobs)
        if unproven is None:
            return output
        return _with(output, unproven=Unproven(unproven, logits, batch, raw_logprobs))

    def finish(self, output: SamplerOutput, rows: Sequence[int]) -> SamplerOutput:
        """Samples the given unproven rows again from a full sort of their vocabulary."""
        pending = output.unproven
        if pending is None or not rows:
            return _with(output, unproven=None)
        batch = pending.batch
        index = torch.tensor(list(rows), dtype=torch.int64, device=output.token_ids.device)  # [R]
        full = _sample_filtered(RowSet(index, len(rows)), pending.logits, batch, pending.logits.shape[-1])[0]  # [R]
        token_ids = output.token_ids.index_copy(0, index, full)  # [B]
        return _output(token_ids, pending.raw_logprobs, batch.max_num_logprobs)

    def read(self, output: SamplerOutput) -> tuple[list[int], SamplerOutput]:
        """The token ids on the host, read in one copy with the unproven-row flags; rows flagged (rare) are
        then sampled again (``finish``) and read once more. Returns them and the final output."""
        if output.unproven is None:
            return output.token_ids.tolist(), output
        token_ids, flags = torch.stack((output.token_ids, output.unproven.rows.long())).tolist()  # [2, B] read
        rows = [row for row, flag in enumerate(flags) if flag]
        output = self.finish(output, rows)
        return (output.token_ids.tolist() if rows else token_ids), output

    def resolve(self, output: SamplerOutput) -> SamplerOutput:
        """The final output (``read`` without the host list)."""
        return self.read(output)[1]


# --- penalties and bans (applied to the raw logits, before greedy) ---


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition, frequency and presence penalties, as vLLM v1 applies them. A copy of logits [B, V]."""
    return logits.scatter(-1, batch.seen_tokens.token_ids, penalise_values(logits, batch))  # [B, V]


def penalise_values(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The penalised logits of each row's seen tokens [B, W] (``batch.seen_tokens.token_ids``)."""
    return penalise_seen(logits, batch.seen_tokens, batch.repetition_penalty, batch.frequency_penalty,
                         batch.presence_penalty)  # [B, W]


def ban_tokens(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """A copy of logits [B, V] with each (rows[i], tokens[i]) set to -inf."""
    return logits.index_put((rows, tokens), logits.new_full((), float("-inf")))  # [B, V]


def _penalties_and_bans(logits: torch.Tensor, batch: SamplingBatch,
                        writable: bool) -> tuple[torch.Tensor, bool]:
    """Penalties, then bans, written into logits [B, V] if ``writable``, else into one copy of them.
    Returns the logits and whether they are now ours to write."""
    if batch.repetition_penalty is None and batch.banned_rows is None:
        return logits, writable
    logits = logits if writable else logits.clone()  # [B, V]
    if batch.repetition_penalty is not None:
        seen = batch.seen_tokens
        logits.scatter_(-1, seen.token_ids, penalise_values(logits, batch))  # [B, V]
    if batch.banned_rows is not None:
        logits.index_put_((batch.banned_rows, batch.banned_tokens), logits.new_full((), float("-inf")))  # [B, V]
    return logits, True


# --- random rows: greedy ones keep the argmax, plain ones race the vocabulary, filtered ones their candidates ---


def _sample_rows(logits: torch.Tensor, batch: SamplingBatch,
                 writable: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids [B], and the unproven rows [B] bool (None: none can be)."""
    groups = batch.groups
    num_rows = logits.shape[0]
    if groups.any_greedy:
        token_ids = argmax(logits)  # [B]
    else:
        token_ids = torch.zeros(num_rows, dtype=torch.int64, device=logits.device)  # [B] all rows overwritten
    if groups.plain.size:
        token_ids = groups.plain.put(token_ids, _sample_plain(groups.plain, logits, batch, writable))  # [B]
    unproven = None
    if groups.filtered.size:
        sampled, covered = _sample_filtered(groups.filtered, logits, batch, groups.num_candidates)  # [R] x2
        token_ids = groups.filtered.put(token_ids, sampled)  # [B]
        if covered is not None:
            unproven = groups.filtered.put(torch.zeros(num_rows, dtype=torch.bool, device=logits.device), ~covered)
    return token_ids, unproven


def _sample_plain(rows: RowSet, logits: torch.Tensor, batch: SamplingBatch, writable: bool) -> torch.Tensor:
    """The race over the whole vocabulary of temperature-scaled probabilities. Token ids [R]."""
    temperature = rows.take(batch.temperature)[:, None]  # [R, 1]
    if writable or rows.index is not None:  # ours to scale in place (all rows are plain, or a copy of some)
        scaled = rows.take(logits).div_(temperature)  # [R, V]
    else:
        scaled = logits / temperature  # [R, V]
    probs = scaled.softmax(dim=-1)  # [R, V]
    return exponential_race(probs, rows.take(batch.seeds), rows.take(batch.positions), overwrite=True)  # [R]


def _sample_filtered(rows: RowSet, logits: torch.Tensor, batch: SamplingBatch,
                     num_candidates: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids [R] raced over each row's K largest logits, and whether those covered the kept set [R]
    (None when K is the whole vocabulary, which always does)."""
    filters = Filters(*(None if f is None else rows.take(f) for f in (batch.top_k, batch.top_p, batch.min_p)))
    candidates = filter_candidates(rows.take(logits), rows.take(batch.temperature), filters, num_candidates,
                                   batch.groups.needs_mass)
    sampled = candidate_race(candidates.weights(), candidates.token_ids, rows.take(batch.seeds),
                             rows.take(batch.positions))  # [R]
    return sampled, candidates.covered


# --- output ---


def _output(token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None, num_logprobs: int | None) -> SamplerOutput:
    if raw_logprobs is None or num_logprobs is None:
        return SamplerOutput(token_ids, None, None, None)
    sampled = raw_logprobs.gather(-1, token_ids[:, None]).squeeze(-1)  # [B]
    top_logprobs, top_ids = raw_logprobs.topk(min(num_logprobs, raw_logprobs.shape[-1]), dim=-1)  # [B, n] x2
    return SamplerOutput(token_ids, sampled, top_ids, top_logprobs)


def _with(output: SamplerOutput, *, unproven: Unproven | None) -> SamplerOutput:
    return SamplerOutput(output.token_ids, output.logprobs, output.top_logprob_ids, output.top_logprobs, unproven)
