"""Builds Llama checkpoints offline and deterministically (``baton model tiny|small``).

A byte-level BPE is trained on a fixed, sorted list of standard-library files; "tiny" is then trained
briefly on the same text (greedy decoding gives python-ish text with confident logits), "small" keeps
seeded random weights. Same machine and library versions -> byte-identical Hugging Face folders.
torch and transformers load only while building: ``default_model_dir`` and finding a build are torch-free.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from engine.errors import InvalidRequest, ModelLoadError

if TYPE_CHECKING:
    import torch

_LOG = logging.getLogger(__name__)
MARKER_FILE = ".baton-complete"
BUILD_VERSION = 1  # bump when a change to this file changes the built bytes: old caches then rebuild
_SEED = 0
_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3, as in Llama 2
_BOS_ID, _EOS_ID, _PAD_ID = 1, 2, 3
_CORPUS_NUM_FILES = 170
_CORPUS_MAX_CHARS_PER_FILE = 16_384
_PROGRESS_EVERY_STEPS = 50
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelPreset:
    """The shape of a built checkpoint (float32 LlamaForCausalLM) and how long to train it."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    train_steps: int  # 0: seeded random weights only


@dataclass(frozen=True, slots=True, kw_only=True)
class _TrainingRecipe:
    batch_size: int = 16
    seq_len: int = 32
    num_tokens: int = 20_000  # a short slice of the corpus: small enough to learn in a few seconds
    learning_rate: float = 5e-3
    warmup_steps: int = 20
    min_lr_fraction: float = 0.1


_RECIPE = _TrainingRecipe()
_COMMON = dict(vocab_size=4096, num_key_value_heads=2)
PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(
        **_COMMON, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=192,
        max_position_embeddings=2048, train_steps=300,
    ),
    # tiny's shape with 32-dim heads: vLLM's CPU attention takes head sizes of 32 and up (tiny's are 16), so the
    # tests that run vLLM workers serve this one
    "tiny32": ModelPreset(
        **_COMMON, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=384,
        max_position_embeddings=2048, train_steps=300,
    ),
    "small": ModelPreset(
        **_COMMON, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, intermediate_size=1536,
        max_position_embeddings=4096, train_steps=0,
    ),
}


def default_model_dir(preset: str = "tiny") -> Path:
    """``$BATON_CACHE_DIR/models/<preset>``, else ``~/.cache/baton/models/<preset>``."""
    cache_dir = os.environ.get("BATON_CACHE_DIR")
    root = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "baton"
    return root / "models" / preset


def ensure_model(preset: str = "tiny") -> Path:
    """The preset's default folder, built first if it is missing or incomplete."""
    return build_model(preset, progress=_LOG.info)


def build_model(
    preset: str = "tiny",
    out_dir: Path | None = None,
    *,
    force: bool = False,
    progress: Callable[[str], None] = print,
    train_steps: int | None = None,
) -> Path:
    """Builds ``preset`` into ``out_dir`` (default: :func:`default_model_dir`) and returns the folder.

    Idempotent: a folder holding a complete build of the same preset is returned untouched unless
    ``force``. The build goes to a temporary sibling folder, gets its marker file last and is then
    renamed into place, so an interrupted build never looks complete.
    """
    spec = PRESETS.get(preset)
    if spec is None:
        raise InvalidRequest(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    steps = spec.train_steps if train_steps is None else train_steps
    if steps < 0:
        raise InvalidRequest(f"train_steps must be >= 0, got {steps}")
    out = Path(out_dir) if out_dir is not None else default_model_dir(preset)
    identity = {"preset": preset, "train_steps": steps, "version": BUILD_VERSION}
    if not force and is_complete(out, identity):
        progress(f"{preset} model already built at {out}")
        return out
    _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache folder is meant to be shared
        _build_into(tmp, spec, steps, progress)
        _write_marker(tmp, identity)
        _publish(tmp, out, identity)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"{preset} model ready at {out}")
    return out


def is_complete(folder: Path, identity: dict[str, object]) -> bool:
    """True when ``folder`` holds a finished build with this identity (marker matches the files)."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or marker.get("identity") != identity:
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return False
    return all(_size(folder / name) == entry.get("num_bytes") for name, entry in files.items())


def _build_into(folder: Path, spec: ModelPreset, train_steps: int, progress: Callable[[str], None]) -> None:
    texts = corpus_texts()
    progress(f"training a {spec.vocab_size}-token byte-level BPE on {len(texts)} stdlib files")
    tokenizer = train_tokenizer(texts, spec.vocab_size)
    _save_tokenizer(tokenizer, folder, spec)
    token_ids = _training_ids(tokenizer, texts, _RECIPE.num_tokens) if train_steps else []
    _build_weights(spec, folder, token_ids, train_steps, progress)
    for path in folder.iterdir():
        path.chmod(0o644)  # transformers writes model.safetensors owner-only; the cache may be shared


def corpus_texts() -> list[str]:
    """The training text: the first files (sorted by name) of the standard library, each capped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))[:_CORPUS_NUM_FILES]
    if not files:
        raise ModelLoadError(f"no .py files found in the standard library folder {root}")
    return [path.read_text(encoding="utf-8", errors="replace")[:_CORPUS_MAX_CHARS_PER_FILE] for path in files]


