"""Layer-wise streaming pieces without processes: the engine-step hooks on a real engine, the decode
side's first-token mailbox, the guard that keeps non-streaming transports off unwritten KV, and the
router's per-pair check."""

from __future__ import annotations

import asyncio

import pytest

from decode_node.first_tokens import RECOMPUTE, FirstTokenMailbox
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from kv_transfer.errors import KVTransferError, LeaseNotFound
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.progress import LayerProgress
from kv_transfer.transport import make_server, streams_layers
from prefill_node.layerwise import LayerwiseHooks
from tests.tiny_model import shared_tiny


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = shared_tiny(tmp_path_factory)
    return Engine(EngineConfig(model=str(folder), num_blocks=64, block_size=4, max_num_batched_tokens=16))


def test_hooks_pin_at_the_last_chunk_and_complete_every_layer(engine):
    """A 30-token prompt in 16-token chunks: admitted only by the step that computes its last chunk, with
    the blocks that step holds; every layer completes within that step, in order."""
    async def run():
        loop = asyncio.get_running_loop()
        admitted: list[tuple[str, tuple[int, ...], int]] = []
        hooks = LayerwiseHooks(loop, engine.model_config.num_layers,
                               lambda rid, blocks, progress, _first: admitted.append((rid, blocks,
                                                                                      progress.num_complete)))
        async_engine = AsyncEngine(engine, step_hooks=hooks)
        async_engine.start()
        try:
            progress = hooks.watch("r")
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            add = lambda e: e.add_request("r", list(range(1, 31)), params, hold_blocks=True)  # noqa: E731
            deltas = [d async for d in async_engine.stream("r", add)]
            await asyncio.sleep(0)  # the admitted callback runs on this loop
        finally:
            async_engine.stop()
        return admitted, progress, deltas, hooks

    admitted, progress, deltas, hooks = asyncio.run(run())
    assert progress.is_complete and progress.num_complete == engine.model_config.num_layers
    assert len(admitted) == 1 and admitted[0][0] == "r"
    assert admitted[0][1] == deltas[-1].held_block_ids  # the lease pins exactly what is handed over
    assert len(admitted[0][1]) == 8  # ceil(30 / 4)
    assert not hooks.watching  # admitted requests are no longer watched
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks  # AsyncEngine freed the held blocks


def test_a_failed_step_fails_its_progress():
    hooks = LayerwiseHooks(asyncio.new_event_loop(), 2, lambda *args: None)
    progress = LayerProgress(2)
    hooks._active = [progress]
    hooks.step_ended(RuntimeError("device lost"))
    with pytest.raises(KVTransferError, match="device lost"):
        asyncio.run(progress.wait(2, timeout_s=1.0))


def test_mailbox_delivers_in_either_order_and_times_out():
    async def run():
        mailbox = FirstTokenMailbox(keep_s=10.0)
        assert not mailbox.deliver("early", 7)  # nobody waits yet: kept
        assert await mailbox.wait("early", 1.0) == 7
        waiter = asyncio.ensure_future(mailbox.wait("late", 1.0))
        await asyncio.sleep(0)
        assert mailbox.deliver("late", RECOMPUTE)
        assert await waiter == RECOMPUTE
        with pytest.raises(KVTransferError, match="did not arrive"):
            await mailbox.wait("never", 0.05)
        mailbox.deliver("orphan", 3)
        assert mailbox.expire(now_s=1e12) == 1 and len(mailbox) == 0

    asyncio.run(run())


def test_a_non_streaming_server_refuses_a_lease_still_being_computed():
    layout = KVLayout(model_fingerprint=b"f" * 8, dtype="float32", block_size=4, num_layers=2, num_kv_heads=1,
                      head_dim=4)
    progress = {"lease": LayerProgress(2)}
    server = make_server("local", buffer=KVBuffer.allocate(layout, 4), resolve=lambda lease_id: (0, 1),
                         progress=progress.get)
    with pytest.raises(LeaseNotFound, match="still being computed"):
        server.resolve("lease")
    progress["lease"].complete_all()
    assert server.resolve("lease") == (0, 1)
    assert server.resolve("other") == (0, 1)  # no progress: fully computed


@pytest.mark.parametrize("prefill_uri, decode_uri, expected", [
    ("tcp://h:1", "tcp://h:2", True),
    ("cma://h:1?boot=b tcp://h:2", "ucx://h:3 tcp://h:4", True),
    ("nccl://h:1", "nccl://h:2 tcp://h:3", True),
    ("cma://h:1?boot=b", "cma://h:2?boot=b", True),
    ("ucx://h:1", "ucx://h:2 tcp://h:3", False),  # P streams over nothing
    ("tcp://h:1", "nccl://h:2", False),  # D does not pull over tcp
])
def test_a_pair_streams_only_over_a_transport_both_have(prefill_uri, decode_uri, expected):
    assert streams_layers(prefill_uri, decode_uri) is expected
