"""Baton's model runtime, shared by prefill and decode workers.

``from engine import LLM, SamplingParams`` — exports are lazy so that torch-free users (the router
imports ``engine.tokenizer``) never pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "engine.llm",
    "RequestOutput": "engine.llm",
    "CompletionOutput": "engine.llm",
    "SamplingParams": "engine.sampling_params",
    "Engine": "engine.engine",
    "EngineConfig": "engine.config",
    "InvalidRequest": "engine.errors",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.errors import InvalidRequest
    from engine.llm import LLM, CompletionOutput, RequestOutput
    from engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
