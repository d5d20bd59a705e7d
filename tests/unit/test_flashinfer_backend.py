"""FlashInfer backend: page tables, cache writes, planning, and parity with the torch reference.

On any machine: the module imports without flashinfer; its CSR page tables, read with FlashInfer's
kernel semantics (bottom-right-aligned causal mask, inclusive ``window_left``), reproduce the torch
backend; and its plan/run plumbing, driven through a strict stand-in for the flashinfer package
(the 0.7 wrapper signatures), plans each wrapper once per step and window. On a GPU with
flashinfer (``-m gpu``): the real kernels against the torch reference on a mixed batch, and greedy
generation through ``engine.LLM`` against ``attention_backend="torch"``.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from engine.attention.base import SeqSlice, StepBatch
from engine.attention.flashinfer_backend import (
    WORKSPACE_BYTES,
    FlashInferBackend,
    flashinfer_available,
    kv_cache_rows,
    paged_kv_tables,
    window_left,
    write_kv,
)
from engine.attention.torch_backend import TorchAttentionBackend

BLOCK_SIZE = 16
NUM_BLOCKS = 64
NUM_HEADS = 8
HEAD_DIM = 64
SCALE = HEAD_DIM**-0.5
LAYER_WINDOWS = (None, 24, None, 8)  # one step's layers: two share the full-attention plan

needs_flashinfer = pytest.mark.skipif(not flashinfer_available(), reason="needs a CUDA GPU and flashinfer-python")
# A kernel variant's first use may JIT-compile it (minutes) unless flashinfer's JIT cache has it.
jit_timeout = pytest.mark.timeout(1800)


# ---- scenario ------------------------------------------------------------------------------
def _with_blocks(shapes: list[tuple[int, int]], extra_block_for: int = 0) -> list[SeqSlice]:
    """(start, num_new_tokens) -> SeqSlice with distinct, shuffled blocks; one table gets a spare block."""
    free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(7)).tolist()
    slices = []
    for i, (start, num_new) in enumerate(shapes):
        num_blocks = -(-(start + num_new) // BLOCK_SIZE) + (i == extra_block_for)
        slices.append(SeqSlice(start, num_new, [free.pop() for _ in range(num_blocks)]))
    return slices


def mixed_slices() -> list[SeqSlice]:
    """Decodes with contexts 1..130, a fresh 37-token prefill chunk, a 19-token chunk after 21 cached."""
    return _with_blocks([(0, 1), (6, 1), (0, 37), (15, 1), (16, 1), (21, 19), (32, 1), (129, 1)])


def decode_slices() -> list[SeqSlice]:
    return _with_blocks([(0, 1), (6, 1), (15, 1), (16, 1), (32, 1), (129, 1)])


def next_mixed_slices() -> list[SeqSlice]:
    """Another prefill-bearing step, shaped differently: the prefill wrapper must be planned anew."""
    return _with_blocks([(37, 9), (7, 1), (0, 2), (40, 1)])


def batch_of(slices, device="cpu", block_size=BLOCK_SIZE) -> StepBatch:
    return StepBatch.from_slices(slices, block_size, torch.device(device))


def make_inputs(slices, num_kv_heads, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    num_tokens = sum(s.num_new_tokens for s in slices)
    randn = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    q = randn(num_tokens, NUM_HEADS, HEAD_DIM)
    k, v = randn(num_tokens, num_kv_heads, HEAD_DIM), randn(num_tokens, num_kv_heads, HEAD_DIM)
    cache = randn(NUM_BLOCKS, 2, BLOCK_SIZE, num_kv_heads, HEAD_DIM)  # stands in for earlier steps' KV
    return q, k, v, cache


def torch_reference(slices, q, k, v, cache, window):
    """The torch backend in float32 on upcast inputs: (output, cache after the write)."""
    backend, cache32 = TorchAttentionBackend(), cache.float().clone()
    metadata = backend.build_metadata(batch_of(slices, q.device))
    out = backend.forward(q.float(), k.float(), v.float(), cache32, metadata, window, SCALE)
    return out, cache32


def _csr(tables):
    return tables.qo_indptr, tables.kv_indptr, tables.kv_indices, tables.kv_last_page_len


def flashinfer_semantics(q, kv_cache, tables, *, causal, window_left, sm_scale):
    """Paged attention as FlashInfer's kernels define it, in float32: request i's queries are the
    last rows of its kv_len = (pages - 1) * page_size + last_page_len keys; key j is masked when
    ``j > kv_len - qo_len + qi`` (causal) or ``j + qo_len + window_left < kv_len + qi``."""
    page_size, out = kv_cache.shape[2], torch.empty(q.shape, dtype=torch.float32)
    qo, kv_ptr, pages_all, last = (t.tolist() for t in tables)
    for i in range(len(qo) - 1):
        pages = pages_all[kv_ptr[i] : kv_ptr[i + 1]]
        kv_len, qo_len = (len(pages) - 1) * page_size + last[i], qo[i + 1] - qo[i]
        kv = kv_cache[pages].float().cpu()  # [p, 2, ps, kvh, d]
        keys = kv[:, 0].flatten(0, 1)[:kv_len].transpose(0, 1)  # [kvh, kv_len, d]
        values = kv[:, 1].flatten(0, 1)[:kv_len].transpose(0, 1)
        q_pos = kv_len - qo_len + torch.arange(qo_len)[:, None]  # [qo_len, 1]
        k_pos = torch.arange(kv_len)[None, :]  # [1, kv_len]
        allowed = (k_pos <= q_pos) if causal else torch.ones(qo_len, kv_len, dtype=torch.bool)
        if window_left >= 0:
            allowed &= k_pos >= q_pos - window_left
        query = q[qo[i] : qo[i + 1]].float().cpu().transpose(0, 1)  # [h, qo_len, d]
        group = query.shape[0] // keys.shape[0]
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # [h, kv_len, d]
        scores = (query @ keys.transpose(1, 2) * sm_scale).masked_fill(~allowed, float("-inf"))  # [h, qo, kv]
        out[qo[i] : qo[i + 1]] = (scores.softmax(-1) @ values).transpose(0, 1)  # [qo_len, h, d]
    return out


# ---- any machine -----------------------------------------------------------------------------
def test_module_imports_without_flashinfer_and_reports_availability():
    import importlib.util

    expected = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None
    assert flashinfer_available() is expected
    assert "flashinfer" not in sys.modules or expected  # importing the module did not import flashinfer


def test_availability_is_false_when_the_import_fails(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ImportError
    assert flashinfer_available() is False


def test_paged_kv_tables_and_cache_rows_exact():
    block_size = 4
    slices = [
        SeqSlice(5, 1, [7, 3, 9]),  # decode at position 5: pages 7, 3 (the spare 9 is not read)
        SeqSlice(0, 4, [2]),  # fresh prefill filling one page
        SeqSlice(2, 3, [5, 1]),  # chunk at 2..4 over 2 cached tokens: crosses into page 1
    ]
    tables = paged_kv_tables(batch_of(slices, block_size=block_size))
    assert tables.qo_indptr.tolist() == [0, 1, 5, 8]
    assert tables.kv_indptr.tolist() == [0, 2, 3, 5]
    assert tables.kv_indices.tolist() == [7, 3, 2, 5, 1]
    assert tables.kv_last_page_len.tolist() == [2, 4, 1]
    assert {t.dtype for t in _csr(tables)} == {torch.int32}
    # key row = block * 2 * block_size + offset; the value row is block_size further on
    assert kv_cache_rows(batch_of(slices, block_size=block_size)).tolist() == [25, 16, 17, 18, 19, 42, 43, 8]


def test_write_kv_matches_torch_backend_write():
    slices = mixed_slices()
    q, k, v, cache = make_inputs(slices, 2, torch.float32, "cpu", seed=0)
    _, expected = torch_reference(slices, q, k, v, cache, None)
    rows = kv_cache_rows(batch_of(slices))
    write_kv(cache, k, v, rows, rows + BLOCK_SIZE)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("make_slices", [mixed_slices, decode_slices, next_mixed_slices])
@pytest.mark.parametrize("window", [None, 1, 8, 24])
@pytest.mark.parametrize("num_kv_heads", [2, 8])
def test_page_tables_under_flashinfer_semantics_match_torch_backend(make_slices, window, num_kv_heads):
    slices = make_slices()
    q, k, v, cache = make_inputs(slices, num_kv_heads, torch.float32, "cpu", seed=1)
    expected, written = torch_reference(slices, q, k, v, cache, window)
    tables = paged_kv_tables(batch_of(slices))
    out = flashinfer_semantics(q, written, _csr(tables), causal=True, window_left=window_left(window), sm_scale=SCALE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# ---- the backend's plumbing, through a stand-in for the flashinfer package --------------------
class _FakeWrapper:
    """Records plan() calls; run() checks what FlashInfer checks and computes its semantics."""

    def __init__(self, fake, float_workspace_buffer, kv_layout):
        assert kv_layout == "NHD" and float_workspace_buffer.numel() == WORKSPACE_BYTES
        self.fake, self.planned = fake, None

    def _record(self, tables, num_qo_heads, num_kv_heads, head_dim, page_size, **options):
        self.planned = dict(tables=tables, heads=(num_qo_heads, num_kv_heads, head_dim), page_size=page_size, **options)
        self.fake.plans.append((type(self).__name__, options["window_left"]))

    def run(self, q, paged_kv_cache):
        p = self.planned
        assert q.dtype == p["q_data_type"] and paged_kv_cache.dtype == p["kv_data_type"]
        assert q.shape[0] == int(p["tables"][0][-1]) and q.shape[1:] == (p["heads"][0], p["heads"][2])
        assert paged_kv_cache.shape[2:] == (p["page_size"], p["heads"][1], p["heads"][2])
        out = flashinfer_semantics(q, paged_kv_cache, p["tables"], causal=p.get("causal", False),
                                   window_left=p["window_left"], sm_scale=p["sm_scale"])
        return out.to(q.dtype)


class _FakePrefillWrapper(_FakeWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True):
        tables = (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        self._record(tables, num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal=causal, sm_scale=sm_scale,
                     window_left=window_left, q_data_type=q_data_type, kv_data_type=kv_data_type)


class _FakeDecodeWrapper(_FakeWrapper):
    def __init__(self, fake, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False):
        super().__init__(fake, float_workspace_buffer, kv_layout)
        fake.tensor_cores.append(use_tensor_cores)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None, non_blocking=True):
        rows = torch.arange(len(last_page_len) + 1, dtype=torch.int32)  # one query row per request
        self._record((rows, indptr, indices, last_page_len), num_qo_heads, num_kv_heads, head_dim, page_size,
                     sm_scale=sm_scale, window_left=window_left, q_data_type=q_data_type, kv_data_type=kv_data_type)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.plans, fake.tensor_cores = [], []
    fake.BatchPrefillWithPagedKVCacheWrapper = lambda *a, **kw: _FakePrefillWrapper(fake, *a, **kw)
    fake.BatchDecodeWithPagedKVCacheWrapper = lambda *a, **kw: _FakeDecodeWrapper(fake, *a, **kw)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    return fake


def run_steps(backend, num_kv_heads, dtype, device, atol):
    """Mixed, decode-only, mixed again: four layers each, checked against the reference."""
    for step, slices in enumerate((mixed_slices(), decode_slices(), next_mixed_slices())):
        metadata = backend.build_metadata(batch_of(slices, device))
        for layer, window in enumerate(LAYER_WINDOWS):
            q, k, v, cache = make_inputs(slices, num_kv_heads, dtype, device, seed=10 * step + layer)
            expected, expected_cache = torch_reference(slices, q, k, v, cache, window)
            out = backend.forward(q, k, v, cache, metadata, window, SCALE)
            assert out.dtype == dtype and out.shape == q.shape
            torch.testing.assert_close(out.float(), expected, atol=atol, rtol=atol)
            assert torch.equal(cache.float(), expected_cache)


@pytest.mark.parametrize("num_kv_heads", [2, 8])
def test_backend_plans_each_wrapper_once_per_step_and_window(fake_flashinfer, num_kv_heads):
    run_steps(FlashInferBackend(torch.device("cpu")), num_kv_heads, torch.bfloat16, "cpu", atol=2e-2)
    windows = [-1, 23, 7]  # layers 0 and 2 share the full-attention plan
    prefill, decode = "_FakePrefillWrapper", "_FakeDecodeWrapper"
    assert fake_flashinfer.plans == [(kind, w) for kind in (prefill, decode, prefill) for w in windows]
    assert fake_flashinfer.tensor_cores == [num_kv_heads < NUM_HEADS] * 3  # for GQA only; made once


def test_float32_falls_back_to_the_torch_backend(fake_flashinfer):
    run_steps(FlashInferBackend(torch.device("cpu")), 2, torch.float32, "cpu", atol=1e-6)
    assert fake_flashinfer.plans == []


# ---- GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_flashinfer
@jit_timeout
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads", [2, 8])
def test_kernels_match_torch_backend(dtype, num_kv_heads):
    device = torch.device("cuda")
    run_steps(FlashInferBackend(device), num_kv_heads, dtype, device, atol=2e-2)


# Logprob margin (top-1 minus top-2 of the torch run) under which the two kernels' rounding may
# legitimately pick different tokens; float32 runs the torch fallback and must match exactly.
_TIE_MARGIN = {"float16": 0.02, "bfloat16": 0.1, "float32": 0.0}


def _tiny_checkpoint(folder, sliding_window):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    sizes = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    if sliding_window is None:
        model = LlamaForCausalLM(LlamaConfig(**sizes))
    else:
        model = MistralForCausalLM(MistralConfig(sliding_window=sliding_window, **sizes))
    model.save_pretrained(folder)
    return str(folder)


def _generate(model, attention_backend, dtype):
    from engine import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(model=model, attention_backend=attention_backend, dtype=dtype, device="cuda", num_blocks=256,
              max_model_len=512, max_num_batched_tokens=64)  # a small budget: chunked prefill mixed with decode
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 17, 45, 90, 130)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    first = llm.generate(prompts, params)
    # Prompts sharing full blocks with the first batch: their prefill starts after cached context.
    second = llm.generate([prompts[3][:70] + [1, 2, 3], prompts[4][:100] + [5]], params)
    assert [o.num_cached_tokens for o in second] == [64, 96]
    return [o.outputs[0] for o in first + second]


@pytest.mark.gpu
@needs_flashinfer
@jit_timeout
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("sliding_window", [None, 24])
def test_greedy_generation_matches_torch_backend(tmp_path, monkeypatch, dtype, sliding_window):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = _tiny_checkpoint(tmp_path, sliding_window)
    expected, actual = _generate(model, "torch", dtype), _generate(model, "flashinfer", dtype)
    compared = total = 0
    for ref, out in zip(expected, actual):
        assert len(out.token_ids) == len(ref.token_ids) == 24
        total += len(ref.token_ids)
        for pos, (want, got) in enumerate(zip(ref.token_ids, out.token_ids)):
            if want != got:  # identical prefixes so far: only a near-tie may flip
                (_, top1), (_, top2) = ref.logprobs[pos][1]
                assert top1 - top2 < _TIE_MARGIN[dtype], f"token {pos} differs: {got} != {want}"
                break
            compared += 1
    assert compared >= total * 3 // 4
