"""A worker hosting vLLM's engine (``baton prefill|decode --engine vllm``, run from ``.venv-vllm``): the shell
(``worker.shell``) around ``VLLMEngine``, serving ``VLLMServicer``.

Registered like any worker: its fingerprint names vLLM and its KV block size (so routers never pair it with a
Baton-engine worker), its layout is in Baton's index blocks (what routers hash prompts in), its pool size
is vLLM's blocks counted in index blocks, and ``kv_uri`` names its connector: NIXL's side channel
(``vllm-nixl://host:port``), or ``vllm-baton://host`` for Baton's connector, whose servers live in vLLM's engine
core and travel in each handle's params.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from worker.config import WorkerConfig
from worker.holders import LeaseReleaser
from worker.shell import WorkerShell
from worker.vllm_engine.engine import VLLMEngine
from worker.vllm_engine.options import VLLMOptions
from worker.vllm_engine.leases import VLLMLease, VLLMLeases
from worker.vllm_engine.servicer import VLLMServicer

logger = logging.getLogger(__name__)


class VLLMNode(WorkerShell):
    def __init__(self, config: WorkerConfig, options: VLLMOptions) -> None:
        super().__init__(config)
        self.options = options
        self.leases = VLLMLeases(config.lease_ttl_s, self._free_lease)
        self.releaser = LeaseReleaser(config.tls)
        self._releases: set[asyncio.Task] = set()

    async def start_engine(self) -> None:
        self.engine = VLLMEngine(self.options)
        await self.engine.start()
        if self.config.calibrate_tokens > 0:
            await self.engine.calibrate(self.config.calibrate_tokens)
        self.seam = self.engine
        self.layout, self.fingerprint = self.engine.layout, self.engine.fingerprint
        self.total_blocks = self.engine.total_blocks
        if self.options.kv_connector == "baton":  # the connector's servers are named in each handle's params
            self.kv_uri = f"vllm-baton://{self.options.side_channel_host}"
        else:
            self.kv_uri = f"vllm-nixl://{self.options.side_channel_host}:{self.engine.side_channel_port}"

    async def stop_engine(self) -> None:
        await self.releaser.close()
        await self.engine.stop()

    def servicer(self) -> VLLMServicer:
        return VLLMServicer(self)

    def _free_lease(self, lease: VLLMLease) -> None:
        """Nobody will read ``lease``'s blocks (the router gave up on its reader, or the request was aborted). vLLM
        frees a prefill's held blocks only on a reader's notification (a decoder that gives up sends one:
        ``VLLMEngine.reject_kv``) or at the end of its own lease, which Baton sets to ``--lease-ttl-s``: a prefiller
        cannot notify itself (its connector refuses its own engine as a peer). So they are freed by then. Baton's
        connector frees them at once (``VLLMEngine.release_kv``)."""
        if self.options.kv_connector == "baton":  # Baton's connector frees them now: a read of none ends its lease
            task = asyncio.get_running_loop().create_task(self.engine.release_kv(lease.kv_params))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)
            return
        logger.info("request_id=%s worker_id=%s lease %s ended unread: vLLM frees its blocks within %g s",
                    lease.request_id, self.worker_id, lease.lease_id[:8], self.config.lease_ttl_s)


def model_folder(model: str | None) -> Path:
    """``--model`` as the Hugging Face folder vLLM loads: a folder as it is, a GGUF file (or ``smollm2``) exported
    once to a float32 folder (``engine.gguf_export``), a preset built first."""
    from engine.model_source import resolve_model

    source = resolve_model(model)
    if not source.is_gguf:
        return Path(source.path)
    from engine.gguf_export import export_folder

    return export_folder(source.path, progress=logger.info)
