"""Cross-worker prefix reuse in the engine, in one process: worker X pins its cached prefix of a prompt
(``hold_cached_prefix``), worker D reserves the prompt's blocks (``add_prefix_request``), gets the prefix
blocks it lacks (here a plain tensor copy; the data plane has its own tests), and prefills only the rest
(``activate_prefix``). The tokens equal one engine's; every pool is full and balanced afterwards."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core.request import Request
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from tests.unit.test_disagg_engine import BLOCK, assert_full, model_dir  # noqa: F401
from tests.unit.test_scheduler import BS, make_scheduler

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True)
PREFIX = list(range(200, 214))  # 14 tokens: 3 full blocks are cached after a one-token run
PROMPT = PREFIX + list(range(40, 57))  # 31 tokens, the first 12 cached on X


def make_engine(model_dir, **overrides) -> Engine:  # noqa: F811
    return Engine(EngineConfig(model=str(model_dir), **{"num_blocks": 64, "block_size": BLOCK, **overrides}))


def run(engine: Engine) -> dict[str, list]:
    """Each request's tokens, and its last delta under key ``(id, "last")``."""
    out: dict = {}
    while engine.has_unfinished():
        for delta in engine.step():
            out.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            out[(delta.request_id, "last")] = delta
    return out


def warm(engine: Engine, prompt: list[int], salt: str = "") -> None:
    engine.add_request("warm", prompt, SamplingParams(temperature=0, max_tokens=1), cache_salt=salt)
    run(engine)


def single_engine_tokens(model_dir, prompt, params) -> list[int]:  # noqa: F811
    single = make_engine(model_dir)
    single.add_request("r", prompt, params)
    return run(single)["r"]


def import_prefix(x: Engine, d: Engine, prompt: list[int], params: SamplingParams) -> int:
    """X leases its prefix, D reserves, copies the blocks it lacks, activates; X's lease ends. Returns
    the number of blocks copied."""
    held = x.hold_cached_prefix(prompt, "", 0)
    reservation = d.add_prefix_request("r", prompt, [], params)
    n = len(held.block_ids)
    assert reservation.block_hashes[:n] == held.block_hashes  # both workers hash the prompt alike
    local = reservation.num_local_blocks
    dst = list(reservation.block_ids[local:n])
    d.runner.kv_cache[:, dst] = x.runner.kv_cache[:, list(held.block_ids[local:])]
    d.activate_prefix("r", held.num_tokens)
    x.release_blocks(list(held.block_ids))
    return len(dst)


def test_hold_cached_prefix_pins_the_longest_cached_prefix_and_release_unpins_it(model_dir):  # noqa: F811
    x = make_engine(model_dir)
    warm(x, PREFIX)
    pool = x.kv_cache_manager.pool
    held = x.hold_cached_prefix(PROMPT, "", 12)
    assert held.num_tokens == 12 and len(held.block_ids) == 3
    assert list(held.block_hashes) == x.kv_cache_manager.prompt_hashes(PROMPT, "")[:3]
    assert all(pool.ref_count(b) == 1 for b in held.block_ids)  # pinned: out of the evictable queue
    assert pool.num_free_blocks == pool.num_blocks - 3
    pool.check_invariants()
    x.release_blocks(list(held.block_ids))
    assert_full(x)
    assert [pool.lookup(h) for h in held.block_hashes] == list(held.block_ids)  # still cached, evictable


def test_hold_cached_prefix_leaves_a_token_to_compute_and_honours_min_tokens_and_salt(model_dir):  # noqa: F811
    x = make_engine(model_dir)
    warm(x, PREFIX)
    exact = x.hold_cached_prefix(PREFIX[:12], "", 0)  # a 12-token prompt: at most 2 blocks, like a local hit
    assert exact.num_tokens == 8
    x.release_blocks(list(exact.block_ids))
    assert x.hold_cached_prefix(PROMPT, "", 13) is None
    assert x.hold_cached_prefix(PROMPT, "tenant-b", 0) is None
    assert x.hold_cached_prefix(list(range(60, 90)), "", 0) is None
    assert_full(x)
    with pytest.raises(InvalidRequest):
        x.hold_cached_prefix([], "", 0)
    with pytest.raises(InvalidRequest):
        x.hold_cached_prefix([x.model_config.vocab_size], "", 0)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_imported_prefix_gives_the_single_engines_tokens(model_dir, params):  # noqa: F811
    x, d = make_engine(model_dir), make_engine(model_dir, max_num_batched_tokens=8)  # D chunks the rest
    warm(x, PREFIX)
    assert import_prefix(x, d, PROMPT, params) == 3
    out = run(d)
    assert out["r"] == single_engine_tokens(model_dir, PROMPT, params)
    assert out[("r", "last")].num_cached_tokens == 12
    assert_full(x, d)
    hashes = d.kv_cache_manager.prompt_hashes(PROMPT, "")[:3]  # committed under D's own hashes
    assert all(d.kv_cache_manager.pool.lookup(h) is not None for h in hashes)


def test_import_pulls_only_the_prefix_blocks_the_decoder_lacks(model_dir):  # noqa: F811
    x, d = make_engine(model_dir), make_engine(model_dir)
    warm(x, PREFIX)
    warm(d, PREFIX[:8] + [1, 2])  # D caches the first 2 of X's 3 blocks
    assert import_prefix(x, d, PROMPT, GREEDY) == 1
    out = run(d)
    assert out["r"] == single_engine_tokens(model_dir, PROMPT, GREEDY)
    assert out[("r", "last")].num_cached_tokens == 12
    assert_full(x, d)


def test_fallback_after_a_prefix_reservation_recomputes_everything(model_dir):  # noqa: F811
    d = make_engine(model_dir)
    assert d.add_prefix_request("r", PROMPT, [], GREEDY).num_local_blocks == 0
    d.fallback_remote("r")
    out = run(d)
    assert out["r"] == single_engine_tokens(model_dir, PROMPT, GREEDY)
    assert out[("r", "last")].num_cached_tokens == 0
    assert_full(d)


def test_abort_of_a_prefix_reservation_frees_it(model_dir):  # noqa: F811
    d = make_engine(model_dir)
    d.add_prefix_request("r", PROMPT, [], GREEDY)
    assert d.abort("r").finish_reason.value == "abort"
    assert_full(d)


def test_scheduler_prefills_only_the_rest_of_an_activated_prefix_in_chunks():
    sched = make_scheduler(max_num_batched_tokens=4)
    request = Request(request_id="r", prompt_token_ids=list(range(1, 15)), sampling_params=GREEDY, seed=0)
    num_hit, block_ids = sched.add_remote(request, request.num_tokens)
    assert (num_hit, block_ids) == (0, [0, 1, 2, 3])  # every token's block reserved up front
    sched.activate_prefix("r", 2 * BS)
    assert request.num_cached_tokens == request.num_computed_tokens == 8
    out = sched.schedule()
    assert [(s.start, s.num_new_tokens, s.block_ids, s.samples) for s in out.seqs] == [(8, 4, (0, 1, 2, 3), False)]
    assert [sched.kv_cache.pool.lookup(h) for h in request.block_hashes[:2]] == [0, 1]  # committed
    sched.abort("r")
    sched.kv_cache.pool.check_invariants()
    assert sched.kv_cache.pool.num_free_blocks == 10
