"""``baton deploy operator``: keep every ``BatonGraphDeployment`` in the cluster rendered and applied.

Each pass lists the custom resources (group/version/plural read from ``deploy/crd.yaml``) and, for each one:
parse (``deploy.spec``) -> render (``deploy.render``) -> server-side apply every object -> prune the objects
an earlier rendering made that this one lacks -> write ``.status`` through the status subresource. A level-
triggered loop, no watch: a pass every ``--interval-s`` converges whatever changed, and an error on one
resource is recorded in its status and never stops the others.

Requests go through ``ApiClient.param_serialize`` + ``call_api`` with a fixed table of paths (``KINDS``), not
the DynamicClient: no discovery round trips, and the exact body and content type are ours. Server-side apply
is ``PATCH`` with ``application/apply-patch+yaml`` (a JSON body is valid YAML), ``fieldManager=baton-operator``
and ``force=true`` -- what ``kubectl apply --server-side --force-conflicts`` sends. Every applied object carries
the graph's labels (``baton.ai/graph``, ``app.kubernetes.io/managed-by``), which select it for pruning, and a
controller ownerReference, so Kubernetes garbage-collects it when the resource is deleted. An autoscaled
Deployment is applied without ``spec.replicas``: the HPA/KEDA owns that field, and a forced apply would undo it.

The ``kubernetes`` package is optional (``pip install 'baton[kube]'``) and imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from deploy.render import Manifest, render, to_yaml
from deploy.spec import API_VERSION, KIND, BatonGraphDeployment, SpecError, parse_spec

log = logging.getLogger(__name__)
CRD_PATH = Path(__file__).with_name("crd.yaml")
MANAGER = "baton-operator"
GRAPH_LABEL = "baton.ai/graph"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
REQUEST_TIMEOUT_S = 10.0  # every request is bounded, so a pass is too


class OperatorError(Exception):
    """The operator cannot run at all: no client installed, no usable Kubernetes configuration."""


class KubeApiError(Exception):
    """The API server refused a request (``status`` is the HTTP code, 0 when it could not be reached)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status} {message}" if status else message)
        self.status = status
        self.detail = message


@dataclass(frozen=True, slots=True, kw_only=True)
class Kind:
    """One namespaced resource type the operator applies and prunes."""

    api_version: str  # "apps/v1", "v1"
    kind: str
    plural: str

    def path(self, namespace: str, name: str | None = None) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        path = f"{base}/namespaces/{namespace}/{self.plural}"
        return path if name is None else f"{path}/{name}"

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]


# Every kind deploy/render.py can produce; a kind it starts producing must be added here (a test checks).
KINDS = (Kind(api_version="v1", kind="ConfigMap", plural="configmaps"),
         Kind(api_version="v1", kind="Service", plural="services"),
         Kind(api_version="apps/v1", kind="StatefulSet", plural="statefulsets"),
         Kind(api_version="apps/v1", kind="Deployment", plural="deployments"),
         Kind(api_version="policy/v1", kind="PodDisruptionBudget", plural="poddisruptionbudgets"),
         Kind(api_version="autoscaling/v2", kind="HorizontalPodAutoscaler", plural="horizontalpodautoscalers"),
         Kind(api_version="keda.sh/v1alpha1", kind="ScaledObject", plural="scaledobjects"),
         Kind(api_version="monitoring.coreos.com/v1", kind="ServiceMonitor", plural="servicemonitors"))
_BY_KIND = {k.kind: k for k in KINDS}


def graph_kind() -> Kind:
    """The BatonGraphDeployment resource as deploy/crd.yaml declares it."""
    crd = yaml.safe_load(CRD_PATH.read_text())["spec"]
    version = next(v["name"] for v in crd["versions"] if v.get("storage"))
    return Kind(api_version=f"{crd['group']}/{version}", kind=crd["names"]["kind"], plural=crd["names"]["plural"])


