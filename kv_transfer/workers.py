"""What a worker is (``WorkerInfo``) and how loaded it is (``WorkerLoad``): plain values, no I/O.

The registry (``kv_transfer.registry``) stores them in Redis; routing prices workers from them without
touching Redis.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from kv_transfer.index_schema import STORE

Role = Literal["prefill", "decode"]
ROLES: tuple[str, ...] = ("prefill", "decode")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerInfo:
    """What a worker is and where to reach it; stored as the ``{ns}:worker:{id}`` hash."""

    worker_id: str
    role: Role
    grpc_address: str
    kv_uri: str
    model_fingerprint: str  # hex
    layout_json: str
    total_blocks: int

    def __post_init__(self) -> None:
        if not self.worker_id or any(c.isspace() for c in self.worker_id):
            raise ValueError(f"worker_id must be non-empty without whitespace, got {self.worker_id!r}")
        if self.worker_id == STORE:
            raise ValueError(f"worker_id {STORE!r} is reserved: it names the shared store in the KV index")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    def to_fields(self) -> dict[str, str]:
        return {f.name: str(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "worker_id"}

    @classmethod
    def from_fields(cls, worker_id: str, fields: dict[str, str]) -> WorkerInfo:
        return cls(
            worker_id=worker_id, role=fields["role"], grpc_address=fields["grpc_address"],  # type: ignore[arg-type]
            kv_uri=fields["kv_uri"], model_fingerprint=fields["model_fingerprint"],
            layout_json=fields["layout_json"], total_blocks=int(fields["total_blocks"]),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerLoad:
    """A worker's load, reported with each heartbeat (``{ns}:load:{id}``)."""

    running: int
    waiting: int
    free_blocks: int
    queued_prefill_tokens: int
    prefill_tokens_per_s: float | None = None
    decode_step_s: float | None = None  # the engine's measured decode step ...
    decode_batch_size: float | None = None  # ... at this mean batch size
    decode_step_per_seq_s: float | None = None  # ... and what one more sequence adds to it
    reported_unix_ms: int | None = None  # set by the heartbeat when left None

    def to_fields(self) -> dict[str, str]:
        return {f.name: str(v) for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> WorkerLoad:
        def opt(name: str, kind: type) -> Any:
            return kind(fields[name]) if name in fields else None

        return cls(
            running=int(fields["running"]), waiting=int(fields["waiting"]),
            free_blocks=int(fields["free_blocks"]), queued_prefill_tokens=int(fields["queued_prefill_tokens"]),
            prefill_tokens_per_s=opt("prefill_tokens_per_s", float), decode_step_s=opt("decode_step_s", float),
            decode_batch_size=opt("decode_batch_size", float),
            decode_step_per_seq_s=opt("decode_step_per_seq_s", float),
            reported_unix_ms=opt("reported_unix_ms", int),
        )
