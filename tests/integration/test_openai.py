"""The official ``openai`` client against a real router's HTTP front (redis-server, router, 1 prefill,
1 decode, the tiny model): completions and chat, streaming and not, get exactly the greedy text the gRPC
Generate path returns for the same input, with usage; bad input is a 400 with a message."""

from __future__ import annotations

import time
import urllib.request

import grpc
import openai
import pytest

from engine.tiny import build_model
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import free_port
from tests.integration.test_e2e import assert_pools_full, start_cluster

MAX_TOKENS = 12
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog and then runs far away into the forest"]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Tell me a long story."}],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("tiny", tmp_path_factory.mktemp("tiny"), train_steps=20, progress=lambda _: None)


@pytest.fixture(scope="module")
def platform(model_dir, tmp_path_factory):
    http_port = free_port()
    cluster, redis = start_cluster(model_dir, tmp_path_factory.mktemp("logs"), prefill=1, decode=1,
                                   router_args=("--http-port", str(http_port)))
    cluster.http_url = f"http://127.0.0.1:{http_port}/v1"
    _wait_http(cluster.http_url)
    yield cluster
    cluster.stop_all()
    redis.stop()


def _wait_http(base_url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}/models", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.fixture(scope="module")
def client(platform):
    return openai.OpenAI(base_url=platform.http_url, api_key="unused", max_retries=0, timeout=60)


def grpc_text(address: str, **input_fields) -> tuple[str, pb.GenerateResponse]:
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(address))
    request = pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), **input_fields)
    responses = list(stub.Generate(request, timeout=60))
    return "".join(r.text for r in responses), responses[-1]


def grpc_chat(address: str, messages: list[dict[str, str]]) -> tuple[str, pb.GenerateResponse]:
    return grpc_text(address, chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in messages]))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_equal_grpc(platform, client, prompt):
    expected, last = grpc_text(platform.router.address, prompt=prompt)
    assert last.timings.route_kind == ("remote" if len(prompt) > 20 else "local")  # both paths are compared
    out = client.completions.create(model=platform.model_dir.name, prompt=prompt, max_tokens=MAX_TOKENS,
                                     temperature=0)
    assert out.choices[0].text == expected and expected
    assert out.choices[0].finish_reason == {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}[
        last.finish_reason]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (last.usage.prompt_tokens,
                                                                       last.usage.completion_tokens)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    chunks = list(client.completions.create(model=platform.model_dir.name, prompt=prompt, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == last.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == out.choices[0].finish_reason
    assert_pools_full(platform)


@pytest.mark.parametrize("messages", CHATS)
def test_chat_equals_grpc(platform, client, messages):
    expected, last = grpc_chat(platform.router.address, messages)
    out = client.chat.completions.create(model=platform.model_dir.name, messages=messages,
                                         max_completion_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].message.content == expected and expected
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == last.usage.prompt_tokens
    stream = client.chat.completions.create(model=platform.model_dir.name, messages=messages,
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == expected
    assert_pools_full(platform)


def test_models_lists_the_served_model(platform, client):
    assert [m.id for m in client.models.list()] == [platform.model_dir.name]


def test_bad_request_is_400_with_a_message_and_the_front_keeps_serving(platform, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=platform.model_dir.name, prompt="hi", max_tokens=4, n=2)
    assert info.value.status_code == 400 and "n must be 1" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert "'gpt-4' is not served here" in info.value.message
    out = client.completions.create(model=platform.model_dir.name, prompt=PROMPTS[0], max_tokens=2, temperature=0)
    assert out.usage.completion_tokens >= 1