class Api:
    """JSON in, JSON out over the ``kubernetes`` client's ApiClient (its auth, TLS and proxy settings)."""

    def __init__(self, api_client: Any) -> None:
        self._client = api_client

    def request(self, method: str, path: str, query: dict[str, str] | None = None, body: Any = None,
                content_type: str | None = None) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        method, url, headers, _, _ = self._client.param_serialize(
            method, path, query_params=list((query or {}).items()), header_params=headers,
            auth_settings=["BearerToken"])
        try:
            response = self._client.call_api(method, url, header_params=headers, body=body,
                                             _request_timeout=REQUEST_TIMEOUT_S)
            data = response.read()
        except Exception as exc:  # urllib3 connection errors and the like: many classes
            raise KubeApiError(0, f"cannot reach the Kubernetes API ({method} {path}): {exc}") from exc
        if not 200 <= response.status <= 299:
            raise KubeApiError(response.status, f"{response.reason} ({method} {path}){_message(data)}")
        return json.loads(data) if data else {}

    def apply(self, path: str, body: Manifest) -> dict[str, Any]:
        return self.request("PATCH", path, {"fieldManager": MANAGER, "force": "true"}, body, APPLY_CONTENT_TYPE)


def _message(data: bytes) -> str:
    try:
        return f": {json.loads(data)['message']}"
    except (TypeError, ValueError, KeyError):
        return ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    name: str  # namespace/name
    phase: str  # Ready | Progressing | Invalid | Failed
    message: str | None = None

    @property
    def ok(self) -> bool:
        return self.phase in ("Ready", "Progressing")


def spec_of(resource: dict[str, Any]) -> BatonGraphDeployment:
    """Parse a stored resource: the server's own metadata (uid, generation, managedFields...) is dropped."""
    meta = resource.get("metadata") or {}
    document = {"apiVersion": resource.get("apiVersion", API_VERSION), "kind": resource.get("kind", KIND),
                "metadata": {k: meta[k] for k in ("name", "namespace", "labels", "annotations") if k in meta},
                "spec": resource.get("spec")}
    return parse_spec(document)


