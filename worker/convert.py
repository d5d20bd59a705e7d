"""proto <-> engine conversions for the worker shells (proto types never enter the engine)."""

from __future__ import annotations

from engine.core.request import FinishReason
from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from kv_transfer.layout import KVLayout
from proto import baton_pb2 as pb

_OPTIONAL = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "max_tokens", "min_tokens", "logprobs")
FINISH_TO_PB = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    fields = {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
    if fields.get("top_k") == 0:
        fields["top_k"] = None
    return SamplingParams(
        **fields, stop_token_ids=tuple(msg.stop_token_ids), stop=tuple(msg.stop), ignore_eos=msg.ignore_eos
    )


def layout_to_pb(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(
        model_fingerprint=layout.model_fingerprint, dtype=layout.dtype, block_size=layout.block_size,
        num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
        scale_bytes=layout.scale_bytes, tp_size=layout.tp_size, tp_rank=layout.tp_rank,
    )


def layout_from_pb(msg: pb.KVLayout) -> KVLayout:
    try:
        return KVLayout(
            model_fingerprint=msg.model_fingerprint, dtype=msg.dtype, block_size=msg.block_size,
            num_layers=msg.num_layers, num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim,
            scale_bytes=msg.scale_bytes, tp_size=msg.tp_size or 1, tp_rank=msg.tp_rank,  # 0: a sender without TP
        )
    except ValueError as exc:
        raise InvalidRequest(f"handle.layout: {exc}") from exc


def logprobs_to_pb(entries) -> list[pb.Logprobs]:
    return [
        pb.Logprobs(logprob=chosen, top=[pb.TokenLogprob(token_id=t, logprob=v) for t, v in top])
        for chosen, top in entries
    ]
