"""Layer-wise KV streaming: LayerProgress, streamed reads (every kind of ``STREAMING_KINDS``), and the
engine's per-layer hook.

Each transport scenario runs in its own event loop, bounded by ``asyncio.wait_for``, so a hang fails fast.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from engine.tiny import build_model
from kv_transfer.errors import KVTransferError, LeaseNotFound
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.leases import LeaseTable
from kv_transfer.progress import LayerProgress
from kv_transfer.transport import STREAMING_KINDS, LayerClock, TransportConfig, kind_available, make_server, pull

LAYOUT = KVLayout(
    model_fingerprint=b"streaming", dtype="float32", block_size=4, num_layers=4, num_kv_heads=2, head_dim=8
)
CLIENT = TransportConfig(connect_timeout_s=2.0, io_timeout_s=3.0)
SERVER = TransportConfig(connect_timeout_s=2.0, io_timeout_s=0.5)  # gives up on a layer before the client does
SENTINEL = 0xAB
SRC_IDS, DST_IDS = [3, 4, 5, 9, 1], [0, 1, 2, 7, 8]


def _runnable(kind: str):
    why = kind_available(kind)
    return pytest.param(kind, marks=pytest.mark.skipif(why is not None, reason=why or ""))


KINDS = [_runnable(kind) for kind in sorted(STREAMING_KINDS)]
# what a failed stream leaves in the layers it never delivered: tcp and nccl send zeros (their receives are
# posted), cma's client never reads them; never the source's bytes either way
UNDELIVERED = {"tcp": 0, "nccl": 0, "cma": SENTINEL}


def run(coro, timeout_s: float = 15.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


class Prefill:
    """A source buffer, a lease table, per-lease progress and a started streaming server of ``kind``."""

    def __init__(self, kind: str, server_config: TransportConfig = SERVER) -> None:
        self.kind = kind
        self.src = KVBuffer.allocate(LAYOUT, 16)
        self.src.array[:] = np.random.default_rng(5).integers(0, 256, self.src.array.shape, dtype=np.uint8)
        self.dst = KVBuffer.allocate(LAYOUT, 16)
        self.dst.array[:] = SENTINEL
        self.table = LeaseTable()
        self.progress: dict[str, LayerProgress] = {}
        self.server = make_server(kind, buffer=self.src, resolve=self.table.resolver(time.monotonic),
                                  config=server_config, progress=self.progress.get)
        self.uri = ""

    async def __aenter__(self) -> Prefill:
        self.uri = await self.server.start("127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.stop()

    def lease(self, block_ids: Sequence[int] = SRC_IDS, computing: bool = True) -> tuple[str, LayerProgress]:
        lease_id = self.table.create(block_ids, now=time.monotonic()).lease_id
        progress = self.progress[lease_id] = LayerProgress(LAYOUT.num_layers)
        if not computing:
            progress.complete_all()
        return lease_id, progress

    def pull(self, lease_id: str, config: TransportConfig = CLIENT) -> asyncio.Task:
        return asyncio.create_task(pull(self.uri, LAYOUT, lease_id, SRC_IDS, self.dst, DST_IDS, config=config))

    def landed(self, layer: int) -> bool:
        """Layer ``layer`` of every pulled block equals the source."""
        return all(np.array_equal(self.dst.array[layer, d], self.src.array[layer, s]) for s, d in zip(SRC_IDS, DST_IDS))

    def untouched(self, layer: int) -> bool:
        return all((self.dst.array[layer, d] == SENTINEL).all() for d in DST_IDS)

    def undelivered(self, layer: int) -> bool:
        """Layer ``layer`` of the pulled blocks holds what a failed stream leaves (never source bytes)."""
        return bool((self.dst.array[layer][DST_IDS] == UNDELIVERED[self.kind]).all())

    def assert_exact(self) -> None:
        assert self.dst.gather(DST_IDS) == self.src.gather(SRC_IDS)
        others = [b for b in range(16) if b not in DST_IDS]
        assert (self.dst.array[:, others] == SENTINEL).all()


def _poll(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


# ---- LayerProgress ---------------------------------------------------------------------------------


def test_progress_counts_layers_in_order_and_waits_are_bounded() -> None:
    progress = LayerProgress(3)
    with pytest.raises(ValueError, match="out of order"):
        progress.complete(1)
    progress.complete(0)
    assert (progress.num_complete, progress.is_complete) == (1, False)

    async def scenario() -> None:
        await progress.wait(1, 0.1)  # already complete: returns at once
        started = time.monotonic()
        with pytest.raises(KVTransferError, match="layer 1 not computed within 0.2 s"):
            await progress.wait(2, 0.2)
        assert 0.15 < time.monotonic() - started < 2.0
        waiter = asyncio.create_task(progress.wait(3, 5.0))
        await asyncio.sleep(0.01)
        threading.Thread(target=progress.complete_all).start()
        await waiter

    run(scenario())
    assert progress.is_complete


def test_progress_waits_for_the_layers_ready_probe_and_fails_fast() -> None:
    progress, ready = LayerProgress(2), [False]
    progress.complete(0, ready=lambda: ready[0])

    async def scenario() -> None:
        with pytest.raises(KVTransferError):
            await progress.wait(1, 0.05)  # complete, but its device work is not done
        threading.Timer(0.05, lambda: ready.__setitem__(0, True)).start()
        await progress.wait(1, 2.0)
        waiter = asyncio.create_task(progress.wait(2, 5.0))
        await asyncio.sleep(0.01)
        progress.fail("request aborted")
        with pytest.raises(KVTransferError, match="request aborted"):
            await waiter

    run(scenario())


# ---- streamed reads -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_streamed_pull_receives_each_layer_as_it_completes(kind: str, monkeypatch) -> None:
    seen: dict[str, bool] = {}
    first_layer_marked, mark = threading.Event(), LayerClock.first_layer

    def marked(clock: LayerClock) -> None:
        mark(clock)
        first_layer_marked.set()

    monkeypatch.setattr(LayerClock, "first_layer", marked)

    def engine_thread(prefill: Prefill, progress: LayerProgress) -> None:
        for layer in range(LAYOUT.num_layers):
            if layer == LAYOUT.num_layers - 1:  # before the last layer completes:
                seen["earlier_layers_landed"] = all(prefill.landed(l) for l in range(layer))
                seen["last_layer_untouched"] = prefill.untouched(layer)
                seen["first_layer_marked"] = first_layer_marked.wait(5.0)  # what Timings reports of the pull
            progress.complete(layer)
            seen[f"layer{layer}"] = _poll(lambda: prefill.landed(layer))

    async def scenario() -> None:
        async with Prefill(kind) as prefill:
            lease_id, progress = prefill.lease()
            task = prefill.pull(lease_id)
            thread = threading.Thread(target=engine_thread, args=(prefill, progress))
            thread.start()
            stats = await task
            await asyncio.to_thread(thread.join, 10)
            assert stats.num_bytes == len(SRC_IDS) * LAYOUT.bytes_per_block
            assert 0 < stats.first_layer_s < stats.seconds
            prefill.assert_exact()

    run(scenario())
    assert seen == {"earlier_layers_landed": True, "last_layer_untouched": True, "first_layer_marked": True,
                    **{f"layer{l}": True for l in range(LAYOUT.num_layers)}}


@pytest.mark.parametrize("kind", KINDS)
def test_streamed_pull_with_checksums_and_a_complete_progress_take_the_same_bytes(kind: str) -> None:
    async def scenario() -> None:
        async with Prefill(kind) as prefill:
            lease_id, progress = prefill.lease()
            task = prefill.pull(lease_id, TransportConfig(io_timeout_s=3.0, checksum=True))
            for layer in range(LAYOUT.num_layers):
                await asyncio.sleep(0.01)
                progress.complete(layer)
            await task
            prefill.assert_exact()
            prefill.dst.array[:] = SENTINEL
            lease_id, _ = prefill.lease(computing=False)  # computed before the read: the default path
            await prefill.pull(lease_id)
            prefill.assert_exact()

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_streamed_pull_waits_for_the_layers_ready_probes(kind: str) -> None:
    async def scenario() -> None:
        async with Prefill(kind) as prefill:
            lease_id, progress = prefill.lease()
            ready = [False] * LAYOUT.num_layers
            for layer in range(LAYOUT.num_layers):  # complete, but the device has not written them yet
                progress.complete(layer, ready=lambda layer=layer: ready[layer])
            task = prefill.pull(lease_id)
            await asyncio.sleep(0.1)
            assert prefill.untouched(0) and not task.done()
            ready[:] = [True] * LAYOUT.num_layers
            await task
            prefill.assert_exact()

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["never", "fails"])
def test_a_layer_that_never_completes_fails_the_pull_and_the_server_keeps_serving(kind: str, how: str) -> None:
    async def scenario() -> None:
        async with Prefill(kind) as prefill:
            lease_id, progress = prefill.lease()
            progress.complete(0)
            task = prefill.pull(lease_id)
            if how == "fails":
                await asyncio.sleep(0.05)
                progress.fail("the prefill step raised")
            started = time.monotonic()
            with pytest.raises(KVTransferError, match="not computed within 0.5 s|the prefill step raised"):
                await task
            assert time.monotonic() - started < CLIENT.io_timeout_s
            assert prefill.landed(0)
            assert all(prefill.undelivered(l) for l in range(1, LAYOUT.num_layers))
            prefill.dst.array[:] = SENTINEL
            lease_id, _ = prefill.lease(computing=False)
            await prefill.pull(lease_id)
            prefill.assert_exact()

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_a_lease_released_mid_stream_fails_the_pull(kind: str) -> None:
    async def scenario() -> None:
        async with Prefill(kind) as prefill:
            lease_id, progress = prefill.lease()
            task = prefill.pull(lease_id)
            progress.complete(0)
            progress.complete(1)
            assert await asyncio.to_thread(_poll, lambda: prefill.landed(1))
            assert prefill.table.release(lease_id) is not None
            progress.complete(2)
            with pytest.raises(LeaseNotFound):
                await task
            assert prefill.undelivered(2) and prefill.undelivered(3)  # never the released blocks' bytes

    run(scenario())


def test_a_cma_client_that_cannot_stream_is_refused_a_lease_still_computing(monkeypatch) -> None:
    """A client without READ_STREAM (one that predates it) would read unwritten KV: it gets LeaseNotFound,
    as from a server that does not stream, and the computed lease is then served as usual."""
    if "cma" not in STREAMING_KINDS or kind_available("cma") is not None:
        pytest.skip("cma does not stream here")
    from kv_transfer import cma

    monkeypatch.setattr(cma, "READ_STREAM", 0)  # neither side knows the flag

    async def scenario() -> None:
        async with Prefill("cma") as prefill:
            lease_id, progress = prefill.lease()
            progress.complete(0)
            with pytest.raises(LeaseNotFound, match="still being computed"):
                await prefill.pull(lease_id)
            assert all(prefill.untouched(layer) for layer in range(LAYOUT.num_layers))
            progress.complete_all()
            await prefill.pull(lease_id)
            prefill.assert_exact()

    run(scenario())


# ---- the engine's per-layer hook -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_model("tiny", tmp_path_factory.mktemp("tiny"), train_steps=5, progress=lambda _: None)


def _engine(model) -> Engine:
    return Engine(EngineConfig(model=str(model), device="cpu", num_blocks=64, max_num_batched_tokens=256,
                               enable_prefix_caching=False, num_threads=1))


PROMPTS = [[5, 9, 14, 2, 77, 31] * 7, [100, 3, 3, 8] * 5, list(range(40, 90))]


def _generate(engine: Engine, **hooks) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for delta in engine.step(**hooks):
            outputs[delta.request_id].extend(delta.new_token_ids)
    return list(outputs.values())


def test_the_hook_runs_once_per_layer_in_order_with_the_layers_kv_written(tiny_model) -> None:
    engine = _engine(tiny_model)
    cache, num_layers = engine.runner.kv_cache, engine.model_config.num_layers
    scheduled, layers, written = [], [], []

    def on_layer(i: int) -> None:
        blocks = list(scheduled[0].seqs[0].block_ids)
        layers.append(i)
        written.append((bool(cache[i, blocks].abs().sum() > 0),
                        i + 1 == num_layers or bool(cache[i + 1, blocks].abs().sum() == 0)))

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request("p", PROMPTS[0], params, hold_blocks=True)
    (delta,) = engine.step(on_scheduled=scheduled.append, on_layer=on_layer)
    assert num_layers == 2 and layers == [0, 1]
    assert written == [(True, True)] * num_layers  # layer i's KV in place, layer i+1's not yet
    assert delta.finished and delta.held_block_ids == scheduled[0].seqs[0].block_ids
    assert len(delta.held_block_ids) == -(-len(PROMPTS[0]) // engine.cache_config.block_size)
    engine.release_blocks(list(delta.held_block_ids))


def test_outputs_are_token_identical_with_and_without_hooks(tiny_model) -> None:
    calls: list[int] = []
    plain = _generate(_engine(tiny_model))
    hooked = _generate(_engine(tiny_model), on_scheduled=lambda output: None, on_layer=calls.append)
    assert hooked == plain and all(len(tokens) == 6 for tokens in plain)
    assert calls[:2] == [0, 1] and len(calls) == 2 * 6  # every step of the batch: 6 steps of 2 layers
