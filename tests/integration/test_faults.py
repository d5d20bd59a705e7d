"""Fault injection with real processes (issue 9): each scenario of ``fault_scenarios`` once, on one shared
platform (redis-server, router, one prefill worker behind a KV proxy, two decode workers).

For every scenario: no client call outlives its deadline (hung == 0), every status is one the scenario
allows (streams on a killed decode worker migrate to the other and complete), completed requests equal the offline engine
token for token, every surviving pool is full with no lease open, and a fresh request succeeds afterwards.
``python -m bench.faults --repeat 20`` runs the same scenarios repeatedly and tabulates the counts.
"""

from __future__ import annotations

import pytest

from tests.integration.fault_scenarios import SCENARIOS
from tests.integration.faults_lib import FaultPlatform, Reference
from tests.integration.test_e2e import assert_pools_full
from tests.tiny_model import shared_tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return shared_tiny(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def platform(model_dir, tmp_path_factory):
    running = FaultPlatform.start(model_dir, tmp_path_factory.mktemp("fault-logs"))
    yield running
    running.stop()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fault_scenario(platform, reference, name):
    result = SCENARIOS[name](platform, reference)
    assert result.problems == [], f"{name}: {result.problems}\ncodes: {dict(result.codes)}"
    assert result.hung == 0 and result.leaked_blocks == 0 and result.open_leases == 0
    assert result.codes["OK"] >= 1  # at least the fresh request after the fault
    assert_pools_full(platform.cluster)


LAYERWISE_SCENARIOS = ("prefill_killed", "kv_stalled", "kv_corrupted")


@pytest.fixture(scope="module")
def layerwise_platform(model_dir, tmp_path_factory):
    """The same platform with the router streaming KV by layer: D holds the handle before P's first token."""
    running = FaultPlatform.start(model_dir, tmp_path_factory.mktemp("fault-logs-layerwise"), ("--kv-layerwise",))
    yield running
    running.stop()


@pytest.mark.parametrize("name", LAYERWISE_SCENARIOS)
def test_fault_scenario_with_layerwise_streaming(layerwise_platform, reference, name):
    """P killed while D already pulls (D is told to recompute), a stalled and a corrupted streamed pull."""
    result = SCENARIOS[name](layerwise_platform, reference)
    assert result.problems == [], f"{name}: {result.problems}\ncodes: {dict(result.codes)}"
    assert result.hung == 0 and result.leaked_blocks == 0 and result.open_leases == 0
    assert result.codes["OK"] >= 1
    assert_pools_full(layerwise_platform.cluster)
