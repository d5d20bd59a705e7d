"""The tensor-parallel ranks' paged KV caches in one shared-memory file (CPU).

Rank r's cache is ``kv[r]`` of one tensor ``[N, num_layers, num_blocks + 1, 2, block_size, kv_heads / N, row]``
(``row``: head_dim values, or a quantized row's bytes), mapped by every rank from a file in ``/dev/shm``. Each
rank reads and writes only its own slice; rank 0's process also sees the others', which is what lets one
process serve every rank's KV on the data plane (each rank's slice is a whole cache of its heads) and copy
every rank's blocks to and from the host tier. Rank 0 creates the file and unlinks it once every rank has
mapped it, so the memory goes away with the last process that maps it, however they end.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

_SHM = Path("/dev/shm")


def create(shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, Path]:
    """A zeroed shared tensor of ``shape`` and the file that backs it (unlink it once every rank mapped it)."""
    numel = 1
    for size in shape:
        numel *= int(size)
    folder = _SHM if _SHM.is_dir() else Path(tempfile.gettempdir())
    fd, name = tempfile.mkstemp(prefix="baton-tp-kv-", dir=folder)
    try:
        os.ftruncate(fd, numel * torch.empty((), dtype=dtype).element_size())  # reads as zeros
    finally:
        os.close(fd)
    return attach(Path(name), shape, dtype), Path(name)


def attach(path: Path, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The shared tensor ``create`` made, mapped into this process (writes are seen by every process)."""
    numel = 1
    for size in shape:
        numel *= int(size)
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(*shape)


def unlink(path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)
