"""ModelConfig: the parts of a Hugging Face ``config.json`` the runtime needs, read once, frozen."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | llama3 | linear
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before RoPE
    layer_windows: tuple[int | None, ...] = ()  # per-layer sliding window (None: full attention)
    dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    hidden_act: str = "silu"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def uniform_window(self) -> int | None:
        """The sliding window every layer attends within (Mistral), or None when some layer attends to all."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 and None not in windows and self.layer_windows else None


def read_config_json(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist")
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no config.json: not a Hugging Face checkpoint folder")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc


def parse_model_config(raw: dict[str, Any], **overrides: Any) -> ModelConfig:
    """Build a ModelConfig from a config.json dict (transformers 4 and 5 spellings both accepted)."""
    try:
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        num_layers = int(raw["num_hidden_layers"])
        fields = dict(
            architecture=raw["architectures"][0],
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bool(raw.get("attention_bias", False)),
            o_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            layer_windows=_layer_windows(raw, num_layers),
            dtype=_parse_dtype(raw),
            eos_token_ids=_as_tuple(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            hidden_act=raw.get("hidden_act", "silu"),
        )
        return ModelConfig(**{**fields, **overrides})  # an architecture's overrides win
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"config.json is missing or has a bad field: {exc!r}") from exc


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "llama3", "linear"):
        raise ModelLoadError(f"unsupported rope_type {rope_type!r} (supported: default, llama3, linear)")
    return RopeConfig(
        theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
    )


def _layer_windows(raw: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if "use_sliding_window" in raw and not raw["use_sliding_window"]:
        window = None
    if window is None:
        return (None,) * num_layers
    if layer_types:
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    return (int(window),) * num_layers


def _parse_dtype(raw: dict[str, Any]) -> str:
    dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").replace("torch.", "")
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r} in config.json (supported: {', '.join(_DTYPES)})")
    return dtype


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)
