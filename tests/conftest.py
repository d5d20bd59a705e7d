"""Shared fixtures: tiny random Hugging Face checkpoints, one per architecture the engine registers.

Each checkpoint is built once per session with ``transformers`` itself (fp32, random weights) and saved
with ``save_pretrained`` into a temporary folder, so the engine loads exactly what a real download holds.
Weights use a large ``initializer_range`` so logits are peaky (greedy argmax is far from ties), and norm
weights and biases are randomized too (HF initializes them to 1 and 0, which would hide loader mistakes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

COMMON_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 384,
    "max_position_embeddings": 512,
    "initializer_range": 0.25,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclass(frozen=True)
class TinySpec:
    """One tiny checkpoint: which transformers classes build it and what differs from COMMON_CONFIG."""

    name: str
    config_class: str
    model_class: str
    overrides: dict[str, Any] = field(default_factory=dict)
    max_shard_size: str | None = None  # set: save as several shards + model.safetensors.index.json

    @property
    def architecture(self) -> str:
        return self.model_class


TINY_SPECS: tuple[TinySpec, ...] = (
    TinySpec("llama", "LlamaConfig", "LlamaForCausalLM"),
    TinySpec(
        "llama3-tied-sharded",
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },
        },
        max_shard_size="40KB",
    ),
    # A window of 20 tokens: not a multiple of 8 or 16, so windows end mid-block; prompts reach 200.
    TinySpec("mistral-swa", "MistralConfig", "MistralForCausalLM", {"sliding_window": 20}),
    TinySpec("qwen2", "Qwen2Config", "Qwen2ForCausalLM"),
    # Per-layer windows from layer_types: layer 0 full attention, layer 1 a 12-token window.
    TinySpec(
        "qwen2-layer-swa", "Qwen2Config", "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1},
    ),
    # head_dim 32 != hidden 64 / 4 heads.
    TinySpec("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
)
TINY_SPEC_NAMES = tuple(spec.name for spec in TINY_SPECS)


@dataclass(frozen=True)
class TinyCheckpoint:
    spec: TinySpec
    path: Path
    model: Any  # the transformers model the folder was saved from (fp32, eval)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the tests may reach a model hub
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # save_pretrained's shard bars


# The longest test files (seconds on this 2-core machine, one process): collected first, so that under `make
# test`'s two pytest-xdist workers (files in collection order: --no-loadscope-reorder) neither is left with one
# of them at the end. test_smollm2.py computes transformers' reference the serving test reads after it.
LONGEST_FIRST = ("tests/unit/test_smollm2.py",  # ~110 with transformers' reference
                 "tests/integration/test_routing.py",  # ~130
                 "tests/unit/test_kv_nixl.py")  # ~50: nixl's cases in a pytest of their own


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    first = {name: rank for rank, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable: files stay whole


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """NIXL must never be imported by the main test process: the libraries it bundles (its own UCX, gRPC,
    protobuf) crashed it later (tests/unit/test_kv_nixl.py runs nixl's cases in a process of their own)."""
    import sys

    loaded = [name for name in ("nixl_cu12", "nixl_cu13", "nixl") if sys.modules.get(name) is not None]
    if loaded and os.environ.get("BATON_TEST_NIXL") != "1":
        session.config.get_terminal_writer().line(f"ERROR: the main test process imported {loaded}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def build_tiny_model(spec: TinySpec, seed: int = 0):
    """A random fp32 transformers model for ``spec`` (eval mode, no EOS in its generation config)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, spec.config_class)(
        **{**COMMON_CONFIG, **spec.overrides}, architectures=[spec.model_class], dtype="float32"
    )
    model = getattr(transformers, spec.model_class)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.2)
    # Reference generation runs to max_new_tokens; the engine side passes ignore_eos=True.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def save_tiny_model(model, spec: TinySpec, folder: Path) -> Path:
    kwargs = {"max_shard_size": spec.max_shard_size} if spec.max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, TinyCheckpoint]:
    """Every tiny checkpoint by spec name (built once per session; about 0.1 s each)."""
    root = tmp_path_factory.mktemp("tiny-hf")
    out = {}
    for i, spec in enumerate(TINY_SPECS):
        model = build_tiny_model(spec, seed=i)
        out[spec.name] = TinyCheckpoint(spec, save_tiny_model(model, spec, root / spec.name), model)
    return out


@pytest.fixture(scope="session", params=TINY_SPEC_NAMES)
def tiny_checkpoint(request, tiny_checkpoints) -> TinyCheckpoint:
    """One tiny checkpoint per architecture variant (parametrizes the tests that use it)."""
    return tiny_checkpoints[request.param]


@pytest.fixture(scope="session")
def hf_models(tiny_checkpoints) -> dict[str, Any]:
    """The transformers reference models (fp32, eval) by spec name."""
    return {name: checkpoint.model for name, checkpoint in tiny_checkpoints.items()}


@dataclass(frozen=True)
class SmolLM2Reference:
    path: Path  # the GGUF file
    prompts: list[list[int]]
    continuations: list[Any]  # tests.smollm2.Continuation, one per prompt


@pytest.fixture(scope="session")
def smollm2_reference(tmp_path_factory) -> SmolLM2Reference:
    """transformers' greedy continuations of tests/smollm2.py's prompts on the installed SmolLM2 GGUF (about
    60 s here: 30 loading the file, 27 for 8 x 32 steps), computed once per run: under pytest-xdist the first
    worker to ask computes it, under a lock in the run's shared temporary folder, and the others read its JSON."""
    import fcntl
    import json

    from engine.model_source import resolve_model
    from engine.tokenizer import Tokenizer
    from tests import smollm2

    path = resolve_model("smollm2").path
    prompts = smollm2.prompts(Tokenizer.from_gguf(path))
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        model = smollm2.transformers_model(path)
        return SmolLM2Reference(path, prompts, [smollm2.reference(model, prompt) for prompt in prompts])
    shared = tmp_path_factory.getbasetemp().parent  # every worker's base folder is in the run's
    saved = shared / "smollm2-reference.json"
    with (shared / "smollm2-reference.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not saved.is_file():
            model = smollm2.transformers_model(path)
            continuations = [smollm2.reference(model, prompt) for prompt in prompts]
            saved.write_text(json.dumps({"prompts": prompts, "continuations": [
                {"token_ids": c.token_ids, "margins": c.margins} for c in continuations]}))
        data = json.loads(saved.read_text())
    if data["prompts"] != prompts:
        raise AssertionError("another worker's SmolLM2 reference is for other prompts")
    return SmolLM2Reference(path, prompts, [smollm2.Continuation(**c) for c in data["continuations"]])
