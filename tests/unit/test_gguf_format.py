"""engine.gguf_format against the ``gguf`` package's own reader: every metadata value of every type, every tensor's
bytes, shape, dtype and offset, the same; malformed files refused with GGUFFormatError, never another error."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.errors import ModelLoadError
from engine.gguf_file import GGUFFile
from engine.gguf_format import GGUFFormatError, read_gguf, tensor_array

VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType


def write_sample(path: Path, *, endianess=gguf.GGUFEndian.LITTLE, alignment: int | None = 64, pad: int = 0) -> Path:
    """A file with a value of every type, arrays of every element type and every stored tensor type Baton meets
    (``pad``: the length of one more string, to move where the header ends)."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_string("test.pad", "x" * pad)
    scalars = {VT.UINT8: 200, VT.INT8: -100, VT.UINT16: 60000, VT.INT16: -30000, VT.UINT32: 4_000_000_000,
               VT.INT32: -2_000_000_000, VT.FLOAT32: 1e-5, VT.BOOL: True, VT.UINT64: 2**63 + 5, VT.INT64: -(2**62),
               VT.FLOAT64: 1 / 3, VT.STRING: "héllo, wörld"}
    for vtype, value in scalars.items():
        writer.add_key_value(f"test.scalar.{vtype.name.lower()}", value, vtype)
    for vtype, value in scalars.items():
        writer.add_key_value(f"test.array.{vtype.name.lower()}", [value] * 3, VT.ARRAY, sub_type=vtype)
    # a tokenizer's shape: many strings, the empty one and multi-byte ones among them
    writer.add_key_value("tokenizer.ggml.tokens", ["", "Ġthe", "日本", *(f"t{i}" for i in range(1000))], VT.ARRAY,
                         sub_type=VT.STRING)
    writer.add_key_value("tokenizer.ggml.scores", rng.standard_normal(300).astype(np.float32).tolist(), VT.ARRAY,
                         sub_type=VT.FLOAT32)
    plain = {"f32": rng.standard_normal((3, 5)).astype(np.float32), "f16": rng.standard_normal(7).astype(np.float16),
             "i32": np.arange(6, dtype=np.int32).reshape(2, 3), "f64": np.linspace(0, 1, 4)}
    for name, values in plain.items():
        writer.add_tensor(name, values)
    for qtype in (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.BF16):
        values = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), qtype)
        writer.add_tensor(qtype.name.lower(), values, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_value_and_tensor_is_what_the_gguf_package_reads(tmp_path):
    path = write_sample(tmp_path / "sample.gguf")
    ours, theirs = read_gguf(path), gguf.GGUFReader(str(path))
    keys = [key for key in theirs.fields if not key.startswith("GGUF.")]  # the reader's own pseudo-fields
    assert sorted(ours.metadata) == sorted(keys)
    for key in keys:
        assert ours.metadata[key] == theirs.fields[key].contents(), key
        assert type(ours.metadata[key]) is type(theirs.fields[key].contents()), key
    assert ours.metadata["test.scalar.float32"] == float(np.float32(1e-5))  # the stored float32, not 1e-5
    assert ours.metadata["general.alignment"] == 64 and ours.version == 3
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for info, tensor in zip(ours.tensors, theirs.tensors, strict=True):
        raw = tensor_array(ours, info)
        assert info.ggml_type == tensor.tensor_type and info.data_offset == tensor.data_offset, info.name
        assert info.data_offset % 64 == 0, info.name
        assert raw.dtype == tensor.data.dtype and raw.shape == tensor.data.shape, info.name
        assert raw.tobytes() == tensor.data.tobytes(), info.name
    f = GGUFFile(path)  # and through the engine's face: shapes in numpy order, types by name
    by_name = {t.name: t for t in f.tensors}
    assert by_name["f32"].shape == (3, 5) and by_name["q4_1"].type_name == "Q4_1" and by_name["q4_1"].shape == (4, 64)
    assert np.array_equal(gguf.quants.dequantize(by_name["q8_0"].raw, by_name["q8_0"].qtype),
                          gguf.quants.dequantize(theirs.tensors[4].data, QT.Q8_0))
    assert f.get("tokenizer.ggml.tokens")[:3] == ["", "Ġthe", "日本"] and f.get("no.such.key", 7) == 7


@pytest.mark.parametrize("pad", [1, 9, 17, 25])  # the header ends at four places 8 bytes apart
def test_the_default_alignment_places_tensors_where_the_gguf_package_does(tmp_path, pad):
    path = write_sample(tmp_path / "default.gguf", alignment=None, pad=pad)
    ours, theirs = read_gguf(path), gguf.GGUFReader(str(path))
    assert "general.alignment" not in ours.metadata
    assert [t.data_offset for t in ours.tensors] == [t.data_offset for t in theirs.tensors]


def test_a_big_endian_file_is_refused_by_name(tmp_path):
    path = write_sample(tmp_path / "big.gguf", endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(GGUFFormatError, match="big-endian"):
        read_gguf(path)


def test_a_file_cut_anywhere_is_refused_cleanly(tmp_path):
    whole = write_sample(tmp_path / "whole.gguf").read_bytes()
    header_end = read_gguf(tmp_path / "whole.gguf").tensors[0].data_offset
    cut = tmp_path / "cut.gguf"
    for size in [*range(1, 64), *range(64, header_end, header_end // 300), header_end, len(whole) - 1]:
        cut.write_bytes(whole[:size])
        with pytest.raises(GGUFFormatError):
            contents = read_gguf(cut)
            for info in contents.tensors:  # a header that survives the cut: the last tensor ends past the file
                tensor_array(contents, info)
        with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
            GGUFFile(cut).tensors  # noqa: B018 - reading them is the point


def _header(version: int = 3, kvs: list[bytes] = (), tensors: list[bytes] = ()) -> bytes:
    return struct.pack("<4sIQQ", b"GGUF", version, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _u32_kv(key: str, value: int) -> bytes:
    return _string(key) + struct.pack("<II", 4, value)


@pytest.mark.parametrize(("data", "match"), [
    (b"GGML" + bytes(20), "no GGUF magic"),
    (_header(version=1), "version 1 is not read here"),
    (_header(kvs=[_u32_kv("a", 1), _u32_kv("a", 2)]), "'a' appears twice"),
    (_header(kvs=[_string("a") + struct.pack("<I", 13)]), "unknown metadata value type 13"),
    (_header(kvs=[_string("a") + struct.pack("<I", 8) + struct.pack("<Q", 2) + b"\xff\xfe"]), "not UTF-8"),
    (_header(kvs=[_u32_kv("general.alignment", 48)]), "power of two"),
    (_header(tensors=[_string("w") + struct.pack("<IQIQ", 1, 4, 0, 0)] * 2), "tensor 'w' appears twice"),
])
def test_malformed_headers_are_refused_saying_why(tmp_path, data, match):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFFormatError, match=match):
        read_gguf(path)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        GGUFFile(path)


def test_an_unknown_tensor_type_is_refused_when_the_tensors_are_read(tmp_path):
    path = tmp_path / "odd.gguf"
    path.write_bytes(_header(tensors=[_string("w") + struct.pack("<IQIQ", 1, 4, 250, 0)]) + bytes(64))
    f = GGUFFile(path)  # the metadata alone reads (the router needs nothing else)
    assert f.tensor_names == {"w"}
    with pytest.raises(ModelLoadError, match="unknown ggml type 250"):
        f.tensors  # noqa: B018
