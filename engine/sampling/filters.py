"""Top-k, top-p and min-p, computed on each row's candidates: its K largest logits in descending order.

One function, ``kept_threshold``, decides the kept set from the candidates whether K is the whole
vocabulary (a full sort: the reference, and the fallback) or a few (``topk``): same arithmetic on the
same leading values, so a row the candidates cover keeps exactly what the full sort keeps. Semantics are
vLLM v1's: min-p, then top-k (ties at the k-th logit kept), then top-p on the renormalised min-p/top-k set
(the smallest top set with mass >= top_p; the top token always). The cut is a logit threshold, so the
kept set never depends on how a sort ordered ties. Top-p's mass is summed from the top token down (a
cumulative sum), which makes it independent of K; rows with neither top-k nor min-p take the whole
vocabulary's mass from ``total_mass``.

A row's candidates cover its kept set when the last candidate is below the cut (tokens outside are no
larger) and, for top-p over a min-p/top-k set, when min-p/top-k masked the last candidate (so the mass
being renormalised over lies within the candidates). A row they do not cover (``covered`` False) must be
sampled from a full sort; the sampler flags it rather than guess.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.sampling.select import topk

MASS_CHUNK = 4096  # columns per chunk of ``total_mass``: fixed, so a row's sum never depends on the batch


@dataclass(frozen=True, slots=True)
class Filters:
    """Per-row filter settings of the rows being filtered, R of them."""

    top_k: torch.Tensor | None  # [R] int64 in [1, V]; V: disabled; None: no row uses top-k
    top_p: torch.Tensor | None  # [R] float32 in (0, 1]; None: no row uses top-p
    min_p: torch.Tensor | None  # [R] float32; None: no row uses min-p


@dataclass(frozen=True, slots=True)
class Candidates:
    """Each row's K largest logits and the kept set's cut among them."""

    values: torch.Tensor  # [R, K] float32 temperature-scaled logits, descending
    token_ids: torch.Tensor  # [R, K] int64
    threshold: torch.Tensor  # [R, 1] the lowest kept logit: the kept set is every logit >= it
    covered: torch.Tensor | None  # [R] bool: the candidates hold the kept set; None: K = V, always

    def weights(self) -> torch.Tensor:
        """exp(logit - max) of the kept candidates, 0 elsewhere [R, K]: the kept distribution, unnormalised."""
        weights = (self.values - self.values[:, :1]).exp()  # [R, K]
        return weights.masked_fill(self.values < self.threshold, 0.0)  # [R, K]


def filter_candidates(logits: torch.Tensor, temperature: torch.Tensor, filters: Filters, num_candidates: int,
                      needs_mass: bool) -> Candidates:
    """Candidates of logits [R, V] (before temperature [R]): a ``topk`` of K, or a full sort when K = V.

    ``needs_mass``: some row has top-p and neither top-k nor min-p (its set is the whole vocabulary).
    """
    vocab_size = logits.shape[-1]
    if num_candidates >= vocab_size:
        values, token_ids = logits.sort(dim=-1, descending=True)  # [R, V] x2
    else:
        values, token_ids = topk(logits, num_candidates)  # [R, K] x2
    values = values / temperature[:, None]  # [R, K]; the same floats as scaling the whole row first
    mass = total_mass(logits, temperature, values[:, :1]) if needs_mass else None  # [R, 1]
    threshold, covered = kept_threshold(values, filters, mass, vocab_size)  # [R, 1], [R]
    return Candidates(values, token_ids, threshold, None if num_candidates >= vocab_size else covered)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p). logits [B, V]."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]  # [B, 1]; min_p 0 -> -inf
    return logits.masked_fill(logits < threshold, float("-inf"))  # [B, V]


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Masks to -inf what top-k, then top-p (on the renormalised top-k set) drop. logits [B, V].

    The full-sort reference: every row's candidates are its whole vocabulary.
    """
    values = logits.sort(dim=-1, descending=True).values  # [B, V]
    mass = total_mass(logits, None, values[:, :1]) if top_p is not None else None  # [B, 1]
    threshold, _ = kept_threshold(values, Filters(top_k, top_p, None), mass, logits.shape[-1])  # [B, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))  # [B, V]


