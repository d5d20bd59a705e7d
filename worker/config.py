"""A worker's settings (``baton prefill|decode`` flags, ``worker.main.worker_config``) and the data-plane
settings derived from them."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from kv_transfer.kv_store import StoreConfig
from kv_transfer.transport import TransportConfig
from proto.tls import TlsConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    role: str  # prefill | decode
    engine: EngineConfig
    redis_url: str
    namespace: str = "baton"
    host: str = "127.0.0.1"  # what gRPC and the KV data plane bind
    advertise_host: str | None = None  # what peers dial (None: host; a wildcard host: the address toward Redis)
    grpc_port: int = 0
    kv_transport: str = "tcp"  # --kv-transport: "auto" or kinds in order of preference, e.g. "ucx,tcp"
    kv_port: int = 0
    kv_advertise_uri: str | None = None  # the KV URI registered for peers (e.g. a proxy's); None: the served one
    kv_checksum: bool = False  # pulls ask for and verify per-block xxh3 checksums (decode role)
    kv_io_timeout_s: float = 10.0  # the longest a pull waits on its peer at any one point (decode role)
    kv_secret: bytes | None = field(default=None, repr=False)  # data-plane HMAC secret (kv_transfer/auth.py)
    worker_id: str | None = None
    calibrate_tokens: int = 256  # Engine.calibrate at start, before registering (0: no calibration)
    lease_ttl_s: float = 30.0
    heartbeat_ttl_s: float = 6.0
    heartbeat_interval_s: float = 2.0
    metrics_port: int | None = None  # Prometheus /metrics on host:metrics_port; None or 0: no endpoint
    on_drain: str = "exit"  # drained by the admin: exit once idle (exit) or stay up, idle (stay)
    drain_settle_s: float = 5.0  # idle this long while draining before exiting
    tls: TlsConfig | None = None  # serve gRPC over TLS (mTLS when it has a CA); None: plaintext
    kv_staging: str = "auto"  # auto: a device-resident cache goes through host staging; always: any cache does
    kv_staging_blocks: int | None = None  # host staging blocks (None: half the cache, room for the longest prompt)
    kv_store: StoreConfig | None = None  # the shared store tier (--kv-store); its slots are engine.kv_store_*
    fault_step_delay_s: float = 0.0  # fault injection (tests, drills): every engine step first sleeps this long
    fault_layer_delay_s: float = 0.0  # fault injection: each decoder layer of a step takes this much longer
    fault_nixl_lose_notifications: bool = False  # fault injection: nixl READ notifications never arrive


def transport_config(config: WorkerConfig) -> TransportConfig:
    """The worker's data-plane settings, the same for what it serves and what it pulls."""
    return TransportConfig(checksum=config.kv_checksum, secret=config.kv_secret, io_timeout_s=config.kv_io_timeout_s)
