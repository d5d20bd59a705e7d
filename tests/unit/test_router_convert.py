"""Proto <-> engine sampling parameters: defaults for unset fields, exact round trips, field-named errors."""

from __future__ import annotations

import math

import pytest

from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from proto import baton_pb2 as pb
from router.convert import sampling_from_proto, sampling_to_proto, with_seed, worker_sampling


def test_unset_fields_take_engine_defaults():
    assert sampling_from_proto(pb.SamplingParams()) == SamplingParams()
    assert sampling_from_proto(None) == SamplingParams()


def test_set_fields_are_taken_exactly():
    msg = pb.SamplingParams(
        temperature=0.0, top_k=5, top_p=0.5, min_p=0.25, repetition_penalty=1.5, presence_penalty=-1.0,
        frequency_penalty=0.5, seed=42, max_tokens=7, min_tokens=2, stop_token_ids=[2, 9], stop=["\n\n", "END"],
        ignore_eos=True, logprobs=3,
    )
    params = sampling_from_proto(msg)
    assert params == SamplingParams(
        temperature=0.0, top_k=5, top_p=0.5, min_p=0.25, repetition_penalty=1.5, presence_penalty=-1.0,
        frequency_penalty=0.5, seed=42, max_tokens=7, min_tokens=2, stop_token_ids=(2, 9), stop=("\n\n", "END"),
        ignore_eos=True, logprobs=3,
    )


def test_zero_is_a_value_not_unset():
    # Proto3 optional: an explicit temperature 0 (greedy) or min_tokens 0 is kept, not defaulted.
    params = sampling_from_proto(pb.SamplingParams(temperature=0.0, seed=0, logprobs=0))
    assert (params.temperature, params.seed, params.logprobs) == (0.0, 0, 0)


def test_top_k_zero_means_disabled():
    assert sampling_from_proto(pb.SamplingParams(top_k=0)).top_k is None


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"seed": 2**63}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 20}, "min_tokens"),  # above the default max_tokens of 16
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_values_raise_invalid_request_naming_the_field(fields, name):
    with pytest.raises(InvalidRequest) as info:
        sampling_from_proto(pb.SamplingParams(**fields))
    assert str(info.value).startswith(name + " ")


def test_round_trip_through_proto_is_exact():
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.75, seed=123456789012345, max_tokens=9,
                            stop=("x",), stop_token_ids=(4,), logprobs=2)
    assert sampling_from_proto(sampling_to_proto(params)) == params
    defaults = sampling_to_proto(SamplingParams())
    assert not defaults.HasField("top_k") and not defaults.HasField("seed") and not defaults.HasField("logprobs")
    assert defaults.HasField("temperature") and defaults.HasField("max_tokens")  # explicit for workers


def test_with_seed_draws_only_when_missing():
    assert with_seed(SamplingParams(seed=7)).seed == 7
    seeds = {with_seed(SamplingParams()).seed for _ in range(20)}
    assert len(seeds) == 20 and all(0 <= s < 2**63 for s in seeds)


def test_worker_sampling_keeps_the_seed_and_drops_stop_strings():
    msg = worker_sampling(SamplingParams(seed=99, stop=("END",), stop_token_ids=(5,), max_tokens=4))
    assert msg.seed == 99 and list(msg.stop) == [] and list(msg.stop_token_ids) == [5] and msg.max_tokens == 4
