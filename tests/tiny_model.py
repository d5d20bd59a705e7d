"""The offline ``tiny`` model the integration tests serve, built once per test session.

``build_model`` is idempotent on a folder (a complete build of the same preset and steps is returned untouched),
so every module asking for the same build gets one folder under the session's base temp: about 4 s of tokenizer
and training per build, some 25 modules. Tests only read it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.tiny import build_model


def shared_tiny(tmp_path_factory: pytest.TempPathFactory, train_steps: int = 20) -> Path:
    folder = tmp_path_factory.getbasetemp() / f"tiny-shared-{train_steps}"
    return build_model("tiny", folder, train_steps=train_steps, progress=lambda _: None)