def total_mass(logits: torch.Tensor, temperature: torch.Tensor | None, top: torch.Tensor) -> torch.Tensor:
    """sum(exp(logits / temperature - top)) per row [R, 1]; logits [R, V], temperature [R], top [R, 1] (the
    max scaled logit). In column chunks of a fixed width, so the temporaries stay in cache and a row's sum
    is added up in the same order whatever the batch."""
    mass = torch.zeros_like(top)  # [R, 1]
    for start in range(0, logits.shape[-1], MASS_CHUNK):
        scaled = logits[:, start : start + MASS_CHUNK]  # [R, w]
        scaled = scaled / temperature[:, None] if temperature is not None else scaled.clone()  # [R, w]
        mass += scaled.sub_(top).exp_().sum(dim=-1, keepdim=True)  # [R, 1]
    return mass


def kept_threshold(values: torch.Tensor, filters: Filters, mass: torch.Tensor | None,
                   vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The lowest kept logit of each row [R, 1] (keep logits >= it), and whether the candidates cover
    the kept set [R] bool (else the threshold is not proven: sort the whole row instead).

    ``values`` [R, K]: each row's K largest (temperature-scaled) logits, descending; ``mass`` [R, 1]: the
    whole row's ``total_mass``, needed when top-p applies to rows with neither top-k nor min-p.
    """
    num_candidates = values.shape[-1]
    masked = _mask_min_p(values, filters.min_p)  # [R, K]
    masked = _mask_top_k(masked, filters.top_k, vocab_size)  # [R, K]
    keep = masked > float("-inf")  # [R, K] a prefix of each row
    whole_row = _unrestricted(filters, vocab_size, values)  # [R] bool: neither top-k nor min-p
    if filters.top_p is not None:
        keep &= _within_top_p(masked, filters.top_p, mass, whole_row)  # [R, K]
    keep[:, 0] = True
    threshold = values.gather(-1, keep.sum(dim=-1, keepdim=True) - 1)  # [R, 1] the last kept candidate
    if num_candidates == vocab_size:
        return threshold, torch.ones_like(whole_row)
    # Tokens outside the candidates are <= the last candidate: out of the kept set when it is below the
    # threshold, and out of the set top-p renormalises over when min-p/top-k masked the last candidate.
    set_covered = whole_row | (masked[:, -1] == float("-inf"))  # [R]
    return threshold, set_covered & (values[:, -1:] < threshold).squeeze(-1)  # [R, 1], [R]


def _mask_min_p(values: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    if min_p is None:
        return values
    threshold = values[:, :1] + min_p.log()[:, None]  # [R, 1] the max logit + log(min_p)
    return values.masked_fill(values < threshold, float("-inf"))  # [R, K]


def _mask_top_k(masked: torch.Tensor, top_k: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Keeps candidates >= the k-th largest; rows with k beyond the candidates (only k = V, disabled) keep all."""
    if top_k is None:
        return masked
    num_candidates = masked.shape[-1]
    kth = masked.gather(-1, (top_k - 1).clamp(max=num_candidates - 1)[:, None])  # [R, 1]
    kth = kth.masked_fill(top_k[:, None] > num_candidates, float("-inf"))  # [R, 1]
    return masked.masked_fill(masked < kth, float("-inf"))  # [R, K]


def _unrestricted(filters: Filters, vocab_size: int, like: torch.Tensor) -> torch.Tensor:
    """[R] bool: rows that neither top-k nor min-p restrict (top-p renormalises over the whole vocabulary)."""
    whole = torch.ones(like.shape[0], dtype=torch.bool, device=like.device)  # [R]
    if filters.top_k is not None:
        whole &= filters.top_k >= vocab_size
    if filters.min_p is not None:
        whole &= filters.min_p <= 0.0
    return whole


def _within_top_p(masked: torch.Tensor, top_p: torch.Tensor, mass: torch.Tensor | None,
                  whole_row: torch.Tensor) -> torch.Tensor:
    """[R, K] bool: candidates whose higher-ranked mass is < top_p of the set's mass (top_p 1: all)."""
    weights = (masked - masked[:, :1]).exp()  # [R, K] exp(logit - max); masked -> 0
    above = weights.cumsum(dim=-1)  # [R, K] mass of a candidate and all above it
    set_mass = above[:, -1:]  # [R, 1] the min-p/top-k set's mass (all within the candidates)
    if mass is not None:
        set_mass = torch.where(whole_row[:, None], mass, set_mass)  # [R, 1]
    strictly_above = F.pad(above[:, :-1], (1, 0))  # [R, K]
    return (strictly_above < top_p[:, None] * set_mass) | (top_p[:, None] >= 1.0)  # [R, K]
