"""The OpenAI-compatible HTTP front: request bodies -> pb.GenerateRequest (pure), and the HTTP server
in-process against a real redis-server with no workers: 400s name their parameter in OpenAI's error shape,
no workers is 503, /v1/models lists the served model."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from proto import baton_pb2 as pb
from router.config import RouterConfig
from router.openai.request import Endpoint, InvalidParam, parse
from router.server import RunningRouter, start_router
from tests.unit.test_router_server import LoopThread, make_model_folder, model_dir, redis_server  # noqa: F401

COMPLETIONS, CHAT = Endpoint.COMPLETIONS, Endpoint.CHAT


# ---- parsing (no I/O) ----------------------------------------------------------------------------

def test_completion_maps_every_sampling_parameter():
    request = parse(COMPLETIONS, {
        "model": "tiny", "prompt": "Hello", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3,
        "stop": "\n", "presence_penalty": 0.25, "top_k": 4, "ignore_eos": True, "stop_token_ids": [9], "n": 1,
        "user": "ignored",
    }, "cmpl-1")
    g = request.generate
    assert (g.request_id, g.model, g.prompt) == ("cmpl-1", "tiny", "Hello")
    s = g.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, list(s.stop), s.top_k) == (7, 0.0, 0.5, 3, ["\n"], 4)
    assert s.presence_penalty == 0.25 and s.ignore_eos and list(s.stop_token_ids) == [9]
    assert not s.HasField("frequency_penalty") and not request.stream and request.max_tokens_given


def test_prompt_forms():
    assert list(parse(COMPLETIONS, {"prompt": [5, 6, 7]}, "r").generate.token_ids.ids) == [5, 6, 7]
    assert list(parse(COMPLETIONS, {"prompt": [[5, 6]]}, "r").generate.token_ids.ids) == [5, 6]
    assert parse(COMPLETIONS, {"prompt": ["one"]}, "r").generate.prompt == "one"


def test_max_completion_tokens_wins_and_absence_is_reported():
    assert parse(CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                        "max_completion_tokens": 5}, "r").generate.sampling.max_tokens == 5
    request = parse(CHAT, {"messages": [{"role": "user", "content": "x"}]}, "r")
    assert not request.max_tokens_given and not request.generate.sampling.HasField("max_tokens")


def test_logprobs_map_to_the_top_n_of_sampling():
    request = parse(COMPLETIONS, {"prompt": "x", "logprobs": 3}, "r")
    assert request.logprobs == 3 and request.generate.sampling.logprobs == 3
    request = parse(COMPLETIONS, {"prompt": "x", "logprobs": 0}, "r")
    assert request.logprobs == 0 and request.generate.sampling.HasField("logprobs")
    assert parse(COMPLETIONS, {"prompt": "x", "logprobs": None}, "r").logprobs is None
    chat = [{"role": "user", "content": "x"}]
    assert parse(CHAT, {"messages": chat, "logprobs": True, "top_logprobs": 5}, "r").generate.sampling.logprobs == 5
    assert parse(CHAT, {"messages": chat, "logprobs": True}, "r").logprobs == 0
    request = parse(CHAT, {"messages": chat, "logprobs": False}, "r")
    assert request.logprobs is None and not request.generate.sampling.HasField("logprobs")


def test_chat_messages_and_text_parts():
    request = parse(CHAT, {"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ], "stream": True, "stream_options": {"include_usage": True}}, "r")
    messages = [(m.role, m.content) for m in request.generate.chat.messages]
    assert messages == [("system", "be brief"), ("user", "ab")]
    assert request.stream and request.include_usage


@pytest.mark.parametrize(("endpoint", "body", "param", "words"), [
    (COMPLETIONS, [], None, "JSON object"),
    (COMPLETIONS, {}, "prompt", "prompt is required"),
    (COMPLETIONS, {"prompt": ""}, "prompt", "must not be empty"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt", "batch of 2"),
    (COMPLETIONS, {"prompt": [1, "x"]}, "prompt", "token ids"),
    (COMPLETIONS, {"prompt": "x", "n": 2}, "n", "n must be 1"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs", "[0, 20]"),
    (COMPLETIONS, {"prompt": "x", "logprobs": True}, "logprobs", "an integer"),
    (COMPLETIONS, {"prompt": "x", "top_logprobs": 2}, "top_logprobs", "chat parameter"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs", "a boolean"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", "requires logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -1}, "top_logprobs",
     "[0, 20]"),
    (COMPLETIONS, {"prompt": "x", "echo": True}, "echo", "not supported"),
    (COMPLETIONS, {"prompt": "x", "best_of": 3}, "best_of", "best_of must be 1"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "5"}, "max_tokens", "an integer"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": True}, "max_tokens", "an integer"),
    (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature", "a number"),
    (COMPLETIONS, {"prompt": "x", "seed": -1}, "seed", "[0, 2**63)"),
    (COMPLETIONS, {"prompt": "x", "stop": ["ok", ""]}, "stop", "non-empty"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
    (COMPLETIONS, {"prompt": "x", "model": 3}, "model", "a string"),
    (CHAT, {"messages": []}, "messages", "non-empty list"),
    (CHAT, {"messages": [{"content": "x"}]}, "messages[0]", "string role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "text"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools", "not supported"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     "response_format", "text"),
])
def test_bad_bodies_name_their_parameter(endpoint, body, param, words):
    with pytest.raises(InvalidParam) as info:
        parse(endpoint, body, "r")
    assert info.value.param == param and words in str(info.value)


# ---- the HTTP server, no workers -----------------------------------------------------------------

@pytest.fixture(scope="module")
def router(redis_server, model_dir) -> Iterator[tuple[LoopThread, RunningRouter]]:  # noqa: F811
    loop = LoopThread()
    config = RouterConfig(model_path=model_dir, redis_url=redis_server.url, ns="oai", host="127.0.0.1", port=0,
                          worker_list_ttl_s=0.0)
    running = loop.run(start_router(config, http_port=0))
    yield loop, running
    loop.run(running.stop(0.5))
    loop.close()


def call(router, path: str, body: Any = None, *, raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
    url = f"http://127.0.0.1:{router[1].http_server.port}{path}"
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_models_lists_the_served_model(router, model_dir):  # noqa: F811
    status, body = call(router, "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [model_dir.name]
    assert call(router, f"/v1/models/{model_dir.name}")[1]["id"] == model_dir.name
    status, body = call(router, "/v1/models/gpt-4")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_the_http_front_serves_the_routers_metrics_as_vllm_does(router):
    call(router, "/v1/completions", {"prompt": "hi", "n": 3})  # a 400: counted like any finished request
    url = f"http://127.0.0.1:{router[1].http_server.port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
    assert "baton:time_to_first_token_seconds" in text and "baton:router_decisions_total" in text


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/v1/completions", {"prompt": "hi", "n": 3}, "n", "n must be 1"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, None, "temperature"),
    ("/v1/completions", {"prompt": [5] * 5000}, None, "max_model_len"),
    ("/v1/completions", {"prompt": [100000]}, None, "token_ids must be in"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, None, "'gpt-4' is not served here"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens", ">= 1"),
])
def test_bad_requests_are_400_in_openai_shape(router, path, body, param, words):
    status, payload = call(router, path, body)
    error = payload["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"] and set(error) == {"message", "type", "param", "code"}


def test_invalid_json_is_400(router):
    status, payload = call(router, "/v1/completions", raw=b"{not json")
    assert status == 400 and "not valid JSON" in payload["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_no_workers_is_503_even_when_streaming(router, stream):
    status, payload = call(router, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "hi"}], "stream": stream})
    assert status == 503 and payload["error"]["message"] == "no decode workers registered"


def test_grpc_still_serves_next_to_http(router):
    import grpc

    from proto import baton_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{router[1].port}") as channel:
        ids = pb_grpc.GenerationStub(channel).Tokenize(pb.TokenizeRequest(prompt="hello"), timeout=10).token_ids
    assert len(ids) > 0


def errors_counted(router, code: str) -> float:
    value = router[1].metrics.registry.get_sample_value("baton:request_errors_total", {"code": code})
    return value or 0.0


def test_http_errors_count_in_request_errors_total_like_grpc_ones(router, model_dir):
    before = {code: errors_counted(router, code) for code in ("INVALID_ARGUMENT", "UNAVAILABLE", "INTERNAL")}
    assert call(router, "/v1/completions", {"prompt": "hi", "n": 3})[0] == 400
    assert call(router, "/v1/completions", raw=b"{not json")[0] == 400
    assert call(router, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})[0] == 503
    assert call(router, "/v1/completions", {"prompt": "hi", "stream": True})[0] == 503
    assert call(router, "/v1/models/gpt-4")[0] == 404  # not a generate call: not counted
    assert errors_counted(router, "INVALID_ARGUMENT") == before["INVALID_ARGUMENT"] + 2
    assert errors_counted(router, "UNAVAILABLE") == before["UNAVAILABLE"] + 2
    assert errors_counted(router, "INTERNAL") == before["INTERNAL"]


# ---- vLLM's /tokenize and /detokenize ------------------------------------------------------------

def test_tokenize_gives_the_ids_generation_sees_and_detokenize_inverts_it(router, model_dir):  # noqa: F811
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model(model_dir)
    status, body = call(router, "/tokenize", {"prompt": "Hello there, Baton", "model": model_dir.name})
    assert status == 200 and body["tokens"] == tokenizer.encode("Hello there, Baton")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0 and body["token_strs"] is None
    chat = [{"role": "user", "content": "Hi"}]
    status, chat_body = call(router, "/tokenize", {"messages": chat, "return_token_strs": True})
    assert status == 200 and chat_body["tokens"] == tokenizer.encode_chat(chat)  # the chat template applied
    assert chat_body["token_strs"] == [tokenizer.decode([i], skip_special_tokens=False) for i in chat_body["tokens"]]
    status, text = call(router, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and text["prompt"] == tokenizer.decode(body["tokens"], skip_special_tokens=False)


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/tokenize", {"prompt": ""}, "prompt", "non-empty string"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": False}, "add_special_tokens", "not supported"),
    ("/tokenize", {"prompt": "hi", "model": "gpt-4"}, None, "'gpt-4' is not served here"),
    ("/tokenize", {"messages": []}, "messages", "non-empty list"),
    ("/detokenize", {"tokens": []}, "tokens", "non-empty list"),
    ("/detokenize", {"tokens": [10**9]}, None, "token_ids must be in"),
])
def test_bad_tokenize_bodies_are_400_naming_their_parameter(router, path, body, param, words):
    status, payload = call(router, path, body)
    assert status == 400 and payload["error"]["param"] == param and words in payload["error"]["message"], payload
