"""Proto <-> engine conversions for sampling parameters (the router's only proto/core boundary logic).

Proto ``optional`` fields left unset take the engine's defaults; ``top_k`` 0 means disabled. Validation is
the engine's own (``SamplingParams.__post_init__``), so errors raise ``InvalidRequest`` naming the field.
"""

from __future__ import annotations

import dataclasses
import secrets

from engine.sampling_params import SamplingParams
from proto import baton_pb2 as pb

# Proto optional scalars that map one to one onto SamplingParams fields of the same name.
_SCALARS = (
    "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "seed", "max_tokens", "min_tokens", "logprobs",
)
_SEED_BITS = 63  # the engine accepts seeds in [0, 2**63)


def sampling_from_proto(msg: pb.SamplingParams | None) -> SamplingParams:
    """Engine parameters from a request's (possibly absent) ``SamplingParams`` message."""
    if msg is None:
        return SamplingParams()
    kwargs: dict[str, object] = {name: getattr(msg, name) for name in _SCALARS if msg.HasField(name)}
    if msg.HasField("top_k"):
        kwargs["top_k"] = msg.top_k or None
    return SamplingParams(
        **kwargs, stop_token_ids=tuple(msg.stop_token_ids), stop=tuple(msg.stop), ignore_eos=msg.ignore_eos
    )


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """Every field set explicitly, so the receiving side never falls back to a default of its own."""
    msg = pb.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, min_p=params.min_p,
        repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, max_tokens=params.max_tokens, min_tokens=params.min_tokens,
        stop_token_ids=list(params.stop_token_ids), stop=list(params.stop), ignore_eos=params.ignore_eos,
    )
    if params.top_k is not None:
        msg.top_k = params.top_k
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def with_seed(params: SamplingParams) -> SamplingParams:
    """``params`` with a random seed drawn when none was given, so P and D sample one sequence."""
    if params.seed is not None:
        return params
    return dataclasses.replace(params, seed=secrets.randbits(_SEED_BITS))


def worker_sampling(params: SamplingParams) -> pb.SamplingParams:
    """What workers get: the request's parameters (seed already drawn) minus stop strings.

    Stop strings are text-level and apply to the detokenized stream, which only the router has.
    """
    assert params.seed is not None, "draw the seed (with_seed) before sending work to a worker"
    return sampling_to_proto(dataclasses.replace(params, stop=()))
