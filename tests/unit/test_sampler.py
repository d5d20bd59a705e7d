"""Sampler: greedy, seeded reproducibility, distribution, filters, penalties, bans, logprobs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampler import Sampler, SamplingBatch, apply_frequency_presence_penalties, apply_min_p
from engine.sampler import apply_penalties, apply_repetition_penalty, apply_top_k_top_p, token_bin_counts
from engine.sampler import uniform_noise
from engine.sampling_params import SamplingParams

sampler = Sampler()


def make_batch(params, vocab_size, *, seeds=None, positions=None, prompts=None, outputs=None, banned=None):
    num_rows, empty = len(params), [[]] * len(params)
    return SamplingBatch.from_params(
        params, seeds=list(range(num_rows)) if seeds is None else seeds,
        positions=[0] * num_rows if positions is None else positions,
        prompt_token_ids=prompts or empty, output_token_ids=outputs or empty, banned=banned or empty,
        vocab_size=vocab_size, device="cpu")


def sample(logits, params, **kwargs):
    return sampler(logits, make_batch(params, logits.shape[-1], **kwargs)).token_ids


# --- greedy ---


def test_greedy_equals_argmax():
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0))  # [16, 100]
    batch = make_batch([SamplingParams(temperature=0.0)] * 16, 100)
    assert batch.all_greedy
    assert torch.equal(sampler(logits, batch).token_ids, logits.argmax(dim=-1))


def test_mixed_batch_keeps_greedy_rows_exact():
    logits = torch.randn(32, 200, generator=torch.Generator().manual_seed(1))  # [32, 200]
    random = SamplingParams(temperature=1.5, top_k=50, top_p=0.9, min_p=0.01)
    params = [SamplingParams(temperature=0.0) if row % 2 == 0 else random for row in range(32)]
    tokens = sample(logits, params)
    assert torch.equal(tokens[0::2], logits[0::2].argmax(dim=-1))
    assert not torch.equal(tokens[1::2], logits[1::2].argmax(dim=-1))  # random rows really sample


def test_input_logits_not_modified_and_other_dtypes_accepted():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))  # [4, 50]
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.3, top_p=0.5, logprobs=2)] * 4
    sample(logits, params, outputs=[[1, 2]] * 4, banned=[[3]] * 4)
    assert torch.equal(logits, before)
    assert sample(logits.to(torch.bfloat16), params).dtype == torch.int64


# --- seeded randomness ---


def test_same_seed_and_position_give_same_token_whatever_the_batch():
    gen = torch.Generator().manual_seed(3)
    others = [SamplingParams(temperature=0.0), SamplingParams(top_k=5), SamplingParams(top_p=0.3, min_p=0.1),
              SamplingParams(temperature=2.0, repetition_penalty=1.5)]
    for trial in range(40):
        row = torch.randn(1, 500, generator=gen)  # [1, 500] flat-ish distribution
        seed, position = 1000 + trial * 7919, trial * 3
        alone = sample(row, [SamplingParams()], seeds=[seed], positions=[position])
        crowd = torch.randn(6, 500, generator=gen)  # [6, 500]
        crowd[trial % 6] = row[0]
        params = [others[i % len(others)] for i in range(6)]
        params[trial % 6] = SamplingParams()
        seeds = [seed + 1 + i for i in range(6)]
        seeds[trial % 6] = seed
        positions = [position + i for i in range(6)]
        positions[trial % 6] = position
        batched = sample(crowd, params, seeds=seeds, positions=positions, outputs=[[1, 2]] * 6)
        assert batched[trial % 6] == alone[0]


def test_different_positions_and_seeds_give_different_draws():
    uniform = torch.zeros(200, 1000)  # [200, 1000] uniform distribution per row
    params = [SamplingParams()] * 200
    by_position = sample(uniform, params, seeds=[42] * 200, positions=list(range(200)))
    by_seed = sample(uniform, params, seeds=list(range(200)), positions=[5] * 200)
    assert len(set(by_position.tolist())) > 150
    assert len(set(by_seed.tolist())) > 150
    assert not torch.equal(by_position, by_seed)


def _splitmix_reference(seed: int, position: int, token: int) -> float:
    mask, gamma = 2**64 - 1, 0x9E3779B97F4A7C15

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    key = mix((mix((seed + gamma) & mask) + (position + 1) * gamma) & mask)
    cell = mix((key + (token + 1) * gamma) & mask)
    signed_high = (cell >> 41) - (1 << 23) * (cell >> 63)  # top 23 bits read as a signed integer
    return (2 * signed_high + 2**23 + 1) / 2**24


def test_uniform_noise_matches_unsigned_splitmix64_bit_for_bit():
    seeds = torch.tensor([0, 1, 123456789, 2**63 - 1])  # [4]
    positions = torch.tensor([0, 7, 1000, 2**31])  # [4]
    noise = uniform_noise(seeds, positions, 300)  # [4, 300]
    for row in range(4):
        for token in (0, 1, 150, 299):
            assert noise[row, token].item() == _splitmix_reference(seeds[row].item(), positions[row].item(), token)
    assert 0.0 < noise.min().item() and noise.max().item() < 1.0
    assert abs(noise.mean().item() - 0.5) < 0.02


# --- the draw follows the distribution ---

PROBS = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])  # [8]


def _frequencies(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=8).float() / tokens.numel()  # [8]


@pytest.mark.parametrize("vary", ["seed", "position"])
def test_draw_follows_distribution(vary):
    num_rows = 20_000
    logits = PROBS.log().expand(num_rows, 8)  # [20000, 8]
    seeds = list(range(num_rows)) if vary == "seed" else [99] * num_rows
    positions = [0] * num_rows if vary == "seed" else list(range(num_rows))
    tokens = sample(logits, [SamplingParams()] * num_rows, seeds=seeds, positions=positions)
    assert (_frequencies(tokens) - PROBS).abs().max() < 0.02


@pytest.mark.parametrize(("params", "expected"), [
    (SamplingParams(temperature=2.0), (PROBS.log() / 2.0).softmax(dim=-1)),
    (SamplingParams(top_k=3), torch.tensor([0.3, 0.2, 0.15, 0, 0, 0, 0, 0]) / 0.65),
    (SamplingParams(top_p=0.45), torch.tensor([0.3, 0.2, 0, 0, 0, 0, 0, 0]) / 0.5),
])
def test_draw_follows_processed_distribution(params, expected):
    num_rows = 20_000
    logits = PROBS.log().expand(num_rows, 8)  # [20000, 8]
    tokens = sample(logits, [params] * num_rows, seeds=list(range(num_rows)))
    assert (_frequencies(tokens) - expected).abs().max() < 0.02


# --- filters ---


def test_filters_on_a_hand_computed_distribution():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()  # [1, 4]
    kept = lambda masked: torch.isfinite(masked[0]).nonzero().flatten().tolist()  # noqa: E731
    assert kept(apply_top_k_top_p(logits, torch.tensor([2]), None)) == [0, 1]
    assert kept(apply_top_k_top_p(logits, None, torch.tensor([0.75]))) == [0, 1]
    assert kept(apply_top_k_top_p(logits, None, torch.tensor([0.85]))) == [0, 1, 2]
    assert kept(apply_top_k_top_p(logits, None, torch.tensor([1e-6]))) == [0]
    # Mass exactly 1.0 <= 1 - 1e-9 (== 1.0 in float32): the top token must survive anyway.
    one_token = torch.tensor([[float("-inf"), 0.0, float("-inf"), float("-inf")]])  # [1, 4]
    assert kept(apply_top_k_top_p(one_token, None, torch.tensor([1e-9]))) == [1]
    # Ties at the cut are never split, whatever order the sort put them in.
    assert kept(apply_top_k_top_p(torch.zeros(1, 4), None, torch.tensor([1e-9]))) == [0, 1, 2, 3]
    assert kept(apply_top_k_top_p(torch.tensor([[1.0, 0.0, 0.0, -1.0]]), torch.tensor([2]), None)) == [0, 1, 2]
    # top-p applies to the renormalised top-k set: 0.8 / 0.95 >= 0.82 > 0.8.
    assert kept(apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([0.82]))) == [0, 1]
    assert kept(apply_top_k_top_p(logits, None, torch.tensor([0.82]))) == [0, 1, 2]
    assert kept(apply_min_p(logits, torch.tensor([0.35]))) == [0, 1]
    assert kept(apply_min_p(logits, torch.tensor([0.0]))) == [0, 1, 2, 3]


def _allowed(logits_row, params):
    """Reference (float64, per row) superset of what min-p -> top-k -> top-p may keep."""
    probs = (logits_row.double() / params.temperature).softmax(dim=-1)  # [V]
    keep = probs >= probs.max() * params.min_p * (1 - 1e-4)  # [V]
    if params.top_k is not None:
        kth = probs.masked_fill(~keep, 0).sort(descending=True).values[min(params.top_k, len(probs)) - 1]
        keep &= probs >= kth * (1 - 1e-4)
    kept_probs = probs.masked_fill(~keep, 0) / probs[keep].sum()  # [V]
    order = kept_probs.argsort(descending=True)  # [V]
    mass_before = kept_probs[order].cumsum(dim=0) - kept_probs[order]  # [V]
    keep_sorted = mass_before < min(params.top_p + 1e-4, 1.0)  # [V]
    return set(order[keep_sorted & keep[order]].tolist())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), scale=st.floats(0.3, 8.0),
       top_k=st.one_of(st.none(), st.integers(1, 80)), top_p=st.floats(0.01, 1.0),
       min_p=st.floats(0.0, 0.9), temperature=st.floats(0.2, 3.0))
def test_filters_never_emit_excluded_tokens(seed, scale, top_k, top_p, min_p, temperature):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(48, 64, generator=gen) * scale  # [48, 64]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    tokens = sample(logits, [params] * 48, seeds=[seed + row for row in range(48)], positions=list(range(48)))
    for row in range(48):
        assert tokens[row].item() in _allowed(logits[row], params)


def test_tiny_top_p_top_k_one_and_min_p_one_keep_only_the_argmax():
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(4))  # [64, 300]
    for params in (SamplingParams(temperature=5.0, top_p=1e-6), SamplingParams(temperature=5.0, top_k=1),
                   SamplingParams(temperature=5.0, min_p=1.0)):
        assert torch.equal(sample(logits, [params] * 64), logits.argmax(dim=-1))


# --- penalties ---


def test_token_bin_counts_ignore_padding():
    counts = token_bin_counts(torch.tensor([[1, 1, 2, 4], [4, 4, 4, 4]]), vocab_size=4)  # [2, 4]
    assert counts.tolist() == [[0, 2, 1, 0], [0, 0, 0, 0]]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])  # [1, 4]
    seen = torch.tensor([[True, True, True, False]])  # [1, 4]
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -2.0, 0.25, 3.0]]


def test_frequency_and_presence_penalties_use_output_counts():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])  # [1, 4]
    counts = torch.tensor([[0, 2, 1, 0]])  # [1, 4]
    out = apply_frequency_presence_penalties(logits, counts, torch.tensor([0.5]), torch.tensor([0.25]))
    assert out.tolist() == [[2.0, -2.25, -0.25, 3.0]]


def test_apply_penalties_combines_prompt_and_output():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])  # [2, 4]
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams()]
    batch = make_batch(params, 4, prompts=[[0], [0, 1]], outputs=[[1, 1, 2], [3]])
    # Row 0: token 0 prompt-only (repetition only); 1 and 2 in the output; 3 unseen. Row 1: no penalties.
    assert apply_penalties(logits, batch).tolist() == [[1.0, -3.25, -0.5, 3.0], [2.0, -1.0, 0.5, 3.0]]


def test_strong_repetition_penalty_stops_greedy_repeating():
    logits = torch.tensor([[2.5, 0.0, 1.0, 3.0]])  # [1, 4]
    assert sample(logits, [SamplingParams(temperature=0.0)], outputs=[[3]]).tolist() == [3]
    penalised = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample(logits, [penalised], outputs=[[3]]).tolist() == [0]


# --- bans ---


def test_banned_tokens_are_never_sampled_even_at_the_max_logit():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(5))  # [64, 50]
    logits[:, 7] = 100.0
    logits[:, 9] = 99.0
    params = [SamplingParams(temperature=0.0) if row % 4 == 0 else SamplingParams(temperature=3.0)
              for row in range(64)]
    tokens = sample(logits, params, banned=[[7, 9]] * 64, positions=list(range(64)))
    assert not torch.isin(tokens, torch.tensor([7, 9])).any()
    unbanned = sample(logits, params, banned=[[7]] * 32 + [[]] * 32)
    assert (unbanned[:32] == 9).all() and (unbanned[32::4] == 7).all()


# --- logprobs ---


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(6))  # [8, 40]
    params = [SamplingParams(logprobs=3, repetition_penalty=1.8, temperature=0.7),
              SamplingParams(logprobs=5, temperature=0.0)] * 4
    out = sampler(logits, make_batch(params, 40, outputs=[[0, 1, 2]] * 8))
    raw = logits.log_softmax(dim=-1)  # [8, 40]
    assert torch.allclose(out.logprobs, raw.gather(-1, out.token_ids[:, None]).squeeze(-1))
    assert out.top_logprobs.shape == out.top_logprob_ids.shape == (8, 5)
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])
    assert torch.equal(out.top_logprob_ids, raw.topk(5, dim=-1).indices)
    assert torch.allclose(out.top_logprobs, raw.gather(-1, out.top_logprob_ids))


def test_no_logprobs_when_no_row_asks():
    out = sampler(torch.randn(2, 10), make_batch([SamplingParams()] * 2, 10))
    assert out.logprobs is None and out.top_logprob_ids is None and out.top_logprobs is None


# --- from_params ---


def test_from_params_without_penalties_or_filters_leaves_them_none():
    batch = make_batch([SamplingParams(), SamplingParams(temperature=0.0, top_p=0.5, top_k=3)], 10)
    assert batch.top_k is None and batch.top_p is None and batch.min_p is None  # greedy rows don't count
    assert batch.repetition_penalty is None and batch.presence_penalty is None
    assert batch.frequency_penalty is None and batch.prompt_token_ids is None and batch.output_token_ids is None
    assert batch.banned_rows is None and batch.banned_tokens is None and batch.max_num_logprobs is None
    assert batch.temperature.tolist() == [1.0, 0.0] and not batch.all_greedy


def test_from_params_builds_padded_tensors():
    params = [SamplingParams(top_k=3, presence_penalty=0.5, logprobs=0),
              SamplingParams(top_k=500, top_p=0.9, min_p=0.1, logprobs=4),
              SamplingParams(temperature=0.0)]
    batch = make_batch(params, 10, seeds=[11, 12, 13], positions=[0, 4, 2],
                       prompts=[[1, 2, 3], [4], []], outputs=[[5], [], [6, 7]], banned=[[2, 10], [], [0, 1]])
    assert batch.top_k.tolist() == [3, 10, 10] and batch.top_k.dtype == torch.int64
    assert batch.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0]) and batch.top_p.dtype == torch.float32
    assert batch.min_p.tolist() == pytest.approx([0.0, 0.1, 0.0])
    assert batch.seeds.tolist() == [11, 12, 13] and batch.positions.tolist() == [0, 4, 2]
    assert batch.presence_penalty.tolist() == [0.5, 0.0, 0.0] and batch.repetition_penalty.tolist() == [1.0] * 3
    assert batch.prompt_token_ids.tolist() == [[1, 2, 3], [4, 10, 10], [10, 10, 10]]
    assert batch.output_token_ids.tolist() == [[5, 10], [10, 10], [6, 7]]
    assert batch.banned_rows.tolist() == [0, 2, 2] and batch.banned_tokens.tolist() == [2, 0, 1]  # 10 >= V dropped
    assert batch.max_num_logprobs == 4 and not batch.all_greedy


def test_from_params_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="positions"):
        make_batch([SamplingParams()] * 2, 10, positions=[0])

