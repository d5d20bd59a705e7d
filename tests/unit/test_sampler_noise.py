"""Candidate-only noise: the hash evaluated at candidate ids is the whole-vocabulary hash there, so the race
over candidates picks the whole-vocabulary race's token; the sampler keeps the pre-change samples, stays
batch-independent with truncated candidates, and leaves logprobs as they were."""

from __future__ import annotations

import torch

import bench.sampler_baseline as old
from engine.sampler import Sampler, SamplingBatch, exponential_race, uniform_noise
from engine.sampling.noise import candidate_race, uniform_noise_at
from engine.sampling_params import SamplingParams

sampler = Sampler()


def test_noise_at_any_ids_is_the_whole_vocabulary_noise_there():
    seeds, positions = torch.tensor([0, 5, 2**62, 123]), torch.tensor([0, 1, 7, 2**31])  # [4] x2
    ids = torch.randint(0, 5000, (4, 300), generator=torch.Generator().manual_seed(0))  # [4, 300]
    assert torch.equal(uniform_noise_at(seeds, positions, ids), uniform_noise(seeds, positions, 5000).gather(1, ids))
    assert torch.equal(uniform_noise(seeds, positions, 5000), old.uniform_noise(seeds, positions, 5000))


def _masked_probs(seed: int, rows: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 2  # [R, V]
    kept = torch.rand(rows, vocab, generator=gen) < 0.02  # [R, V] a sparse kept set per row
    kept[:, 0] = True
    return logits.masked_fill(~kept, float("-inf")).softmax(dim=-1), kept  # [R, V] x2


def test_candidate_race_picks_the_whole_vocabulary_race_token():
    probs, kept = _masked_probs(1, 2000, 700)  # [2000, 700]
    seeds, positions = torch.arange(2000) * 7919, torch.arange(2000) % 13  # [2000] x2
    # Candidates: every kept token plus some dropped ones, in a shuffled order, per row.
    order = torch.rand(2000, 700, generator=torch.Generator().manual_seed(2)).argsort(dim=-1)  # [2000, 700]
    score = kept.float().gather(1, order) * 2 + torch.rand(2000, 700)  # kept ones first
    candidates = order.gather(1, score.argsort(dim=-1, descending=True)[:, :40])  # [2000, 40]
    assert bool(kept.sum(dim=-1).max() <= 40)
    expected = old.exponential_race(probs, seeds, positions)  # [2000]
    assert torch.equal(candidate_race(probs.gather(1, candidates), candidates, seeds, positions), expected)
    assert torch.equal(exponential_race(probs, seeds, positions), expected)  # the chunked whole-vocabulary race


def test_chunked_whole_vocabulary_race_equals_the_pre_change_one():
    for rows, vocab in ((1, 70_000), (3, 50_000), (40, 4097), (300, 600)):
        probs = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 3).softmax(dim=-1)
        seeds, positions = torch.arange(rows) + 99, torch.arange(rows) * 5  # [R] x2
        assert torch.equal(exponential_race(probs, seeds, positions), old.exponential_race(probs, seeds, positions))


MODES = [SamplingParams(temperature=0.8), SamplingParams(top_k=20), SamplingParams(top_p=0.3, temperature=1.3),
         SamplingParams(min_p=0.2), SamplingParams(top_k=50, top_p=0.9, temperature=0.8),
         SamplingParams(temperature=0.0, repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3),
         SamplingParams(temperature=1.1, top_k=8, repetition_penalty=1.2, logprobs=3)]


def _both(params, logits, seeds, positions, prompts, outputs):
    vocab, banned = logits.shape[-1], [[]] * len(params)
    new = SamplingBatch.from_params(params, seeds, positions, prompts, outputs, banned, vocab, "cpu")
    before = old.SamplingBatch.from_params(params, seeds, positions, prompts, outputs, banned, vocab, "cpu")
    return sampler.resolve(sampler(logits, new)), old.Sampler()(logits, before)


def test_sampled_tokens_and_logprobs_are_the_pre_change_ones():
    rows, vocab = 140, 6000  # large enough for truncated candidates
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(rows, vocab, generator=gen) * 3  # [140, V]
    params = [MODES[row % len(MODES)] for row in range(rows)]
    prompts = [torch.randint(0, vocab, (30,), generator=gen).tolist() for _ in range(rows)]
    outputs = [torch.randint(0, vocab, (9,), generator=gen).tolist() for _ in range(rows)]
    new, before = _both(params, logits, list(range(rows)), [row % 7 for row in range(rows)], prompts, outputs)
    assert torch.equal(new.token_ids, before.token_ids)
    assert torch.equal(new.logprobs, before.logprobs) and torch.equal(new.top_logprobs, before.top_logprobs)
    assert torch.equal(new.top_logprob_ids, before.top_logprob_ids)


def test_a_seeded_row_samples_the_same_token_whatever_its_batch_and_candidate_count():
    vocab = 20_000
    gen = torch.Generator().manual_seed(5)
    for trial in range(30):
        row = torch.randn(1, vocab, generator=gen) * 2  # [1, V]
        mine = MODES[trial % 5]
        alone = sampler.resolve(sampler(row, _plain_batch([mine], vocab, [trial], [trial]))).token_ids
        crowd = torch.randn(7, vocab, generator=gen) * 2  # [7, V]
        crowd[3] = row[0]
        params = [SamplingParams(top_k=1 + 300 * i) if i % 2 else SamplingParams(min_p=0.05) for i in range(7)]
        params[3] = mine
        seeds, positions = [trial + 1 + i for i in range(7)], [trial + i for i in range(7)]
        seeds[3], positions[3] = trial, trial
        batch = _plain_batch(params, vocab, seeds, positions)
        assert batch.groups.num_candidates != _plain_batch([mine], vocab, [0], [0]).groups.num_candidates
        assert sampler.resolve(sampler(crowd, batch)).token_ids[3] == alone[0]


def _plain_batch(params, vocab, seeds, positions):
    empty = [[]] * len(params)
    return SamplingBatch.from_params(params, seeds, positions, empty, empty, empty, vocab, "cpu")


def test_equal_race_keys_go_to_the_smallest_token_id_in_any_candidate_order():
    seeds, positions, vocab = torch.tensor([3, 4]), torch.tensor([0, 9]), 500  # [2] x2
    tied = torch.tensor([[400, 17], [250, 251]])  # [2, 2] two tokens per row with exactly equal keys
    probs = torch.full((2, vocab), 1e-9)  # [2, V] (unnormalised is fine: the race is scale-free)
    probs.scatter_(1, tied, -uniform_noise_at(seeds, positions, tied).log())  # p = E, so p / E = 1 exactly
    expected = old.exponential_race(probs, seeds, positions)  # [2]
    assert expected.tolist() == [17, 250]
    candidates = torch.tensor([[400, 3, 17, 99], [251, 7, 250, 8]])  # [2, 4] the larger id first
    assert torch.equal(candidate_race(probs.gather(1, candidates), candidates, seeds, positions), expected)
    assert torch.equal(exponential_race(probs, seeds, positions), expected)
