"""``baton admin scale ROLE N --kube``: also set the pool's Kubernetes Deployment to N replicas.

It patches the ``scale`` subresource the way ``kubectl scale`` does: ``PATCH .../deployments/{name}/scale``
with ``Content-Type: application/merge-patch+json`` and ``{"spec": {"replicas": N}}``. (The client's default
content type for that call is ``json-patch+json``, which Kubernetes refuses for an object body, so it is set
explicitly.) The Deployment is named as ``baton deploy render`` names it (``deploy/pods.metadata``):
``{graph}-{role}``, where graph is the BatonGraphDeployment's name (also the Redis namespace it renders).
The ``kubernetes`` package is optional (``pip install 'baton[kube]'``); it is imported only here, on use.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass


class KubeError(Exception):
    """The Kubernetes side of a scale failed (no client installed, no config, API refused)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KubeTarget:
    name: str  # the Deployment
    namespace: str | None  # None: the kubeconfig context's namespace, else "default"
    kubeconfig: str | None  # None: $KUBECONFIG / ~/.kube/config, or in-cluster
    context: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Patched:
    name: str
    namespace: str
    replicas: int


def deployment_name(graph: str, role: str) -> str:
    """The rendered Deployment's name for this role (deploy/pods.py ``metadata``: ``{spec.name}-{component}``)."""
    return f"{graph}-{role}"


def scale_patch(replicas: int) -> dict:
    return {"spec": {"replicas": replicas}}


def add_kube_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kube", action="store_true", help="also patch the role's Kubernetes Deployment replicas")
    p.add_argument("--graph", default="baton",
                   help="BatonGraphDeployment name: the Deployment is GRAPH-ROLE (default: %(default)s)")
    p.add_argument("--deployment", default=None, help="Deployment name (default: GRAPH-ROLE)")
    p.add_argument("--kube-namespace", default=None, help="Kubernetes namespace (default: the context's)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, "
                   "or the in-cluster service account)")
    p.add_argument("--kube-context", default=None, help="kubeconfig context (default: the current one)")


def kube_target(args: argparse.Namespace) -> KubeTarget:
    return KubeTarget(name=args.deployment or deployment_name(args.graph, args.role), namespace=args.kube_namespace,
                      kubeconfig=args.kubeconfig, context=args.kube_context)


def scale_deployment(target: KubeTarget, replicas: int) -> Patched:
    if replicas < 0:
        raise KubeError(f"replicas must be >= 0, got {replicas}")
    kubernetes = _import()
    api_client, namespace = _client(kubernetes, target)
    apps = kubernetes.client.AppsV1Api(api_client)
    try:
        scale = apps.patch_namespaced_deployment_scale(target.name, namespace, scale_patch(replicas),
                                                       _content_type="application/merge-patch+json")
    except kubernetes.client.ApiException as exc:
        raise KubeError(f"kubernetes refused to scale deployment {namespace}/{target.name}: "
                        f"{exc.status} {exc.reason}{_message(exc.body)}") from exc
    except Exception as exc:  # urllib3 connection errors and the like: many classes
        raise KubeError(f"cannot reach the Kubernetes API to scale {namespace}/{target.name}: {exc}") from exc
    finally:
        api_client.close()
    return Patched(name=target.name, namespace=namespace, replicas=scale.spec.replicas)


def _import():
    try:
        import kubernetes
    except ImportError as exc:
        raise KubeError("--kube needs the kubernetes client: pip install 'baton[kube]'") from exc
    return kubernetes


def _client(kubernetes, target: KubeTarget):
    configuration = kubernetes.client.Configuration()
    namespace = target.namespace
    try:
        if target.kubeconfig is None and _in_cluster(kubernetes, configuration):
            namespace = namespace or _service_account_namespace()
        else:
            kubernetes.config.load_kube_config(config_file=target.kubeconfig, context=target.context,
                                               client_configuration=configuration)
            _, active = kubernetes.config.list_kube_config_contexts(config_file=target.kubeconfig)
            chosen = active if target.context is None else {"context": {}}
            namespace = namespace or chosen.get("context", {}).get("namespace")
    except kubernetes.config.ConfigException as exc:
        raise KubeError(f"no usable Kubernetes configuration: {exc}") from exc
    return kubernetes.client.ApiClient(configuration), namespace or "default"


def _in_cluster(kubernetes, configuration) -> bool:
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        return False
    return True


def _service_account_namespace() -> str | None:
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace", encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _message(body) -> str:
    try:
        return f": {json.loads(body)['message']}"
    except (TypeError, ValueError, KeyError):
        return ""
