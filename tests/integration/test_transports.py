"""The KV transport per worker pair, with real processes: each worker serves every transport it was
started with; a pull uses the puller's first transport the server offers (shown in the timings); a
decode worker without the deployment's data-plane secret reads nothing and recomputes locally. Every
transport a worker can be started with serves here: tcp, nccl (gloo), ucx, nixl (NIXL READs of host memory) and
auto (cma first on one host)."""

from __future__ import annotations

import grpc
import pytest

from kv_transfer.nixl import INSTALL_HINT as NIXL_HINT, installed as nixl_installed
from kv_transfer.transport import parse_kinds
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.cluster import Cluster, set_draining_seen
from tests.integration.test_e2e import (  # noqa: F401
    MAX_TOKENS, PROMPTS, _wait_serving, assert_pools_full, expected, expected_outputs, generate_output, model_dir,
)
from tests.oracle import assert_same
from tests.redis_server import RedisServer, require_redis_server

# decode worker -> (its --kv-transport, has the data-plane secret); p0 serves every transport that runs here
# (auto's, and nixl: auto offers it only for a CUDA cache)
DECODES = {"d-nccl": ("nccl,tcp", True), "d-tcp": ("tcp", True), "d-ucx": ("ucx,tcp", True), "d-auto": ("auto", True),
           "d-nosecret": ("tcp,nccl", False)}
NIXL = None if nixl_installed() else NIXL_HINT  # never imported here: the workers import it (see kv_transfer/nixl.py)
if NIXL is None:
    DECODES["d-nixl"] = ("nixl,tcp", True)
P0_KINDS = ",".join((*parse_kinds("auto"), *(() if NIXL else ("nixl",))))


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):  # noqa: F811
    require_redis_server()
    redis = RedisServer.start()
    logs = tmp_path_factory.mktemp("transport-logs")
    secret = logs / "kv.secret"
    secret.write_text("a-deployment-secret-of-32-bytes!\n")
    cluster = Cluster(redis.url, model_dir, logs)
    with_secret = ("--kv-secret-file", str(secret))
    cluster.workers = [cluster.start_worker("prefill", "--kv-transport", P0_KINDS, *with_secret, worker_id="p0")]
    for worker_id, (kinds, has_secret) in DECODES.items():
        cluster.workers.append(cluster.start_worker("decode", "--kv-transport", kinds, "--on-drain", "stay",  # only()
                                                    *(with_secret if has_secret else ()), worker_id=worker_id))
    try:
        cluster.wait_for_workers({"p0", *DECODES})
        cluster.router = cluster.start_router("--disagg-threshold-tokens", "8", "--policy", "least_loaded")
        _wait_serving(cluster.router.address)
        yield cluster
    finally:
        cluster.stop_all()
        redis.stop()


def only(cluster, decode_id: str) -> None:
    """Drain every decode worker but ``decode_id`` so the router has one choice; returns once the router routes by a
    listing that says so (``set_draining_seen``: probe requests, decoded locally)."""
    with grpc.insecure_channel(cluster.router.address) as channel:
        set_draining_seen(channel, cluster.redis_url, cluster.namespace, decode_ids=list(DECODES),
                          draining=[d for d in DECODES if d != decode_id])


def generate(cluster, prompt: list[int]) -> tuple[list[int], pb.Timings]:
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(cluster.router.address))
    params = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    responses = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params),
                                   timeout=60))
    return [t for r in responses for t in r.token_ids], responses[-1].timings


# worker processes started with each --kv-transport, serving through the router: nccl (gloo on CPU), tcp, ucx
# (ucxx over UCX's tcp), nixl (NIXL's UCX picks cma on one host), and auto, whose first kind on one host is cma
# (process_vm_readv)
@pytest.mark.parametrize("decode_id, transport", [
    ("d-nccl", "nccl"), ("d-tcp", "tcp"), ("d-ucx", "ucx"), ("d-auto", "cma"),
    pytest.param("d-nixl", "nixl", marks=pytest.mark.skipif(NIXL is not None, reason=NIXL or "")),
])
def test_the_pair_uses_the_pullers_first_transport_the_server_offers(cluster, expected_outputs, decode_id,  # noqa: F811
                                                                      transport):
    only(cluster, decode_id)
    for i in (20, 23):  # long enough to prefill remotely
        output, last = generate_output(cluster.router.address, PROMPTS[i])
        assert_same(output, expected_outputs[i], f"prompt {i} over {transport}")  # tokens and logprobs: every block
        timings = last.timings
        assert (timings.route_kind, timings.decode_worker, timings.prefill_worker) == ("remote", decode_id, "p0")
        assert timings.transport == transport and timings.transfer_bytes > 0 and not timings.local_fallback, timings
    assert_pools_full(cluster)
    admin = pb_grpc.AdminStub(grpc.insecure_channel(cluster.router.address))
    rows = {w.worker_id: w for w in admin.ListWorkers(pb.ListWorkersRequest(), timeout=10).workers}
    assert rows[decode_id].HasField("transfer_gbps") and rows[decode_id].transfer_gbps > 0  # `baton admin status`


def test_a_decode_worker_without_the_secret_reads_nothing_and_recomputes(cluster, expected):  # noqa: F811
    only(cluster, "d-nosecret")
    tokens, timings = generate(cluster, PROMPTS[21])
    assert tokens == expected[21]  # recomputed locally: the same tokens
    assert timings.transfer_bytes == 0 and "unauthenticated" in timings.route_reason, timings
    assert_pools_full(cluster)  # P's lease was released although nobody read it
