"""bench.hosts / tests/hosts.py pure parts: tc's rate spelling, and the htb bursts that keep small pulls shaped."""

from __future__ import annotations

import pytest

from tests.hosts import _htb_rate, rate_bits


def test_rates_in_tc_units() -> None:
    assert rate_bits("10gbit") == 10e9 and rate_bits("100mbit") == 100e6 and rate_bits("1.5Gbit") == 1.5e9
    assert rate_bits("64kbit") == 64e3
    for bad in ("fast", "1gbps", "gbit", "10"):
        with pytest.raises(ValueError, match="tc's units"):
            rate_bits(bad)


def test_an_htb_class_bursts_200_us_of_its_rate_and_at_least_8_kib() -> None:
    def burst(rate: str) -> int:
        args = _htb_rate(rate)
        return int(args[args.index("burst") + 1].removesuffix("b"))

    assert burst("10gbit") == 250_000  # 200 us at 1.25 GB/s
    assert burst("1gbit") == 25_000
    assert burst("100mbit") == 8192  # 2,500 bytes computed: the floor


# ---- the link study's plumbing (bench/link_study.py): no processes --------------------------------------------

REASON = ("cost: 0 of 2048 prompt tokens cached on d0; d0: cost 9.1000 s = ttft 4.6000 + stall 0.0000 + 3 x itl "
          "0.0500; remote on p0 4.6000 s = overhead 0.0200 + queue 0.0000 + prefill 4.3000 + transfer 0.2800 vs "
          "local 4.4000 s = overhead 0.0100 + queue 0.0000 + prefill 4.3000 + interference 0.0900 (itl 1.1000, stall "
          "of running 4.3000); remote predicts the lower ttft + stall; 2048 uncached prompt tokens > threshold 64")


def test_the_study_reads_both_plans_off_the_cost_routers_reason() -> None:
    from bench.link_study import plans

    assert plans(REASON) == {"remote_s": 4.6, "transfer_s": 0.28, "local_s": 4.4, "stall_s": 4.3}
    assert plans("least_loaded: 2048 uncached prompt tokens > threshold 512") == {}


def test_a_cell_sums_up_routes_percentiles_agreement_and_the_predictions_error(tmp_path) -> None:
    from bench.link_study import Sample, plot, summarise, table

    def sample(kind: str, d_first_ms: float, **extra) -> Sample:
        return Sample(rate="100mbit", link_mbit=100.0, policy="cost", kind=kind, ttft_ms=d_first_ms / 2,
                      d_first_ms=d_first_ms, e2e_ms=d_first_ms + 100, stall_ms=1000.0 if kind == "local" else 0.0,
                      **extra)

    cell = [sample("remote", 5000.0, predicted_ms=4500.0, remote_s=4.6, transfer_s=0.28, local_s=4.4, stall_s=4.3),
            sample("local", 4000.0, predicted_ms=5000.0, remote_s=9.0, transfer_s=0.28, local_s=4.4, stall_s=4.3),
            sample("remote", 6000.0, predicted_ms=6000.0, remote_s=9.0, transfer_s=0.28, local_s=4.4, stall_s=4.3),
            sample("remote", 8000.0, transfer_ms=1340.0)]  # no prediction (a baseline's reason)
    row = summarise(cell)
    # the first is the cheaper plan (4.6 < 8.7), the second too (9.0 > 8.7: local), the third not (remote at 9.0)
    assert (row["remote"], row["local"], row["agrees"]) == (3, 1, "2/3")
    assert (row["d_first_p50_ms"], row["d_first_p90_ms"]) == (5000.0, 8000.0)  # nearest rank of 4
    assert row["median_abs_error"] == pytest.approx(0.1)  # |-10%|, |+25%|, 0
    assert row["median_error"] == pytest.approx(0.0) and row["pull_ms"] == 1340.0
    assert row["predicted_remote_s"] == 9.0 and row["predicted_local_s"] == pytest.approx(8.7)
    text = table([row])
    assert row["predicted_pull_ms"] == pytest.approx(280.0)  # the remote plans' transfer term, 4.6 = ... + 0.28
    assert (row["stall_p50_ms"], row["cost_p50_ms"]) == (0.0, 5000.0)  # the local one: 4,000 + its 1,000 stall
    assert ("| 100 Mbit/s | cost | 3 / 1 | 2,500 | 4,000 | 5,000 | 8,000 | 1,340 ms (280 ms) | 0 | 5,000 | 9.00 / 8.70 s "
            "| 2/3 | 10% |") in text
    plot([row, {**row, "policy": "threshold"}], tmp_path / "study.png")
    assert (tmp_path / "study.png").read_bytes()[:4] == b"\x89PNG"
