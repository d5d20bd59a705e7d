"""The integration tests' oracle can see one wrong KV block (tests/oracle.py): with the tiny checkpoint they use,
a block of the prompt's KV swapped for another of its blocks right after prefill moves some sampled token's
log-probability past ``LOGPROB_TOLERANCE`` in every case tried, while serving the same prompt beside another (a
different batch) moves it by a tenth of that at most. Greedy tokens alone would miss most of these swaps."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from tests.integration.test_e2e import PROMPTS
from tests.oracle import LOGPROB_TOLERANCE, Output
from tests.tiny_model import shared_tiny

MAX_TOKENS = 10
LONG = [p for p in PROMPTS if len(p) >= 24]  # 6 blocks of 4 or more: first, middle and last full block differ


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # no prefix cache: a corrupted block must not serve the next run
    return Engine(EngineConfig(model=str(shared_tiny(tmp_path_factory)), num_blocks=512, block_size=4,
                               enable_prefix_caching=False))


def run(engine: Engine, prompt: list[int], *, swap: tuple[int, int] | None = None, beside=None) -> Output:
    """Greedy with logprobs; ``swap=(k, j)``: once prefilled, the prompt's KV block k holds block j's contents."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    engine.add_request("probe", prompt, params)
    if beside is not None:
        engine.add_request("beside", beside, params)
    out = Output([], [])
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.request_id == "probe":
                out.tokens.extend(delta.new_token_ids)
                out.logprobs.extend(chosen for chosen, _ in delta.new_logprobs)
        if swap is not None and out.tokens:
            blocks, (k, j) = engine.kv_cache_manager.block_ids("probe"), swap
            engine.runner.kv_cache[:, blocks[k]] = engine.runner.kv_cache[:, blocks[j]].clone()
            swap = None
    return out


def shift(a: Output, b: Output) -> float:
    return max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs))


def test_one_swapped_kv_block_moves_the_logprobs_past_the_tolerance(engine):
    tokens_changed, cases = 0, 0
    for prompt in LONG:
        reference = run(engine, prompt)
        assert len(reference.logprobs) == MAX_TOKENS
        assert shift(reference, run(engine, prompt, beside=LONG[0][:37])) <= LOGPROB_TOLERANCE / 10
        full = len(prompt) // 4
        for k in (0, full // 2, full - 1):
            swapped = run(engine, prompt, swap=(k, (k + 3) % full))
            assert shift(reference, swapped) > LOGPROB_TOLERANCE, (len(prompt), k, reference, swapped)
            tokens_changed += swapped.tokens != reference.tokens
            cases += 1
    print(f"tokens alone saw {tokens_changed} of {cases} swapped blocks; logprobs saw all")
