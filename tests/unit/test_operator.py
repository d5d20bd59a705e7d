"""`baton deploy operator` against a fake Kubernetes API server (http.server in a thread) that serves the stored
BatonGraphDeployments, answers server-side apply like the API server (the object back, with a status), lists
by label selector, and records every request: the exact apply requests, pruning of what a new rendering lacks,
status through the status subresource, an invalid resource that does not stop the others, and exit codes."""

from __future__ import annotations

import copy
import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import kubernetes_validate
import pytest
import yaml

from deploy import operator
from deploy.operator import GRAPH_LABEL, KINDS, MANAGED_BY_LABEL, Operator, connect
from deploy.render import render
from deploy.spec import load_spec

pytest.importorskip("kubernetes")
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "examples"
CRS = "/apis/baton.ai/v1alpha1/namespaces/baton/batongraphdeployments"
APPLY = {"fieldManager": "baton-operator", "force": "true"}


def _resource(name: str = "baton-tiny", uid: str = "uid-1", example: str = "single-node.yaml") -> dict:
    doc = yaml.safe_load((EXAMPLES / example).read_text())
    doc["metadata"].update(name=name, uid=uid, generation=1, resourceVersion="7",
                           creationTimestamp="2026-01-01T00:00:00Z", managedFields=[{"manager": "kubectl"}])
    return doc


class FakeKube(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[dict] = []
        self.resources: dict[str, dict] = {}  # BatonGraphDeployments by name (namespace "baton")
        self.objects: dict[str, dict] = {}  # applied objects by path
        self.ready = True  # Deployments report all replicas ready
        self.missing_plurals: set[str] = set()  # kinds whose CRD is "not installed": 404
        self.lock = threading.Lock()

    def clear(self) -> None:
        self.requests.clear()


class _Handler(BaseHTTPRequestHandler):
    server: FakeKube

    def _record(self) -> tuple[str, dict, dict | None]:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        query = dict(parse_qsl(url.query))
        self.server.requests.append({"method": self.command, "path": url.path, "query": query,
                                     "content_type": self.headers.get("Content-Type"), "body": body})
        return url.path, query, body

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path, query, _ = self._record()
        if path in (CRS, "/apis/baton.ai/v1alpha1/batongraphdeployments"):
            return self._reply(200, {"kind": "BatonGraphDeploymentList", "items": list(self.server.resources.values())})
        plural = path.rsplit("/", 1)[1]
        if plural in self.server.missing_plurals:
            return self._reply(404, {"kind": "Status", "message": "the server could not find the requested resource"})
        wanted = dict(part.split("=") for part in query["labelSelector"].split(","))
        items = [obj for p, obj in self.server.objects.items() if p.rsplit("/", 1)[0] == path
                 and wanted.items() <= obj["metadata"].get("labels", {}).items()]
        self._reply(200, {"items": items})

    def do_PATCH(self) -> None:  # noqa: N802
        path, _, body = self._record()
        if path.endswith("/status"):
            name = path.split("/")[-2]
            self.server.resources[name]["status"] = body["status"]
            return self._reply(200, self.server.resources[name])
        if path.split("/")[-2] in self.server.missing_plurals:
            return self._reply(404, {"kind": "Status", "message": "the server could not find the requested resource"})
        obj = copy.deepcopy(body)
        obj["metadata"]["generation"] = 1
        if obj["kind"] == "Deployment":
            replicas = obj["spec"].setdefault("replicas", 1)
            ready = replicas if self.server.ready else 0
            obj["status"] = {"observedGeneration": 1, "readyReplicas": ready, "updatedReplicas": ready}
        self.server.objects[path] = obj
        self._reply(200, obj)

    def do_DELETE(self) -> None:  # noqa: N802
        path, _, _ = self._record()
        obj = self.server.objects.pop(path, None)
        self._reply(200 if obj else 404, {"kind": "Status", "status": "Success" if obj else "Failure"})

    def _reply(self, code: int, doc: dict) -> None:
        data = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def kube(tmp_path) -> Iterator[tuple[FakeKube, Path]]:
    server = FakeKube()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "test",
              "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
              "users": [{"name": "ops", "user": {"token": "kube-token"}}],
              "contexts": [{"name": "test", "context": {"cluster": "fake", "user": "ops"}}]}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    try:
        yield server, path
    finally:
        server.shutdown()
        server.server_close()


