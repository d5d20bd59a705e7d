"""Bad input against one real cluster (redis-server, router, 1 prefill, 1 decode on the tiny model).

Random and extreme GenerateRequests, malformed protobuf bytes on the router's and workers' gRPC methods,
garbage on a worker's KV data-plane port and Decode calls carrying bogus KV handles: every call ends in a
stream or a clean status (never INTERNAL/UNKNOWN, never a hang), no process dies, every block pool comes
back full, and a normal request still returns the offline engine's tokens and logprobs (tests/oracle.py: a KV block
the garbage reached would move a logprob, seldom a token)."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import uuid

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_transfer.registry import Registry, connect
from kv_transfer.tcp_wire import HEADER, HELLO, MAGIC, READ, VERSION, encode_frame
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from tests.integration.test_e2e import assert_pools_full, generate_output, start_cluster
from tests.oracle import Output, assert_same, reference, streamed
from tests.tiny_model import shared_tiny

PROMPT = [(5 * j) % 3000 + 10 for j in range(37)]  # over the 8-token threshold: prefilled remotely
MAX_TOKENS = 8
VOCAB = 4096
CALL_TIMEOUT_S = 8.0
CLEAN = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
         grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE}
INT32 = st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31)]))
FLOAT = st.one_of(st.floats(width=32), st.sampled_from([0.0, -0.0, 1.0, 0.5, 2.0, -2.0]))
TEXT = st.text(st.characters(codec="utf-8"), max_size=40)
CONTROL = st.text(st.characters(categories=["Cc"]), min_size=1, max_size=20)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return shared_tiny(tmp_path_factory)


@pytest.fixture(scope="module")
def expected(model_dir) -> Output:
    """The offline engine's greedy tokens for PROMPT and their logprobs."""
    return reference(model_dir, [PROMPT], MAX_TOKENS)[0]


@pytest.fixture(scope="module")
def platform(model_dir, tmp_path_factory):
    cluster, redis = start_cluster(model_dir, tmp_path_factory.mktemp("logs"), prefill=1, decode=1)
    cluster.infos = {info.worker_id: info for info in asyncio.run(_list_workers(cluster))}
    yield cluster
    cluster.stop_all()
    redis.stop()


async def _list_workers(cluster):
    redis = connect(cluster.redis_url)
    try:
        return [info for info, _ in await Registry(redis, cluster.namespace).list_workers()]
    finally:
        await redis.aclose()


def _assert_alive(cluster) -> None:
    for proc in [*cluster.workers, cluster.router]:
        assert proc.popen.poll() is None, f"{proc.name} died:\n{proc.log()}"


# ---- (1) random GenerateRequests through the router ------------------------------------------------

def _sampling(draw) -> pb.SamplingParams:
    """Half the time every field is extreme; otherwise mostly in range, so streams run too."""
    wild = draw(st.booleans())
    msg = pb.SamplingParams(ignore_eos=draw(st.booleans()))
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if draw(st.booleans()):
            setattr(msg, name, draw(FLOAT if wild else st.floats(0.125, 1.0, width=32)))
    for name in ("top_k", "min_tokens", "logprobs"):
        if draw(st.booleans()):
            setattr(msg, name, draw(INT32 if wild else st.integers(0, 3)))
    if draw(st.booleans()):
        msg.seed = draw(st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 2**63 - 1, 2**63, 2**64 - 1])))
    if draw(st.booleans()):
        msg.max_tokens = draw(st.one_of(st.integers(1, 6), INT32))
    msg.stop_token_ids.extend(draw(st.lists(INT32 if wild else st.integers(0, VOCAB - 1), max_size=4)))
    msg.stop.extend(draw(st.lists(st.one_of(TEXT, CONTROL) if wild else CONTROL, max_size=3)))
    return msg


def _huge_text(draw) -> str:
    return draw(st.one_of(TEXT, CONTROL)) * draw(st.integers(1, 5000))


