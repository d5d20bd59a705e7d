"""ModelRegistry: ``architectures[0]`` -> model class. Adding a model is one file plus one line here."""

from __future__ import annotations

import importlib

from engine.errors import ModelLoadError

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "engine.model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "engine.model.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "engine.model.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "engine.model.qwen3:Qwen3ForCausalLM",
}


class ModelRegistry:
    @staticmethod
    def supported() -> list[str]:
        return sorted(_MODELS)

    @staticmethod
    def resolve(architecture: str) -> type:
        target = _MODELS.get(architecture)
        if target is None:
            raise ModelLoadError(
                f"unsupported architecture {architecture!r}; supported: {', '.join(ModelRegistry.supported())}"
            )
        module, name = target.split(":")
        return getattr(importlib.import_module(module), name)
