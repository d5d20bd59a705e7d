"""The official ``openai`` client against a real router's HTTP front (redis-server, router, 1 prefill,
1 decode, the tiny model): completions and chat, streaming and not, get exactly the greedy text the gRPC
Generate path returns for the same input, with usage and the same logprobs; bad input is a 400 with a
message."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request

import grpc
import openai
import pytest

from engine.tokenizer import Tokenizer
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import free_port
from tests.integration.test_e2e import aborted, assert_pools_full, start_cluster
from tests.tiny_model import shared_tiny

MAX_TOKENS = 12
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog and then runs far away into the forest"]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Tell me a long story."}],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return shared_tiny(tmp_path_factory)


# Every process prints its trace spans (proto.tracing's console exporter) to its log, flushed every 100 ms.
TRACING_ENV = {"BATON_OTEL_CONSOLE": "1", "OTEL_BSP_SCHEDULE_DELAY": "100"}


@pytest.fixture(scope="module")
def platform(model_dir, tmp_path_factory):
    http_port = free_port()
    saved = {name: os.environ.get(name) for name in TRACING_ENV}
    os.environ.update(TRACING_ENV)
    try:
        cluster, redis = start_cluster(model_dir, tmp_path_factory.mktemp("logs"), prefill=1, decode=1,
                                       router_args=("--http-port", str(http_port)))
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
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


def grpc_responses(address: str, logprobs: int | None = None, **input_fields) -> list[pb.GenerateResponse]:
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(address))
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=logprobs)
    return list(stub.Generate(pb.GenerateRequest(sampling=sampling, **input_fields), timeout=60))


def grpc_text(address: str, **input_fields) -> tuple[str, pb.GenerateResponse]:
    responses = grpc_responses(address, **input_fields)
    return "".join(r.text for r in responses), responses[-1]


def grpc_chat(address: str, messages: list[dict[str, str]]) -> tuple[str, pb.GenerateResponse]:
    return grpc_text(address, chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in messages]))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_equal_grpc(platform, client, prompt):
    expected, last = grpc_text(platform.router.address, prompt=prompt)
    assert last.timings.route_kind == ("remote" if len(prompt) > 20 else "local")  # both paths are compared
    assert 0.0 < last.timings.queue_ms <= last.timings.ttft_ms  # P's (remote) or D's (local) engine queue wait
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


def test_a_client_hanging_up_mid_stream_aborts_the_request_quietly(platform, client):
    """The connection closed while D decodes: D aborts the request (pools back to full), the router logs no
    error for it, and serves the next request."""
    log_before, before = platform.router.log_path.stat().st_size, aborted(platform)
    body = json.dumps({"model": platform.model_dir.name, "prompt": PROMPTS[1], "max_tokens": 1500,
                       "ignore_eos": True, "temperature": 0, "stream": True}).encode()
    host, port = platform.http_url.removeprefix("http://").removesuffix("/v1").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while received.count(b"data: {") < 3:  # P sent the first token, D the next ones: D is decoding it
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
        assert received.startswith(b"HTTP/1.1 200"), received[:200]
    assert_pools_full(platform, timeout_s=30)
    after = aborted(platform)
    assert sum(after.values()) == sum(before.values()) + 1, (before, after)  # aborted, not run to its 1,500th token
    out = client.completions.create(model=platform.model_dir.name, prompt=PROMPTS[0], max_tokens=2, temperature=0)
    assert out.usage.completion_tokens >= 1
    with platform.router.log_path.open("rb") as log:
        log.seek(log_before)
        logged = log.read().decode(errors="replace")
    assert "Traceback" not in logged and " ERROR " not in logged, logged[-3000:]


@pytest.fixture(scope="module")
def tokenizer(platform) -> Tokenizer:
    return Tokenizer.from_pretrained(platform.model_dir)


def grpc_logprobs(address: str, top_n: int, **input_fields) -> tuple[list[int], list[pb.Logprobs]]:
    """The reference: greedy logprobs over gRPC, after one warm-up call so that every compared call finds
    the same prefix cache (and so the same route and the same float arithmetic)."""
    grpc_responses(address, logprobs=top_n, **input_fields)
    responses = grpc_responses(address, logprobs=top_n, **input_fields)
    ids, logprobs = [t for r in responses for t in r.token_ids], [lp for r in responses for lp in r.logprobs]
    assert len(ids) == len(logprobs) == responses[-1].usage.completion_tokens
    return ids, logprobs


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_logprobs_equal_grpc(platform, client, tokenizer, prompt):
    ids, expected = grpc_logprobs(platform.router.address, 3, prompt=prompt)
    texts = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    tops = [{tokenizer.decode([t.token_id], skip_special_tokens=False): t.logprob for t in lp.top} for lp in expected]
    for i, top in enumerate(tops):
        top.setdefault(texts[i], expected[i].logprob)
    kwargs = dict(model=platform.model_dir.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=3)
    got = client.completions.create(**kwargs).choices[0].logprobs
    assert got.tokens == texts and got.token_logprobs == [lp.logprob for lp in expected]
    assert got.top_logprobs == tops and all(len(lp.top) == 3 for lp in expected)
    assert got.text_offset == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    chunks = [c.choices[0].logprobs for c in client.completions.create(**kwargs, stream=True) if c.choices]
    streamed = [c for c in chunks if c is not None]
    assert [t for c in streamed for t in c.token_logprobs] == got.token_logprobs
    assert [o for c in streamed for o in c.text_offset] == got.text_offset


@pytest.mark.parametrize("messages", CHATS)
def test_chat_logprobs_equal_grpc(platform, client, tokenizer, messages):
    chat = pb.Chat(messages=[pb.ChatMessage(**m) for m in messages])
    ids, expected = grpc_logprobs(platform.router.address, 2, chat=chat)
    kwargs = dict(model=platform.model_dir.name, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                  logprobs=True, top_logprobs=2)
    content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert [c.logprob for c in content] == [lp.logprob for lp in expected]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in content] == [
        [(tokenizer.decode([t.token_id], skip_special_tokens=False), t.logprob) for t in lp.top] for lp in expected]
    stream = client.chat.completions.create(**kwargs, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(model=platform.model_dir.name, messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None  # not asked for: none
    assert_pools_full(platform)


def logged_spans(log_text: str) -> list[dict]:
    """The JSON spans the console exporter wrote among a process's log lines."""
    decoder, spans, at = json.JSONDecoder(), [], 0
    while (at := log_text.find("\n{", at)) != -1:
        try:
            span, end = decoder.raw_decode(log_text, at + 1)
        except json.JSONDecodeError:
            at += 2
            continue
        spans.append(span)
        at = end
    return [span for span in spans if isinstance(span, dict) and "context" in span]


