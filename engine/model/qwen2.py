"""Qwen2: Llama with a bias on q/k/v (never on o_proj)."""

from engine.model.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def config_overrides(raw: dict) -> dict:
        return {"qkv_bias": True, "o_bias": False}
