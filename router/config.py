"""The router's configuration (one frozen dataclass) and the model facts it reads (config.json or GGUF metadata).

Flags and environment variables are read only in ``router.main``; everything here is plain data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import ModelLoadError

if TYPE_CHECKING:
    from engine.gguf_file import GGUFFile
from router.admin.planner import PlannerConfig
from router.routing.mirror_sync import DEFAULT_MIRROR_MAX_ENTRIES
from router.routing.policy import PolicyConfig
from router.routing.preselect import PreselectConfig
from router.routing.shared_books import SharedBooksConfig

DEFAULT_PORT = 50051
DEFAULT_ROUTER_ADDRESS = f"localhost:{DEFAULT_PORT}"
DEFAULT_MAX_MIGRATIONS = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    model_path: Path  # what the workers serve: a HF folder (tokenizer + config.json) or a GGUF file (its metadata)
    redis_url: str
    ns: str = "baton"
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT  # 0: any free port (tests)
    # share port and http_port with other router processes (SO_REUSEPORT: `--processes N`); off, a port another
    # process holds is an error at start, not a silent split of the clients between two routers
    reuse_port: bool = False
    model_name: str | None = None  # None: the folder's name or the file's stem; GenerateRequest.model must match
    max_model_len: int | None = None  # None: config.json's max_position_embeddings
    request_timeout_s: float = 600.0  # applies when the client sets no shorter deadline
    worker_list_ttl_s: float = 0.5  # how long a listing of the registry is reused
    control_rpc_timeout_s: float = 2.0  # Abort / ReleaseLease
    decode_retries: int = 1  # another decode worker when one fails before producing a token
    # moves to another decode worker after one failed with tokens streamed (0: the client gets UNAVAILABLE)
    max_migrations: int = DEFAULT_MAX_MIGRATIONS
    planner: PlannerConfig = field(default_factory=PlannerConfig)  # `baton admin plan` limits and cool-downs
    max_inflight_requests: int | None = None  # admission limit: more in flight get RESOURCE_EXHAUSTED (None: none)
    shutdown_grace_s: float = 5.0
    # mirror the KV index in memory from {ns}:events:{id}: no round trip per lookup (docs/architecture.md, "KV index
    # at scale": on by default since issue 23), unless it grows past this many (block, holder) entries
    index_mirror: bool = True
    index_mirror_max_entries: int = DEFAULT_MIRROR_MAX_ENTRIES
    kv_layerwise: bool = False  # remote prefills stream KV layer by layer to D while P computes (PrefillStream)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    preselect: PreselectConfig = field(default_factory=PreselectConfig)  # who is priced in a large pool
    # publish this router's in-flight books and price the other routers' beside them (docs/architecture.md, "Several
    # routers"); None: this router's books only
    shared_books: SharedBooksConfig | None = field(default_factory=SharedBooksConfig)

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.decode_retries < 0 or self.max_migrations < 0:
            raise ValueError(f"decode_retries and max_migrations must be >= 0, got {self.decode_retries} and "
                             f"{self.max_migrations}")
        if self.max_inflight_requests is not None and self.max_inflight_requests < 1:
            raise ValueError(f"max_inflight_requests must be >= 1, got {self.max_inflight_requests}")

    @property
    def served_model_name(self) -> str:
        return self.model_name or (self.model_path.stem if self.model_path.is_file() else self.model_path.name)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelCard:
    """What the router needs from ``config.json`` (read with ``json``: no torch, no transformers)."""

    architecture: str
    vocab_size: int
    max_position_embeddings: int

    @classmethod
    def from_path(cls, model: Path, gguf: GGUFFile | None = None) -> ModelCard:
        """From a HF folder's config.json, or from a GGUF file's metadata (``gguf``: the file, already opened)."""
        if gguf is not None or Path(model).is_file():
            from engine.gguf_file import GGUFFile

            raw = (gguf or GGUFFile(model)).config_dict()
            return cls(architecture=raw["architectures"][0], vocab_size=raw["vocab_size"],
                       max_position_embeddings=raw["max_position_embeddings"])
        path = Path(model) / "config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            return cls(
                architecture=str((raw.get("architectures") or ["unknown"])[0]),
                vocab_size=int(raw["vocab_size"]),
                max_position_embeddings=int(raw["max_position_embeddings"]),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"cannot read the model's {path}: {exc!r}") from exc


def resolve_max_model_len(config: RouterConfig, card: ModelCard) -> int:
    """The configured limit, never above what the model's positions allow."""
    limit = card.max_position_embeddings
    return limit if config.max_model_len is None else min(config.max_model_len, limit)
