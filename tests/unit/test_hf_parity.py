"""Greedy outputs equal ``transformers`` greedy generation token for token (DESIGN.md, Engine).

Every test runs on each tiny checkpoint from ``conftest.py`` (Llama, Llama 3 RoPE + tied embeddings saved
as shards, Mistral with a sliding window, Qwen2, Qwen2 with per-layer windows, Qwen3). The reference is
``model.generate(do_sample=False)`` in fp32, computed once per (checkpoint, prompt) and cached. Scenarios
push the scheduler through many blocks, prefix-cache hits (also on decoded tokens), chunked prefill and
preemption; after each one the block pool must balance and be empty again.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.errors import ModelLoadError
from engine.model.layers import Linear

MAX_TOKENS = 12
PROMPT_LENGTHS = (3, 7, 16, 33, 64, 100, 150, 200)
LOGIT_ATOL = 1e-4
LOGPROB_ATOL = 1e-4


def make_prompts(vocab_size: int) -> dict[int, list[int]]:
    rng = random.Random(1234)
    return {n: [rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS}


@dataclass(frozen=True)
class Continuation:
    token_ids: list[int]
    logprobs: list[float]  # log-softmax of each chosen token under the model
    margins: list[float]  # top-1 minus top-2 logit at each step (how far from a tie)


class Reference:
    """HF greedy continuations and prompt logits of one checkpoint, memoized per prompt."""

    def __init__(self, model) -> None:
        self.model = model
        self._greedy: dict[tuple[int, ...], Continuation] = {}
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.inference_mode()
    def greedy(self, prompt: list[int]) -> Continuation:
        key = tuple(prompt)
        if key not in self._greedy:
            input_ids = torch.tensor([prompt])  # [1, T]
            # An explicit mask: without one, generate() infers it from pad_token_id and would silently
            # mask out every prompt token that happens to equal the pad id.
            out = self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_TOKENS,
                do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(prompt):].tolist()
            assert len(tokens) == MAX_TOKENS, "the reference stopped early"
            logits = torch.cat(out.logits).float()  # [MAX_TOKENS, vocab]
            top2 = logits.topk(2, dim=-1).values  # [MAX_TOKENS, 2]
            chosen = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]  # [MAX_TOKENS]
            self._greedy[key] = Continuation(tokens, chosen.tolist(), (top2[:, 0] - top2[:, 1]).tolist())
        return self._greedy[key]

    @torch.inference_mode()
    def prompt_logits(self, prompt: list[int]) -> torch.Tensor:
        key = tuple(prompt)
        if key not in self._logits:
            self._logits[key] = self.model(torch.tensor([prompt])).logits[0].float()  # [T, vocab]
        return self._logits[key]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny matrices gain nothing from intra-op threads; on a busy CI box the threads' barriers make each op
    tens of times slower. The previous setting is restored for the other modules."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def reference(tiny_checkpoint) -> Reference:
    return Reference(tiny_checkpoint.model)


@pytest.fixture(scope="session")
def prompts(tiny_checkpoint) -> dict[int, list[int]]:
    return make_prompts(tiny_checkpoint.vocab_size)


# ---- helpers -------------------------------------------------------------------------------------
def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def make_llm(checkpoint, **engine_args) -> LLM:
    return LLM(model=str(checkpoint.path), **{"num_blocks": 256, **engine_args})


def assert_matches(reference: Reference, prompt: list[int], output, max_tokens: int = MAX_TOKENS) -> None:
    expected = reference.greedy(prompt)
    got = output.outputs[0].token_ids
    want = expected.token_ids[:max_tokens]
    if got != want:
        i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        margin = expected.margins[i] if i < len(expected.margins) else float("nan")
        pytest.fail(
            f"prompt of {len(prompt)} tokens: engine {got} != HF {want}; first difference at output {i}, "
            f"where HF's top-2 logit margin is {margin:.2e}"
        )
    assert output.outputs[0].finish_reason == "length"


def assert_pool_drained(llm: LLM) -> None:
    pool = llm.engine.kv_cache_manager.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks
    assert not llm.engine.has_unfinished()


# ---- parity scenarios ----------------------------------------------------------------------------
def test_single_prompts_match_hf(tiny_checkpoint, reference, prompts):
    llm = make_llm(tiny_checkpoint)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears) == torch.backends.mkldnn.is_available()
    for n in (3, 33, 150):
        (output,) = llm.generate([prompts[n]], greedy())
        assert_matches(reference, prompts[n], output)
        assert_pool_drained(llm)


def test_mixed_batch_matches_hf_with_logprobs(tiny_checkpoint, reference, prompts):
    """All prompts (3..200 tokens) in one call; max_tokens 1..12 so requests leave the batch one by one."""
    llm = make_llm(tiny_checkpoint)
    batch = [prompts[n] for n in PROMPT_LENGTHS]
    max_tokens = [1 + (5 * i) % MAX_TOKENS for i in range(len(batch))]
    outputs = llm.generate(batch, [greedy(k, logprobs=1) for k in max_tokens])
    for prompt, k, output in zip(batch, max_tokens, outputs):
        assert_matches(reference, prompt, output, k)
        got = [chosen for chosen, _ in output.outputs[0].logprobs]
        assert got == pytest.approx(reference.greedy(prompt).logprobs[:k], abs=LOGPROB_ATOL)
    assert_pool_drained(llm)


def test_prompts_spanning_many_blocks_match_hf(tiny_checkpoint, reference, prompts):
    llm = make_llm(tiny_checkpoint, block_size=4)
    batch = [prompts[n] for n in (100, 150, 200, 7)]  # up to 53 blocks per request
    for prompt, output in zip(batch, llm.generate(batch, greedy())):
        assert_matches(reference, prompt, output)
    assert_pool_drained(llm)


def test_prefix_cache_hits_keep_outputs_exact(tiny_checkpoint, reference, prompts):
    llm = make_llm(tiny_checkpoint, block_size=8)
    first = prompts[150]
    (out,) = llm.generate([first], greedy())
    assert_matches(reference, first, out)
    assert out.num_cached_tokens == 0
    shared = first[:120] + prompts[33][:20]  # a new tail after 15 shared blocks
    continued = first + out.outputs[0].token_ids  # blocks 18-19 hold KV written by decode steps
    # The same prompt again: every full block but the one holding the last prompt token is reused.
    for prompt, cached in ((first, 144), (shared, 120), (continued, 160)):
        (out,) = llm.generate([prompt], greedy())
        assert_matches(reference, prompt, out)
        assert out.num_cached_tokens == cached
        assert_pool_drained(llm)


def test_chunked_prefill_matches_hf(tiny_checkpoint, reference, prompts):
    """A budget of 8 tokens a step splits every prompt. The repeated 100-token prompt is admitted while its
    twin still runs, so it shares the twin's blocks; the second pass starts every prompt from cached blocks."""
    llm = make_llm(tiny_checkpoint, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    batch = [prompts[n] for n in (3, 7, 16, 33, 64, 100, 100, 150, 200)]
    for _ in range(2):
        outputs = llm.generate(batch, greedy())
        for prompt, output in zip(batch, outputs):
            assert_matches(reference, prompt, output)
        assert_pool_drained(llm)
        assert outputs[6].num_cached_tokens > 0
    assert [o.num_cached_tokens for o in outputs] == [0, 4, 12, 32, 60, 96, 96, 148, 196]


@pytest.mark.parametrize(
    ("enable_prefix_caching", "max_num_batched_tokens"),
    [(True, 2048), (False, 2048), (True, 8)],
    ids=["cache", "no-cache", "cache-chunked"],
)
def test_preemption_keeps_outputs_exact(tiny_checkpoint, reference, prompts, enable_prefix_caching,
                                        max_num_batched_tokens):
    """20 blocks of 4 tokens hold any one request (at most 76 tokens) but not all of them at once."""
    llm = make_llm(tiny_checkpoint, block_size=4, num_blocks=20, enable_prefix_caching=enable_prefix_caching,
                   max_num_batched_tokens=max_num_batched_tokens)
    batch = [prompts[n] for n in (33, 16, 7, 64, 3)]
    outputs = llm.generate(batch, greedy())
    if llm.engine.scheduler.config.sliding_window is None:  # a windowed model frees blocks instead (Mistral's
        assert llm.engine.scheduler.num_preemptions > 0      # 20-token window: tests/unit/test_sliding_window.py)
    for prompt, output in zip(batch, outputs):
        assert_matches(reference, prompt, output)
    assert_pool_drained(llm)


def test_prompt_logits_match_hf(tiny_checkpoint, reference, prompts):
    llm = make_llm(tiny_checkpoint, block_size=8)
    for n in (3, 64, 200):
        got = llm.engine.prompt_logits(prompts[n])  # [T, vocab]
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, reference.prompt_logits(prompts[n]), atol=LOGIT_ATOL, rtol=0)
        assert_pool_drained(llm)


