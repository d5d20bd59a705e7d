"""OpenAI logprobs objects from a Generate stream's token ids and pb.Logprobs (the tiny tokenizer, no I/O)."""

from __future__ import annotations

import pytest

from engine.tokenizer import Tokenizer
from proto import baton_pb2 as pb
from router.openai.logprobs import LogprobsBuilder
from tests.unit.test_router_server import make_model_folder


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(make_model_folder(tmp_path_factory.mktemp("logprobs") / "tiny"))


def entry(chosen: float, *top: tuple[int, float]) -> pb.Logprobs:
    return pb.Logprobs(logprob=chosen, top=[pb.TokenLogprob(token_id=t, logprob=v) for t, v in top])


def test_completion_object_with_offsets_across_takes(tokenizer):
    ids = tokenizer.encode(" the quick brown", add_special_tokens=False)
    texts = [tokenizer.decode([i]) for i in ids]
    builder = LogprobsBuilder(tokenizer, chat=False)
    builder.add(ids[:1], [entry(-0.5, (ids[0], -0.5), (ids[1], -1.5))])
    first = builder.take()
    assert first == {"tokens": texts[:1], "token_logprobs": [-0.5],
                     "top_logprobs": [{texts[0]: -0.5, texts[1]: -1.5}], "text_offset": [0]}
    assert not builder.has_pending
    builder.add(ids[1:], [entry(-2.0, (ids[0], -0.25)) for _ in ids[1:]])
    rest = builder.take()
    assert rest["tokens"] == texts[1:] and rest["token_logprobs"] == [-2.0] * (len(ids) - 1)
    # the sampled token is in its entry even when it is not among the top n (n + 1 entries, as OpenAI says)
    assert rest["top_logprobs"][0] == {texts[0]: -0.25, texts[1]: -2.0}
    assert rest["text_offset"][0] == len(texts[0]) and rest["text_offset"][-1] == sum(map(len, texts[:-1]))


def test_chat_object_has_bytes_and_top_lists(tokenizer):
    ids = tokenizer.encode(" fox", add_special_tokens=False)[:1]
    other = tokenizer.encode(" dog", add_special_tokens=False)[0]
    builder = LogprobsBuilder(tokenizer, chat=True)
    builder.add(ids, [entry(-0.125, (ids[0], -0.125), (other, -3.0))])
    text, other_text = tokenizer.decode(ids), tokenizer.decode([other])
    assert builder.take() == {"refusal": None, "content": [{
        "token": text, "logprob": -0.125, "bytes": list(text.encode()),
        "top_logprobs": [{"token": text, "logprob": -0.125, "bytes": list(text.encode())},
                         {"token": other_text, "logprob": -3.0, "bytes": list(other_text.encode())}],
    }]}
    assert builder.take() == {"content": [], "refusal": None}  # nothing new