def _operator(config: Path) -> Operator:
    return Operator(connect(str(config), None), "baton")


def _applies(server: FakeKube) -> list[dict]:
    return [r for r in server.requests if r["method"] == "PATCH" and not r["path"].endswith("/status")]


def _expected_manifests(**owner) -> list[dict]:
    owner_ref = {"apiVersion": "baton.ai/v1alpha1", "kind": "BatonGraphDeployment", "name": "baton-tiny",
                 "uid": "uid-1", "controller": True, "blockOwnerDeletion": True} | owner
    out = render(load_spec(EXAMPLES / "single-node.yaml"))
    for m in out:
        m["metadata"]["labels"].update({"baton.ai/graph": "baton-tiny",
                                        "app.kubernetes.io/managed-by": "baton-operator"})
        m["metadata"]["ownerReferences"] = [owner_ref]
    return json.loads(json.dumps(out))  # as JSON on the wire


def test_the_operator_manages_every_kind_render_produces():
    kinds = {m["kind"] for f in EXAMPLES.glob("*.yaml") for m in render(load_spec(f))}
    kinds |= {"ScaledObject", "HorizontalPodAutoscaler", "ServiceMonitor"}
    assert kinds <= {k.kind for k in KINDS}
    for m in (m for f in EXAMPLES.glob("*.yaml") for m in render(load_spec(f))):
        kind = next(k for k in KINDS if k.kind == m["kind"])
        assert kind.api_version == m["apiVersion"]


def test_first_pass_server_side_applies_every_rendered_object(kube):
    server, config = kube
    server.resources["baton-tiny"] = _resource()
    outcomes = _operator(config).run_pass()
    assert [(o.name, o.phase, o.message) for o in outcomes] == [("baton/baton-tiny", "Ready", None)]
    assert server.requests[0] == {"method": "GET", "path": CRS, "query": {}, "content_type": None, "body": None}
    expected = _expected_manifests()
    paths = ["/api/v1/namespaces/baton/configmaps/baton-tiny-config",
             "/apis/apps/v1/namespaces/baton/statefulsets/baton-tiny-redis",
             "/api/v1/namespaces/baton/services/baton-tiny-redis",
             "/apis/apps/v1/namespaces/baton/deployments/baton-tiny-router",
             "/api/v1/namespaces/baton/services/baton-tiny-router",
             "/apis/policy/v1/namespaces/baton/poddisruptionbudgets/baton-tiny-router",
             "/apis/apps/v1/namespaces/baton/deployments/baton-tiny-prefill",
             "/api/v1/namespaces/baton/services/baton-tiny-prefill",
             "/apis/apps/v1/namespaces/baton/deployments/baton-tiny-decode",
             "/api/v1/namespaces/baton/services/baton-tiny-decode",
             "/apis/policy/v1/namespaces/baton/poddisruptionbudgets/baton-tiny-decode",
             "/apis/monitoring.coreos.com/v1/namespaces/baton/servicemonitors/baton-tiny-metrics"]
    assert _applies(server) == [{"method": "PATCH", "path": path, "query": APPLY,
                                 "content_type": "application/apply-patch+yaml", "body": body}
                                for path, body in zip(paths, expected, strict=True)]
    for body in expected:  # the object is labelled, never the selector (immutable) or its pods
        assert GRAPH_LABEL not in json.dumps(body.get("spec"))
    # nothing to prune: one labelled list per managed kind, no DELETE
    lists = [r for r in server.requests[1:] if r["method"] == "GET"]
    assert [r["query"] for r in lists] == [
        {"labelSelector": "baton.ai/graph=baton-tiny,app.kubernetes.io/managed-by=baton-operator"}] * len(KINDS)
    assert not [r for r in server.requests if r["method"] == "DELETE"]
    status = server.requests[-1]
    assert (status["method"], status["path"], status["query"], status["content_type"]) == (
        "PATCH", f"{CRS}/baton-tiny/status", APPLY, "application/apply-patch+yaml")
    assert status["body"] == {
        "apiVersion": "baton.ai/v1alpha1", "kind": "BatonGraphDeployment",
        "metadata": {"name": "baton-tiny", "namespace": "baton"},
        "status": {"phase": "Ready", "observedGeneration": 1,
                   "replicas": {"router": {"desired": 1, "ready": 1}, "prefill": {"desired": 0, "ready": 0},
                                "decode": {"desired": 1, "ready": 1}}}}


