"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3): one implementation, switched by ModelConfig.

Parameter names follow the checkpoint keys (``model.layers.N.self_attn...``) except the two fused
projections, ``qkv_proj`` and ``gate_up_proj``, which the loader fills from q/k/v and gate/up. Under tensor
parallelism (``tp``) each rank's modules hold its share of the heads and MLP columns (``engine/parallel/shard.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.attention.base import ForwardBatch
from engine.model.config import ModelConfig
from engine.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, row_linear
from engine.parallel.shard import TensorParallel


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        ranks = tp.size if tp else 1
        # this rank's heads (all of them on one rank)
        self.num_heads, self.num_kv_heads = config.num_heads // ranks, config.num_kv_heads // ranks
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.window = config.layer_windows[layer_idx] if config.layer_windows else None
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = row_linear(self.q_size, config.hidden_size, config.o_bias, tp)
        self.rotary = rotary
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:  # x [T, hidden]
        qkv = self.qkv_proj(x)  # [T, q + 2 kv]
        v = qkv[:, self.q_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)  # [T, kvh, d]
        if self.q_norm is None:  # q and k side by side in qkv: rotated as one tensor of h + kvh heads
            qk = self.rotary.rotate(qkv[:, :self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads,
                                                                              self.head_dim), batch.rope)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # [T, h, d], [T, kvh, d]
        else:
            q, k = qkv[:, :self.q_size + self.kv_size].split((self.q_size, self.kv_size), dim=-1)
            q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))  # [T, h, d]
            k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))  # [T, kvh, d]
            q, k = self.rotary.rotate(q, batch.rope), self.rotary.rotate(k, batch.rope)
        out = batch.attention(self.layer_idx, q, k, v, self.window, self.scale)  # [T, h, d]
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, rotary, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, config.hidden_act, tp)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:  # [T, hidden]
        x = x + self.self_attn(self.input_layernorm(x), batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)  # replicated on every rank
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope)
        self.rotary = rotary
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, rotary, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        batch.rope = self.rotary.tables(batch.positions, x.dtype)  # shared by every layer of this pass
        for i, layer in enumerate(self.layers):
            x = layer(x, batch)  # [T, hidden]; layer i's KV is written (issued, on CUDA)
            if on_layer is not None:
                on_layer(i)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Also serves Mistral; Qwen2 and Qwen3 differ only in config flags (see their files)."""

    @staticmethod
    def config_overrides(raw: dict) -> dict:
        """Architecture facts that config.json does not spell out."""
        return {}

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, tp)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """``on_layer(i)`` runs after decoder layer i wrote its KV (see ``engine.runner.LayerHook``)."""
        return self.model(input_ids, batch, on_layer)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab]
        return self.lm_head(hidden).float()
