"""A GGUF file with every tensor dequantized to float32, for llama.cpp (benchmarks only).

``bench engines`` compares engines on the same numbers: Baton dequantizes a quantized GGUF to float32 when it loads
it (``engine/model/gguf_loader.py``, the ``gguf`` package's codecs), vLLM gets the same float32 weights as a Hugging
Face folder (``engine/gguf_export.py``), and llama.cpp gets this file: the same metadata and tensor names, the
tensors as the ``gguf`` package dequantizes them (llama.cpp's own Q/K row order kept, which its kernels expect), and
``general.file_type`` 0 (all F32). Cached beside the float32 folder (``engine.gguf_export.export_dir``), reused
once complete.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

MARKER = ".f32-complete"


def export_f32(gguf_path: str | Path, out: Path | None = None, progress: Callable[[str], None] = print) -> Path:
    from engine.gguf_export import export_dir

    path = Path(gguf_path).resolve()
    out = out or export_dir(path, "f32") / f"{path.stem}.F32.gguf"
    if (out.parent / MARKER).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    progress(f"writing {path.name} with float32 tensors to {out} (for llama.cpp)")
    tmp = out.with_suffix(".tmp")
    _write(path, tmp)
    os.replace(tmp, out)
    (out.parent / MARKER).write_text(path.name)
    return out


def _write(src: Path, dst: Path) -> None:
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = 0 if field.name == gguf.Keys.General.FILE_TYPE else field.contents()  # 0: LlamaFileType.ALL_F32
        writer.add_key_value(field.name, value, kind, sub_type=sub_type)
    tensors = [(t.name, np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
               for t in reader.tensors]
    for name, array in tensors:
        writer.add_tensor_info(name, array.shape, np.dtype(np.float32), array.nbytes, gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, array in tensors:
        writer.write_tensor_data(array)
    writer.close()
