"""Top-k / top-p / min-p on a truncated candidate set keep exactly what the full sort keeps (or say they
cannot prove it, and the full-sort fallback then samples the row); the two-level argmax/topk are exact."""

from __future__ import annotations

from dataclasses import replace
from unittest.mock import patch

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bench.sampler_baseline as old
from engine.sampler import Sampler, SamplingBatch
from engine.sampling import select
from engine.sampling.filters import Filters, filter_candidates
from engine.sampling_params import SamplingParams

sampler = Sampler()


def _logits(seed: int, rows: int, vocab: int, tie_heavy: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if tie_heavy:  # few distinct values: ties at every cut
        return torch.randint(-4, 3, (rows, vocab), generator=gen).float()  # [R, V]
    return torch.randn(rows, vocab, generator=gen) * 3  # [R, V]


def _filters(seed: int, rows: int, vocab: int) -> tuple[Filters, torch.Tensor, bool]:
    gen = torch.Generator().manual_seed(seed + 1)
    top_k = torch.randint(1, 40, (rows,), generator=gen)  # [R]
    top_k = torch.where(torch.rand(rows, generator=gen) < 0.4, vocab, top_k)  # some rows: no top-k
    top_p = torch.where(torch.rand(rows, generator=gen) < 0.3, 1.0, torch.rand(rows, generator=gen))  # [R]
    min_p = torch.where(torch.rand(rows, generator=gen) < 0.6, 0.0, torch.rand(rows, generator=gen) * 0.5)
    temperature = torch.rand(rows, generator=gen) * 2 + 0.2  # [R]
    needs_mass = bool(((top_k >= vocab) & (min_p <= 0) & (top_p < 1)).any())
    return Filters(top_k, top_p, min_p), temperature, needs_mass


def _kept(logits, temperature, candidates) -> torch.Tensor:
    return logits / temperature[:, None] >= candidates.threshold  # [R, V]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), vocab=st.integers(8, 600), num_candidates=st.integers(1, 200),
       tie_heavy=st.booleans())
def test_truncated_kept_set_equals_the_full_sort_where_covered(seed, vocab, num_candidates, tie_heavy):
    logits = _logits(seed, 24, vocab, tie_heavy)  # [24, V]
    filters, temperature, needs_mass = _filters(seed, 24, vocab)
    full = filter_candidates(logits, temperature, filters, vocab, needs_mass)
    truncated = filter_candidates(logits, temperature, filters, min(num_candidates, vocab), needs_mass)
    expected = _kept(logits, temperature, full)  # [24, V]
    covered = torch.ones(24, dtype=torch.bool) if truncated.covered is None else truncated.covered  # [24]
    assert torch.equal(_kept(logits, temperature, truncated)[covered], expected[covered])
    # A row falls back only if its kept set, or the min-p/top-k set top-p renormalises over, is as large
    # as the candidates (so it may reach past them).
    pre_top_p = filter_candidates(logits, temperature, Filters(filters.top_k, None, filters.min_p), vocab, False)
    size = truncated.values.shape[-1]
    may_reach_past = (expected.sum(dim=-1) >= size) | (_kept(logits, temperature, pre_top_p).sum(dim=-1) >= size)
    assert torch.all(covered | may_reach_past)


def test_kept_set_matches_the_pre_change_sampler_on_random_logits():
    vocab = 3000
    logits = _logits(7, 64, vocab, tie_heavy=False)  # [64, V]
    filters, temperature, needs_mass = _filters(7, 64, vocab)
    scaled = logits / temperature[:, None]  # [64, V]
    reference = old.apply_top_k_top_p(old.apply_min_p(scaled, filters.min_p), filters.top_k, filters.top_p)
    for num_candidates in (64, 1024, vocab):
        candidates = filter_candidates(logits, temperature, filters, num_candidates, needs_mass)
        covered = torch.ones(64, dtype=torch.bool) if candidates.covered is None else candidates.covered
        assert torch.equal(_kept(logits, temperature, candidates)[covered], torch.isfinite(reference)[covered])
        assert covered.float().mean() > 0.5


def _batch(params, vocab, seeds):
    empty = [[]] * len(params)
    return SamplingBatch.from_params(params, seeds=seeds, positions=[3] * len(params), prompt_token_ids=empty,
                                     output_token_ids=empty, banned=empty, vocab_size=vocab, device="cpu")


def test_rows_the_candidates_cannot_prove_fall_back_to_the_full_sort():
    vocab = 8192
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))  # [4, V]
    logits[0] = 0.0  # flat: top-p 0.9 needs ~7,400 tokens, far past the 1,024 candidates
    logits[1, 1000:2500] = 5.0  # 1,500 tokens tied at the top: top-k 2 keeps all of them (ties kept)
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=2, logprobs=2), SamplingParams(top_k=5, top_p=0.8),
              SamplingParams(min_p=0.2)]
    batch = _batch(params, vocab, seeds=[11, 12, 13, 14])
    assert batch.groups.num_candidates < vocab
    output = sampler(logits, batch)
    assert output.unproven is not None and output.unproven.rows.tolist() == [True, True, False, False]
    resolved = sampler.resolve(output)
    final = resolved.token_ids  # [4]
    assert torch.equal(resolved.logprobs, logits.log_softmax(dim=-1).gather(1, final[:, None]).squeeze(1))
    full_batch = replace(batch, groups=replace(batch.groups, num_candidates=vocab))  # full sorts, every row
    assert torch.equal(final, sampler(logits, full_batch).token_ids)
    assert 1000 <= final[1] < 2500
    assert torch.equal(final, old.Sampler()(logits, old.SamplingBatch.from_params(
        params, [11, 12, 13, 14], [3] * 4, [[]] * 4, [[]] * 4, [[]] * 4, vocab, "cpu")).token_ids)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 5), vocab=st.integers(1, 3000), k=st.integers(1, 300),
       tie_heavy=st.booleans())
def test_two_level_argmax_argmin_and_topk_are_exact(seed, rows, vocab, k, tie_heavy):
    logits = _logits(seed, rows, vocab, tie_heavy)  # [R, V]
    with patch.object(select, "SMALL_NUMEL", 0):  # two levels even for these small rows
        assert torch.equal(select.argmax(logits), logits.argmax(dim=-1))
        assert torch.equal(select.argmin(logits), logits.argmin(dim=-1))
    k = min(k, vocab)
    values, token_ids = select.topk(logits, k)  # [R, k] x2
    assert torch.equal(values, logits.topk(k, dim=-1).values)
    assert torch.equal(logits.gather(-1, token_ids), values)
    assert all(len(set(row)) == k for row in token_ids.tolist())


def test_read_brings_tokens_back_with_the_fallback_done():
    vocab = 8192
    logits = torch.zeros(3, vocab)  # [3, V] flat rows: top-p 0.9 needs ~7,400 tokens
    logits[2, 7] = 30.0  # one sharp row the candidates cover
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.9), SamplingParams(top_p=0.9)]
    output = sampler(logits, _batch(params, vocab, seeds=[1, 2, 3]))
    assert output.unproven.rows.tolist() == [True, True, False]
    token_ids, final = sampler.read(output)
    assert final.unproven is None and token_ids == final.token_ids.tolist()
    full = _batch(params, vocab, seeds=[1, 2, 3])
    full = replace(full, groups=replace(full.groups, num_candidates=vocab))  # full sorts, every row
    assert token_ids == sampler(logits, full).token_ids.tolist()
    assert token_ids[2] == 7
