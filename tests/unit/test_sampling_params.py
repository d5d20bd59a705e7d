"""SamplingParams: every invalid value raises InvalidRequest naming its field; inputs are normalised."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams

INVALID = [
    ("temperature", -0.5),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "1.0"),
    ("temperature", 10**400),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", float("nan")),
    ("top_k", 0),
    ("top_k", -1),
    ("top_k", 2.0),
    ("top_k", True),
    ("min_p", 2.0),
    ("min_p", -0.1),
    ("repetition_penalty", 0.0),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", 1.5),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", True),
    ("min_tokens", -1),
    ("min_tokens", 17),  # more than the default max_tokens of 16
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", 5),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop", 5),
    ("logprobs", 21),
    ("logprobs", -1),
    ("ignore_eos", "yes"),
]


@pytest.mark.parametrize(("field", "value"), INVALID)
def test_invalid_value_raises_invalid_request_naming_the_field(field, value):
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(**{field: value})
    assert str(caught.value).startswith(field)


def test_invalid_request_is_a_value_error():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)


def test_defaults_construct_and_are_random_sampling_without_penalties():
    params = SamplingParams()
    assert params.temperature == 1.0 and params.top_k is None and params.top_p == 1.0 and params.min_p == 0.0
    assert params.max_tokens == 16 and params.stop == () and params.stop_token_ids == ()
    assert not params.greedy and not params.needs_penalties


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, top_k=1, top_p=1.0, min_p=1.0, seed=2**63 - 1, logprobs=20),
    SamplingParams(max_tokens=1, min_tokens=1, presence_penalty=-2.0, frequency_penalty=2.0, logprobs=0),
    SamplingParams(temperature=2, top_p=1, repetition_penalty=1.2, seed=0),
])
def test_boundary_values_are_valid(params):
    assert isinstance(params, SamplingParams)


def test_lists_become_tuples_and_params_are_hashable():
    params = SamplingParams(stop_token_ids=[1, 2], stop=["a", "b"])
    assert params.stop_token_ids == (1, 2) and params.stop == ("a", "b")
    assert hash(params) == hash(SamplingParams(stop_token_ids=(1, 2), stop=("a", "b")))


def test_single_stop_string_becomes_a_tuple():
    assert SamplingParams(stop="x").stop == ("x",)


def test_none_lists_mean_empty():
    params = SamplingParams(stop=None, stop_token_ids=None)
    assert params.stop == () and params.stop_token_ids == ()


def test_greedy_and_needs_penalties():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
    assert SamplingParams(presence_penalty=0.1).needs_penalties
    assert SamplingParams(frequency_penalty=-0.1).needs_penalties
