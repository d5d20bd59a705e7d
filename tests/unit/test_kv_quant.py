"""A quantized KV cache (issue 24, item 3: ``--kv-cache-dtype int8|fp8``): rows and their scales on exact shapes,
the layout and fingerprint that keep quantized blocks apart from full-precision ones, the cache's size, and
generation against the full-precision engine (the quality cost, bounded)."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.errors import InvalidRequest
from engine.kv_quant import KVQuant, kv_quant
from kv_transfer.errors import LayoutMismatch
from kv_transfer.layout import KVLayout
from worker.convert import layout_from_pb, layout_to_pb


@pytest.mark.parametrize("name,bound", [("int8", 1 / 254), ("fp8", 1 / 16)])
def test_rows_round_trip_within_the_formats_precision(name, bound):
    quant = KVQuant(name)
    x = torch.randn(7, 3, 64) * torch.logspace(-3, 2, 7)[:, None, None]  # rows of very different magnitudes
    packed = quant.pack(x)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 3, 68)
    back = quant.unpack(packed, torch.float32)
    row_max = x.abs().amax(-1, keepdim=True)
    assert ((back - x).abs() <= bound * row_max + 1e-12).all()  # relative to each row's own range
    zeros = quant.unpack(quant.pack(torch.zeros(2, 1, 8)), torch.float32)
    assert torch.equal(zeros, torch.zeros(2, 1, 8))  # an all-zero row stays zero (no 0/0)


def test_layout_counts_the_scales_and_refuses_a_full_precision_peer():
    quantized = KVLayout(model_fingerprint=b"f", dtype="int8", block_size=16, num_layers=2, num_kv_heads=3,
                         head_dim=64, scale_bytes=4)
    assert quantized.bytes_per_block_per_layer == 2 * 16 * 3 * 68
    assert KVLayout.from_json(quantized.to_json()) == quantized
    full = KVLayout(model_fingerprint=b"f", dtype="bfloat16", block_size=16, num_layers=2, num_kv_heads=3,
                    head_dim=64)
    assert full.bytes_per_block_per_layer == 2 * 16 * 3 * 128  # 1.88x the quantized block
    with pytest.raises(LayoutMismatch) as refused:
        full.check_compatible(quantized)
    assert set(refused.value.fields) == {"dtype", "scale_bytes"}
    assert "scale_bytes" not in full.to_json() and KVLayout.from_json(full.to_json()) == full  # as before
    assert layout_from_pb(layout_to_pb(quantized)) == quantized  # the handle carries it too
    with pytest.raises(ValueError, match="scale_bytes"):
        KVLayout(model_fingerprint=b"f", dtype="int8", block_size=1, num_layers=1, num_kv_heads=1, head_dim=1,
                 scale_bytes=-4)


def test_config_names_the_formats():
    assert kv_quant("auto") is None and kv_quant("fp8").storage == torch.float8_e4m3fn
    with pytest.raises(InvalidRequest):
        EngineConfig(kv_cache_dtype="int4")


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 30, 70, 120)]


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _chunked_logits(llm: LLM, tokens: list[int], split: int) -> torch.Tensor:
    """Logits of tokens[split:] [T, vocab], teacher-forced, attending to tokens[:split] as the cache holds them
    (quantized or not): scored in two chunks into scratch blocks."""
    engine = llm.engine
    block_ids = engine.kv_cache_manager.allocate_scratch(engine.kv_cache_manager.blocks_needed(len(tokens)))
    try:
        engine.runner.prompt_logits(tokens[:split], block_ids)
        return engine.runner.prompt_logits(tokens[split:], block_ids, start=split)
    finally:
        engine.kv_cache_manager.pool.free(block_ids)


@pytest.mark.parametrize("name", ["llama", "mistral-swa", "qwen3"])
def test_quantized_cache_costs_little_against_full_precision(tiny_checkpoints, name):
    """Teacher-forced over a cached context of 100 tokens (no cascade of one early difference): the next-token
    argmax agrees with the float32 cache at >= 95% of positions for int8 and >= 80% for fp8 (3 mantissa bits);
    greedy generation with int8 agrees on >= 90% of tokens. The cache holds uint8 rows of head_dim + 4 bytes."""
    checkpoint = tiny_checkpoints[name]
    tokens = _prompts(checkpoint.vocab_size)[3] + _prompts(checkpoint.vocab_size)[2]  # 190 tokens
    full = LLM(str(checkpoint.path), num_blocks=64)
    reference = _chunked_logits(full, tokens, 100).argmax(-1)
    for dtype, floor in (("int8", 0.95), ("fp8", 0.8)):
        llm = LLM(str(checkpoint.path), num_blocks=64, kv_cache_dtype=dtype)
        cache = llm.engine.runner.kv_cache
        assert cache.dtype == torch.uint8 and cache.shape[-1] == llm.engine.model_config.head_dim + 4
        agree = (_chunked_logits(llm, tokens, 100).argmax(-1) == reference).float().mean().item()
        assert agree >= floor, (dtype, agree)
    prompts = _prompts(checkpoint.vocab_size)
    expected, int8 = _greedy(full, prompts), LLM(str(checkpoint.path), num_blocks=64, kv_cache_dtype="int8")
    got = _greedy(int8, prompts)
    assert sum(a == b for x, y in zip(expected, got) for a, b in zip(x, y)) >= 0.9 * sum(map(len, expected))
    stats = int8.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_quantized_blocks_have_their_own_hashes_and_more_fit_in_the_same_memory(tiny_checkpoints):
    path = str(tiny_checkpoints["llama"].path)
    budget = 1 << 20
    full = LLM(path, kv_cache_memory_bytes=budget, max_num_seqs=64)
    int8 = LLM(path, kv_cache_memory_bytes=budget, max_num_seqs=64, kv_cache_dtype="int8")
    assert int8.engine.fingerprint != full.engine.fingerprint  # a quantized prefix never matches a float one
    head_dim = full.engine.model_config.head_dim
    ratio = int8.engine.cache_config.num_blocks / full.engine.cache_config.num_blocks
    assert ratio == pytest.approx(4 * head_dim / (head_dim + 4), rel=0.02)  # float32 rows vs int8 rows + scale


def test_static_decode_and_the_host_tier_move_quantized_rows(tiny_checkpoints):
    path = str(tiny_checkpoints["qwen3"].path)
    prompts = _prompts(tiny_checkpoints["qwen3"].vocab_size)
    expected = _greedy(LLM(path, num_blocks=64, kv_cache_dtype="int8"), prompts)
    graphs = LLM(path, num_blocks=64, kv_cache_dtype="int8")
    graphs.engine.runner.use_decode_graphs((1, 2, 4), capture=False)
    assert _greedy(graphs, prompts) == expected and graphs.engine.runner.graphs.num_runs > 0
    tiered = LLM(path, num_blocks=12, kv_host_blocks=32, kv_cache_dtype="int8")
    one_by_one = [_greedy(tiered, [p])[0] for p in prompts + prompts]
    assert one_by_one == expected + expected and tiered.engine.stats().host_tier_loaded > 0
