"""Qwen3: Llama with RMSNorm on each head of q and k before RoPE, and an explicit head_dim."""

from engine.model.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def config_overrides(raw: dict) -> dict:
        return {"qk_norm": True}