def test_a_changed_resource_is_reapplied_and_the_dropped_object_pruned(kube):
    server, config = kube
    server.resources["baton-tiny"] = _resource()
    op = _operator(config)
    op.run_pass()
    server.clear()
    changed = server.resources["baton-tiny"]
    changed["spec"]["services"]["decode"]["replicas"] = 3
    changed["spec"]["serviceMonitor"] = False
    changed["metadata"]["generation"] = 2
    server.ready = False
    outcomes = op.run_pass()
    assert [o.phase for o in outcomes] == ["Progressing"]
    decode = next(r for r in _applies(server) if r["path"].endswith("/deployments/baton-tiny-decode"))
    assert decode["body"]["spec"]["replicas"] == 3
    assert not [r for r in _applies(server) if "servicemonitors" in r["path"]]
    assert [(r["path"], r["query"]) for r in server.requests if r["method"] == "DELETE"] == [
        ("/apis/monitoring.coreos.com/v1/namespaces/baton/servicemonitors/baton-tiny-metrics",
         {"propagationPolicy": "Background"})]
    assert server.resources["baton-tiny"]["status"] == {
        "phase": "Progressing", "observedGeneration": 2,
        "replicas": {"router": {"desired": 1, "ready": 0}, "prefill": {"desired": 0, "ready": 0},
                     "decode": {"desired": 3, "ready": 0}}}


def test_an_unchanged_status_is_not_rewritten_and_foreign_objects_are_not_pruned(kube):
    server, config = kube
    server.resources["baton-tiny"] = _resource()
    op = _operator(config)
    op.run_pass()
    # same labels, another owner (e.g. left by a deleted-and-recreated resource): not ours to delete
    stray = {"kind": "ConfigMap", "metadata": {"name": "stray", "labels": {
        GRAPH_LABEL: "baton-tiny", MANAGED_BY_LABEL: "baton-operator"}, "ownerReferences": [{"uid": "uid-0"}]}}
    server.objects["/api/v1/namespaces/baton/configmaps/stray"] = stray
    server.clear()
    op.run_pass()
    assert not [r for r in server.requests if r["method"] == "DELETE" or r["path"].endswith("/status")]


def test_an_invalid_resource_gets_an_invalid_status_and_the_others_are_applied(kube):
    server, config = kube
    bad = _resource(name="broken", uid="uid-2")
    bad["spec"]["services"]["decode"]["replicas"] = -1
    server.resources["broken"] = bad
    server.resources["baton-tiny"] = _resource()
    outcomes = _operator(config).run_pass()
    message = "spec.services.decode.replicas: must be >= 0, got -1"
    assert [(o.name, o.phase, o.message) for o in outcomes] == [
        ("baton/broken", "Invalid", message), ("baton/baton-tiny", "Ready", None)]
    assert server.resources["broken"]["status"] == {"phase": "Invalid", "message": message, "observedGeneration": 1}
    assert not [r for r in _applies(server) if "broken" in r["path"] and not r["path"].endswith("/status")]
    assert len(_applies(server)) == 12  # every object of the valid one


