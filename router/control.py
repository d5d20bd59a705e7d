"""Fire-and-forget control calls to workers (Abort, ReleaseLease, FirstToken) that outlive the request asking for them.

A request being cancelled cannot await anything reliably, so its cleanup queues these as background tasks;
each is bounded by a short timeout, failures are logged (a dead worker has nothing left to free), and
``drain`` waits for the stragglers at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import grpc

from kv_transfer.workers import WorkerInfo
from proto import baton_pb2 as pb
from router.routing.directory import WorkerDirectory

log = logging.getLogger(__name__)


class WorkerControl:
    def __init__(self, directory: WorkerDirectory, *, timeout_s: float = 2.0) -> None:
        self._directory = directory
        self._timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    def abort(self, worker: WorkerInfo, request_id: str, *, then_release: tuple[WorkerInfo, str] | None = None) -> None:
        """The worker forgets ``request_id`` and frees what it holds for it.

        ``then_release`` = (prefill worker, lease id): a decode worker that was handed the lease may be
        reading its blocks, so the lease is released only once that worker confirmed the abort (or is
        unreachable, so reads nothing); otherwise the lease's TTL frees the blocks.
        """
        self._spawn(self._abort_then_release(worker, request_id, then_release), f"Abort-{worker.worker_id}")

    def release_lease(self, worker: WorkerInfo, lease_id: str) -> None:
        """The prefill worker unpins a handle's blocks that no decode worker will pull."""
        self._spawn(self._release(worker, lease_id), f"ReleaseLease-{worker.worker_id}")

    def first_token(self, worker: WorkerInfo, request_id: str, token: int | None) -> None:
        """Layer-wise: hand P's first token to the decode worker already pulling (None: P failed, D
        prefills itself). A decode worker that does not get it fails the Decode call, which the request
        sees and handles (retry elsewhere), so a lost delivery costs nothing else."""
        request = pb.FirstTokenRequest(request_id=request_id, token_id=token or 0, recompute=token is None)
        self._spawn(self._first_token(worker, request), f"FirstToken-{worker.worker_id}")

    async def _first_token(self, worker: WorkerInfo, request: pb.FirstTokenRequest) -> None:
        try:
            await self._directory.stub(worker).FirstToken(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.debug("FirstToken on worker_id=%s failed: %s %s", worker.worker_id, exc.code().name, exc.details())

    async def drain(self, timeout_s: float) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    async def _abort_then_release(
        self, worker: WorkerInfo, request_id: str, then_release: tuple[WorkerInfo, str] | None
    ) -> None:
        try:
            await self._directory.stub(worker).Abort(pb.AbortRequest(request_id=request_id), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.debug("Abort on worker_id=%s failed: %s %s", worker.worker_id, exc.code().name, exc.details())
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                return
        if then_release is not None:
            await self._release(*then_release)

    async def _release(self, worker: WorkerInfo, lease_id: str) -> None:
        request = pb.ReleaseLeaseRequest(lease_id=lease_id)
        try:
            await self._directory.stub(worker).ReleaseLease(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.debug("ReleaseLease on worker_id=%s failed: %s %s", worker.worker_id, exc.code().name, exc.details())

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
