"""BatonGraphDeployment spec validation: bad specs raise SpecError naming the field path."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from deploy.spec import SpecError, load_spec, parse_spec

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "disagg-h200-h100.yaml"


def _spec() -> dict:
    return copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))


def _error(data: dict) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_spec(data)
    return info.value


def test_example_parses_to_typed_fields():
    spec = load_spec(EXAMPLE)
    assert (spec.name, spec.namespace) == ("baton-llama-8b", "baton")
    assert (spec.prefill.replicas, spec.decode.replicas, spec.router.replicas) == (2, 4, 1)
    assert spec.prefill.resources.gpu.product == "NVIDIA-H200"
    assert spec.kv_transport.backend == "ucx" and spec.kv_transport.rdma_resource == "rdma/ib"
    assert spec.slo.ttft_p90_ms == 300.0 and spec.decode.autoscaling.kind == "keda"
    assert spec.redis.external_url is None and spec.redis.password_secret.name == "baton-redis"


def test_missing_model_is_named():
    data = _spec()
    del data["spec"]["model"]
    assert str(_error(data)) == "spec.model: is required"


def test_missing_model_pvc_is_named():
    data = _spec()
    del data["spec"]["model"]["pvc"]
    assert _error(data).path == "spec.model.pvc"


def test_negative_replicas_is_named():
    data = _spec()
    data["spec"]["services"]["decode"]["replicas"] = -1
    assert str(_error(data)) == "spec.services.decode.replicas: must be >= 0, got -1"


def test_unknown_transport_is_named():
    data = _spec()
    data["spec"]["kvTransport"]["backend"] = "carrier-pigeon"
    err = _error(data)
    assert err.path == "spec.kvTransport.backend"
    assert "ucx, nccl, nixl, tcp" in str(err)


def test_misspelled_field_is_rejected_not_ignored():
    data = _spec()
    data["spec"]["services"]["prefill"]["replicaz"] = 3
    assert _error(data).path == "spec.services.prefill.replicaz"


@pytest.mark.parametrize(("edit", "path"), [
    (lambda d: d.update(apiVersion="baton.ai/v2"), "apiVersion"),
    (lambda d: d.update(kind="Deployment"), "kind"),
    (lambda d: d["metadata"].update(name="Not_A_Name"), "metadata.name"),
    (lambda d: d["spec"]["services"]["decode"].update(replicas="4"), "spec.services.decode.replicas"),
    (lambda d: d["spec"]["services"]["decode"]["resources"].update(memory="lots"),
     "spec.services.decode.resources.memory"),
    (lambda d: d["spec"]["services"]["prefill"]["resources"]["gpu"].update(count=0),
     "spec.services.prefill.resources.gpu.count"),
    (lambda d: d["spec"]["services"]["router"]["resources"].update(gpu={"count": 1}),
     "spec.services.router.resources.gpu"),
    (lambda d: d["spec"]["services"]["prefill"].update(tensorParallelSize=4),
     "spec.services.prefill.tensorParallelSize"),
    (lambda d: d["spec"]["services"]["decode"].update(args=["--tensor-parallel-size=2"]),
     "spec.services.decode.args"),
    (lambda d: d["spec"]["slo"].update(ttftP90Ms=0), "spec.slo.ttftP90Ms"),
    (lambda d: d["spec"]["services"]["decode"]["autoscaling"].update(maxReplicas=1),
     "spec.services.decode.autoscaling.maxReplicas"),
    (lambda d: d["spec"]["services"]["redis"].update(externalUrl="http://redis"),
     "spec.services.redis.externalUrl"),
    (lambda d: d["spec"]["services"]["redis"].update(replicas=3), "spec.services.redis.replicas"),
    (lambda d: d["spec"].update(kvTransport={"backend": "tcp", "rdmaResource": "rdma/ib"}),
     "spec.kvTransport.rdmaResource"),
    (lambda d: d["spec"]["model"].update(path="/etc"), "spec.model.path"),
    (lambda d: d["spec"]["services"]["decode"].update(args="--max-num-seqs 8"), "spec.services.decode.args"),
    (lambda d: d["spec"]["services"]["decode"].update(env={"A": ["x"]}), "spec.services.decode.env.A"),
    (lambda d: d["spec"]["adminTokenSecret"].pop("key"), "spec.adminTokenSecret.key"),
])
def test_invalid_field_is_named(edit, path):
    data = _spec()
    edit(data)
    assert _error(data).path == path


def test_defaults_fill_a_minimal_spec():
    spec = parse_spec({"apiVersion": "baton.ai/v1alpha1", "kind": "BatonGraphDeployment",
                       "metadata": {"name": "m"}, "spec": {"model": {"pvc": "p", "path": "x"}, "services": {}}})
    assert spec.namespace == "default" and spec.kv_transport.backend == "tcp"
    assert (spec.router.replicas, spec.prefill.replicas, spec.decode.replicas) == (1, 1, 1)
    assert spec.decode.termination_grace_s == 300 and spec.slo is None


def test_yaml_syntax_error_is_a_spec_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)
