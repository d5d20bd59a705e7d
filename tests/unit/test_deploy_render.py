"""Rendering every example spec: the manifests validate against the Kubernetes schemas offline, and every
container command line parses with the real `baton` CLI parser."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest

from kv_transfer.transport import TRANSPORT_KINDS
import yaml

from deploy.commands import main as deploy_main
from deploy.render import render, to_yaml
from deploy.spec import load_spec
from worker.main import parser as worker_parser
from router.main import build_parser as router_parser

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "deploy" / "examples").glob("*.yaml"))
K8S_VERSION = "1.33.0"  # a release whose schemas kubernetes-validate ships
# Kinds of CRDs we do not own: checked against the fields their operators require (minimal schemas below).
CRD_KINDS = {
    "ServiceMonitor": {"type": "object", "required": ["spec"], "properties": {"spec": {
        "type": "object", "required": ["selector", "endpoints"],
        "properties": {"endpoints": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["port"], "properties": {"port": {"type": "string"}}}}}}}},
    "ScaledObject": {"type": "object", "required": ["spec"], "properties": {"spec": {
        "type": "object", "required": ["scaleTargetRef", "triggers"],
        "properties": {"scaleTargetRef": {"type": "object", "required": ["name"]},
                       "minReplicaCount": {"type": "integer", "minimum": 0},
                       "triggers": {"type": "array", "minItems": 1, "items": {
                           "type": "object", "required": ["type", "metadata"]}}}}}},
}


def _manifests(example: Path) -> list[dict]:
    # through YAML and back, as kubectl would read them
    return list(yaml.safe_load_all(to_yaml(render(load_spec(example)))))


def test_there_are_three_examples():
    assert [p.name for p in EXAMPLES] == ["disagg-h200-h100.yaml", "multinode-tp.yaml", "single-node.yaml"]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_manifests_validate_against_kubernetes_schemas(example):
    for manifest in _manifests(example):
        if manifest["kind"] in CRD_KINDS:
            jsonschema.validate(manifest, CRD_KINDS[manifest["kind"]])
        else:
            kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_container_command_parses_with_the_real_cli(example):
    spec = load_spec(example)
    seen = set()
    for container in _containers(_manifests(example)):
        if container["command"][0] == "redis-server":
            continue
        assert container["command"][0] == "baton"
        role, argv = container["command"][1], container["args"]
        seen.add(role)
        if role == "router":
            args = router_parser().parse_args(argv)
            assert args.port == container["ports"][0]["containerPort"]
            http = next(p for p in container["ports"] if p["name"] == "http")  # the OpenAI front is exposed
            assert args.http_port == http["containerPort"] == 8000
            assert args.ns == spec.name
        else:
            args = worker_parser(role).parse_args(argv)
            assert args.port == container["ports"][0]["containerPort"] and args.namespace == spec.name
            service = getattr(spec, role)
            assert args.tensor_parallel_size == service.tensor_parallel_size  # the spec's degree reaches the worker
            # a transport the worker knows (whether it can run is checked where the worker runs: ucx needs ucxx)
            assert set(args.kv_transport.split(",")) <= set(TRANSPORT_KINDS) - {"local"}
    assert seen == {"router", "prefill", "decode"}


def test_probes_use_grpc_health_on_the_served_port():
    for container in _containers(_manifests(EXAMPLES[0])):
        if container["command"][0] == "baton":
            port = container["ports"][0]["containerPort"]
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert container[probe]["grpc"] == {"port": port}


def test_disaggregated_example_objects():
    by_kind: dict[str, list[str]] = {}
    for manifest in _manifests(EXAMPLES[0]):
        by_kind.setdefault(manifest["kind"], []).append(manifest["metadata"]["name"])
    assert by_kind["Deployment"] == ["baton-llama-8b-router", "baton-llama-8b-prefill", "baton-llama-8b-decode"]
    assert by_kind["StatefulSet"] == ["baton-llama-8b-redis"]
    assert len(by_kind["PodDisruptionBudget"]) == 3 and by_kind["ScaledObject"] == ["baton-llama-8b-decode"]
    assert by_kind["ConfigMap"] == ["baton-llama-8b-config"] and len(by_kind["ServiceMonitor"]) == 1
    services = {m["metadata"]["name"]: m for m in _manifests(EXAMPLES[0]) if m["kind"] == "Service"}
    router_ports = {p["name"]: p["port"] for p in services["baton-llama-8b-router"]["spec"]["ports"]}
    assert router_ports == {"grpc": 50051, "metrics": 9450, "http": 8000}


def test_gpu_rdma_placement_and_model_volume():
    deployments = {m["metadata"]["name"]: m for m in _manifests(EXAMPLES[0]) if m["kind"] == "Deployment"}
    pod = deployments["baton-llama-8b-prefill"]["spec"]["template"]["spec"]
    limits = pod["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1" and limits["rdma/ib"] == "1"
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"][0] == {"key": "nvidia.com/gpu.product", "operator": "In",
                                           "values": ["NVIDIA-H200"]}
    assert pod["volumes"][0]["persistentVolumeClaim"] == {"claimName": "baton-models", "readOnly": True}
    assert pod["volumes"][1]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert pod["terminationGracePeriodSeconds"] == 120
    router = deployments["baton-llama-8b-router"]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in router["containers"][0]["resources"].get("limits", {})
    env = {e["name"]: e for e in router["containers"][0]["env"]}
    assert env["BATON_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "baton-admin", "key": "token"}


def test_external_redis_renders_no_statefulset_and_an_hpa():
    manifests = _manifests(Path(EXAMPLES[1]))
    kinds = [m["kind"] for m in manifests]
    assert "StatefulSet" not in kinds and kinds.count("HorizontalPodAutoscaler") == 1
    decode = next(m for m in manifests if m["metadata"]["name"] == "baton-llama-70b-decode")
    args = decode["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--redis-url") + 1] == "rediss://:$(REDIS_PASSWORD)@baton-redis.prod.internal:6380/0"
    assert decode["spec"]["template"]["metadata"]["annotations"]["baton.ai/tensor-parallel-size"] == "8"


def test_cli_writes_a_kustomize_base(tmp_path, capsys):
    assert deploy_main(["render", str(EXAMPLES[2]), "-o", str(tmp_path)]) == 0
    kustomization = yaml.safe_load((tmp_path / "kustomization.yaml").read_text())
    assert len(kustomization["resources"]) == len(_manifests(EXAMPLES[2]))
    for name in kustomization["resources"]:
        assert yaml.safe_load((tmp_path / name).read_text())["metadata"]["namespace"] == "baton"


def test_cli_reports_a_bad_spec(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLES[2].read_text().replace("replicas: 1\n      resources:\n        cpu: \"4\"",
                                                   "replicas: -2\n      resources:\n        cpu: \"4\""))
    assert deploy_main(["render", str(bad)]) == 2
    assert "spec.services.decode.replicas: must be >= 0, got -2" in capsys.readouterr().err


def _containers(manifests: list[dict]) -> list[dict]:
    return [c for m in manifests if m["kind"] in ("Deployment", "StatefulSet")
            for c in m["spec"]["template"]["spec"]["containers"]]


def test_deploy_command_prints_the_crd_and_rejects_unknown_commands(capsys):
    assert deploy_main(["crd"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["kind"] == "CustomResourceDefinition"
    assert deploy_main(["apply"]) == 2
    assert "unknown command 'apply'" in capsys.readouterr().err
