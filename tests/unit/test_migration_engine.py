"""What a migrated request asks of the engine (router.migration): a decode worker given the prompt plus the first k
outputs another one streamed goes on with exactly the outputs the uninterrupted request would have had after them,
greedy, seeded and with penalties; also when it first imports a cached prefix of the prompt from another worker
(``add_prefix_request`` with the outputs). Every pool is full afterwards."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from tests.unit.test_disagg_engine import assert_full, model_dir  # noqa: F401
from tests.unit.test_prefix_import_engine import make_engine, run, warm

PROMPT = list(range(300, 331))  # 31 tokens
PARAMS = [
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=3, repetition_penalty=1.3, presence_penalty=0.5, max_tokens=16,
                   ignore_eos=True),
]
IDS = ["greedy", "seeded", "penalties"]


@pytest.fixture(scope="module")
def uninterrupted(model_dir):  # noqa: F811
    engine = make_engine(model_dir)
    for i, params in enumerate(PARAMS):
        engine.add_request(str(i), PROMPT, params)
    out = run(engine)
    return [out[str(i)] for i in range(len(PARAMS))]


@pytest.mark.parametrize("i", range(len(PARAMS)), ids=IDS)
def test_a_request_resumed_after_k_outputs_goes_on_exactly(model_dir, uninterrupted, i):  # noqa: F811
    full = uninterrupted[i]
    engine = make_engine(model_dir)
    for k in (1, 2, 9, 15):
        engine.add_request(f"k{k}", PROMPT, PARAMS[i], output_token_ids=full[:k])
    out = run(engine)
    # the same tokens, and as many: max_tokens counts the outputs a request resumed after (k15 samples one)
    assert {k: out[f"k{k}"] for k in (1, 2, 9, 15)} == {k: full[k:] for k in (1, 2, 9, 15)}
    assert_full(engine)


@pytest.mark.parametrize("i", range(len(PARAMS)), ids=IDS)
def test_a_resumed_request_importing_a_prefix_goes_on_exactly(model_dir, uninterrupted, i):  # noqa: F811
    full, k = uninterrupted[i], 10
    x, d = make_engine(model_dir), make_engine(model_dir)
    warm(x, PROMPT)  # X caches the prompt's full blocks (as the prefill worker does)
    tokens = [*PROMPT, *full[:k]]
    held = x.hold_cached_prefix(tokens, "", 0)
    assert held.num_tokens == len(PROMPT) // 4 * 4  # the prompt's full blocks: X never saw the outputs
    reservation = d.add_prefix_request("r", PROMPT, full[:k], PARAMS[i])
    n = len(held.block_ids)
    assert reservation.block_hashes[:n] == held.block_hashes  # prompt + outputs hash alike on both
    d.runner.kv_cache[:, list(reservation.block_ids[:n])] = x.runner.kv_cache[:, list(held.block_ids)]
    d.activate_prefix("r", held.num_tokens)
    x.release_blocks(list(held.block_ids))
    assert run(d)["r"] == full[k:]
    assert_full(x, d)