def train_tokenizer(texts: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    """Byte-level BPE with Llama-style special tokens and a post-processor that prepends ``<s>``."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # all 256 bytes: any text encodes, nothing is <unk>
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(_SPECIAL_TOKENS), initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos = _SPECIAL_TOKENS[_BOS_ID]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, _BOS_ID)]
    )
    return tokenizer


def _save_tokenizer(tokenizer: tokenizers.Tokenizer, folder: Path, spec: ModelPreset) -> None:
    tokenizer.save(str(folder / "tokenizer.json"))
    names = ("unk_token", "bos_token", "eos_token", "pad_token")
    special_map = dict(zip(names, _SPECIAL_TOKENS, strict=True))
    config = {
        **special_map,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(folder / "tokenizer_config.json", config)
    _write_json(folder / "special_tokens_map.json", special_map)


def _training_ids(tokenizer: tokenizers.Tokenizer, texts: list[str], num_tokens: int) -> list[int]:
    """``<s>`` + each file's tokens, in order, until ``num_tokens`` are collected."""
    ids: list[int] = []
    for text in texts:
        ids.append(_BOS_ID)
        ids.extend(tokenizer.encode(text, add_special_tokens=False).ids)
        if len(ids) >= num_tokens:
            break
    return ids[:num_tokens]


def _build_weights(
    spec: ModelPreset, folder: Path, token_ids: list[int], train_steps: int, progress: Callable[[str], None]
) -> None:
    import torch  # here, not at the top: see the module docstring
    from transformers import LlamaConfig, LlamaForCausalLM

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same float reductions, in the same order, every build
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's RNG state is left as it was
            torch.manual_seed(_SEED)
            model = LlamaForCausalLM(LlamaConfig(**_llama_config(spec)))
            if train_steps:
                progress(f"training the model: {train_steps} steps of {_RECIPE.batch_size}x{_RECIPE.seq_len} tokens")
                _train(model, torch.tensor(token_ids), train_steps, progress)
        progress(f"saving weights to {folder}")
        model.save_pretrained(folder)  # transformers 5 always writes safetensors
    finally:
        torch.set_num_threads(previous_threads)


def _llama_config(spec: ModelPreset) -> dict[str, object]:
    shape = {field.name: getattr(spec, field.name) for field in fields(spec) if field.name != "train_steps"}
    ids = dict(bos_token_id=_BOS_ID, eos_token_id=_EOS_ID, pad_token_id=_PAD_ID)
    return {**shape, **ids, "tie_word_embeddings": False, "architectures": ["LlamaForCausalLM"]}


def _train(model: torch.nn.Module, data: torch.Tensor, steps: int, progress: Callable[[str], None]) -> None:
    """Next-token prediction on ``data`` ([num_tokens]) with AdamW, warmup and cosine decay."""
    import torch

    seq_len = _RECIPE.seq_len
    if data.numel() < seq_len:
        raise ModelLoadError(f"training text too short: {data.numel()} tokens < {seq_len}")
    generator = torch.Generator().manual_seed(_SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=_RECIPE.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps))
    model.train()
    for step in range(1, steps + 1):
        starts = torch.randint(0, data.numel() - seq_len + 1, (_RECIPE.batch_size,), generator=generator)
        batch = torch.stack([data[start : start + seq_len] for start in starts.tolist()])  # [batch_size, seq_len]
        loss = model(input_ids=batch, labels=batch).loss  # labels are shifted inside the model
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % _PROGRESS_EVERY_STEPS == 0 or step == steps:
            progress(f"  step {step}/{steps}  loss {loss.item():.3f}")
    model.eval()


def lr_factor(step: int, total_steps: int) -> float:
    """Linear warmup, then cosine decay to ``min_lr_fraction`` of the peak learning rate."""
    warmup = min(1.0, (step + 1) / _RECIPE.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * step / max(total_steps, 1)))
    return warmup * (_RECIPE.min_lr_fraction + (1.0 - _RECIPE.min_lr_fraction) * cosine)


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_marker(folder: Path, identity: dict[str, object]) -> None:
    """Written last: its presence says every file it lists was fully written."""
    files = {
        path.name: {"num_bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
        for path in sorted(folder.iterdir())
        if path.is_file()
    }
    _write_json(folder / MARKER_FILE, {"identity": identity, "files": files})


def _size(path: Path) -> int | None:
    return path.stat().st_size if path.is_file() else None


def _check_replaceable(folder: Path) -> None:
    """Only an empty folder or an earlier Baton build (it has a marker) may be replaced."""
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{folder} exists and is not a folder")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / MARKER_FILE).is_file():
        raise FileExistsError(f"{folder} is not empty and holds no Baton build; refusing to overwrite it")


def _publish(tmp: Path, out: Path, identity: dict[str, object]) -> None:
    """Moves the finished build into place; a concurrent builder that won the race is kept."""
    old = out.with_name(f"{tmp.name}.old")
    if out.is_dir():
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        if not is_complete(out, identity):
            raise
    shutil.rmtree(old, ignore_errors=True)
