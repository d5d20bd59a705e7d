"""Baton's KV connector for vLLM (``--vllm-kv-connector baton``): vLLM's ``KVConnectorBase_V1`` over Baton's data
plane, so vLLM workers move a prompt's KV with Baton's transports (cma, tcp), their layout check, leases and
checksums, instead of NIXL. vLLM loads this module in its engine core and its worker process
(``kv_connector_module_path``) and builds the class once per side; each side delegates to
``worker/vllm_engine/kv_plane.py`` (no vLLM there: it is tested without it). The worker side's URIs reach the
scheduler side through vLLM's handshake metadata; each pull's bytes and seconds reach Baton's worker through vLLM's
connector stats (``BatonConnectorStats``), which ``VLLMEngine`` reads from its stat logger.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorHandshakeMetadata, KVConnectorMetadata, KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.request import RequestStatus

from kv_transfer.layout import KVLayout
from worker.vllm_engine.identity import vllm_kv_identity
from worker.vllm_engine.kv_plane import IDLE_WAIT_S, Orders, PlaneScheduler, PlaneWorker

if TYPE_CHECKING:
    import torch

NAME = "BatonConnector"
COMPLETED = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


class BatonConnectorMetadata(KVConnectorMetadata, Orders):
    pass


@dataclass
class BatonHandshake(KVConnectorHandshakeMetadata):
    uris: str  # the worker side's servers, space-separated (as a Baton worker's kv_uri)


@dataclass
class BatonConnectorStats(KVConnectorStats):
    """``data["pulls"]``: one ``[request_id, bytes, seconds, transport]`` per pull ended since the last report."""

    def reset(self) -> None:
        self.data = {"pulls": []}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data.setdefault("pulls", []).extend(other.data.get("pulls", []))
        return self

    def reduce(self) -> dict[str, int | float]:
        pulls = self.data.get("pulls", [])
        return {"pulls": len(pulls), "bytes": sum(p[1] for p in pulls)}

    def is_empty(self) -> bool:
        return not self.data.get("pulls")



class BatonConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        settings = dict(transfer.kv_connector_extra_config or {})
        self._scheduler: PlaneScheduler | None = None
        self._worker: PlaneWorker | None = None
        self._idle_step = False
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = PlaneScheduler(transfer.engine_id, settings)
        else:
            kv = vllm_kv_identity(vllm_config)
            layout = KVLayout(model_fingerprint=kv.fingerprint, dtype=kv.dtype, block_size=kv.vllm_block_size,
                              num_layers=kv.num_layers, num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim)
            self._worker = PlaneWorker(layout, settings)

    # ---- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> BatonHandshake | None:
        return BatonHandshake(self._worker.uris) if self._worker is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._idle_step = getattr(forward_context, "attn_metadata", None) is None  # vLLM's step without a model run
        self._worker.start(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # pulls land before vLLM schedules their request (asynchronous loads)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # P's KV is served where vLLM wrote it

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.finished(IDLE_WAIT_S if self._idle_step else 0.0)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        pulls = self._worker.take_stats() if self._worker is not None else []
        return BatonConnectorStats(data={"pulls": pulls}) if pulls else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return BatonConnectorStats(data=data if data is not None else {"pulls": []})

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- scheduler side ------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._scheduler.uris = metadata[0].uris

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        orders = self._scheduler.take_orders()
        return BatonConnectorMetadata(orders.to_serve, orders.to_pull)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, block_ids, request.status in COMPLETED)
