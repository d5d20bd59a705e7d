"""Seeded randomness for sampling: a counter-based hash u(seed, output position, token id) and the
exponential race that turns it into a draw.

Scheme ``NOISE_SCHEME`` (unchanged since the sampler was written): row key k = mix(mix(seed + G) +
(position + 1) * G); cell (row, token) = mix(k + (token + 1) * G), splitmix64's finalizer ``mix`` and
increment G; u = its top 23 bits as an odd multiple of 2**-24 in (0, 1). All int64 torch ops, so a seeded
draw depends on nothing else (not the batch, not a generator's state) and CPU and CUDA produce the same
uniforms bit for bit. The draw is argmax(probs / E), E = -log u: a sample from ``probs``.

Because u is counter-based, it can be evaluated at any token ids: a row whose kept set is known to lie
within some candidate ids races only those (tokens outside have probability 0 and can never win), with
the same uniforms, hence the same token, as the race over the whole vocabulary.
"""

from __future__ import annotations

import torch

from engine.sampling.select import argmin

NOISE_SCHEME = "splitmix64-exponential-race/1"

_CHUNK_CELLS = 1 << 17  # cells hashed per chunk of the whole-vocabulary race: its int64 scratch stays in L2


def _as_int64(value: int) -> int:
    """The signed int64 with the same 64 bits as the unsigned constant ``value``."""
    return value - (1 << 64) if value >= (1 << 63) else value


_GOLDEN_GAMMA = _as_int64(0x9E3779B97F4A7C15)  # splitmix64 increment
_MIX_1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX_2 = _as_int64(0x94D049BB133111EB)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The stream key of each row [B] int64, from its seed [B] and output position [B]."""
    return _mix64(_mix64(seeds + _GOLDEN_GAMMA) + (positions + 1) * _GOLDEN_GAMMA)  # [B]


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u(seed, position, token) in (0, 1) for every token id, float32 [B, V]."""
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)  # [V]
    return uniform_noise_at(seeds, positions, token_ids.expand(seeds.shape[0], vocab_size))  # [B, V]


def uniform_noise_at(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """u(seed, position, token) at the given token ids [B, K] int64: float32 [B, K]."""
    cells = row_keys(seeds, positions)[:, None] + (token_ids + 1) * _GOLDEN_GAMMA  # [B, K]
    return _uniform_(cells)  # [B, K]


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, *,
                     overwrite: bool = False) -> torch.Tensor:
    """argmax(probs / E) over the whole vocabulary, probs [B, V]: token ids [B]. ``overwrite``: the race's
    keys may replace ``probs`` (no [B, V] buffer).

    Hashed in column chunks so the int64 scratch stays in cache. The key is probs / log u = -(probs / E)
    exactly, so its first argmin is the first argmax of probs / E.
    """
    num_rows, vocab_size = probs.shape
    width = min(vocab_size, max(1024, _CHUNK_CELLS // max(num_rows, 1)))
    keys = row_keys(seeds, positions)[:, None]  # [B, 1]
    steps = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=probs.device) * _GOLDEN_GAMMA  # [V]
    cells = torch.empty(num_rows, width, dtype=torch.int64, device=probs.device)  # [B, w] reused scratch
    scratch = torch.empty_like(cells)  # [B, w]
    race = probs if overwrite else torch.empty_like(probs)  # [B, V] the keys
    for start in range(0, vocab_size, width):
        end = min(start + width, vocab_size)
        x, s = cells[:, : end - start], scratch[:, : end - start]  # [B, w]
        torch.add(keys, steps[start:end], out=x)  # [B, w]
        torch.div(probs[:, start:end], _uniform_(x, s).log_(), out=race[:, start:end])  # [B, w] <= 0
    return argmin(race)  # [B]


def candidate_race(probs: torch.Tensor, token_ids: torch.Tensor, seeds: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """The exponential race over candidate tokens: probs [B, K] (or weights, any positive multiple of them)
    of token_ids [B, K]. Token ids [B].

    Equal keys go to the smallest token id, as the whole-vocabulary argmax would have it.
    """
    key = probs / uniform_noise_at(seeds, positions, token_ids).log_()  # [B, K] <= 0
    smallest = key.amin(dim=-1, keepdim=True)  # [B, 1]
    no_token = torch.iinfo(torch.int64).max
    return token_ids.masked_fill(key != smallest, no_token).amin(dim=-1)  # [B]


def _uniform_(cells: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Hashes int64 ``cells`` [B, K] in place into float32 u [B, K] (odd multiples of 2**-24, exact).

    splitmix64's finalizer, less its last ``x ^= x >>> 31`` (it only changes bits below the 23 kept).
    """
    scratch = torch.empty_like(cells) if scratch is None else scratch
    _mix64_high_bits_(cells, scratch)
    high = cells.bitwise_right_shift_(41)  # [B, K] top 23 bits as a signed integer in [-2**22, 2**22)
    return high.float().mul_(2.0**-23).add_(0.5 + 2.0**-24)  # [B, K]


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