def test_stop_token_ends_generation(tiny_checkpoint, reference, prompts):
    want = reference.greedy(prompts[64]).token_ids
    stop = want[4]
    llm = make_llm(tiny_checkpoint)
    (out,) = llm.generate([prompts[64]], greedy(stop_token_ids=(stop,)))
    assert out.outputs[0].token_ids == want[: want.index(stop) + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert_pool_drained(llm)


# ---- the fixtures exercise what they claim -------------------------------------------------------
@pytest.mark.parametrize("name", ["mistral-swa", "qwen2-layer-swa"])
def test_sliding_window_changes_the_reference(tiny_checkpoints, name):
    """Parity on 200-token prompts only covers sliding windows if HF's windowed logits differ from full attention."""
    import copy

    model = tiny_checkpoints[name].model
    config = copy.deepcopy(model.config)
    config.sliding_window = None
    if hasattr(config, "layer_types"):  # Qwen2 reads per-layer windows from layer_types; Mistral has none
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    full = type(model)(config).eval()
    full.load_state_dict(model.state_dict())
    prompt = torch.tensor([make_prompts(config.vocab_size)[200]])  # [1, 200]
    with torch.inference_mode():
        windowed, unwindowed = model(prompt).logits[0], full(prompt).logits[0]  # [200, vocab] each
    assert (windowed[-1] - unwindowed[-1]).abs().max() > 1e-2


def test_sharded_tied_checkpoint_is_sharded_and_tied(tiny_checkpoints):
    folder = tiny_checkpoints["llama3-tied-sharded"].path
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    assert "lm_head.weight" not in weight_map


# ---- malformed checkpoint folders ----------------------------------------------------------------
@pytest.fixture
def llama_copy(tiny_checkpoints, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_checkpoints["llama"].path, tmp_path / "llama"))


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _edit_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _load_error(folder: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        LLM(model=str(folder), num_blocks=8)
    return str(info.value)


def test_missing_folder_raises(tmp_path):
    assert "does not exist" in _load_error(tmp_path / "nowhere")


def test_missing_config_json_raises(llama_copy):
    (llama_copy / "config.json").unlink()
    assert "config.json" in _load_error(llama_copy)


def test_unsupported_architecture_raises(llama_copy):
    _edit_config(llama_copy, architectures=["GPT2LMHeadModel"])
    message = _load_error(llama_copy)
    assert "GPT2LMHeadModel" in message and "LlamaForCausalLM" in message  # names the supported ones too


def test_config_missing_a_field_raises(llama_copy):
    config = json.loads((llama_copy / "config.json").read_text())
    del config["hidden_size"]
    (llama_copy / "config.json").write_text(json.dumps(config))
    assert "hidden_size" in _load_error(llama_copy)


def test_missing_safetensors_raises(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    assert "safetensors" in _load_error(llama_copy)


def test_tensor_with_wrong_shape_raises(llama_copy):
    key = "model.layers.1.self_attn.k_proj.weight"
    _edit_weights(llama_copy, lambda t: t.__setitem__(key, t[key][:-1].clone()))
    message = _load_error(llama_copy)
    assert key in message and "shape" in message


def test_missing_tensor_raises(llama_copy):
    key = "model.layers.0.post_attention_layernorm.weight"
    _edit_weights(llama_copy, lambda t: t.pop(key))
    assert key in _load_error(llama_copy)


def test_unexpected_tensor_raises(llama_copy):
    key = "model.layers.7.mlp.up_proj.weight"
    _edit_weights(llama_copy, lambda t: t.__setitem__(key, torch.zeros(128, 64)))
    assert key in _load_error(llama_copy)


def test_missing_shard_raises(tiny_checkpoints, tmp_path):
    folder = Path(shutil.copytree(tiny_checkpoints["llama3-tied-sharded"].path, tmp_path / "sharded"))
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    assert shard.name in _load_error(folder)