def desired(spec: BatonGraphDeployment, owner: dict[str, Any], graph: Kind) -> list[Manifest]:
    """The rendered objects, labelled for pruning and owned by the resource."""
    owner_ref = {"apiVersion": graph.api_version, "kind": graph.kind, "name": owner["metadata"]["name"],
                 "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
    autoscaled = {f"{spec.name}-{s.role}" for s in (spec.router, spec.prefill, spec.decode) if s.autoscaling}
    out = []
    for manifest in render(spec):
        manifest["metadata"]["labels"].update({GRAPH_LABEL: spec.name, MANAGED_BY_LABEL: MANAGER})
        manifest["metadata"]["ownerReferences"] = [owner_ref]
        if manifest["kind"] == "Deployment" and manifest["metadata"]["name"] in autoscaled:
            del manifest["spec"]["replicas"]
        out.append(manifest)
    return out


def role_replicas(applied: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Desired and ready pods per role, read from the Deployments the apply responses returned."""
    out = {}
    for obj in applied:
        if obj.get("kind") == "Deployment":
            role = obj["metadata"]["labels"]["app.kubernetes.io/component"]
            status = obj.get("status") or {}
            seen = (status.get("observedGeneration") or 0) >= (obj["metadata"].get("generation") or 0)
            out[role] = {"desired": (obj.get("spec") or {}).get("replicas") or 0,
                         "ready": status.get("readyReplicas") or 0,
                         "updated": (status.get("updatedReplicas") or 0) if seen else 0}
    return out


def ready_phase(replicas: dict[str, dict[str, int]]) -> str:
    """Ready once every Deployment has rolled out (as ``kubectl rollout status``) and its pods are ready."""
    done = all(min(r["ready"], r["updated"]) >= r["desired"] for r in replicas.values())
    return "Ready" if done else "Progressing"


class Operator:
    """One reconcile pass over every BatonGraphDeployment in ``namespace`` (None: all namespaces)."""

    def __init__(self, api: Api, namespace: str | None) -> None:
        self.api = api
        self.namespace = namespace
        self.graph = graph_kind()

    def run_pass(self) -> list[Outcome]:
        base = f"/apis/{self.graph.api_version}"
        path = f"{base}/{self.graph.plural}" if self.namespace is None else self.graph.path(self.namespace)
        outcomes = []
        for resource in self.api.request("GET", path).get("items", []):
            resource.setdefault("apiVersion", self.graph.api_version)
            resource.setdefault("kind", self.graph.kind)
            outcomes.append(self.reconcile(resource))
        return outcomes

    def reconcile(self, resource: dict[str, Any]) -> Outcome:
        meta = resource["metadata"]
        name = f"{meta['namespace']}/{meta['name']}"
        try:
            outcome, status = self._converge(resource, name)
        except KubeApiError as exc:
            outcome = Outcome(name=name, phase="Failed", message=str(exc))
            status = {"phase": "Failed", "message": str(exc), "observedGeneration": meta.get("generation")}
        log.log(logging.INFO if outcome.ok else logging.WARNING, "%s: %s%s", name, outcome.phase,
                f": {outcome.message}" if outcome.message else "")
        try:
            self._write_status(resource, status)
        except KubeApiError as exc:
            log.warning("%s: cannot write status: %s", name, exc)
            return Outcome(name=name, phase="Failed", message=f"status: {exc}")
        return outcome

    def _converge(self, resource: dict[str, Any], name: str) -> tuple[Outcome, dict[str, Any]]:
        generation = resource["metadata"].get("generation")
        try:
            spec = spec_of(resource)
        except SpecError as exc:
            status = {"phase": "Invalid", "message": str(exc), "observedGeneration": generation}
            return Outcome(name=name, phase="Invalid", message=str(exc)), status
        manifests = desired(spec, resource, self.graph)
        applied, errors = [], []
        for manifest in manifests:  # one refused object (a kind not installed) does not hold back the rest
            try:
                applied.append(self.api.apply(_BY_KIND[manifest["kind"]].path(
                    spec.namespace, manifest["metadata"]["name"]), manifest))
            except KubeApiError as exc:
                errors.append(exc)
        if errors:  # and nothing is pruned on a partial apply
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise KubeApiError(errors[0].status, f"{errors[0].detail}{more}")
        self._prune(spec, resource["metadata"]["uid"], {(m["kind"], m["metadata"]["name"]) for m in manifests})
        replicas = role_replicas(applied)
        phase = ready_phase(replicas)
        status = {"phase": phase, "observedGeneration": generation,
                  "replicas": {role: {"desired": r["desired"], "ready": r["ready"]} for role, r in replicas.items()}}
        return Outcome(name=name, phase=phase), status

    def _prune(self, spec: BatonGraphDeployment, uid: str, keep: set[tuple[str, str]]) -> None:
        selector = f"{GRAPH_LABEL}={spec.name},{MANAGED_BY_LABEL}={MANAGER}"
        for kind in KINDS:
            try:
                items = self.api.request("GET", kind.path(spec.namespace), {"labelSelector": selector})["items"]
            except KubeApiError as exc:
                if exc.status == 404:  # the kind's CRD (KEDA, Prometheus Operator) is not installed
                    continue
                raise
            for item in items:
                owners = {ref.get("uid") for ref in item["metadata"].get("ownerReferences", [])}
                if (kind.kind, item["metadata"]["name"]) in keep or uid not in owners:
                    continue
                log.info("%s/%s: pruning %s %s", spec.namespace, spec.name, kind.kind, item["metadata"]["name"])
                self._delete(kind.path(spec.namespace, item["metadata"]["name"]))

    def _delete(self, path: str) -> None:
        try:
            self.api.request("DELETE", path, {"propagationPolicy": "Background"})
        except KubeApiError as exc:
            if exc.status != 404:  # already gone is what we wanted
                raise

    def _write_status(self, resource: dict[str, Any], status: dict[str, Any]) -> None:
        """Server-side apply on the status subresource; omitted fields (a stale message) are removed."""
        status = {k: v for k, v in status.items() if v is not None}
        if resource.get("status") == status:
            return
        meta = resource["metadata"]
        body = {"apiVersion": self.graph.api_version, "kind": self.graph.kind,
                "metadata": {"name": meta["name"], "namespace": meta["namespace"]}, "status": status}
        self.api.apply(self.graph.path(meta["namespace"], meta["name"]) + "/status", body)


def rbac(namespace: str | None, operator_namespace: str) -> list[Manifest]:
    """ServiceAccount and the (Cluster)Role/-Binding the operator needs: a Role in ``namespace`` when it watches
    one, else cluster-wide."""
    graph = graph_kind()
    rules: list[dict[str, Any]] = [
        {"apiGroups": [graph.group], "resources": [graph.plural], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [graph.group], "resources": [f"{graph.plural}/status"], "verbs": ["get", "patch", "update"]},
        # blockOwnerDeletion on the ownerReferences needs update on the owner's finalizers
        {"apiGroups": [graph.group], "resources": [f"{graph.plural}/finalizers"], "verbs": ["update"]}]
    groups: dict[str, list[str]] = {}
    for kind in KINDS:
        groups.setdefault(kind.group, []).append(kind.plural)
    rules += [{"apiGroups": [group], "resources": plurals, "verbs": ["get", "list", "watch", "create", "patch",
                                                                      "delete"]} for group, plurals in groups.items()]
    scope = "Role" if namespace else "ClusterRole"
    role_meta: dict[str, Any] = {"name": MANAGER} | ({"namespace": namespace} if namespace else {})
    account = {"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": MANAGER, "namespace": operator_namespace}}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": scope, "metadata": role_meta, "rules": rules}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": f"{scope}Binding", "metadata": dict(role_meta),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": scope, "name": MANAGER},
               "subjects": [{"kind": "ServiceAccount", "name": MANAGER, "namespace": operator_namespace}]}
    return [account, role, binding]


def connect(kubeconfig: str | None, context: str | None) -> Api:
    try:
        import kubernetes
    except ImportError as exc:
        raise OperatorError("the operator needs the kubernetes client: pip install 'baton[kube]'") from exc
    configuration = kubernetes.client.Configuration()
    try:
        if kubeconfig is None and context is None:
            try:
                kubernetes.config.load_incluster_config(client_configuration=configuration)
                return Api(kubernetes.client.ApiClient(configuration))
            except kubernetes.config.ConfigException:
                pass
        kubernetes.config.load_kube_config(config_file=kubeconfig, context=context,
                                           client_configuration=configuration)
    except kubernetes.config.ConfigException as exc:
        raise OperatorError(f"no usable Kubernetes configuration: {exc}") from exc
    return Api(kubernetes.client.ApiClient(configuration))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="baton deploy operator",
                                description="Reconcile BatonGraphDeployment resources into Kubernetes objects.")
    p.add_argument("--namespace", default=None, help="watch one namespace (default: all namespaces)")
    p.add_argument("--once", action="store_true", help="one pass, then exit: 0 if every resource reconciled, else 1")
    p.add_argument("--interval-s", type=float, default=15.0, help="seconds between passes (default: %(default)s)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster service account, "
                   "else $KUBECONFIG / ~/.kube/config)")
    p.add_argument("--context", default=None, help="kubeconfig context (default: the current one)")
    p.add_argument("--print-rbac", action="store_true",
                   help="print the ServiceAccount and RBAC the operator needs (Role with --namespace) and exit")
    p.add_argument("--operator-namespace", default="baton-system",
                   help="where the operator's ServiceAccount lives, for --print-rbac (default: %(default)s)")
    return p


def main(argv: list[str] | None = None, stop: threading.Event | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.print_rbac:
        sys.stdout.write(to_yaml(rbac(args.namespace, args.namespace or args.operator_namespace)))
        return 0
    if args.interval_s <= 0:
        print("baton deploy operator: --interval-s must be > 0", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        operator = Operator(connect(args.kubeconfig, args.context), args.namespace)
    except OperatorError as exc:
        print(f"baton deploy operator: {exc}", file=sys.stderr)
        return 1
    if args.once:
        return _one_pass(operator)
    if stop is None:
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
    while not stop.is_set():
        _one_pass(operator)
        stop.wait(args.interval_s)
    return 0


def _one_pass(operator: Operator) -> int:
    try:
        outcomes = operator.run_pass()
    except KubeApiError as exc:
        log.error("cannot list %s: %s", operator.graph.plural, exc)
        return 1
    return 0 if all(o.ok for o in outcomes) else 1
