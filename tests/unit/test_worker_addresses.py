"""The address a worker registers for its peers (worker/addresses.py): --host unless it is a wildcard, which
advertises the address that routes to Redis; a loopback address with Redis elsewhere is warned about."""

from __future__ import annotations

from worker.addresses import advertised_host, host_port, loopback_warning, route_source


def test_a_concrete_host_is_advertised_as_it_is() -> None:
    assert advertised_host("10.1.2.3", "redis://10.9.9.9:6379/0") == "10.1.2.3"
    assert advertised_host("127.0.0.1", "redis://10.9.9.9:6379/0") == "127.0.0.1"  # warned about, not changed


def test_a_wildcard_host_advertises_the_address_toward_redis() -> None:
    assert advertised_host("0.0.0.0", "redis://127.0.0.1:6379/0") == "127.0.0.1"  # Redis here: so is every peer
    assert advertised_host("0.0.0.0", "unix:///tmp/redis.sock") == "127.0.0.1"
    assert advertised_host("0.0.0.0", "redis://127.0.0.5:6379/0") == "127.0.0.1"
    toward = route_source("127.0.0.5")  # the machine's own routes pick it: any loopback destination -> lo
    assert toward is not None and toward.startswith("127.")
    assert advertised_host("0.0.0.0", "redis://:pw@localhost:6379/0") == "127.0.0.1"


def test_loopback_with_redis_on_another_host_is_warned_about() -> None:
    warning = loopback_warning("127.0.0.1", "redis://10.9.9.9:6379/0")
    assert warning is not None and "10.9.9.9" in warning and "--host" in warning
    assert loopback_warning("127.0.0.1", "redis://127.0.0.1:6379/0") is None  # one host: fine
    assert loopback_warning("10.1.2.3", "redis://10.9.9.9:6379/0") is None
    assert loopback_warning("::1", "rediss://redis.example:6380/0") is not None


def test_host_port_brackets_ipv6() -> None:
    assert host_port("10.0.0.1", 5) == "10.0.0.1:5" and host_port("::1", 5) == "[::1]:5"
