"""The engine's device and dtype defaults (no GPU needed: only the choice is tested)."""

from __future__ import annotations

import pytest
import torch

from engine.engine_setup import pick_dtype
from engine.errors import InvalidRequest


@pytest.mark.parametrize(("device", "expected"), [("cuda", "bfloat16"), ("cuda:1", "bfloat16"), ("cpu", "float32")])
def test_auto_dtype_is_bf16_on_a_gpu_and_fp32_on_cpu(device, expected):
    assert pick_dtype("auto", torch.device(device)) == expected


def test_an_explicit_dtype_wins_and_a_bad_one_is_refused():
    assert pick_dtype("float32", torch.device("cuda")) == "float32"  # the GPU parity runs (tiny model, fp32)
    with pytest.raises(InvalidRequest, match="dtype must be"):
        pick_dtype("int8", torch.device("cuda"))
