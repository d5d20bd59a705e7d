"""`baton admin profile`'s pure parts: the steady-state ITL of concurrent streams, the running max that keeps
ITL non-decreasing in batch size, and the grid trimmed to what the model and the worker's KV cache hold."""

from __future__ import annotations

import pytest

from router.admin.profile import Model, ProfileConfig, fits, monotone, steady_itl_s


def test_steady_itl_ignores_gaps_before_every_stream_has_its_first_token():
    # stream 0 decodes alone (gaps of 1 s) until stream 1's prefill ends at t = 10; then both step every 2 s
    arrivals = [[0.0, 1.0, 2.0, 10.0, 12.0, 14.0], [10.0, 12.0, 14.0, 16.0]]
    assert steady_itl_s(arrivals) == 2.0


def test_steady_itl_counts_steps_when_tokens_arrive_bunched():
    # a token per 1 s step, but the event loop flushes them three at a time, 20 us apart: the median single gap is
    # 20 us (what the profile measured on a busy machine); each stream's span over its gaps still counts the steps
    times = [group + k * 2e-5 for group in (3.0, 6.0, 9.0) for k in range(3)]
    assert steady_itl_s([times, list(times)]) == pytest.approx((9.00004 - 3.0) / 8)


def test_steady_itl_needs_tokens():
    with pytest.raises(RuntimeError, match="no tokens"):
        steady_itl_s([[1.0], []])
    with pytest.raises(RuntimeError, match="too few"):
        steady_itl_s([[1.0, 1.0]])  # tokens of one message arrive together: no gap to time


def test_monotone_is_a_running_max():
    assert monotone([5.0, 4.0, 6.0, 5.5, 7.0]) == [5.0, 5.0, 6.0, 6.0, 7.0]


def test_fits_drops_points_the_model_or_kv_cache_cannot_hold():
    config = ProfileConfig(prompt_lens=(32, 512, 4096), batch_sizes=(1, 2, 4, 8), context_lens=(64, 256),
                           decode_tokens=16)
    trimmed = fits(config, Model(vocab_size=1000, max_model_len=1024, block_size=4), kv_tokens=1024)
    assert trimmed.prompt_lens == (32, 512)
    assert trimmed.context_lens == (64, 256)
    assert trimmed.batch_sizes == (1, 2)  # 1024 // (256 + 16 + 1) = 3
    assert fits(config, Model(vocab_size=1000, max_model_len=100, block_size=4), None).context_lens == (64,)
