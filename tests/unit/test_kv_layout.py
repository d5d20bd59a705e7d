"""KVLayout (JSON contract, mismatch naming) and KVBuffer (zero-copy views of the paged cache)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kv_transfer.errors import KVTransferError, LayoutMismatch
from kv_transfer.layout import KVBuffer, KVLayout, block_runs, paired_runs

SMALL = KVLayout(
    model_fingerprint=bytes.fromhex("00ff10"), dtype="float32", block_size=16, num_layers=8, num_kv_heads=2, head_dim=64
)
TINY = KVLayout(model_fingerprint=b"tiny", dtype="float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)


def test_sizes_of_the_small_preset() -> None:
    assert SMALL.bytes_per_block_per_layer == 2 * 16 * 2 * 64 * 4 == 16384
    assert SMALL.bytes_per_block == 8 * 16384
    assert dataclasses.replace(SMALL, dtype="bfloat16").bytes_per_block_per_layer == 8192


def test_json_is_stable_and_round_trips() -> None:
    text = SMALL.to_json()
    assert text == (
        '{"block_size":16,"dtype":"float32","head_dim":64,"model_fingerprint":"00ff10",'
        '"num_kv_heads":2,"num_layers":8}'
    )
    assert KVLayout.from_json(text) == SMALL
    assert KVLayout.from_json(text.encode()) == SMALL


def test_from_json_ignores_unknown_keys_and_rejects_missing_or_bad_ones() -> None:
    assert KVLayout.from_json(SMALL.to_json()[:-1] + ',"future_field":1}') == SMALL
    with pytest.raises(KVTransferError, match="head_dim"):
        KVLayout.from_json(SMALL.to_json().replace('"head_dim":64,', ""))
    with pytest.raises(KVTransferError):
        KVLayout.from_json(b"\xff not json")
    with pytest.raises(KVTransferError):
        KVLayout.from_json(SMALL.to_json().replace('"00ff10"', '"zz"'))


def test_invalid_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="dtype"):
        dataclasses.replace(SMALL, dtype="float31")
    with pytest.raises(ValueError, match="block_size"):
        dataclasses.replace(SMALL, block_size=0)
    with pytest.raises(ValueError, match="model_fingerprint"):
        dataclasses.replace(SMALL, model_fingerprint=b"")


def test_check_compatible_names_the_differing_fields() -> None:
    SMALL.check_compatible(KVLayout.from_json(SMALL.to_json()))
    with pytest.raises(LayoutMismatch, match=r"head_dim \(local 64, remote 128\)") as info:
        SMALL.check_compatible(dataclasses.replace(SMALL, head_dim=128))
    assert info.value.fields == ("head_dim",)
    with pytest.raises(LayoutMismatch) as info:
        SMALL.check_compatible(dataclasses.replace(SMALL, model_fingerprint=b"other", dtype="float16"))
    assert info.value.fields == ("model_fingerprint", "dtype")
    assert "model_fingerprint" in str(info.value) and "dtype" in str(info.value)


def test_runs() -> None:
    assert block_runs([4, 5, 6, 2, 3, 9]) == [(4, 3), (2, 2), (9, 1)]
    assert block_runs([]) == []
    assert paired_runs([4, 5, 6, 7], [0, 1, 8, 9]) == [(4, 0, 2), (6, 8, 2)]
    assert paired_runs([1, 2], [5, 4]) == [(1, 5, 1), (2, 4, 1)]


def engine_cache(layout: KVLayout, num_blocks: int, seed: int = 0) -> np.ndarray:
    """A cache shaped like the engine's: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]."""
    shape = (layout.num_layers, num_blocks, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_a_block_is_one_segment_per_layer_of_the_engine_cache() -> None:
    cache = engine_cache(TINY, 10)
    buffer = KVBuffer(TINY, cache)
    assert buffer.num_blocks == 10 and buffer.segment_bytes == TINY.bytes_per_block_per_layer
    expected = b"".join(cache[layer, block].tobytes() for layer in range(3) for block in (7, 2, 3))
    assert buffer.gather([7, 2, 3]) == expected  # wire order: layer-major, request order within a layer


def test_segments_are_views_into_the_cache_and_coalesce_runs() -> None:
    cache = engine_cache(TINY, 10)
    buffer = KVBuffer(TINY, cache)
    views = buffer.segments([2, 3, 4, 8])
    assert [v.nbytes for v in views] == [3 * 512, 512] * 3  # [layer x run]
    views[1][:] = bytes(512)  # layer 0, block 8
    assert not cache[0, 8].any() and cache[1, 8].any()


def test_scatter_gather_and_copy_round_trip() -> None:
    src = KVBuffer(TINY, engine_cache(TINY, 10, seed=1))
    dst = KVBuffer.allocate(TINY, 6)
    dst.scatter([5, 0], src.gather([3, 9]))
    assert dst.gather([5, 0]) == src.gather([3, 9])
    other = KVBuffer.allocate(TINY, 6)
    other.copy_blocks_from(src, [3, 4, 9], [1, 2, 0])
    assert other.gather([1, 2, 0]) == src.gather([3, 4, 9])
    assert not other.array[:, 3:].any()
    with pytest.raises(KVTransferError, match="expected"):
        dst.scatter([1], b"short")


def test_block_ids_out_of_range_are_refused() -> None:
    buffer = KVBuffer.allocate(TINY, 4)
    for bad in ([4], [-1], [0, 99], [1.0], [None], ["2"], [0, 2**64]):
        with pytest.raises(KVTransferError, match="out of range"):
            buffer.segments(bad)
    buffer.check_block_ids([np.int64(3), np.uint32(0), 2])  # numpy's integers are ids too
    buffer.check_block_ids(())


def test_kvbuffer_refuses_a_cache_that_does_not_fit_the_layout() -> None:
    with pytest.raises(ValueError, match="whole number"):
        KVBuffer(TINY, np.zeros(TINY.bytes_per_block + 1, np.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        KVBuffer(TINY, engine_cache(TINY, 4)[:, ::2])
    with pytest.raises(ValueError, match="shape"):
        KVBuffer(TINY, engine_cache(dataclasses.replace(TINY, num_layers=1, block_size=12), 4))
    assert KVBuffer(TINY, bytearray(2 * TINY.bytes_per_block)).num_blocks == 2
    assert not KVBuffer(TINY, bytes(TINY.bytes_per_block)).writable
