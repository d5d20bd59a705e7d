"""``engine.model.layers.linear``: the product by a weight in the form fastest on the CPU (one or two rows: batched slices
of the output features; more: oneDNN on the weight packed at load) is ``F.linear``'s to float rounding for every row
count, bias or not, and falls back to ``F.linear`` itself where the weight cannot be sliced or was not packed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.layers import SPLIT, Linear, RowParallelLinear, linear, pack_linears, pack_weight


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


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_the_packed_product_is_f_linears(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 96, generator=gen), torch.randn(8 * 40 + 3, 96, generator=gen)
    b = torch.randn(8 * 40 + 3, generator=gen) if bias else None
    got = linear(x, weight, b, pack_weight(weight))
    assert got.shape == (rows, 323) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_three_rows_or_more_multiply_the_packed_weight_fewer_the_weight():
    x, weight, other = torch.randn(4, 16), torch.randn(SPLIT * 2, 16), torch.randn(SPLIT * 2, 16)
    packed = pack_weight(other)  # stands for a weight packed before it changed: what each form reads shows
    for rows, read in ((4, other), (3, other), (2, weight), (1, weight)):
        torch.testing.assert_close(linear(x[:rows], weight, packed=packed), F.linear(x[:rows], read), rtol=1e-5,
                                   atol=1e-5)


def test_only_float32_weights_on_the_cpu_are_packed():
    assert pack_weight(torch.randn(8, 8, dtype=torch.bfloat16)) is None
    assert pack_weight(torch.randn(8, 8, device="meta")) is None


@needs_onednn
def test_pack_linears_packs_every_linear_layer_and_nothing_else():
    model = torch.nn.Sequential(Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 16), Linear(16, 8))
    assert pack_linears(model) == 2
    assert model[0].packed is not None and model[3].packed is not None and not hasattr(model[2], "packed")
    x = torch.randn(5, 8)
    torch.testing.assert_close(model(x), model[3](model[2](model[1](F.linear(x, model[0].weight, model[0].bias)))))
    assert RowParallelLinear.packed is None  # packed per instance, like Linear
