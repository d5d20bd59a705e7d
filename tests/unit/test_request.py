"""Request: one transition table that rejects illegal moves; block hashes that grow incrementally."""

from __future__ import annotations

import itertools

import pytest

from engine.core.request import FinishReason, IllegalTransition, Request, RequestStatus
from engine.sampling_params import SamplingParams
from kv_transfer.hashing import hash_block, hash_blocks, root_hash

S = RequestStatus
FINISHED = {S.FINISHED_STOPPED, S.FINISHED_LENGTH, S.FINISHED_ABORTED}
# An independent copy of the lifecycle (DESIGN.md / STYLE.md rule 6); the code's table must match it.
LEGAL = {
    (S.WAITING, S.RUNNING),
    (S.WAITING, S.FINISHED_ABORTED),
    (S.RUNNING, S.PREEMPTED),
    *((S.RUNNING, f) for f in FINISHED),
    (S.PREEMPTED, S.RUNNING),
    (S.PREEMPTED, S.FINISHED_ABORTED),
    # disaggregated decode: blocks reserved while the prompt's KV is pulled from a prefill worker
    (S.WAITING, S.WAITING_FOR_REMOTE_KV),
    (S.WAITING_FOR_REMOTE_KV, S.RUNNING),  # KV in place
    (S.WAITING_FOR_REMOTE_KV, S.WAITING),  # pull failed: recompute locally
    (S.WAITING_FOR_REMOTE_KV, S.FINISHED_ABORTED),
}
ALL_PAIRS = list(itertools.product(RequestStatus, RequestStatus))
ROOT = root_hash(b"x" * 16, 4)


def make_request(prompt=(1, 2, 3), status: RequestStatus = S.WAITING) -> Request:
    return Request(
        request_id="r", prompt_token_ids=list(prompt), sampling_params=SamplingParams(temperature=0, max_tokens=4),
        seed=0, status=status,
    )


@pytest.mark.parametrize(("old", "new"), sorted(LEGAL, key=str))
def test_legal_transitions_are_allowed(old, new):
    request = make_request(status=old)
    request.transition(new)
    assert request.status is new


@pytest.mark.parametrize(("old", "new"), [p for p in ALL_PAIRS if p not in LEGAL], ids=str)
def test_illegal_transitions_raise_and_leave_the_status(old, new):
    request = make_request(status=old)
    with pytest.raises(IllegalTransition, match=f"{old.name} -> {new.name}"):
        request.transition(new)
    assert request.status is old


def test_finished_states_are_terminal():
    for status in FINISHED:
        assert status.finished
        for new in RequestStatus:
            with pytest.raises(IllegalTransition):
                make_request(status=status).transition(new)
    assert not any(s.finished for s in (S.WAITING, S.RUNNING, S.PREEMPTED))


def test_full_lifecycle_with_a_preemption():
    request = make_request()
    for status in (S.RUNNING, S.PREEMPTED, S.RUNNING, S.FINISHED_LENGTH):
        request.transition(status)
    assert request.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(
    ("status", "reason"),
    [(S.FINISHED_STOPPED, FinishReason.STOP), (S.FINISHED_LENGTH, FinishReason.LENGTH),
     (S.FINISHED_ABORTED, FinishReason.ABORT), (S.WAITING, None), (S.RUNNING, None), (S.PREEMPTED, None)],
)
def test_finish_reason(status, reason):
    assert make_request(status=status).finish_reason is reason


def test_token_bookkeeping():
    prompt = [5, 6, 7]
    request = make_request(prompt)
    assert request.all_token_ids == [5, 6, 7] and request.all_token_ids is not request.prompt_token_ids
    request.append_output_token(9)
    assert request.prompt_token_ids == [5, 6, 7]  # the prompt is never aliased or mutated
    assert request.output_token_ids == [9]
    assert request.all_token_ids == [5, 6, 7, 9]
    assert (request.num_prompt_tokens, request.num_output_tokens, request.num_tokens) == (3, 1, 4)


def test_block_hashes_cover_full_blocks_only():
    request = make_request([1, 2, 3])
    request.update_block_hashes(ROOT, 4)
    assert request.block_hashes == []
    request.append_output_token(4)
    request.update_block_hashes(ROOT, 4)
    assert request.block_hashes == hash_blocks([1, 2, 3, 4], 4, ROOT)
    assert len(request.block_hashes) == 1


def test_block_hashes_update_incrementally_as_tokens_arrive():
    request = make_request(list(range(7)))
    request.update_block_hashes(ROOT, 4)
    assert request.block_hashes == hash_blocks(list(range(7)), 4, ROOT)
    for token in range(7, 17):
        request.append_output_token(token)
        request.update_block_hashes(ROOT, 4)
        assert request.block_hashes == hash_blocks(request.all_token_ids, 4, ROOT)
    assert len(request.block_hashes) == 4
    request.update_block_hashes(ROOT, 4)  # idempotent
    assert len(request.block_hashes) == 4


def test_block_hashes_chain_on_the_stored_parent_instead_of_rehashing():
    request = make_request(list(range(4)))
    request.update_block_hashes(ROOT, 4)
    sentinel = b"\x01" * 16
    request.block_hashes[0] = sentinel  # only new blocks are hashed, chained on the last stored one
    for token in range(4, 8):
        request.append_output_token(token)
    request.update_block_hashes(ROOT, 4)
    assert request.block_hashes == [sentinel, hash_block(sentinel, [4, 5, 6, 7])]


def test_block_hashes_depend_on_the_root():
    a, b = make_request(list(range(8))), make_request(list(range(8)))
    a.update_block_hashes(root_hash(b"x" * 16, 4, ""), 4)
    b.update_block_hashes(root_hash(b"x" * 16, 4, "tenant"), 4)
    assert len(a.block_hashes) == len(b.block_hashes) == 2
    assert not set(a.block_hashes) & set(b.block_hashes)
