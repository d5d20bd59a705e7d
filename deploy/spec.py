"""The ``BatonGraphDeployment`` spec (apiVersion ``baton.ai/v1alpha1``), modelled on Dynamo's
DynamoGraphDeployment: one model volume, four services (router, prefill, decode, redis), a KV transport
and SLO targets. ``load_spec`` turns YAML into frozen dataclasses or raises ``SpecError`` naming the field.

Plain data and validation only: no Kubernetes objects here (``deploy.render`` builds those).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from deploy.fields import Fields, SpecError, check_dns_label

API_VERSION = "baton.ai/v1alpha1"
KIND = "BatonGraphDeployment"
TRANSPORTS = ("ucx", "nccl", "nixl", "tcp")
DEFAULT_IMAGE = "ghcr.io/baton-ai/baton:latest"
DEFAULT_REDIS_IMAGE = "redis:7.4-alpine"
ROUTER_PORT = 50051
WORKER_PORT = 50061
KV_PORT = 50062
METRICS_PORT = 9450  # not 9400: dcgm-exporter, on every GPU node, listens there
HTTP_PORT = 8000  # the router's OpenAI-compatible front
REDIS_PORT = 6379
DEFAULT_PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"
_GRACE_S = {"router": 60, "prefill": 120, "decode": 300}  # long enough to finish in-flight requests

__all__ = ["SpecError", "load_spec", "parse_spec", "BatonGraphDeployment"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SecretRef:
    name: str
    key: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Gpu:
    count: int
    product: str | None = None  # node label nvidia.com/gpu.product, e.g. NVIDIA-H200


@dataclass(frozen=True, slots=True, kw_only=True)
class Resources:
    cpu: str | None = None
    memory: str | None = None
    gpu: Gpu | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Autoscaling:
    kind: str  # "hpa" (CPU utilisation) or "keda" (Prometheus queue depth)
    min_replicas: int
    max_replicas: int
    target_cpu_percent: int = 70
    queue_depth_per_replica: int = 8
    prometheus_url: str = DEFAULT_PROMETHEUS_URL


@dataclass(frozen=True, slots=True, kw_only=True)
class Service:
    role: str  # router | prefill | decode
    replicas: int
    image: str
    resources: Resources = field(default_factory=Resources)
    node_selector: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()  # extra flags appended to the `baton <role>` command
    tensor_parallel_size: int = 1  # the workers' --tensor-parallel-size, noted on the pod; GPUs per replica cover it
    termination_grace_s: int = 60
    autoscaling: Autoscaling | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Redis:
    external_url: str | None = None  # None: an in-cluster StatefulSet
    image: str = DEFAULT_REDIS_IMAGE
    resources: Resources = field(default_factory=Resources)
    password_secret: SecretRef | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Model:
    pvc: str
    path: str  # inside the volume, e.g. "Qwen3-8B"
    name: str | None = None  # the name clients send as `model`


@dataclass(frozen=True, slots=True, kw_only=True)
class KVTransport:
    backend: str  # ucx | nccl | nixl | tcp
    rdma_resource: str | None = None  # extended resource of the RDMA device, e.g. rdma/ib; None for tcp
    rdma_count: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Slo:
    ttft_p90_ms: float
    itl_p90_ms: float


@dataclass(frozen=True, slots=True, kw_only=True)
class BatonGraphDeployment:
    name: str
    namespace: str
    model: Model
    router: Service
    prefill: Service
    decode: Service
    redis: Redis
    kv_transport: KVTransport
    shm_size: str
    slo: Slo | None
    admin_token_secret: SecretRef | None
    service_monitor: bool


def load_spec(path: str | Path) -> BatonGraphDeployment:
    """Read and validate one spec file; a YAML syntax error is a SpecError too."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise SpecError(str(path), f"not valid YAML: {exc}") from exc
    return parse_spec(data)


def parse_spec(data: Any) -> BatonGraphDeployment:
    top = Fields(data, "<document>")
    if top.string("apiVersion") != API_VERSION:
        raise SpecError("apiVersion", f"must be {API_VERSION}, got {top.data['apiVersion']!r}")
    if top.string("kind") != KIND:
        raise SpecError("kind", f"must be {KIND}, got {top.data['kind']!r}")
    meta = Fields(top.raw("metadata"), "metadata")
    name = check_dns_label("metadata.name", meta.string("name"), max_len=40)  # room for "-prefill-metrics"
    namespace = check_dns_label("metadata.namespace", meta.string("namespace", "default"))
    for key in ("labels", "annotations"):  # accepted (kubectl adds them) but not rendered
        meta.raw(key, {})
    meta.done()
    spec = Fields(top.raw("spec"), "spec")
    top.done()
    services = spec.child("services", required=True)
    deployment = BatonGraphDeployment(
        name=name, namespace=namespace, model=_model(spec.child("model", required=True)),
        router=_service(services.child("router"), "router"), prefill=_service(services.child("prefill"), "prefill"),
        decode=_service(services.child("decode"), "decode"), redis=_redis(services.child("redis")),
        kv_transport=_transport(spec.child("kvTransport")), shm_size=spec.quantity("shmSize", "8Gi"),
        slo=_slo(spec.child("slo")) if spec.has("slo") else None,
        admin_token_secret=_secret_ref(spec, "adminTokenSecret"),
        service_monitor=spec.boolean("serviceMonitor", True),
    )
    services.done()
    spec.done()
    return deployment