def _input(draw, request: pb.GenerateRequest) -> None:
    kind = draw(st.sampled_from(["prompt", "huge", "control", "token_ids", "chat", "none"]))
    if kind == "prompt":
        request.prompt = draw(TEXT)
    elif kind == "huge":
        request.prompt = _huge_text(draw)[:100_000]
    elif kind == "control":
        request.prompt = draw(CONTROL)
    elif kind == "token_ids":
        ids = draw(st.lists(st.one_of(st.integers(0, VOCAB - 1), INT32), max_size=64))
        request.token_ids.ids.extend(ids * draw(st.sampled_from([1, 1, 1, 40])))  # some past max_model_len
        request.token_ids.SetInParent()
    elif kind == "chat":
        for role, content in draw(st.lists(st.tuples(st.one_of(TEXT, st.sampled_from(["user", "system"])),
                                                     st.one_of(TEXT, CONTROL)), max_size=4)):
            request.chat.messages.add(role=role, content=content)
        request.chat.SetInParent()


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), TEXT, st.text(max_size=2).map(lambda s: s * 400))),
        cache_salt=draw(st.one_of(st.just(""), TEXT)), priority=draw(INT32),
        model=draw(st.one_of(st.just(""), st.just(""), TEXT)),
    )
    _input(draw, request)
    if draw(st.booleans()):
        request.sampling.CopyFrom(_sampling(draw))
    return request


