"""`baton admin scale ROLE N --kube` against a fake Kubernetes API server (http.server in a thread) that records
the request: the `kubernetes` client sends `kubectl scale`'s merge patch to the rendered Deployment's `scale`
subresource, with the kubeconfig's token and namespace; a refusal or a missing client fails clearly."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from deploy.render import render
from deploy.spec import load_spec
from router.admin.kube import KubeError, KubeTarget, deployment_name, scale_deployment
from tests.unit.test_admin_cli import cli, loop, redis_server, router  # noqa: F401 - fixtures
from tests.unit.test_admin_server import NS

pytest.importorskip("kubernetes")
EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"


class FakeKube(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[dict] = []
        self.missing: set[str] = set()  # deployment names that answer 404


class _Handler(BaseHTTPRequestHandler):
    server: FakeKube

    def do_PATCH(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests.append({"method": "PATCH", "path": self.path, "body": json.loads(body),
                                     "content_type": self.headers["Content-Type"],
                                     "authorization": self.headers["Authorization"]})
        parts = self.path.split("/")  # /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale
        namespace, name = parts[5], parts[7]
        if name in self.server.missing:
            return self._reply(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                                     "message": f'deployments.apps "{name}" not found', "code": 404})
        replicas = json.loads(body)["spec"]["replicas"]
        self._reply(200, {"kind": "Scale", "apiVersion": "autoscaling/v1",
                          "metadata": {"name": name, "namespace": namespace},
                          "spec": {"replicas": replicas}, "status": {"replicas": 1, "selector": "app=baton"}})

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
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "test",
              "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
              "users": [{"name": "ops", "user": {"token": "kube-token"}}],
              "contexts": [{"name": "test", "context": {"cluster": "fake", "user": "ops", "namespace": "serving"}}]}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    try:
        yield server, path
    finally:
        server.shutdown()
        server.server_close()


def test_the_deployment_name_is_the_rendered_one():
    spec = load_spec(EXAMPLES / "disagg-h200-h100.yaml")
    names = {m["metadata"]["name"] for m in render(spec) if m["kind"] == "Deployment"}
    assert {deployment_name(spec.name, role) for role in ("prefill", "decode")} <= names


def test_scale_sends_kubectls_merge_patch_to_the_scale_subresource(kube):
    server, config = kube
    target = KubeTarget(name="baton-decode", namespace=None, kubeconfig=str(config), context=None)
    patched = scale_deployment(target, 3)
    assert (patched.name, patched.namespace, patched.replicas) == ("baton-decode", "serving", 3)
    assert server.requests == [{
        "method": "PATCH", "path": "/apis/apps/v1/namespaces/serving/deployments/baton-decode/scale",
        "body": {"spec": {"replicas": 3}}, "content_type": "application/merge-patch+json",
        "authorization": "Bearer kube-token"}]


def test_cli_scale_with_kube_sets_redis_and_the_deployment(router, redis_server, kube):  # noqa: F811
    server, config = kube
    code, out, err = cli(router, "scale", "prefill", "4", "--kube", "--kubeconfig", str(config), "--graph", "llama",
                         "--kube-namespace", "prod")
    assert code == 0, err
    assert out.splitlines() == ["kubernetes: prod/llama-prefill replicas -> 4",
                                "prefill pool: desired unset -> 4 (actual 0)"]
    assert server.requests[0]["path"] == "/apis/apps/v1/namespaces/prod/deployments/llama-prefill/scale"
    import redis as redis_lib

    client = redis_lib.Redis.from_url(redis_server.url, decode_responses=True)
    assert client.get(f"{NS}:pool:prefill:desired") == "4"
    client.delete(f"{NS}:pool:prefill:desired")
    client.close()


def test_a_refused_patch_fails_clearly(router, kube):  # noqa: F811
    server, config = kube
    server.missing.add("baton-decode")
    code, out, err = cli(router, "scale", "decode", "2", "--kube", "--kubeconfig", str(config))
    assert code == 1
    assert "kubernetes refused to scale deployment serving/baton-decode: 404" in err
    assert 'deployments.apps "baton-decode" not found' in err


def test_without_the_kubernetes_package_the_error_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # import kubernetes -> ImportError
    with pytest.raises(KubeError, match=r"pip install 'baton\[kube\]'"):
        scale_deployment(KubeTarget(name="x", namespace=None, kubeconfig=None, context=None), 1)
