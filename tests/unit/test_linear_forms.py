"""``engine.model.layers.linear``: the product by a weight in the form fastest on the CPU (batched slices of the
output features) is ``F.linear``'s to float rounding for every row count, bias or not, and falls back to
``F.linear`` itself where the weight cannot be sliced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.layers import SPLIT, Linear, linear


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_the_sliced_product_is_f_linears(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 96, generator=gen), torch.randn(8 * 40, 96, generator=gen)
    b = torch.randn(8 * 40, generator=gen) if bias else None
    got = linear(x, weight, b)
    assert got.shape == (rows, 320)
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_a_weight_that_cannot_be_sliced_is_f_linear_exactly():
    x = torch.randn(4, 16)
    for weight in (torch.randn(SPLIT * 3 + 1, 16), torch.randn(16, SPLIT * 4).T):  # odd rows; not contiguous
        assert torch.equal(linear(x, weight), F.linear(x, weight))


def test_the_layer_keeps_nn_linears_parameters_and_state_dict():
    layer = Linear(24, 64, bias=True)
    assert isinstance(layer, torch.nn.Linear) and set(layer.state_dict()) == {"weight", "bias"}
    x = torch.randn(5, 24)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
