"""The integration tests' oracle: greedy tokens *and* their log-probabilities, against the offline engine.

Tokens alone are a blunt oracle with the tiny checkpoint the tests use (``shared_tiny``, trained 20 steps): its
greedy continuations hardly depend on the prompt (3 distinct tokens over 12 random prompts), so one KV block holding
another block's contents changes the tokens of 10 steps in about 1 case in 5 (tests/unit/test_oracle.py measures
it). The log-probability of each sampled token moves with any wrong block (by 3.9e-4 or more) while batching and
chunking move it by under 1e-6; comparing both within ``LOGPROB_TOLERANCE`` sees one wrong block where tokens
cannot. (No oracle sees two of a prompt's blocks trading places in decode: keys carry their position (RoPE is
applied before caching) and attention sums over all cached positions, so the sum is the same in any order.)"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams

LOGPROB_TOLERANCE = 5e-5  # between float32 paths of one model: ~5e-7 measured (TP=2, int8/fp8 KV, n-gram
#                            speculation included: < 1e-6); one wrong KV block: >= 3.9e-4 in every breakage tried


@dataclass(frozen=True, slots=True)
class Output:
    tokens: list[int]
    logprobs: list[float]  # of each sampled token

    def __getitem__(self, steps: slice) -> Output:
        """The outputs of ``steps`` (``want[1:]``: all but the first token)."""
        return Output(self.tokens[steps], self.logprobs[steps])


def reference(model_dir, prompts: Sequence[list[int]], max_tokens: int, **engine_args) -> list[Output]:
    """Greedy outputs of the offline engine (one batch of all prompts), with each token's log-probability."""
    engine = Engine(EngineConfig(model=str(model_dir), **{"num_blocks": 512, "block_size": 4, **engine_args}))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    logprobs: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[int(delta.request_id)].extend(delta.new_token_ids)
            logprobs[int(delta.request_id)].extend(chosen for chosen, _ in delta.new_logprobs)
    engine.close()
    return [Output(tokens[i], logprobs[i]) for i in range(len(prompts))]


def streamed(responses) -> Output:
    """A Generate stream's tokens and their log-probabilities (the request asked for ``logprobs=0``)."""
    return Output([t for r in responses for t in r.token_ids], [lp.logprob for r in responses for lp in r.logprobs])


def handed_off(prefill, responses) -> Output:
    """A prefill's first token (its ``PrefillResponse``), then a Decode stream: tokens and log-probabilities (both
    calls asked for ``logprobs=0``)."""
    assert prefill.HasField("logprobs"), "the prefill sent no logprob for its first token"
    decoded = streamed(responses)
    return Output([prefill.first_token, *decoded.tokens], [prefill.logprobs.logprob, *decoded.logprobs])


def assert_same(got: Output, want: Output, what: str = "") -> None:
    assert got.tokens == want.tokens, f"{what}: tokens {got.tokens} != {want.tokens}"
    assert len(got.logprobs) == len(want.logprobs), f"{what}: {len(got.logprobs)} logprobs, not {len(want.logprobs)}"
    worst = max((abs(a - b) for a, b in zip(got.logprobs, want.logprobs)), default=0.0)
    assert worst <= LOGPROB_TOLERANCE, f"{what}: a token's logprob differs by {worst:.2e} (> {LOGPROB_TOLERANCE:g})"
