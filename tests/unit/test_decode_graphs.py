"""Decode steps in fixed shapes (``engine/decode_graphs.py``), the shapes CUDA graphs capture.

On CPU the graphs are never captured (``capture=False``): the same fixed-shape forward runs eagerly, so what is
checked here is everything but the capture and the replay — padding to a captured batch size and table width,
the pad block, the static plan's masks (sliding windows too), falling back to the eager path where a step does
not fit — against the eager engine, token for token. On a GPU (``-m gpu``) the real graphs are checked the same
way."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.base import SeqSlice, StepBatch
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import EngineConfig
from engine.decode_graphs import DecodeGraphs, graph_sizes
from engine.errors import InvalidRequest

SIZES = (1, 2, 4)


def _prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 90))] for _ in range(count)]


def _generate(llm: LLM, prompts, max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", ["llama", "mistral-swa", "qwen2-layer-swa", "qwen3"])
def test_greedy_output_equals_the_eager_engine(tiny_checkpoints, name):
    """Six prompts at once: decode batches of 6 run eagerly (past the largest size, 4), and of 1-5 padded to
    4 or 2 or 1 as requests finish at different lengths; windows (mistral, qwen2) end mid-block."""
    checkpoint = tiny_checkpoints[name]
    prompts = _prompts(checkpoint.vocab_size, 6, seed=3)
    eager = LLM(str(checkpoint.path), num_blocks=128, max_num_seqs=8)
    expected = [_generate(eager, [p], max_tokens=8 + 4 * i)[0] for i, p in enumerate(prompts)]
    static = LLM(str(checkpoint.path), num_blocks=128, max_num_seqs=8)
    static.engine.runner.use_decode_graphs(SIZES, capture=False)
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    outs = static.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert static.engine.runner.graphs.num_runs > 10  # most decode steps ran in fixed shapes
    pool = static.engine.kv_cache_manager.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


def test_padding_rows_write_only_the_pad_block():
    """A decode batch of 3 in a graph of 4 rows and a table of 8 blocks: the outputs of the 3 real rows equal
    the eager backend's, and every block but the pad block and the 3 written slots is untouched."""
    torch.manual_seed(0)
    num_blocks, bs, heads, kv_heads, dim = 24, 4, 4, 2, 8
    slices = [SeqSlice(5, 1, [3, 7]), SeqSlice(0, 1, [11]), SeqSlice(12, 1, [0, 1, 2, 5])]
    batch = StepBatch.from_slices(slices, bs, torch.device("cpu"))
    q, k, v = torch.randn(3, heads, dim), torch.randn(3, kv_heads, dim), torch.randn(3, kv_heads, dim)
    cache = torch.randn(num_blocks + 1, 2, bs, kv_heads, dim)  # block 24: the pad block
    backend = TorchAttentionBackend()
    eager_cache = cache.clone()
    expected = backend.forward(q, k, v, eager_cache, backend.build_metadata(batch), window=None, scale=0.3)

    static = backend.static_decode(max_seqs=4, max_blocks=8, block_size=bs, pad_block=num_blocks, device="cpu")
    static.fill(batch, 4)
    pad = lambda t: torch.cat((t, torch.randn(1, *t.shape[1:])))  # noqa: E731  row 3: padding
    static_cache = cache.clone()
    out = backend.forward(pad(q), pad(k), pad(v), static_cache, static.metadata(4, 8), window=None, scale=0.3)
    torch.testing.assert_close(out[:3], expected)
    assert torch.equal(static_cache[:num_blocks], eager_cache[:num_blocks])  # only the pad block differs


def test_steps_that_do_not_fit_run_eagerly():
    graphs = DecodeGraphs(torch.nn.Identity(), [], sizes=SIZES, max_blocks=64, block_size=16, pad_block=0,
                          device=torch.device("cpu"), capture=False)
    batch = lambda *slices: StepBatch.from_slices(list(slices), 16, torch.device("cpu"))  # noqa: E731
    assert graphs.widths == [4, 8, 16, 32, 64]
    assert graphs.fits(batch(SeqSlice(3, 1, [0]), SeqSlice(40, 1, [1, 2, 3])))
    assert not graphs.fits(batch(SeqSlice(3, 1, [0]), SeqSlice(0, 5, [1])))  # a prefill chunk
    assert not graphs.fits(batch(*[SeqSlice(0, 1, [i]) for i in range(5)]))  # more than the largest size
    assert not graphs.fits(batch(SeqSlice(64 * 16, 1, list(range(65)))))  # wider than the widest table


def test_graph_sizes_are_capped_by_max_num_seqs_and_checked():
    assert graph_sizes((1, 2, 4, 8, 16, 32), 12) == (1, 2, 4, 8, 12)
    assert graph_sizes((1, 2, 4), 64) == (1, 2, 4)
    with pytest.raises(ValueError):
        graph_sizes((0, 2), 8)
    with pytest.raises(InvalidRequest):
        EngineConfig(cuda_graph_sizes=())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_graphs_equal_the_eager_engine_on_a_gpu(tiny_checkpoints):
    checkpoint = tiny_checkpoints["llama"]
    prompts = _prompts(checkpoint.vocab_size, 6, seed=5)
    common = dict(num_blocks=128, max_num_seqs=8, device="cuda", dtype="float32", cuda_graph_sizes=SIZES)
    eager = LLM(str(checkpoint.path), enforce_eager=True, **common)
    graphed = LLM(str(checkpoint.path), **common)
    assert graphed.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    assert _generate(graphed, prompts) == _generate(eager, prompts)
    assert graphed.engine.runner.graphs.num_runs > 10
