"""Deployments for the router, prefill and decode services: the real ``baton`` command lines, gRPC health
probes, the read-only model volume, ``/dev/shm``, GPU and RDMA resources, and node placement."""

from __future__ import annotations

from typing import Any

from deploy.spec import (HTTP_PORT, KV_PORT, METRICS_PORT, REDIS_PORT, ROUTER_PORT, WORKER_PORT,
                         BatonGraphDeployment, Resources, Service)

MODEL_MOUNT = "/models"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
_REDIS_PASSWORD_ENV = "REDIS_PASSWORD"


def labels(spec: BatonGraphDeployment, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "baton", "app.kubernetes.io/instance": spec.name,
            "app.kubernetes.io/component": component, "app.kubernetes.io/part-of": "baton"}


def metadata(spec: BatonGraphDeployment, component: str, name: str | None = None) -> dict[str, Any]:
    return {"name": name or f"{spec.name}-{component}", "namespace": spec.namespace,
            "labels": labels(spec, component)}


def redis_url(spec: BatonGraphDeployment) -> str:
    """The URL every component connects to; a password is spliced in from the env (Kubernetes expands $(VAR))."""
    url = spec.redis.external_url or f"redis://{spec.name}-redis:{REDIS_PORT}/0"
    if spec.redis.password_secret is None:
        return url
    scheme, rest = url.split("://", 1)
    return url if "@" in rest else f"{scheme}://:$({_REDIS_PASSWORD_ENV})@{rest}"


def model_dir(spec: BatonGraphDeployment) -> str:
    return f"{MODEL_MOUNT}/{spec.model.path}"


def router_args(spec: BatonGraphDeployment) -> list[str]:
    args = ["--redis-url", redis_url(spec), "--model", model_dir(spec), "--host", "0.0.0.0",
            "--port", str(ROUTER_PORT), "--http-port", str(HTTP_PORT), "--ns", spec.name]
    if spec.model.name:
        args += ["--model-name", spec.model.name]
    return args + list(spec.router.args)


def worker_args(spec: BatonGraphDeployment, service: Service) -> list[str]:
    # The worker advertises --host in the registry, so it binds the pod IP, not 0.0.0.0.
    args = ["--redis-url", redis_url(spec), "--model", model_dir(spec), "--namespace", spec.name,
            "--host", "$(POD_IP)", "--port", str(WORKER_PORT), "--kv-transport", spec.kv_transport.backend,
            "--kv-port", str(KV_PORT), "--worker-id", "$(POD_NAME)"]
    if service.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(service.tensor_parallel_size)]
    return args + list(service.args)


def deployment(spec: BatonGraphDeployment, service: Service) -> dict[str, Any]:
    pod_labels = labels(spec, service.role)
    annotations = {"baton.ai/tensor-parallel-size": str(service.tensor_parallel_size)}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata(spec, service.role),
        "spec": {
            "replicas": service.replicas,
            "selector": {"matchLabels": pod_labels},
            # one extra pod first, none down: a rollout never drops serving capacity
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": pod_labels, "annotations": annotations},
                         "spec": _pod_spec(spec, service)},
        },
    }


def _pod_spec(spec: BatonGraphDeployment, service: Service) -> dict[str, Any]:
    worker = service.role != "router"
    volumes: list[dict[str, Any]] = [
        {"name": "model", "persistentVolumeClaim": {"claimName": spec.model.pvc, "readOnly": True}}]
    if worker:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}})
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": service.termination_grace_s,
        "containers": [_container(spec, service)],
        "volumes": volumes,
    }
    pod.update(_placement(service))
    return pod


def _container(spec: BatonGraphDeployment, service: Service) -> dict[str, Any]:
    worker = service.role != "router"
    port = WORKER_PORT if worker else ROUTER_PORT
    ports = [{"name": "grpc", "containerPort": port, "protocol": "TCP"},
             {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}]
    mounts = [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}]
    if not worker:
        ports.append({"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"})
    if worker:
        ports.append({"name": "kv", "containerPort": KV_PORT, "protocol": "TCP"})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    container: dict[str, Any] = {
        "name": service.role, "image": service.image, "imagePullPolicy": "IfNotPresent",
        "command": ["baton", service.role],
        "args": worker_args(spec, service) if worker else router_args(spec),
        "ports": ports, "env": _env(spec, service),
        "envFrom": [{"configMapRef": {"name": f"{spec.name}-config"}}],
        "volumeMounts": mounts, "resources": _resources(spec, service),
        # model load can take minutes: the startup probe holds liveness off until the first SERVING
        "startupProbe": {"grpc": {"port": port}, "periodSeconds": 10, "failureThreshold": 90},
        "readinessProbe": {"grpc": {"port": port}, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"grpc": {"port": port}, "periodSeconds": 15, "failureThreshold": 4, "timeoutSeconds": 5},
    }
    if worker and spec.kv_transport.rdma_resource:
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}  # pinned memory for RDMA
    return container


def _env(spec: BatonGraphDeployment, service: Service) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    if spec.redis.password_secret:
        ref = spec.redis.password_secret
        env.append({"name": _REDIS_PASSWORD_ENV,
                    "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    if service.role == "router" and spec.admin_token_secret:
        ref = spec.admin_token_secret
        env.append({"name": "BATON_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env + [{"name": name, "value": value} for name, value in service.env.items()]


def _resources(spec: BatonGraphDeployment, service: Service) -> dict[str, Any]:
    res = service_resources(service.resources)
    if service.role != "router" and spec.kv_transport.rdma_resource:
        res.setdefault("limits", {})[spec.kv_transport.rdma_resource] = str(spec.kv_transport.rdma_count)
    return res


def service_resources(resources: Resources) -> dict[str, Any]:
    requests = {k: v for k, v in (("cpu", resources.cpu), ("memory", resources.memory)) if v is not None}
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = dict(requests)
    limits = {"memory": resources.memory} if resources.memory else {}  # no CPU limit: avoid throttling
    if resources.gpu:
        limits[GPU_RESOURCE] = str(resources.gpu.count)
    if limits:
        out["limits"] = limits
    return out


def _placement(service: Service) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if service.node_selector:
        out["nodeSelector"] = dict(service.node_selector)
    gpu = service.resources.gpu
    if gpu is None:
        return out
    out["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    if gpu.product:
        term = {"matchExpressions": [{"key": GPU_PRODUCT_LABEL, "operator": "In", "values": [gpu.product]}]}
        out["affinity"] = {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}
    return out
