"""The GGUF container read at the speed of its bytes: metadata values and the tensor table, from one pass over
the header with ``struct``; the tensor data memory-mapped, not read. Torch-free (``engine.gguf_file`` wraps it).

The ``gguf`` package's own ``GGUFReader`` builds a numpy view per value, so a tokenizer's 100,000 strings cost it
about 6 s on this machine (SmolLM2's file); the same header parses here in a fraction of a second. Its results are
the same (tests/unit/test_gguf_format.py compares every key and tensor with it), and its codecs still dequantize.

Layout (llama.cpp's gguf.md), little-endian, versions 2 and 3:
    "GGUF" | u32 version | u64 tensor count | u64 metadata count
    metadata: string key | u32 value type | value      (a string: u64 length | UTF-8 bytes;
                                                       an array: u32 element type | u64 count | elements)
    tensors:  string name | u32 dims | u64 x dims (innermost first) | u32 ggml type | u64 offset
    padding to ``general.alignment`` (32 by default), then the tensor data, each at its offset from there
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
# value type -> its struct format (strings and arrays are read apart)
_LAYOUTS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
SCALARS = {kind: struct.Struct(layout) for kind, layout in _LAYOUTS.items()}
ARRAY_ITEMS = {kind: np.dtype(layout.format) for kind, layout in SCALARS.items()}  # numbers: one numpy read each
U32, U64 = struct.Struct("<I"), struct.Struct("<Q")
U32_U64 = struct.Struct("<IQ")  # an array's element type and count; a tensor's ggml type and offset
HEAD = struct.Struct("<4sIQQ")
# unquantized ggml types stored as plain numpy arrays of their elements (the others: bytes, a row of blocks per row)
PLAIN_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader can take (the message says where and why)."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType's value
    dims: tuple[int, ...]  # as stored: innermost (columns) first
    data_offset: int  # from the start of the file


@dataclass(frozen=True, slots=True)
class GGUFContents:
    version: int
    metadata: dict[str, Any]  # key -> str, int, float, bool, or a list of them (lists of lists for nested arrays)
    tensors: list[TensorInfo]
    data: np.memmap  # the whole file, read-only


def read_gguf(path: str | Path) -> GGUFContents:
    """Parse ``path``'s header; GGUFFormatError when it is not GGUF (or a version or byte order not read here),
    is truncated, or repeats a key or a tensor (a tensor outside the file is found by ``tensor_array``)."""
    data = np.memmap(path, mode="r")
    reader = _Reader(memoryview(data))
    magic, version, num_tensors, num_kvs = reader.unpack(HEAD)
    if magic != MAGIC:
        raise GGUFFormatError(f"no GGUF magic at the start (found {bytes(magic)!r})")
    if version not in VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in VERSIONS:
            raise GGUFFormatError("a big-endian GGUF file: only little-endian files are read here")
        raise GGUFFormatError(f"GGUF version {version} is not read here (versions {VERSIONS})")
    metadata: dict[str, Any] = {}
    for _ in range(num_kvs):
        key = reader.string()
        if key in metadata:
            raise GGUFFormatError(f"metadata key {key!r} appears twice")
        metadata[key] = reader.value(reader.unpack(U32)[0])
    infos = []
    for _ in range(num_tensors):
        name = reader.string()
        (num_dims,) = reader.unpack(U32)
        dims = reader.unpack(struct.Struct(f"<{num_dims}Q"))
        ggml_type, offset = reader.unpack(U32_U64)
        infos.append((name, ggml_type, dims, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment must be a power of two, got {alignment!r}")
    start = -(-reader.offset // alignment) * alignment
    tensors, names = [], set()
    for name, ggml_type, dims, offset in infos:
        if name in names:
            raise GGUFFormatError(f"tensor {name!r} appears twice")
        names.add(name)
        tensors.append(TensorInfo(name, ggml_type, dims, start + offset))
    return GGUFContents(version, metadata, tensors, data)


def tensor_array(contents: GGUFContents, info: TensorInfo) -> np.ndarray:
    """The tensor's stored bytes as the ``gguf`` package's reader gives them: a plain type as its elements in
    numpy order (rows first), a quantized one as uint8 rows of blocks. GGUFFormatError if past the file's end."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    try:
        qtype = GGMLQuantizationType(info.ggml_type)
    except ValueError:
        raise GGUFFormatError(f"tensor {info.name!r} has unknown ggml type {info.ggml_type}") from None
    shape = tuple(reversed(info.dims))
    count = int(np.prod(info.dims, dtype=np.int64))
    dtype = PLAIN_TYPES.get(info.ggml_type)
    if dtype is None:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        try:
            shape = quant_shape_to_byte_shape(shape, qtype)
        except ValueError as exc:
            raise GGUFFormatError(f"tensor {info.name!r}: {exc}") from None
        dtype, count = np.uint8, count // block_size * type_size
    nbytes = count * np.dtype(dtype).itemsize
    if info.data_offset + nbytes > len(contents.data):
        raise GGUFFormatError(f"tensor {info.name!r} ({nbytes} bytes at {info.data_offset}) ends past the end of "
                              f"the file ({len(contents.data)} bytes)")
    return contents.data[info.data_offset:info.data_offset + nbytes].view(dtype).reshape(shape)


class _Reader:
    """A cursor over the header's bytes."""

    __slots__ = ("buf", "offset")

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.offset = buf, 0

    def unpack(self, layout: struct.Struct) -> tuple:
        try:
            values = layout.unpack_from(self.buf, self.offset)
        except struct.error:
            raise GGUFFormatError(f"the file ends inside its header (at byte {self.offset})") from None
        self.offset += layout.size
        return values

    def string(self) -> str:
        (length,) = self.unpack(U64)
        end = self.offset + length
        if end > len(self.buf):
            raise GGUFFormatError(f"a string of {length} bytes at byte {self.offset} runs past the end of the file")
        try:
            text = str(self.buf[self.offset:end], "utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFFormatError(f"a string at byte {self.offset} is not UTF-8: {exc}") from None
        self.offset = end
        return text

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item_kind, count = self.unpack(U32_U64)
            dtype = ARRAY_ITEMS.get(item_kind)
            if dtype is not None:  # numbers: one numpy read, not one per element
                end = self.offset + count * dtype.itemsize
                if end > len(self.buf):
                    raise GGUFFormatError(f"an array of {count} at byte {self.offset} runs past the end of the file")
                values = np.frombuffer(self.buf, dtype, count, self.offset).tolist()
                self.offset = end
                return values
            return [self.value(item_kind) for _ in range(count)]
        layout = SCALARS.get(kind)
        if layout is None:
            raise GGUFFormatError(f"unknown metadata value type {kind} at byte {self.offset}")
        return self.unpack(layout)[0]
