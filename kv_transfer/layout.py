"""The KV layout contract and a zero-copy view of a paged KV cache's bytes.

The engine's cache tensor is ``[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]``, so
one block is not contiguous: it is ``num_layers`` segments of ``bytes_per_block_per_layer`` bytes, one
per layer, ``num_blocks * bytes_per_block_per_layer`` bytes apart. ``KVBuffer`` sees that tensor as
``[num_layers, num_blocks, segment_bytes]`` uint8 and hands out memoryviews of block runs.

Wire order (every transport): for each layer, the requested blocks' segments in request order. Runs of
consecutive block ids within a layer are one contiguous memoryview, so a transfer of N blocks is at most
``num_layers * N`` views and usually far fewer.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from kv_transfer.errors import KVTransferError, LayoutMismatch

# Bytes per element of the dtypes a KV cache may hold (torch's names, without the "torch." prefix).
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class KVLayout:
    """What two workers must agree on before one may read the other's KV blocks."""

    model_fingerprint: bytes
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    scale_bytes: int = 0  # a quantized cache (int8, fp8): each row's scale, stored after its head_dim values
    # Tensor parallelism: the cache of rank ``tp_rank`` of ``tp_size``, which holds KV heads
    # [tp_rank * H / tp_size, (tp_rank + 1) * H / tp_size) of the model's ``num_kv_heads`` H (``local_kv_heads``).
    tp_size: int = 1
    tp_rank: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"KVLayout.dtype: unknown dtype {self.dtype!r} (known: {sorted(DTYPE_ITEMSIZE)})")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVLayout.{name} must be an int >= 1, got {value!r}")
        for name in ("scale_bytes", "tp_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"KVLayout.{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.tp_size, int) or self.tp_size < 1 or self.num_kv_heads % self.tp_size:
            raise ValueError(f"KVLayout.tp_size must divide num_kv_heads ({self.num_kv_heads}), got {self.tp_size!r}")
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"KVLayout.tp_rank must be below tp_size ({self.tp_size}), got {self.tp_rank}")
        if not isinstance(self.model_fingerprint, bytes) or not self.model_fingerprint:
            raise ValueError("KVLayout.model_fingerprint must be non-empty bytes")

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def local_kv_heads(self) -> int:
        """The KV heads this cache holds: all of them, or one rank's share."""
        return self.num_kv_heads // self.tp_size

    @property
    def row_bytes(self) -> int:
        """One token's key (or value) for one KV head: its values and, quantized, its scale."""
        return self.head_dim * self.itemsize + self.scale_bytes

    @property
    def bytes_per_block_per_layer(self) -> int:
        """One layer's K and V of one block in this cache: ``2 * block_size * local_kv_heads * row_bytes``."""
        return 2 * self.block_size * self.local_kv_heads * self.row_bytes

    @property
    def bytes_per_block(self) -> int:
        """One block in this cache (one rank's share under tensor parallelism)."""
        return self.num_layers * self.bytes_per_block_per_layer

    @property
    def model_bytes_per_block(self) -> int:
        """One block of the whole model's KV, every rank's share together (what moving a block costs)."""
        return self.tp_size * self.bytes_per_block

    def for_rank(self, rank: int) -> KVLayout:
        """The layout of rank ``rank``'s cache in the same group."""
        return dataclasses.replace(self, tp_rank=rank)

    def check_same_model(self, other: KVLayout) -> None:
        """Raise LayoutMismatch unless ``other`` caches the same model's KV alike, whatever the two groups' tensor
        parallelism (the fields but ``tp_size`` and ``tp_rank``): its blocks can be re-cut into this one's heads."""
        self._check(other, frozenset({"tp_size", "tp_rank"}))

    def to_json(self) -> str:
        """Stable JSON (sorted keys, no spaces; fingerprint as hex) for Redis and the wire (made once per layout:
        every pull sends it)."""
        return _layout_json(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> KVLayout:
        """Parse ``to_json`` output; unknown keys are ignored, missing or bad ones raise KVTransferError."""
        try:
            doc = json.loads(text)
            kwargs = {f.name: doc[f.name] for f in fields(cls) if f.name in doc or f.name not in _OPTIONAL}
            kwargs["model_fingerprint"] = bytes.fromhex(kwargs["model_fingerprint"])
            return cls(**kwargs)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise KVTransferError(f"invalid KV layout JSON: {exc}") from exc

    def check_compatible(self, other: KVLayout) -> None:
        """Raise LayoutMismatch naming every field where ``other`` differs from this layout."""
        if other != self:
            self._check(other, frozenset())

    def _check(self, other: KVLayout, ignored: frozenset[str]) -> None:
        differing = tuple(f.name for f in fields(self)
                          if f.name not in ignored and getattr(self, f.name) != getattr(other, f.name))
        if differing:
            details = ", ".join(f"{n} (local {_show(self, n)}, remote {_show(other, n)})" for n in differing)
            raise LayoutMismatch(f"KV layout mismatch: {details}", differing)


# Fields left out of the JSON at their defaults (so older layouts read, and write, as before).
_OPTIONAL = {"scale_bytes": 0, "tp_size": 1, "tp_rank": 0}


@functools.lru_cache(maxsize=256)
def _layout_json(layout: KVLayout) -> str:
    doc: dict[str, Any] = {f.name: getattr(layout, f.name) for f in fields(layout)}
    doc["model_fingerprint"] = layout.model_fingerprint.hex()
    for name, default in _OPTIONAL.items():
        if doc[name] == default:
            del doc[name]  # a full-precision, single-rank layout reads as it always has
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def _show(layout: KVLayout, name: str) -> str:
    value = getattr(layout, name)
    return value.hex() if isinstance(value, bytes) else repr(value)


def check_block_ids(block_ids: Sequence[int], num_blocks: int) -> None:
    """Raise KVTransferError unless every id is an int in ``[0, num_blocks)``. In C loops (every pull checks its
    ids on both sides: a Python loop was ~0.1 ms per 1,000 ids); the offending id is looked for only then."""
    try:
        ids = array.array("q", block_ids)  # refuses floats, strings, None; takes numpy integers
    except (TypeError, OverflowError):
        ids = None
    if ids is not None and (not ids or (min(ids) >= 0 and max(ids) < num_blocks)):
        return
    bad = next(b for b in block_ids if not isinstance(b, (int, np.integer)) or not 0 <= b < num_blocks)
    raise KVTransferError(f"block id {bad!r} out of range [0, {num_blocks})")


def block_runs(block_ids: Iterable[int]) -> list[tuple[int, int]]:
    """Runs of consecutive ids, in order, as ``(first_id, count)``: ``[4, 5, 6, 2, 3]`` -> ``[(4, 3), (2, 2)]``."""
    runs: list[list[int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1][1] += 1
        else:
            runs.append([block_id, 1])
    return [(first, count) for first, count in runs]


def paired_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs consecutive on both sides, as ``(src_first, dst_first, count)``."""
    runs: list[list[int]] = []
    for src, dst in zip(src_ids, dst_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [(s, d, c) for s, d, c in runs]


def _as_array(cache: Any) -> np.ndarray:
    """A numpy view of ``cache``, never a copy (``np.asarray(b"...")`` would copy into an "S" scalar)."""
    if isinstance(cache, np.ndarray):
        return cache
    try:
        return np.asarray(memoryview(cache))  # bytes, bytearray, mmap, array.array: the buffer protocol
    except TypeError:
        return np.asarray(cache)  # objects with __array__ (a CPU torch tensor) view their memory


class KVBuffer:
    """A paged KV cache's bytes, seen without copying as ``[num_layers, num_blocks, segment_bytes]`` uint8.

    ``cache`` is anything numpy can view without a copy: the engine passes ``tensor.numpy()`` (CPU) or a
    uint8 view of it (dtypes numpy lacks, e.g. bfloat16); tests pass bytearrays. It must be C-contiguous.
    """

    __slots__ = ("layout", "array", "num_blocks", "segment_bytes", "base_ptr", "_flat", "_bytes")
    is_host = True  # host memory (a ``TensorKVBuffer`` may be on a device)

    def __init__(self, layout: KVLayout, cache: Any) -> None:
        arr = _as_array(cache)
        if not arr.flags.c_contiguous:
            raise ValueError("KVBuffer: the cache must be C-contiguous")
        segment_bytes = layout.bytes_per_block_per_layer
        num_blocks, rest = divmod(arr.nbytes, layout.num_layers * segment_bytes)
        if rest or num_blocks < 1:
            raise ValueError(f"KVBuffer: {arr.nbytes} bytes is not a whole number of blocks of {layout}")
        engine_shape = (layout.num_layers, (2, layout.block_size, layout.local_kv_heads))
        if arr.ndim == 6 and (arr.shape[0], arr.shape[2:5]) != engine_shape:
            raise ValueError(f"KVBuffer: cache shape {arr.shape} does not match {layout}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.segment_bytes = segment_bytes
        self.array = arr.reshape(-1).view(np.uint8).reshape(layout.num_layers, num_blocks, segment_bytes)
        self._flat = self.array.reshape(layout.num_layers, num_blocks * segment_bytes)  # [L, N * seg]
        # Sliced by ``segments``: a memoryview slice costs ~0.1 us, a numpy view made a memoryview ~3 us (a
        # 16k-token pull into scattered blocks has 8192 segments: 23 ms before the first byte, per side).
        self._bytes = memoryview(self.array.reshape(-1))
        self.base_ptr: int = self.array.ctypes.data  # the first byte's address (one-sided transports offset from it)

    @classmethod
    def allocate(cls, layout: KVLayout, num_blocks: int) -> KVBuffer:
        """A zeroed buffer of ``num_blocks`` blocks (tests, benchmarks, staging)."""
        return cls(layout, np.zeros(layout.num_layers * num_blocks * layout.bytes_per_block_per_layer, np.uint8))

    @property
    def writable(self) -> bool:
        return bool(self.array.flags.writeable)


    def check_block_ids(self, block_ids: Sequence[int]) -> None:
        """Raise KVTransferError unless every id is an int in ``[0, num_blocks)``."""
        check_block_ids(block_ids, self.num_blocks)

    def segments(self, block_ids: Sequence[int]) -> list[memoryview]:
        """Zero-copy views of the blocks' bytes in wire order (layer-major, runs coalesced)."""
        self.check_block_ids(block_ids)
        seg, per_layer, whole = self.segment_bytes, self.num_blocks * self.segment_bytes, self._bytes
        runs = [(first * seg, (first + count) * seg) for first, count in block_runs(int(b) for b in block_ids)]
        return [
            whole[base + start : base + stop]
            for base in range(0, self.layout.num_layers * per_layer, per_layer)
            for start, stop in runs
        ]

    def gather(self, block_ids: Sequence[int]) -> bytes:
        """The blocks' bytes in wire order, copied into one bytes object."""
        return b"".join(self.segments(block_ids))

    def scatter(self, block_ids: Sequence[int], data: bytes | memoryview) -> None:
        """Write wire-order ``data`` (as ``gather`` returns it) into the blocks."""
        expected = len(block_ids) * self.layout.bytes_per_block
        src = memoryview(data).cast("B")
        if src.nbytes != expected:
            raise KVTransferError(f"scatter: got {src.nbytes} bytes for {len(block_ids)} blocks, expected {expected}")
        pos = 0
        for view in self.segments(block_ids):
            view[:] = src[pos : pos + view.nbytes]
            pos += view.nbytes

    def copy_blocks_from(self, src: KVBuffer, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Copy blocks ``src_ids`` of ``src`` into this buffer's ``dst_ids`` (one strided copy per run)."""
        src.check_block_ids(src_ids)
        self.check_block_ids(dst_ids)
        for s, d, count in paired_runs([int(b) for b in src_ids], [int(b) for b in dst_ids]):
            np.copyto(self.array[:, d : d + count], src.array[:, s : s + count])  # [L, count, seg]
