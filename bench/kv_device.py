"""``bench.kv_transfer --device cuda``: the KV pull between two processes' CUDA caches, as workers on a GPU move it.

The serving process holds the source blocks in a CUDA tensor, the pulling one pulls into a CUDA tensor of its
own. Each Baton transport serves as a worker on a GPU does (``worker/kv_plane.py``): nixl, ucx and nccl in place
(``TensorKVBuffer``: NIXL READs of registered VRAM; UCX picks cuda_ipc / cuda_copy on one host; NCCL, which
refuses two ranks on one device), tcp and cma through pinned host staging (P's device-to-host copy is made when
the lease opens, as a worker's is, so it is not in the timed pull; D's pull lands in pinned staging blocks and is
copied to the device: timed). The ceiling row is the device's own copy (``d2d-copy``: ``torch`` ``copy_`` of
the same bytes between two CUDA tensors, synchronized). ``raw`` stays the host-socket baseline; the peers are not
run on device memory.

Needs a CUDA GPU: ``require_cuda`` refuses clearly without one. Never run here (no GPU): every line below that
touches CUDA has only run in this module's shape checks on the host, if at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kv_transfer.layout import KVLayout
from kv_transfer.leases import LeaseTable
from kv_transfer.staging import KVRegion, StagedLeases, StagingPool, pull_staged
from kv_transfer.tensor_buffer import IN_PLACE_KINDS, TensorKVBuffer
from kv_transfer.transport import KVServer, make_server

CEILING = "d2d-copy"


def require_cuda() -> str | None:
    """None when a CUDA device is here, else why ``--device cuda`` cannot run."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        return f"--device cuda needs torch: {exc}"
    if not torch.cuda.is_available():
        return "--device cuda needs a CUDA GPU, and torch sees none here (torch.cuda.is_available() is False)"
    return None


def device_tensor(host: np.ndarray) -> Any:  # pragma: no cover - never run here (no GPU)
    """``host`` (``[L, N, seg]`` uint8) copied into a CUDA tensor."""
    import torch

    return torch.from_numpy(host).to("cuda")


def serve(kind: str, layout: KVLayout, source: np.ndarray, table: LeaseTable, lease_id: str,
          clock: Callable[[], float]) -> KVServer:  # pragma: no cover - never run here (no GPU)
    """A server of ``kind`` over the source blocks in device memory: in place, or from pinned host staging
    filled once for the lease (as a worker stages a lease when it opens)."""
    tensor = device_tensor(source)
    if kind in IN_PLACE_KINDS:
        return make_server(kind, buffer=TensorKVBuffer(layout, tensor), resolve=table.resolver(clock))
    region = KVRegion(layout, tensor)
    staged = StagedLeases(StagingPool(region, region.num_blocks), table.resolver(clock))
    staged.stage(lease_id, list(table.resolver(clock)(lease_id)))
    server = make_server(kind, buffer=staged.pool.buffer, resolve=staged.resolve, locate=staged.locate)
    server.staged = staged  # kept alive with the server
    return server


class Destination:  # pragma: no cover - never run here (no GPU)
    """The pulling side's CUDA cache, and the host staging a tcp or cma pull lands in first."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        import torch

        self.tensor = torch.zeros((layout.num_layers, num_blocks, layout.bytes_per_block_per_layer),
                                  dtype=torch.uint8, device="cuda")
        self.buffer = TensorKVBuffer(layout, self.tensor)
        self.pool = StagingPool(KVRegion(layout, self.tensor), num_blocks)

    def pull(self, kind: str, client: Any, loop: Any, uri: str, layout: KVLayout, lease_id: str,
             src_ids: list[int], dst_ids: list[int]) -> tuple[float, int]:
        if kind in IN_PLACE_KINDS:
            pull = client.pull(uri, layout, lease_id, src_ids, self.buffer, dst_ids)
        else:
            pull = pull_staged(client, self.pool, uri, layout, lease_id, src_ids, dst_ids)
        stats = loop.run_until_complete(pull)
        return stats.seconds, stats.num_bytes

    def landed(self, _src_ids: list[int], dst_ids: list[int]) -> np.ndarray:
        return self.tensor[:, dst_ids].cpu().numpy()  # [L, n, seg]

    def clear(self, _src_ids: list[int], dst_ids: list[int]) -> None:
        self.tensor[:, dst_ids] = 0xFF


def d2d_copy(source: np.ndarray) -> Callable[[np.ndarray, np.ndarray], tuple[float, int]]:  # pragma: no cover
    """The ceiling: the device's own copy of as many bytes between two CUDA tensors, synchronized. Never run
    here (no GPU)."""
    import torch

    src = device_tensor(source.reshape(-1))
    dst = torch.empty_like(src)

    def copy(out: np.ndarray, _expected: np.ndarray) -> tuple[float, int]:
        n = out.size
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst[:n].copy_(src[:n])
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        out[:] = dst[:n].cpu().numpy()  # checked on the warm-up pull, outside the timing
        return elapsed, n

    return copy
