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
