"""Load a Hugging Face checkpoint folder: config.json + one or many safetensors shards."""

from __future__ import annotations

import dataclasses
import json
import logging
from hashlib import blake2b
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.errors import ModelLoadError
from engine.model.config import ModelConfig, parse_model_config, read_config_json
from engine.model.registry import ModelRegistry

logger = logging.getLogger(__name__)

_SAMPLE_BYTES = 1 << 20
# checkpoint projection -> (fused parameter, shard index); shard order matches the fused layout.
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_model_config(folder: Path, dtype: str | None = None) -> ModelConfig:
    raw = read_config_json(folder)
    architecture = (raw.get("architectures") or [None])[0]
    if architecture is None:
        raise ModelLoadError(f"{folder}/config.json has no 'architectures' entry")
    cls = ModelRegistry.resolve(architecture)
    config = parse_model_config(raw, **cls.config_overrides(raw))
    return dataclasses.replace(config, dtype=dtype) if dtype else config


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


def weights_id(files: list[Path]) -> str:
    """A cheap, stable identity of the weights: each shard's size, header and first/last MiB."""
    digest = blake2b(digest_size=16)
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(_SAMPLE_BYTES))
            f.seek(max(0, size - _SAMPLE_BYTES))
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def load_model(folder: Path, config: ModelConfig, device: torch.device) -> nn.Module:
    cls = ModelRegistry.resolve(config.architecture)
    dtype = getattr(torch, config.dtype)
    with torch.device("meta"):
        model = cls(config)
    model = model.to_empty(device=device).to(dtype)
    model.model.rotary.reset_tables(device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    files = checkpoint_files(folder)
    loaded: set[str] = set()
    for i, path in enumerate(files, 1):
        logger.info("loading weights %d/%d: %s", i, len(files), path.name)
        loaded |= _load_file(model, config, path)
    _check_complete(model, config, loaded)
    return model.eval()


def _load_file(model: nn.Module, config: ModelConfig, path: Path) -> set[str]:
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for key in f.keys():
            if key.endswith(_IGNORED_SUFFIXES):
                continue
            name, rows = _target(key, config)
            if name not in params:
                raise ModelLoadError(f"{path.name}: unexpected tensor {key!r} for {config.architecture}")
            _copy(params[name], rows, f.get_tensor(key), key)
            loaded.add(f"{name}#{rows[0] if rows else ''}")
    return loaded


def _target(key: str, config: ModelConfig) -> tuple[str, tuple[int, int] | None]:
    """Checkpoint key -> (our parameter name, row range in a fused parameter or None)."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, shard = _FUSED[part]
            sizes = (config.q_size, config.kv_size, config.kv_size) if fused == "qkv_proj" else (
                config.intermediate_size, config.intermediate_size)
            start = sum(sizes[:shard])
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), (start, start + sizes[shard])
    return key, None


def _copy(param: nn.Parameter, rows: tuple[int, int] | None, tensor: torch.Tensor, key: str) -> None:
    target = param.data if rows is None else param.data[rows[0] : rows[1]]
    if target.shape != tensor.shape:
        raise ModelLoadError(f"tensor {key!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor)


def _check_complete(model: nn.Module, config: ModelConfig, loaded: set[str]) -> None:
    expected: set[str] = set()
    for name, _ in model.named_parameters():
        fused = name.split(".")[-2]
        if fused == "qkv_proj":
            expected |= {f"{name}#{s}" for s in (0, config.q_size, config.q_size + config.kv_size)}
        elif fused == "gate_up_proj":
            expected |= {f"{name}#0", f"{name}#{config.intermediate_size}"}
        else:
            expected.add(f"{name}#")
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight#")
        loaded.discard("lm_head.weight#")
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[0].split('#')[0]!r}")
