"""``--weights int4`` (``engine/model/weight_quant.py``): the kernel multiplies by the weight the groups encode, the
engine's linear layers switch to it only when asked, and an engine with 4-bit weights names itself apart (its KV is
not a float32 engine's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.errors import InvalidRequest
from engine.model.layers import Linear, pack_linears
from engine.model.weight_quant import GROUP, Int4Weight, check_weight_format, quantize_linears


def representable(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """A weight each of whose groups of GROUP is low + k * scale, k in 0..15 with 0 and 15 present, scale and low
    exact in bfloat16: 4 bits hold it exactly."""
    gen = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, 16, (out_features, in_features // GROUP, GROUP), generator=gen)
    levels[..., 0], levels[..., 1] = 0, 15
    scale = torch.randint(1, 64, (out_features, in_features // GROUP, 1), generator=gen) / 256
    low = torch.randint(-64, 0, (out_features, in_features // GROUP, 1), generator=gen) / 64
    return (low + levels * scale).view(out_features, in_features)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_a_weight_that_4_bits_hold_is_multiplied_exactly_but_for_bfloat16(rows):
    weight, x = representable(96, 128, rows), torch.randn(rows, 128)
    got = Int4Weight(weight)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    want = F.linear(x.bfloat16().float(), weight)  # the activations are rounded to bfloat16, the output too
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_any_weight_is_multiplied_within_its_quantization_error():
    weight, x, bias = torch.randn(64, 256), torch.randn(5, 256), torch.randn(64)
    got, want = Int4Weight(weight)(x, bias), F.linear(x, weight, bias)
    assert (got - want).norm() / want.norm() < 0.1  # 16 levels per group of 32: about 5% here
    assert not torch.allclose(got, want, atol=1e-3)  # it is not the float32 product


def test_quantize_linears_switches_the_layers_only_when_asked():
    model = torch.nn.Sequential(Linear(64, 32), Linear(48, 32), torch.nn.Linear(64, 64))
    pack_linears(model)
    x = torch.randn(4, 64)
    before = model[0](x)
    assert quantize_linears(model, "auto") == 0 and torch.equal(model[0](x), before)
    assert quantize_linears(model, "int4") == 1  # 48 input features are no whole groups: that layer stays float
    assert model[0].int4 is not None and model[1].int4 is None and model[0].packed is None
    torch.testing.assert_close(model[0](x), model[0].int4(x, model[0].bias))
    assert not torch.allclose(model[0](x), before, atol=1e-4)


def test_bad_formats_and_places_are_refused():
    with pytest.raises(InvalidRequest, match="auto|int4"):
        check_weight_format("int8", torch.device("cpu"), 1)
    with pytest.raises(InvalidRequest, match="one rank"):
        check_weight_format("int4", torch.device("cpu"), 2)
    with pytest.raises(InvalidRequest, match="CPU"):
        check_weight_format("int4", torch.device("meta"), 1)


def test_an_engine_with_4_bit_weights_generates_and_has_its_own_fingerprint(tiny_checkpoints):
    path = str(tiny_checkpoints["llama"].path)
    with LLM(path, num_blocks=64) as base, LLM(path, num_blocks=64, weights="int4") as four:
        assert base.engine.fingerprint != four.engine.fingerprint
        linears = [m for m in four.engine.runner.model.modules() if isinstance(m, Linear)]
        assert linears and all(m.int4 is not None for m in linears)
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        (out,) = four.generate([[1, 5, 9, 13, 17]], params)
        assert len(out.outputs[0].token_ids) == 16
        logits = base.engine.prompt_logits([1, 5, 9, 13, 17, 21]), four.engine.prompt_logits([1, 5, 9, 13, 17, 21])
        assert not torch.equal(*logits)  # the 4-bit product ran
        pool = four.engine.kv_cache_manager.pool
        assert pool.num_free_blocks == pool.num_blocks
