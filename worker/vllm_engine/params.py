"""Baton's request values in vLLM's terms and back (pure: no vLLM import, so it tests anywhere).

- ``sampling_kwargs``: Baton's ``SamplingParams`` (validated by Baton already, so both engines refuse the same bad
  values with the same status) as the keyword arguments of ``vllm.SamplingParams``.
- ``prefill_kv_params`` / ``decode_kv_params``: vLLM's ``kv_transfer_params`` for the two halves of a disaggregated
  request (NixlConnector's protocol); P's answer travels in ``KVHandle.engine_params`` as JSON, unchanged.
- ``prefill_max_tokens``: how many tokens a vLLM P computes. One (the first token) as a rule; two when the prompt
  ends on a vLLM block boundary, because the decode worker is handed the prompt *and* the first token, and vLLM's
  connector pairs the decoder's blocks with the prefiller's one to one: P must then hold the first token's KV
  (one more block) too. The second sampled token is dropped.
"""

from __future__ import annotations

import json
from typing import Any

from engine.core.request import FinishReason
from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams

FINISH_OF_VLLM = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
# vLLM's "error" finish (a request it failed, e.g. a KV load under the "fail" policy) is an error, not a finish:
# ``VLLMEngine`` raises it as UNAVAILABLE
# What a P asks of vLLM's connector: hold the prompt's blocks for a remote decoder to read.
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}


def sampling_kwargs(params: SamplingParams, *, max_tokens: int | None = None) -> dict[str, Any]:
    """``vllm.SamplingParams(**sampling_kwargs(params))``; stop strings stay with the router (as for Baton's
    engine), so none are passed."""
    return dict(
        temperature=params.temperature, top_k=params.top_k or 0, top_p=params.top_p, min_p=params.min_p,
        repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, seed=params.seed,
        max_tokens=params.max_tokens if max_tokens is None else max_tokens,
        min_tokens=min(params.min_tokens, params.max_tokens if max_tokens is None else max_tokens),
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos, logprobs=params.logprobs,
        detokenize=False, skip_special_tokens=False,
    )


def prefill_max_tokens(num_prompt_tokens: int, vllm_block_size: int) -> int:
    return 2 if num_prompt_tokens % vllm_block_size == 0 else 1


def encode_kv_params(params: dict[str, Any]) -> bytes:
    return json.dumps(params, separators=(",", ":")).encode()


def decode_kv_params(raw: bytes) -> dict[str, Any]:
    """A handle's ``engine_params`` as vLLM's ``kv_transfer_params`` for the decoder; bad bytes are refused."""
    try:
        params = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"handle.engine_params is not vLLM's kv_transfer_params (JSON): {exc}") from None
    if not isinstance(params, dict) or not params.get("remote_engine_id") or "remote_block_ids" not in params:
        raise InvalidRequest("handle.engine_params lacks vLLM's remote_engine_id / remote_block_ids")
    return params


def logprobs_of(entries: list[dict[int, Any]] | None, token_ids: list[int],
                num_top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """vLLM's per-token ``{token: Logprob}`` (the ``num_top`` best and the sampled token) as Baton's (sampled
    token's logprob, the ``num_top`` best (token, logprob) by rank)."""
    if not entries:
        return []
    out = []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token].logprob
        top = sorted(((t, p) for t, p in entry.items() if p.rank is not None and 1 <= p.rank <= num_top),
                     key=lambda item: item[1].rank)
        out.append((chosen, [(t, p.logprob) for t, p in top]))
    return out