def _model(f: Fields) -> Model:
    model = Model(pvc=check_dns_label(f.at("pvc"), f.string("pvc"), max_len=253), path=f.string("path"),
                  name=f.string("name", None))
    if model.path.startswith("/") or ".." in model.path.split("/"):
        raise SpecError(f.at("path"), f"must be relative to the volume, without '..', got {model.path!r}")
    f.done()
    return model


def _service(f: Fields, role: str) -> Service:
    service = Service(
        role=role, replicas=f.integer("replicas", 1, minimum=0), image=f.string("image", DEFAULT_IMAGE),
        resources=_resources(f.child("resources")), node_selector=f.string_map("nodeSelector"),
        env=f.string_map("env"), args=f.string_list("args"),
        tensor_parallel_size=f.integer("tensorParallelSize", 1, minimum=1),
        termination_grace_s=f.integer("terminationGracePeriodSeconds", _GRACE_S[role], minimum=0),
        autoscaling=_autoscaling(f.child("autoscaling")) if f.has("autoscaling") else None,
    )
    f.done()
    if role == "router" and (service.resources.gpu or service.tensor_parallel_size > 1):
        raise SpecError(f.at("resources.gpu"), "the router needs no GPU")
    if any(arg.split("=", 1)[0] == "--tensor-parallel-size" for arg in service.args):
        raise SpecError(f.at("args"), "set tensorParallelSize instead of --tensor-parallel-size (the pod's GPUs are "
                        "checked against it)")
    gpus = service.resources.gpu.count if service.resources.gpu else 0
    if service.tensor_parallel_size > 1 and gpus < service.tensor_parallel_size:
        raise SpecError(f.at("tensorParallelSize"), f"needs resources.gpu.count >= {service.tensor_parallel_size}, "
                        f"got {gpus}")
    return service


def _resources(f: Fields) -> Resources:
    gpu = None
    if f.has("gpu"):
        g = f.child("gpu")
        gpu = Gpu(count=g.integer("count", 1, minimum=1), product=g.string("product", None))
        g.done()
    else:
        f.raw("gpu", None)
    resources = Resources(cpu=f.quantity("cpu", None), memory=f.quantity("memory", None), gpu=gpu)
    f.done()
    return resources


def _autoscaling(f: Fields) -> Autoscaling:
    scaling = Autoscaling(
        kind=f.string("kind", "hpa", choices=("hpa", "keda")), min_replicas=f.integer("minReplicas", 1, minimum=0),
        max_replicas=f.integer("maxReplicas", minimum=1),
        target_cpu_percent=f.integer("targetCPUUtilizationPercentage", 70, minimum=1),
        queue_depth_per_replica=f.integer("queueDepthPerReplica", 8, minimum=1),
        prometheus_url=f.string("prometheusUrl", DEFAULT_PROMETHEUS_URL),
    )
    f.done()
    if scaling.max_replicas < scaling.min_replicas:
        raise SpecError(f.at("maxReplicas"), f"must be >= minReplicas ({scaling.min_replicas})")
    if scaling.kind == "hpa" and scaling.min_replicas < 1:
        raise SpecError(f.at("minReplicas"), "must be >= 1 for kind hpa (use kind keda to scale to zero)")
    return scaling


def _redis(f: Fields) -> Redis:
    url = f.string("externalUrl", None)
    if url is not None and not url.startswith(("redis://", "rediss://")):
        raise SpecError(f.at("externalUrl"), f"must start with redis:// or rediss://, got {url!r}")
    redis = Redis(external_url=url, image=f.string("image", DEFAULT_REDIS_IMAGE),
                  resources=_resources(f.child("resources")), password_secret=_secret_ref(f, "passwordSecret"))
    replicas = f.integer("replicas", 0 if url else 1, minimum=0)
    if url is None and replicas != 1:
        raise SpecError(f.at("replicas"), f"must be 1 for the in-cluster Redis (or set externalUrl), got {replicas}")
    if url is not None and replicas != 0:
        raise SpecError(f.at("replicas"), "must be 0 (or unset) with externalUrl")
    f.done()
    return redis


def _transport(f: Fields) -> KVTransport:
    backend = f.string("backend", "tcp", choices=TRANSPORTS)
    if backend == "tcp":
        if f.has("rdmaResource"):
            raise SpecError(f.at("rdmaResource"), "only for backend ucx, nccl or nixl (tcp needs no RDMA device)")
        transport = KVTransport(backend=backend, rdma_resource=None, rdma_count=f.integer("rdmaCount", 1, minimum=1))
    else:
        transport = KVTransport(backend=backend, rdma_resource=f.string("rdmaResource", "rdma/ib"),
                                rdma_count=f.integer("rdmaCount", 1, minimum=1))
    f.done()
    return transport


def _slo(f: Fields) -> Slo:
    slo = Slo(ttft_p90_ms=f.number("ttftP90Ms", exclusive_minimum=0),
              itl_p90_ms=f.number("itlP90Ms", exclusive_minimum=0))
    f.done()
    return slo


def _secret_ref(parent: Fields, key: str) -> SecretRef | None:
    if not parent.has(key):
        parent.raw(key, None)
        return None
    f = parent.child(key)
    ref = SecretRef(name=check_dns_label(f.at("name"), f.string("name"), max_len=253), key=f.string("key"))
    f.done()
    return ref
