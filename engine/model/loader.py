"""Load a checkpoint into a model: a Hugging Face folder (config.json + safetensors shards) or a GGUF file.

Both paths feed one ``WeightSink`` with Hugging Face tensor names; it fills the fused parameters, checks
shapes and completeness, and digests every tensor's bytes as they are read (no second pass over the
file): that digest is the ``weights_id`` in the model fingerprint, so two different checkpoints never
share KV in the index.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from hashlib import blake2b
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from engine.errors import ModelLoadError
from engine.model.config import ModelConfig, parse_model_config, read_config_json
from engine.model.layers import pack_linears
from engine.model.progress import Progress
from engine.model.registry import ModelRegistry
from engine.model_source import ModelSource
from engine.parallel.shard import TensorParallel

if TYPE_CHECKING:
    from engine.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

# checkpoint projection -> (fused parameter, shard index); shard order matches the fused layout.
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Row-parallel weights: a tensor-parallel rank holds a slice of their input columns (engine/parallel/shard.py).
_ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")


def read_model_config(source: ModelSource, dtype: str | None = None, gguf: GGUFFile | None = None) -> ModelConfig:
    """The model's config; ``gguf``: the source's file, already opened (opening one reads its metadata)."""
    if source.is_gguf:
        raw = (gguf or open_gguf(source)).config_dict()
    else:
        raw = read_config_json(source.path)
    architecture = (raw.get("architectures") or [None])[0]
    if architecture is None:
        raise ModelLoadError(f"{source.path}/config.json has no 'architectures' entry")
    cls = ModelRegistry.resolve(architecture)
    config = parse_model_config(raw, **cls.config_overrides(raw))
    return dataclasses.replace(config, dtype=dtype) if dtype else config


def load_model(source: ModelSource, config: ModelConfig, device: torch.device,
               gguf: GGUFFile | None = None, tp: TensorParallel | None = None) -> tuple[nn.Module, str]:
    """The model with its weights on ``device`` (``tp``: this rank's share of them), and the weights' digest
    (``weights_id``: the whole checkpoint's, whatever the share)."""
    cls = ModelRegistry.resolve(config.architecture)
    with torch.device("meta"):
        model = cls(config, tp)
    model = model.to_empty(device=device).to(getattr(torch, config.dtype))
    model.model.rotary.reset_tables(device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    sink = WeightSink(model, config, tp)
    if source.is_gguf:
        from engine.model.gguf_loader import load_gguf

        load_gguf(gguf or open_gguf(source), config, sink)
    else:
        _load_safetensors(source.path, sink)
    sink.check_complete()
    pack_linears(model)  # on the CPU: every weight also in oneDNN's layout (engine/model/layers.py)
    return model.eval(), sink.weights_id()


def open_gguf(source: ModelSource) -> GGUFFile:
    from engine.gguf_file import GGUFFile

    return GGUFFile(source.path)


class WeightSink:
    """Receives checkpoint tensors by Hugging Face name and copies them into the model's parameters."""

    def __init__(self, model: nn.Module, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._names = [name for name, _ in model.named_parameters()]
        self._config = config
        self._tp = tp or TensorParallel(0, 1)
        self._loaded: set[str] = set()
        self._digest = blake2b(digest_size=16)

    def put(self, key: str, tensor: torch.Tensor, stored: memoryview | bytes | None = None) -> None:
        """Copy ``tensor`` into the parameter ``key`` names; digest ``stored`` (the bytes as the file holds
        them, e.g. quantized), else the tensor's own bytes."""
        if key.endswith(_IGNORED_SUFFIXES):
            return
        name, rows = _target(key, self._config, self._tp)
        if name not in self._params:
            raise ModelLoadError(f"unexpected tensor {key!r} for {self._config.architecture}")
        self._digest.update(f"{key}:{tuple(tensor.shape)}:{tensor.dtype}|".encode())
        self._digest.update(_tensor_bytes(tensor) if stored is None else stored)
        _copy(self._params[name], rows, _shard(key, tensor, self._tp), key)
        self._loaded.add(f"{name}#{rows[0] if rows else ''}")

    def weights_id(self) -> str:
        return self._digest.hexdigest()

    def check_complete(self) -> None:
        q_size, kv_size, inter = _local_sizes(self._config, self._tp)
        expected: set[str] = set()
        for name in self._names:
            fused = name.split(".")[-2]
            if fused == "qkv_proj":
                expected |= {f"{name}#{s}" for s in (0, q_size, q_size + kv_size)}
            elif fused == "gate_up_proj":
                expected |= {f"{name}#0", f"{name}#{inter}"}
            else:
                expected.add(f"{name}#")
        loaded = set(self._loaded)
        if self._config.tie_word_embeddings:
            expected.discard("lm_head.weight#")
            loaded.discard("lm_head.weight#")
        missing = sorted(expected - loaded)
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[0].split('#')[0]!r}")


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index} is malformed: {exc!r}") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index.name} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


def _load_safetensors(folder: Path, sink: WeightSink) -> None:
    files = checkpoint_files(folder)
    for i, path in enumerate(files, 1):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys = list(f.keys())
            for key in Progress(keys, f"loading {path.name} ({i}/{len(files)})", unit="tensors"):
                try:
                    sink.put(key, f.get_tensor(key))
                except ModelLoadError as exc:
                    raise ModelLoadError(f"{path.name}: {exc}") from None


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (any dtype: viewed as uint8)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _local_sizes(config: ModelConfig, tp: TensorParallel) -> tuple[int, int, int]:
    """This rank's (q rows, k or v rows, MLP columns): the whole model's on one rank."""
    return config.q_size // tp.size, config.kv_size // tp.size, config.intermediate_size // tp.size


def _target(key: str, config: ModelConfig, tp: TensorParallel) -> tuple[str, tuple[int, int] | None]:
    """Checkpoint key -> (our parameter name, row range in a fused parameter or None)."""
    parts = key.split(".")
    q_size, kv_size, inter = _local_sizes(config, tp)
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, shard = _FUSED[part]
            sizes = (q_size, kv_size, kv_size) if fused == "qkv_proj" else (inter, inter)
            start = sum(sizes[:shard])
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), (start, start + sizes[shard])
    return key, None


def _shard(key: str, tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's slice of a checkpoint tensor: rows of q/k/v/gate/up (weights and biases), input columns of
    o_proj/down_proj; everything else (embedding, norms, lm_head, row-parallel biases) whole."""
    if tp.size == 1:
        return tensor
    if key.endswith(_ROW_PARALLEL):
        start, stop = tp.part(tensor.shape[1])
        return tensor[:, start:stop]  # [out, in / N]
    if any(f".{part}." in f".{key}" for part in _FUSED):
        start, stop = tp.part(tensor.shape[0])
        return tensor[start:stop]  # [rows / N, ...]: this rank's heads or MLP columns
    return tensor


def _copy(param: nn.Parameter, rows: tuple[int, int] | None, tensor: torch.Tensor, key: str) -> None:
    target = param.data if rows is None else param.data[rows[0] : rows[1]]
    if target.shape != tensor.shape:
        raise ModelLoadError(f"tensor {key!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor)