def _check_stream(stub, request: pb.GenerateRequest) -> None:
    try:
        responses = list(stub.Generate(request, timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as exc:
        assert exc.code() in CLEAN and exc.details(), f"{exc.code()} {exc.details()!r} for {request!r:.600}"
        return
    assert responses and responses[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED, f"{request!r:.600}"
    assert all(0 <= t < VOCAB for r in responses for t in r.token_ids)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=generate_requests())
def test_random_generate_requests_end_in_a_stream_or_a_clean_status(platform, request):
    _check_stream(pb_grpc.GenerationStub(grpc.insecure_channel(platform.router.address)), request)


# ---- (2) malformed protobuf bytes on the gRPC methods ----------------------------------------------

def _garbage(rng: random.Random) -> list[bytes]:
    fixed = [b"\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05ab", b"\x08" + b"\x80" * 11, b"\x07", b"\x0b\x0c"]
    return fixed + [rng.randbytes(rng.randint(1, 300)) for _ in range(20)]


def _raw_call(channel, method: str, payload: bytes, streaming: bool) -> list[bytes] | None:
    make = channel.unary_stream if streaming else channel.unary_unary
    call = make(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        out = call(payload, timeout=CALL_TIMEOUT_S)
        return list(out) if streaming else [out]
    except grpc.RpcError as exc:
        # corrupt bytes: INVALID_ARGUMENT from proto.malformed (grpc alone would answer UNKNOWN)
        assert exc.code() in CLEAN, f"{method}: {exc.code()} {exc.details()!r} for {payload!r}"
        return None


@pytest.mark.parametrize("target, method, streaming", [
    ("router", "/baton.v1.Generation/Generate", True),
    ("router", "/baton.v1.Generation/Tokenize", False),
    ("prefill", "/baton.v1.Worker/Prefill", False),
    ("decode", "/baton.v1.Worker/Decode", True),
])
def test_malformed_protobuf_bytes_get_a_clean_status(platform, target, method, streaming):
    address = {"router": platform.router, "prefill": platform.workers[0], "decode": platform.workers[1]}[target]
    channel = grpc.insecure_channel(address.address)
    for payload in _garbage(random.Random(method)):
        out = _raw_call(channel, method, payload, streaming)
        if out and method.endswith("Prefill"):  # bytes that parsed into a real prefill: free its lease
            lease = pb.PrefillResponse.FromString(out[0]).handle.lease_id
            pb_grpc.WorkerStub(channel).ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease))
    _assert_alive(platform)
    assert_pools_full(platform)


# ---- (3) garbage on the KV data plane ----------------------------------------------------------------

def _kv_address(uri: str) -> tuple[str, int]:
    host, port = uri.removeprefix("tcp://").rsplit(":", 1)
    return host.strip("[]"), int(port)


def _send_and_drain(address: tuple[str, int], payload: bytes) -> bytes:
    """Send ``payload``, half-close, read whatever comes back until the server closes (bounded)."""
    with socket.create_connection(address, timeout=5) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except (ConnectionResetError, TimeoutError, socket.timeout):
            pass
        return received


def _kv_payloads(layout_json: str, rng: random.Random) -> list[bytes]:
    hello = encode_frame(HELLO, layout_json.encode())
    read = struct.pack("<H4sI2I", 4, b"nope", 2, 0, 1)
    return [
        b"", rng.randbytes(7), rng.randbytes(4096), b"GET / HTTP/1.1\r\n\r\n",
        HEADER.pack(MAGIC, VERSION, HELLO, 0, 1 << 31),  # oversized control frame
        HEADER.pack(MAGIC, 99, HELLO, 0, 0),  # unknown version
        HEADER.pack(MAGIC, VERSION, HELLO, 0, 100) + b"{",  # truncated payload
        encode_frame(HELLO, b"\xff\xfe not json"), encode_frame(HELLO, b'{"dtype": 5}'),
        encode_frame(READ, read),  # READ before HELLO
        hello,  # HELLO, then silence
        hello + encode_frame(HELLO, layout_json.encode()),  # HELLO twice
        hello + encode_frame(READ, b"\x01"),  # truncated READ
        hello + encode_frame(READ, struct.pack("<H", 60000) + b"x" * 10),  # lease length past the end
        hello + encode_frame(READ, struct.pack("<H2sI", 2, b"\xff\xfe", 0)),  # lease id not UTF-8
        hello + encode_frame(READ, read),  # unknown lease
        hello + encode_frame(READ, struct.pack("<H4sI", 4, b"nope", 1 << 30)),  # count past the end
        hello + encode_frame(READ, read)[:-3],  # truncated frame
    ]


def test_garbage_on_the_kv_data_plane_leaves_it_serving(platform, expected):
    for info in platform.infos.values():
        address = _kv_address(info.kv_uri)
        for payload in _kv_payloads(info.layout_json, random.Random(info.worker_id)):
            reply = _send_and_drain(address, payload)
            assert not reply or reply[:4] == MAGIC, f"{info.worker_id}: {reply[:64]!r} for {payload[:64]!r}"
            assert b"DATA" not in reply
    _assert_alive(platform)
    output, last = generate_output(platform.router.address, PROMPT, max_tokens=MAX_TOKENS, timeout=30)
    assert_same(output, expected, "after the garbage")
    assert last.timings.route_kind == "remote" and last.timings.transfer_blocks > 0, last.timings
    assert_pools_full(platform)


# ---- (4) Decode with a bogus KV handle -----------------------------------------------------------------

def _layout(platform, **changes) -> pb.KVLayout:
    doc = json.loads(platform.infos["p0"].layout_json)
    doc["model_fingerprint"] = bytes.fromhex(doc["model_fingerprint"])
    return pb.KVLayout(**{**doc, **changes})


def _bogus_handles(platform) -> list[tuple[str, pb.KVHandle]]:
    uri, n = platform.infos["p0"].kv_uri, (len(PROMPT) + 3) // 4
    base = dict(worker_id="p0", data_plane_uri=uri, num_tokens=len(PROMPT), layout=_layout(platform))
    return [
        ("random lease", pb.KVHandle(**base, lease_id=uuid.uuid4().hex, block_ids=range(n))),
        ("empty lease", pb.KVHandle(**base, lease_id="", block_ids=range(n))),
        ("huge lease", pb.KVHandle(**base, lease_id="x" * 5000, block_ids=range(n))),
        ("out-of-range ids", pb.KVHandle(**base, lease_id="l", block_ids=[10**9 + i for i in range(n)])),
        ("negative ids", pb.KVHandle(**base, lease_id="l", block_ids=[-1] * n)),
        ("no block ids", pb.KVHandle(**base, lease_id="l")),
        ("too few ids", pb.KVHandle(**base, lease_id="l", block_ids=[0])),
        ("too many ids", pb.KVHandle(**base, lease_id="l", block_ids=range(n + 50))),
        ("closed port", pb.KVHandle(**{**base, "data_plane_uri": "tcp://127.0.0.1:1"}, lease_id="l",
                                    block_ids=range(n))),
        ("bad scheme", pb.KVHandle(**{**base, "data_plane_uri": "bogus://x"}, lease_id="l", block_ids=range(n))),
        ("no uri", pb.KVHandle(**{**base, "data_plane_uri": ""}, lease_id="l", block_ids=range(n))),
        ("wrong head_dim", pb.KVHandle(**{**base, "layout": _layout(platform, head_dim=7)}, lease_id="l",
                                       block_ids=range(n))),
        ("zero block size", pb.KVHandle(**{**base, "layout": _layout(platform, block_size=0)}, lease_id="l",
                                        block_ids=range(n))),
        ("empty layout", pb.KVHandle(**{**base, "layout": pb.KVLayout()}, lease_id="l", block_ids=range(n))),
    ]


@pytest.mark.parametrize("with_first_token", [True, False])
def test_decode_with_a_bogus_handle_recomputes_or_fails_cleanly(platform, expected, with_first_token):
    stub = pb_grpc.WorkerStub(grpc.insecure_channel(platform.workers[1].address))
    outputs = expected.tokens[:1] if with_first_token else []
    sampling = pb.SamplingParams(temperature=0.0, top_p=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=0,
                                 logprobs=0)
    for name, handle in _bogus_handles(platform):
        request = pb.DecodeRequest(request_id=f"bogus-{uuid.uuid4().hex}", token_ids=[*PROMPT, *outputs],
                                   sampling=sampling, handle=handle, prompt_len=len(PROMPT),
                                   num_output_tokens_so_far=len(outputs))
        try:
            responses = list(stub.Decode(request, timeout=30))
        except grpc.RpcError as exc:
            assert exc.code() in CLEAN and exc.details(), f"{name}: {exc.code()} {exc.details()!r}"
            continue
        assert_same(streamed(responses), expected[len(outputs):], f"{name}: {responses[0].timings.route_reason}")
        assert responses[0].timings.route_reason, name  # says why it recomputed locally
    _assert_alive(platform)
    assert_pools_full(platform)


# ---- afterwards --------------------------------------------------------------------------------------

def test_after_the_fuzzing_every_process_serves_and_every_pool_is_full(platform, expected):
    _assert_alive(platform)
    assert_pools_full(platform)
    output, last = generate_output(platform.router.address, PROMPT, max_tokens=MAX_TOKENS, timeout=30)
    assert_same(output, expected, "after the fuzzing")
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert_pools_full(platform)
    for proc in [*platform.workers, platform.router]:
        log = proc.log_path.read_text(errors="replace")
        assert "Task exception was never retrieved" not in log and "internal error" not in log, proc.name


def test_corrupt_bytes_are_invalid_argument(platform):
    for address in (platform.router.address, platform.workers[0].address):
        with grpc.insecure_channel(address) as channel:
            method = "/baton.v1.Generation/Generate" if address == platform.router.address else "/baton.v1.Worker/Prefill"
            streaming = method.endswith("Generate")
            make = channel.unary_stream if streaming else channel.unary_unary
            call = make(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as info:
                out = call(b"\xff", timeout=CALL_TIMEOUT_S)
                list(out) if streaming else out
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed request" in info.value.details()
