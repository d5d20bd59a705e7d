"""The runner's incremental penalty state equals a count from scratch, step after step, through finishes,
new requests, preemption and resumption, re-entry with other outputs, evictions and growth; and the batch
it builds penalises exactly as the pre-change sampler did."""

from __future__ import annotations

import random

import torch

import bench.sampler_baseline as old
from engine.core.request import Request
from engine.sampler import Sampler, SamplingBatch, apply_penalties
from engine.sampling.builder import SamplingBatchBuilder, banned_tokens
from engine.sampling.penalties import SeenTokens, token_bin_counts
from engine.sampling.penalty_state import PenaltyState
from engine.sampling_params import SamplingParams

VOCAB = 300
PENALISED = SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3)


def _request(rid: str, rng: random.Random, params: SamplingParams = PENALISED, num_prompt: int = 20) -> Request:
    prompt = [rng.randrange(VOCAB) for _ in range(num_prompt)]
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=params, seed=rng.randrange(2**40))


def _reentered(request: Request, outputs: list[int]) -> Request:
    again = Request(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params, seed=request.seed)
    for token in outputs:
        again.append_output_token(token)
    return again


def _dense(seen: SeenTokens) -> tuple[torch.Tensor, torch.Tensor]:
    """SeenTokens as dense [B, V] (seen mask, output counts)."""
    rows = seen.token_ids.shape[0]
    mask = torch.zeros(rows, VOCAB, dtype=torch.bool).scatter_(1, seen.token_ids, True) & seen.nonempty[:, None]
    counts = torch.zeros(rows, VOCAB, dtype=torch.int32).scatter_(1, seen.token_ids, seen.output_counts)
    return mask, counts


def _assert_matches_scratch(seen: SeenTokens, requests: list[Request | None]) -> None:
    mask, counts = _dense(seen)
    for row, request in enumerate(requests):
        if request is None:
            assert not mask[row].any() and not counts[row].any()
            continue
        outputs = torch.tensor([request.output_token_ids], dtype=torch.int64).view(1, -1)  # [1, Lo]
        expected = token_bin_counts(outputs, VOCAB)[0]  # [V]
        assert torch.equal(counts[row].long(), expected)
        assert mask[row].nonzero().flatten().tolist() == sorted(set(request.all_token_ids))


def test_incremental_state_equals_a_count_from_scratch_through_a_request_lifecycle():
    rng = random.Random(0)
    state = PenaltyState("cpu", num_slots=4, width=8, idle_steps=3)  # tiny: forces growth and eviction
    running = [_request(f"r{i}", rng) for i in range(3)]
    preempted: list[Request] = []
    for step in range(60):
        batch: list[Request | None] = [*running, None]  # a row without penalties
        _assert_matches_scratch(state.seen_tokens(batch), batch)
        for request in running:  # each row's sampled token joins its outputs (repeats are common)
            request.append_output_token(rng.choice([rng.randrange(VOCAB), *request.all_token_ids[-5:]]))
        if step % 7 == 3:  # one finishes, two join (one with a long prompt)
            state.forget([running.pop(0).request_id])
            running += [_request(f"n{step}", rng), _request(f"long{step}", rng, num_prompt=200)]
        if step % 11 == 5 and len(running) > 1:  # preemption by recompute: same outputs, back later
            preempted.append(running.pop())
            state.forget([preempted[-1].request_id])
        if step % 11 == 9 and preempted:
            running.append(preempted.pop())
        if step % 13 == 6:  # re-entry it never heard of: one output more, but the counted last one differs
            outputs = running[0].output_token_ids
            running[0] = _reentered(running[0], [*outputs[:-2], (outputs[-2] + 1) % VOCAB, outputs[-1]])
        if step % 13 == 10:  # re-entry with as many outputs as counted, the last one different
            outputs = running[0].output_token_ids
            running[0] = _reentered(running[0], [*outputs[:-2], (outputs[-2] + 1) % VOCAB])
        if step % 17 == 8:
            running[-1].append_output_token(5)  # two new tokens since the last step
    assert state.num_requests <= 12


def test_slots_of_requests_never_forgotten_are_evicted_once_idle():
    rng = random.Random(1)
    state = PenaltyState("cpu", num_slots=3, width=4, idle_steps=2)
    for step in range(40):
        batch = [_request(f"s{step}-{i}", rng) for i in range(2)]  # new ids every step, never forgotten
        _assert_matches_scratch(state.seen_tokens(batch), batch)
    assert state.num_requests <= 2 * (state.idle_steps + 2)  # the last few steps' requests, not all 80
    assert state.token_ids.shape[0] <= 12


def test_builder_batch_penalises_as_the_pre_change_sampler_did():
    rng = random.Random(2)
    params = [PENALISED, SamplingParams(temperature=0.7, top_k=9, repetition_penalty=0.8, seed=3),
              SamplingParams(temperature=0.0), SamplingParams(frequency_penalty=-0.5, min_tokens=3)]
    requests = [_request(f"b{i}", rng, params=p) for i, p in enumerate(params)]
    builder = SamplingBatchBuilder(VOCAB, "cpu")
    for step in range(12):
        logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(step)) * 3  # [4, V]
        new = Sampler()(logits.clone(), builder.build(requests), scratch=True)
        before = old.Sampler()(logits, _old_batch(requests))
        assert torch.equal(new.token_ids, before.token_ids)
        reference = old.apply_penalties(logits, _old_batch(requests))  # [4, V]
        assert torch.equal(_penalised(logits, builder, requests), reference)
        for request, token in zip(requests, new.token_ids.tolist()):
            request.append_output_token(token)


def _penalised(logits, builder, requests):
    return apply_penalties(logits, builder.build(requests))


def _old_batch(requests):
    return old.SamplingBatch.from_params(
        [r.sampling_params for r in requests], [r.seed for r in requests], [r.num_output_tokens for r in requests],
        [r.prompt_token_ids for r in requests], [r.output_token_ids for r in requests],
        [banned_tokens(r) for r in requests], VOCAB, "cpu")


def test_from_params_seen_tokens_pad_with_the_first_entry_and_mark_empty_rows():
    params = [PENALISED, PENALISED, SamplingParams()]
    batch = SamplingBatch.from_params(params, [0] * 3, [0] * 3, [[4, 4, 2], [], [9]], [[2, 7, 7], [], [1]],
                                      [[]] * 3, VOCAB, "cpu")
    seen = batch.seen_tokens
    assert seen.token_ids.tolist() == [[4, 2, 7], [0, 0, 0], [0, 0, 0]]
    assert seen.output_counts.tolist() == [[0, 1, 2], [0, 0, 0], [0, 0, 0]]
    assert seen.nonempty.tolist() == [True, False, False]
