"""bench.decode_sampling on the tiny model: one row per mode with the step and sampling times, the runner's
own sampler and builder back in place afterwards, and the engine's pool full again (no timing asserted)."""

from __future__ import annotations

import argparse

from bench.decode_sampling import MODES, run_mode, _prompts
from engine.config import EngineConfig
from engine.engine import Engine
from engine.tiny import build_model


def test_each_mode_reports_its_share_and_leaves_the_runner_as_it_was(tmp_path):
    folder = build_model("tiny", tmp_path / "tiny", train_steps=0, progress=lambda _: None)
    engine = Engine(EngineConfig(model=str(folder), num_blocks=64, max_num_seqs=4))
    sampler, builder = engine.runner.sampler, engine.runner.sampling
    args = argparse.Namespace(prompts="text", batch=3, prompt_tokens=12)
    for mode in MODES:
        row = run_mode(engine, mode, _prompts(engine, args, seed=0), max_tokens=5)
        assert row["mode"] == mode and row["steps"] >= 2
        assert 0 < row["sampling_ms"] < row["step_ms"] and 0 < row["sampling_share"] < 1
    assert engine.runner.sampler is sampler and engine.runner.sampling is builder
    pool = engine.kv_cache_manager.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks
