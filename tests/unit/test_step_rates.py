"""The engine measures its own prefill rate and decode step time (reported with the worker's heartbeat)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core.outputs import ScheduledSeq, SchedulerOutput
from engine.core.request import Request
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from engine.step_rates import StepRates
from engine.tiny import build_model


def request(rid: str, prompt_len: int, outputs: int = 0) -> Request:
    r = Request(request_id=rid, prompt_token_ids=list(range(1, prompt_len + 1)), sampling_params=SamplingParams(),
                seed=0, eos_token_ids=frozenset(), arrival_time=0.0)
    for token in range(outputs):
        r.append_output_token(token + 1)
    return r


def step(*slices: tuple[Request, int, int]) -> SchedulerOutput:
    seqs = tuple(ScheduledSeq(r, start, n, (0,), True) for r, start, n in slices)
    return SchedulerOutput(seqs=seqs, num_batched_tokens=sum(n for _, _, n in slices))


def test_prefill_and_decode_samples_are_told_apart():
    rates = StepRates(alpha=0.5)
    a, b, c = request("a", 100), request("b", 10, outputs=3), request("c", 10, outputs=5)
    rates.observe(step((a, 0, 64)), 0.010)  # 64 prompt tokens in 10 ms
    assert rates.prefill_tokens_per_s == pytest.approx(6400.0) and rates.decode_step_s is None
    rates.observe(step((a, 64, 36), (b, 12, 1)), 0.005)  # 36 prompt tokens + a decode: a prefill sample
    assert rates.prefill_tokens_per_s == pytest.approx((6400.0 + 7200.0) / 2)
    rates.observe(step((b, 12, 1), (c, 14, 1)), 0.004)  # two decodes
    rates.observe(step((b, 13, 1)), 0.002)  # one decode
    assert rates.decode_step_s == pytest.approx(0.003) and rates.decode_batch_size == pytest.approx(1.5)
    rates.observe(step((a, 0, 4), (b, 14, 1)), 0.003)  # too few prompt tokens to tell: neither
    assert rates.decode_step_s == pytest.approx(0.003) and rates.prefill_tokens_per_s == pytest.approx(6800.0)


def test_a_real_engine_reports_what_its_steps_took(tmp_path):
    engine = Engine(EngineConfig(model=str(build_model("tiny", tmp_path, train_steps=5, progress=lambda _: None)),
                                 num_blocks=64, block_size=4, num_threads=1))
    assert engine.step_rates.prefill_tokens_per_s is None
    engine.add_request("r0", list(range(5, 105)), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.step_rates.prefill_tokens_per_s > 100  # 100 tokens in one step, far faster than 1 s
    assert 0 < engine.step_rates.decode_step_s < 1 and engine.step_rates.decode_batch_size == 1.0


def test_the_engine_fits_its_decode_step_slope_over_batch_size():
    rates = StepRates(alpha=0.2)
    reqs = [request(f"r{i}", 10, outputs=2) for i in range(8)]
    for _ in range(6):
        for batch in (1, 4, 8, 2, 6):  # 10 ms + 5 ms per sequence
            rates.observe(step(*[(r, 12, 1) for r in reqs[:batch]]), 0.010 + 0.005 * batch)
    assert rates.decode_step_per_seq_s == pytest.approx(0.005, rel=1e-6)
    assert rates.decode_step_s == pytest.approx(0.010 + 0.005 * rates.decode_batch_size, rel=1e-6)
    flat = StepRates()
    flat.observe(step((reqs[0], 12, 1)), 0.01)
    assert flat.decode_step_per_seq_s is None  # one batch size: no slope to tell


def test_seed_counts_as_a_first_sample_and_never_overrides_a_measurement():
    rates = StepRates(alpha=0.5)
    rates.seed(1000.0, 0.02)
    assert rates.prefill_tokens_per_s == 1000.0 and rates.decode_step_s == 0.02 and rates.decode_batch_size == 1.0
    rates.observe(step((request("a", 100), 0, 64)), 0.032)  # 2000 tokens/s moves the seed half way
    assert rates.prefill_tokens_per_s == pytest.approx(1500.0)
    rates.seed(9.0, 9.0)  # a second seed changes nothing measured
    assert rates.prefill_tokens_per_s == pytest.approx(1500.0) and rates.decode_step_s == 0.02


def test_calibrate_seeds_the_rates_on_scratch_blocks_and_leaves_the_engine_as_it_was(tmp_path):
    model = str(build_model("tiny", tmp_path, train_steps=5, progress=lambda _: None))
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    prompt = list(range(5, 45))

    def tokens(engine: Engine) -> list[int]:
        engine.add_request("r", prompt, params)
        out = []
        while engine.has_unfinished():
            out += [t for d in engine.step() for t in d.new_token_ids]
        return out

    engine = Engine(EngineConfig(model=model, num_blocks=64, block_size=4, num_threads=1))
    free = engine.stats().num_free_blocks
    prefill_rate, decode_s = engine.calibrate(64)
    assert engine.step_rates.prefill_tokens_per_s == prefill_rate > 0
    assert engine.step_rates.decode_step_s == decode_s > 0 and engine.step_rates.decode_batch_size == 1.0
    assert engine.stats().num_free_blocks == free and engine.take_block_events() == []  # nothing cached, nothing leaked
    assert engine.stats().prefix_cache_queries == 0
    fresh = Engine(EngineConfig(model=model, num_blocks=64, block_size=4, num_threads=1))
    assert tokens(engine) == tokens(fresh)  # the scratch KV is never read as anybody's prefix


def test_calibrate_fits_what_the_pool_and_step_budget_allow(tmp_path):
    model = str(build_model("tiny", tmp_path, train_steps=5, progress=lambda _: None))
    small = Engine(EngineConfig(model=model, num_blocks=3, block_size=4, num_threads=1))
    assert small.calibrate(256) is not None  # capped to (3 - 1) blocks x 4 = 8 tokens: still a sample
    assert small.stats().num_free_blocks == 3
    tiny_pool = Engine(EngineConfig(model=model, num_blocks=1, block_size=4, num_threads=1))
    assert tiny_pool.calibrate(256) is None and tiny_pool.step_rates.prefill_tokens_per_s is None


def test_a_waiting_requests_cached_prefix_is_not_reported_as_queued_work(tmp_path):
    from worker.node import worker_load

    engine = Engine(EngineConfig(model=str(build_model("tiny", tmp_path, train_steps=5, progress=lambda _: None)),
                                 num_blocks=64, block_size=4, num_threads=1))
    prompt = list(range(5, 45))  # 40 tokens: 10 blocks
    engine.add_request("a", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    engine.add_request("b", prompt + [7, 8, 9, 10, 11], SamplingParams(max_tokens=1))  # 40 of 45 tokens cached
    engine.add_request("c", list(range(100, 120)), SamplingParams(max_tokens=1))  # nothing cached
    assert worker_load(engine, engine.stats()).queued_prefill_tokens == 5 + 20