def test_one_trace_spans_router_and_both_workers(platform):
    prompt = "A trace follows this request from the router to the prefill worker and on to the decode worker"
    final = grpc_responses(platform.router.address, prompt=prompt, request_id="traced-1")[-1]
    assert final.timings.route_kind == "remote"
    procs = [platform.router, *platform.workers]

    def spans() -> dict[str, list[dict]]:
        return {proc.name: logged_spans(proc.log_path.read_text(errors="replace")) for proc in procs}

    def root_of(found: dict[str, list[dict]]) -> dict | None:
        return next((s for s in found[platform.router.name]
                     if s["name"] == "generate" and s["attributes"].get("baton.request_id") == "traced-1"), None)

    deadline = time.monotonic() + 20
    while (root := root_of(found := spans())) is None or not all(found.values()):
        assert time.monotonic() < deadline, "spans did not reach the logs"
        time.sleep(0.2)
    trace_id = root["context"]["trace_id"]
    in_trace = {name: {s["name"]: s for s in found[name] if s["context"]["trace_id"] == trace_id} for name in found}
    router, prefill, decode = (in_trace[p.name] for p in procs)
    assert {"route", "prefill", "kv.lease", "decode", "stream"} <= set(router)
    assert {"prefill", "prefill.queue", "prefill.compute"} <= set(prefill)
    assert {"decode", "kv.transfer", "decode.first_token"} <= set(decode)
    assert prefill["prefill"]["parent_id"] == router["prefill"]["context"]["span_id"]
    assert decode["decode"]["parent_id"] == router["decode"]["context"]["span_id"]
    assert root["attributes"]["baton.queue_ms"] == final.timings.queue_ms