def test_autoscaled_deployments_leave_replicas_to_the_autoscaler(kube):
    server, config = kube
    server.resources["baton-llama-8b"] = _resource(name="baton-llama-8b", example="disagg-h200-h100.yaml")
    server.resources["baton-llama-8b"]["metadata"]["namespace"] = "baton"
    _operator(config).run_pass()
    spec = load_spec(EXAMPLES / "disagg-h200-h100.yaml")
    scaled = {f"{spec.name}-{s.role}" for s in (spec.router, spec.prefill, spec.decode) if s.autoscaling}
    assert scaled, "the example should autoscale a service"
    for request in _applies(server):
        if request["body"]["kind"] == "Deployment":
            has_replicas = "replicas" in request["body"]["spec"]
            assert has_replicas == (request["body"]["metadata"]["name"] not in scaled)


def test_once_exit_codes_and_a_missing_crd_kind(kube, capsys):
    server, config = kube
    server.resources["baton-tiny"] = _resource()
    assert operator.main(["--once", "--namespace", "baton", "--kubeconfig", str(config)]) == 0
    server.missing_plurals.add("poddisruptionbudgets")  # a kind the cluster lacks: those applies fail
    server.resources["baton-tiny"]["metadata"]["generation"] = 2
    server.clear()
    assert operator.main(["--once", "--kubeconfig", str(config)]) == 1
    status = server.resources["baton-tiny"]["status"]
    assert status == {"phase": "Failed", "observedGeneration": 2, "message": (
        "404 Not Found (PATCH /apis/policy/v1/namespaces/baton/poddisruptionbudgets/baton-tiny-router): the "
        "server could not find the requested resource (and 1 more)")}
    assert len(_applies(server)) == 12  # the others still applied, in order
    assert not [r for r in server.requests if r["method"] == "GET" and "labelSelector" in r["query"]]  # no prune
    server.missing_plurals.clear()
    bad = _resource(name="broken", uid="uid-2")
    bad["spec"]["kvTransport"]["backend"] = "pigeon"
    server.resources["broken"] = bad
    assert operator.main(["--once", "--kubeconfig", str(config)]) == 1
    assert server.resources["baton-tiny"]["status"]["phase"] == "Ready"


def test_the_loop_runs_passes_until_stopped(kube):
    server, config = kube
    server.resources["baton-tiny"] = _resource()
    stop = threading.Event()
    thread = threading.Thread(target=operator.main, args=(["--interval-s", "0.05", "--kubeconfig", str(config)],),
                              kwargs={"stop": stop}, daemon=True)
    thread.start()
    for _ in range(200):
        if sum(r["path"] == "/apis/baton.ai/v1alpha1/batongraphdeployments" for r in list(server.requests)) >= 2:
            break
        threading.Event().wait(0.02)
    stop.set()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert sum(r["path"] == "/apis/baton.ai/v1alpha1/batongraphdeployments" for r in server.requests) >= 2


def test_unreachable_api_fails_the_pass(tmp_path):
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "t",
              "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
              "users": [{"name": "u", "user": {"token": "x"}}],
              "contexts": [{"name": "t", "context": {"cluster": "c", "user": "u"}}]}
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(config))
    assert operator.main(["--once", "--kubeconfig", str(tmp_path / "kubeconfig")]) == 1


def test_print_rbac_covers_every_managed_kind(capsys):
    assert operator.main(["--print-rbac"]) == 0
    account, role, binding = yaml.safe_load_all(capsys.readouterr().out)
    assert (account["kind"], role["kind"], binding["kind"]) == ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")
    for obj in (account, role, binding):
        kubernetes_validate.validate(obj, "1.33.0", strict=True)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "baton-operator", "namespace": "baton-system"}]
    granted = {(g, r): rule["verbs"] for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    for kind in KINDS:
        assert {"create", "patch", "list", "delete"} <= set(granted[(kind.group, kind.plural)])
    assert "patch" in granted[("baton.ai", "batongraphdeployments/status")]
    assert operator.main(["--print-rbac", "--namespace", "serving"]) == 0
    account, role, binding = yaml.safe_load_all(capsys.readouterr().out)
    assert (role["kind"], role["metadata"]["namespace"], account["metadata"]["namespace"]) == (
        "Role", "serving", "serving")


def test_without_the_kubernetes_package_the_error_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "kubernetes", None)
    assert operator.main(["--once"]) == 1
    assert "pip install 'baton[kube]'" in capsys.readouterr().err
