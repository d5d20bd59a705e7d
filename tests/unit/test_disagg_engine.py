"""The engine's disaggregation hooks, in one process: a prefill engine hands its prompt blocks over,
a decode engine adopts a copy of them and goes on; the result equals the single engine's, token for
token, greedy and seeded. The KV copy here is a plain tensor copy (the data plane has its own tests)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from tests.tiny_model import shared_tiny

BLOCK = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return shared_tiny(tmp_path_factory)


def make_engine(model_dir, num_blocks=128) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), num_blocks=num_blocks, block_size=BLOCK))


def run(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return tokens


def prefill(engine: Engine, rid: str, prompt: list[int], params: SamplingParams) -> tuple[int, tuple[int, ...]]:
    first = SamplingParams(**{**_fields(params), "max_tokens": 1, "min_tokens": min(params.min_tokens, 1)})
    engine.add_request(rid, prompt, first, hold_blocks=True)
    (delta,) = [d for d in _drain(engine) if d.request_id == rid]
    return delta.new_token_ids[0], delta.held_block_ids


def _drain(engine):
    out = []
    while engine.has_unfinished():
        out.extend(engine.step())
    return out


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


def assert_full(*engines: Engine) -> None:
    for engine in engines:
        pool = engine.kv_cache_manager.pool
        pool.check_invariants()
        assert pool.num_free_blocks == pool.num_blocks


PROMPTS = [list(range(5, 5 + n)) for n in (3, 4, 9, 17, 30)]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True),
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_prefill_then_pulled_decode_equals_one_engine(model_dir, params):
    single, p, d = make_engine(model_dir), make_engine(model_dir), make_engine(model_dir)
    for i, prompt in enumerate(PROMPTS):
        single.add_request(str(i), prompt, params)
    expected = run(single)
    for i, prompt in enumerate(PROMPTS):
        first, src_blocks = prefill(p, str(i), prompt, params)
        assert len(src_blocks) == -(-len(prompt) // BLOCK)  # every prompt block, the partial last one too
        request, num_hit, dst_blocks = d.add_remote_request(str(i), prompt, [first], params)
        # the prompts share prefixes: D reuses the full blocks it already holds and pulls the rest
        assert num_hit == (0 if i == 0 else len(PROMPTS[i - 1]) // BLOCK)
        d.runner.kv_cache[:, dst_blocks[num_hit:]] = p.runner.kv_cache[:, list(src_blocks[num_hit:])]
        d.activate_remote(str(i))
        p.release_blocks(list(src_blocks))
    got = run(d)
    for i, prompt in enumerate(PROMPTS):
        first = expected[str(i)][0]
        assert [first] + got[str(i)] == expected[str(i)]
    assert_full(single, p, d)


def test_decode_reuses_its_own_cached_prefix_and_pulls_only_the_rest(model_dir):
    p, d = make_engine(model_dir), make_engine(model_dir)
    params = PARAMS[0]
    prefix = list(range(100, 112))  # 3 full blocks
    d.add_request("warm", prefix + [7, 8], params)
    run(d)
    prompt = prefix + [1, 2, 3, 4, 5]
    first, src_blocks = prefill(p, "r", prompt, params)
    request, num_hit, dst_blocks = d.add_remote_request("r", prompt, [first], params)
    assert num_hit == 3 and request.num_cached_tokens == 12
    d.runner.kv_cache[:, dst_blocks[num_hit:]] = p.runner.kv_cache[:, list(src_blocks[num_hit:])]
    d.activate_remote("r")
    p.release_blocks(list(src_blocks))
    got = run(d)["r"]
    single = make_engine(model_dir)
    single.add_request("r", prompt, params)
    assert [first] + got == run(single)["r"]
    assert_full(p, d, single)


def test_failed_pull_falls_back_to_local_prefill(model_dir):
    p, d, single = make_engine(model_dir), make_engine(model_dir), make_engine(model_dir)
    params, prompt = PARAMS[1], PROMPTS[3]
    single.add_request("r", prompt, params)
    expected = run(single)["r"]
    first, src_blocks = prefill(p, "r", prompt, params)
    p.release_blocks(list(src_blocks))  # the lease lapsed: nothing is ever copied
    d.add_remote_request("r", prompt, [first], params)
    d.fallback_remote("r")
    assert [first] + run(d)["r"] == expected
    assert_full(p, d, single)


def test_abort_while_waiting_for_remote_kv_frees_the_reservation(model_dir):
    d = make_engine(model_dir, num_blocks=16)
    reserved = d.add_remote_request("r", PROMPTS[4], [9], PARAMS[0])
    assert reserved is not None and d.kv_cache_manager.pool.num_free_blocks < 16
    delta = d.abort("r")
    assert delta.finish_reason.value == "abort"
    assert_full(d)


def test_no_room_for_remote_kv_returns_none(model_dir):
    d = make_engine(model_dir, num_blocks=4)
    d.add_request("busy", list(range(10, 22)), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    d.step()  # 'busy' finished; its blocks stay cached but evictable, so room exists
    assert d.add_remote_request("a", list(range(40, 52)), [3], PARAMS[0]) is not None
    assert d.add_remote_request("b", list(range(60, 72)), [3], PARAMS[0]) is None  # a holds 3 of 4 blocks
    d.abort("a")
    assert_full(d)


def test_activating_pulled_kv_without_a_first_token_is_refused(model_dir):
    """With no output token the next step would schedule 0 tokens and sample another row's logits."""
    d = make_engine(model_dir, num_blocks=16)
    d.add_remote_request("r", PROMPTS[3], [], PARAMS[0])
    with pytest.raises(InvalidRequest, match="first output token"):
        d.activate_remote("r")
    assert d.scheduler._requests["r"].status.value == "waiting_for_remote_kv"  # nothing changed
    d.fallback_remote("r")  # the caller can still recompute: D samples the first token itself
    single = make_engine(model_dir)
    single.add_request("r", PROMPTS[3], PARAMS[0])
    assert run(d)["r"] == run(single)["r"]
    assert_full(d, single)


@pytest.mark.parametrize("reserve", ["add_remote_request", "add_prefix_request"])
def test_a_duplicate_id_for_pulled_kv_is_refused_before_any_block_is_taken(model_dir, reserve):
    d = make_engine(model_dir, num_blocks=16)
    d.add_request("r", PROMPTS[0], PARAMS[0])
    free = d.kv_cache_manager.pool.num_free_blocks
    with pytest.raises(InvalidRequest, match="duplicate"):
        getattr(d, reserve)("r", PROMPTS[4], [9], PARAMS[0])
    assert d.kv_cache_manager.pool.num_free_blocks == free
    run(d)
    assert_full(d)
