"""The objects around the three Deployments: Services, the ConfigMap, PodDisruptionBudgets, the in-cluster
Redis, decode autoscaling (HPA or KEDA) and the Prometheus ServiceMonitor."""

from __future__ import annotations

from typing import Any

from deploy.pods import labels, metadata, service_resources
from deploy.spec import (HTTP_PORT, KV_PORT, METRICS_PORT, REDIS_PORT, ROUTER_PORT, WORKER_PORT,
                         BatonGraphDeployment, Service)

Manifest = dict[str, Any]


def config_map(spec: BatonGraphDeployment) -> Manifest:
    """Settings shared by every pod (loaded with envFrom): transport, SLO targets for the planner."""
    data = {"BATON_NAMESPACE": spec.name, "BATON_KV_TRANSPORT": spec.kv_transport.backend}
    if spec.slo:
        data["BATON_SLO_TTFT_P90_MS"] = f"{spec.slo.ttft_p90_ms:g}"
        data["BATON_SLO_ITL_P90_MS"] = f"{spec.slo.itl_p90_ms:g}"
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata(spec, "config"), "data": data}


def service(spec: BatonGraphDeployment, role: str) -> Manifest:
    """The router gets a ClusterIP Service (the public API); workers a headless one (per-pod metrics, DNS)."""
    ports = [{"name": "grpc", "port": ROUTER_PORT if role == "router" else WORKER_PORT, "targetPort": "grpc",
              "protocol": "TCP", "appProtocol": "grpc"},
             {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}]
    if role != "router":
        ports.append({"name": "kv", "port": KV_PORT, "targetPort": "kv", "protocol": "TCP"})
    if role == "router":
        ports.append({"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"})
    body: dict[str, Any] = {"selector": labels(spec, role), "ports": ports}
    if role != "router":
        body.update(clusterIP="None", publishNotReadyAddresses=False)
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata(spec, role), "spec": body}


def disruption_budget(spec: BatonGraphDeployment, svc: Service) -> Manifest:
    """Voluntary evictions (node drains, upgrades) take at most one pod of a service at a time."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": metadata(spec, svc.role),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels(spec, svc.role)}}}


def redis(spec: BatonGraphDeployment) -> list[Manifest]:
    """A single-replica Redis StatefulSet without persistence (the index is rebuilt from heartbeats)."""
    args = ["--save", "", "--appendonly", "no"]
    env: list[dict[str, Any]] = []
    if spec.redis.password_secret:
        ref = spec.redis.password_secret
        env = [{"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]
        args += ["--requirepass", "$(REDIS_PASSWORD)"]
    pod_labels = labels(spec, "redis")
    container = {
        "name": "redis", "image": spec.redis.image, "command": ["redis-server"], "args": args, "env": env,
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "resources": service_resources(spec.redis.resources),
        "readinessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 15},
    }
    stateful_set = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata(spec, "redis"),
        "spec": {"serviceName": f"{spec.name}-redis", "replicas": 1, "selector": {"matchLabels": pod_labels},
                 "template": {"metadata": {"labels": pod_labels}, "spec": {"containers": [container]}}},
    }
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": metadata(spec, "redis"),
           "spec": {"selector": pod_labels,
                    "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}]}}
    return [stateful_set, svc]


def autoscaler(spec: BatonGraphDeployment, svc: Service) -> Manifest | None:
    scaling = svc.autoscaling
    if scaling is None:
        return None
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{spec.name}-{svc.role}"}
    if scaling.kind == "hpa":
        metric = {"type": "Resource", "resource": {
            "name": "cpu", "target": {"type": "Utilization", "averageUtilization": scaling.target_cpu_percent}}}
        return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                "metadata": metadata(spec, svc.role),
                "spec": {"scaleTargetRef": target, "minReplicas": scaling.min_replicas,
                         "maxReplicas": scaling.max_replicas, "metrics": [metric],
                         # scale down slowly: a removed decode pod must drain its running requests
                         "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}}}}
    query = (f'sum(baton:num_requests_waiting{{namespace="{spec.namespace}",'
             f'service="{spec.name}-{svc.role}"}})')
    trigger = {"type": "prometheus", "metadata": {
        "serverAddress": scaling.prometheus_url, "query": query,
        "threshold": str(scaling.queue_depth_per_replica)}}
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": metadata(spec, svc.role),
            "spec": {"scaleTargetRef": {"name": target["name"]}, "minReplicaCount": scaling.min_replicas,
                     "maxReplicaCount": scaling.max_replicas, "cooldownPeriod": 300, "triggers": [trigger]}}


def service_monitor(spec: BatonGraphDeployment) -> Manifest:
    """One ServiceMonitor scrapes /metrics of the router and every worker (the `metrics` Service port)."""
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": metadata(spec, "metrics"),
            "spec": {"selector": {"matchLabels": {"app.kubernetes.io/instance": spec.name,
                                                  "app.kubernetes.io/part-of": "baton"},
                                  "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                                                        "values": ["router", "prefill", "decode"]}]},
                     "namespaceSelector": {"matchNames": [spec.namespace]},
                     "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}]}}
