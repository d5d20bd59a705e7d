"""Plan profiles from the workers' start-up calibration (router/admin/calibrated.py), pure."""

from __future__ import annotations

import pytest

from kv_transfer.workers import WorkerLoad
from router.admin.calibrated import from_calibration


def load(**rates) -> WorkerLoad:
    return WorkerLoad(running=0, waiting=0, free_blocks=10, queued_prefill_tokens=0, **rates)


def test_prefill_workers_rates_are_averaged_into_a_flat_curve():
    got = from_calibration([("prefill", load(prefill_tokens_per_s=1000.0)), ("prefill", load(prefill_tokens_per_s=3000.0)),
                            ("decode", load(prefill_tokens_per_s=99.0))], None)
    assert got.prefill.tokens_per_s == (2000.0, 2000.0) and got.prefill.service_time_s(1000) == pytest.approx(0.5)
    assert got.decode is None and [t.name for t in got.terms] == ["calibrated rate"]


def test_without_prefill_workers_the_decode_workers_rate_is_used():
    got = from_calibration([("decode", load(prefill_tokens_per_s=800.0, decode_step_s=0.03))], 4096)
    assert got.prefill.tokens_per_s[0] == 800.0 and got.decode.kv_tokens_per_worker == 4096


def test_decode_itl_grows_with_the_measured_per_sequence_cost():
    got = from_calibration([("decode", load(decode_step_s=0.05, decode_batch_size=8.0, decode_step_per_seq_s=0.002))],
                           None)
    itl = dict(zip(got.decode.batch_sizes, got.decode.itl_s))
    assert itl[8] == pytest.approx(0.05) and itl[32] == pytest.approx(0.05 + 24 * 0.002)
    flat = from_calibration([("decode", load(decode_step_s=0.02))], None).decode
    assert set(flat.itl_s) == {0.02}  # one batch size measured: flat, the KV limit bounds the batch


def test_nothing_measured_gives_nothing():
    got = from_calibration([("prefill", load()), ("decode", load())], None)
    assert (got.prefill, got.decode, got.terms) == (None, None, ())
