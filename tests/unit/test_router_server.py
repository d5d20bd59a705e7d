"""The router's gRPC server, in-process, against a real redis-server, with no workers registered:
validation errors name their field, Generate without workers is UNAVAILABLE, Tokenize / ModelInfo /
health / reflection answer, and the server keeps serving after every error."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine.tokenizer import Tokenizer
from kv_transfer.registry import Registry, connect
from kv_transfer.workers import WorkerInfo
from proto import baton_pb2 as pb, baton_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.server import RunningRouter, start_router
from tests.redis_server import RedisServer, require_redis_server

VOCAB_SIZE = 512
MAX_POSITIONS = 256


def make_model_folder(folder: Path) -> Path:
    """What the router reads of a checkpoint: the tiny model's tokenizer files and a config.json."""
    from engine import tiny  # torch-free: trains only the byte-level BPE

    folder.mkdir(parents=True, exist_ok=True)
    tiny.train_tokenizer(tiny.corpus_texts()[:20], VOCAB_SIZE).save(str(folder / "tokenizer.json"))
    specials = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({**specials, "chat_template": tiny.CHAT_TEMPLATE}))
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB_SIZE, "max_position_embeddings": MAX_POSITIONS}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


class LoopThread:
    """An asyncio loop in a thread: the router (and fake workers) live there; tests stay synchronous."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout_s: float = 30.0) -> Any:
        future: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    require_redis_server()
    with RedisServer.start() as server:
        yield server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_folder(tmp_path_factory.mktemp("router-model") / "tiny")


@pytest.fixture(scope="module")
def router(redis_server, model_dir) -> Iterator[tuple[LoopThread, RunningRouter]]:
    loop = LoopThread()
    config = RouterConfig(model_path=model_dir, redis_url=redis_server.url, ns="srv", host="127.0.0.1", port=0,
                          worker_list_ttl_s=0.0)
    running = loop.run(start_router(config))
    yield loop, running
    loop.run(running.stop(0.5))
    loop.close()


@pytest.fixture(scope="module")
def channel(router) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{router[1].port}") as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


def generate_error(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=10))
    return info.value


def test_generate_without_workers_is_unavailable(stub):
    error = generate_error(stub, pb.GenerateRequest(prompt="Hello"))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == "no decode workers registered"


def sampling(**fields: Any) -> pb.SamplingParams:
    message = pb.SamplingParams()
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    return message


BAD_REQUESTS = {
    "empty prompt": (pb.GenerateRequest(prompt=""), "prompt must not be empty"),
    "no input": (pb.GenerateRequest(), "input is required"),
    "max_tokens 0": (pb.GenerateRequest(prompt="hi", sampling=sampling(max_tokens=0)), "max_tokens must be >= 1"),
    "max_tokens < 0": (pb.GenerateRequest(prompt="hi", sampling=sampling(max_tokens=-3)), "max_tokens"),
    "temperature < 0": (pb.GenerateRequest(prompt="hi", sampling=sampling(temperature=-0.5)), "temperature"),
    "temperature nan": (pb.GenerateRequest(prompt="hi", sampling=sampling(temperature=float("nan"))), "temperature"),
    "top_p > 1": (pb.GenerateRequest(prompt="hi", sampling=sampling(top_p=1.5)), "top_p must be in (0, 1]"),
    "top_k < 0": (pb.GenerateRequest(prompt="hi", sampling=sampling(top_k=-1)), "top_k"),
    "min_p > 1": (pb.GenerateRequest(prompt="hi", sampling=sampling(min_p=2.0)), "min_p"),
    "presence_penalty": (pb.GenerateRequest(prompt="hi", sampling=sampling(presence_penalty=3.0)), "presence_penalty"),
    "seed too large": (pb.GenerateRequest(prompt="hi", sampling=sampling(seed=2**63)), "seed"),
    "min_tokens > max": (pb.GenerateRequest(prompt="hi", sampling=sampling(max_tokens=2, min_tokens=3)), "min_tokens"),
    "empty stop": (pb.GenerateRequest(prompt="hi", sampling=sampling(stop=[""])), "stop must be non-empty"),
    "logprobs": (pb.GenerateRequest(prompt="hi", sampling=sampling(logprobs=99)), "logprobs"),
    "prompt too long": (pb.GenerateRequest(prompt="word " * 400), "shorter than max_model_len (256)"),
    "token ids too long": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 256)), "token_ids has 256 tokens"),
    "token id out of range": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, VOCAB_SIZE])), "token_ids must be in"),
    "negative token id": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[-1])), "token_ids must be in"),
    "empty token ids": (pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids must not be empty"),
    "unknown model": (pb.GenerateRequest(prompt="hi", model="gpt-5"), "model 'gpt-5' is not served here"),
    "empty chat": (pb.GenerateRequest(chat=pb.Chat()), "chat.messages must not be empty"),
    "bad chat role": (
        pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="robot", content="hi")])),
        "roles must be system, user or assistant",
    ),
    "request id too long": (pb.GenerateRequest(prompt="hi", request_id="x" * 200), "request_id must be at most"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_naming_the_field(stub, case):
    request, fragment = BAD_REQUESTS[case]
    error = generate_error(stub, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert fragment in error.details()


def test_server_keeps_serving_after_errors(stub, tokenizer):
    for _ in range(3):
        generate_error(stub, pb.GenerateRequest(prompt=""))
    assert list(stub.Tokenize(pb.TokenizeRequest(prompt="still here")).token_ids) == tokenizer.encode("still here")


def test_tokenize_prompt_and_chat(stub, tokenizer):
    assert list(stub.Tokenize(pb.TokenizeRequest(prompt="def f(x):")).token_ids) == tokenizer.encode("def f(x):")
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi there")])
    expected = tokenizer.encode_chat([{"role": "user", "content": "hi there"}])
    assert list(stub.Tokenize(pb.TokenizeRequest(chat=chat)).token_ids) == expected
    with pytest.raises(grpc.RpcError) as info:
        stub.Tokenize(pb.TokenizeRequest(prompt=""))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_model_info_without_and_with_a_registered_worker(stub, router, redis_server):
    info = stub.ModelInfo(pb.ModelInfoRequest())
    assert (info.model, info.architecture, info.max_model_len, info.vocab_size) == (
        "tiny", "LlamaForCausalLM", MAX_POSITIONS, VOCAB_SIZE)
    assert info.block_size == 0 and info.model_fingerprint == b""

    async def register() -> None:
        redis = connect(redis_server.url)
        worker = WorkerInfo(worker_id="d9", role="decode", grpc_address="127.0.0.1:1", kv_uri="tcp://127.0.0.1:2",
                            model_fingerprint="0f" * 16, layout_json='{"block_size": 8}', total_blocks=10)
        await Registry(redis, "srv").register(worker)
        await redis.aclose()

    async def deregister() -> None:
        redis = connect(redis_server.url)
        await Registry(redis, "srv").deregister("d9")
        await redis.aclose()

    loop = router[0]
    loop.run(register())
    try:
        info = stub.ModelInfo(pb.ModelInfoRequest())
        assert info.block_size == 8 and info.model_fingerprint == bytes.fromhex("0f" * 16)
    finally:
        loop.run(deregister())


def test_health_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "baton.v1.Generation"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = list(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"baton.v1.Generation", "grpc.health.v1.Health"} <= names


def test_generate_cli_says_what_went_wrong(router):
    import io

    from router import generate_cli

    out, err = io.StringIO(), io.StringIO()
    assert generate_cli.main(["Hello", "--router", f"127.0.0.1:{router[1].port}"], out=out, err=err) == 1
    assert "baton generate: error: UNAVAILABLE: no decode workers registered" in err.getvalue()
    assert generate_cli.main(["Hello", "--router", f"127.0.0.1:{router[1].port}", "--max-tokens", "0"],
                             out=out, err=err) == 1
    assert "INVALID_ARGUMENT: max_tokens must be >= 1, got 0" in err.getvalue()
