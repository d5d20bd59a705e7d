"""Redis AUTH and TLS against a real ``redis-server``: the right password works, a wrong or missing one
stops the router and workers at start with a clear error that never shows the password; ``rediss://``
verifies the server's certificate."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from kv_transfer.registry import RedisCredentialsError, Registry, check_credentials, connect, redact_url, with_ca
from kv_transfer.workers import WorkerInfo
from tests.redis_server import RedisServer, RedisTls, require_redis_server
from tests.tls_certs import make_pki

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "s3cret-P4ss/word"  # a slash: URL-quoted in the URL
QUOTED = "s3cret-P4ss%2Fword"


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://:hunter2@10.0.0.1:6379/0", "redis://:***@10.0.0.1:6379/0"),
    ("redis://baton:hunter2@redis:6379/1", "redis://baton:***@redis:6379/1"),
    ("rediss://:hunter2@r:6380/0?ssl_ca_certs=/ca.pem", "rediss://:***@r:6380/0?ssl_ca_certs=/ca.pem"),
    ("redis://r:6379/0?password=hunter2&db=1", "redis://r:6379/0?password=***&db=1"),
    ("redis://user@r:6379", "redis://user@r:6379"),
])
def test_redact_url_hides_every_password(url, shown):
    assert redact_url(url) == shown
    assert "hunter2" not in redact_url(url)


def test_with_ca_adds_the_ca_to_rediss_urls_only():
    assert with_ca("rediss://:p@r:6380/0", "/etc/ca.pem") == "rediss://:p@r:6380/0?ssl_ca_certs=%2Fetc%2Fca.pem"
    assert (with_ca("rediss://r/0?ssl_cert_reqs=required", "/c.pem")
            == "rediss://r/0?ssl_cert_reqs=required&ssl_ca_certs=%2Fc.pem")
    assert with_ca("rediss://r/0?ssl_ca_certs=/mine.pem", "/c.pem") == "rediss://r/0?ssl_ca_certs=/mine.pem"
    assert with_ca("redis://r/0", "/c.pem") == "redis://r/0"
    assert with_ca("rediss://r/0", None) == "rediss://r/0"


def test_a_bad_url_error_does_not_show_the_password():
    with pytest.raises(ValueError) as caught:
        connect("http://:hunter2@r:6379/0")
    assert "hunter2" not in str(caught.value) and "***" in str(caught.value)


@pytest.fixture(scope="module")
def protected_redis():
    require_redis_server()
    with RedisServer.start(password=PASSWORD) as server:
        yield server


async def _check(url: str) -> bool:
    redis = connect(url)
    try:
        return await check_credentials(redis, url)
    finally:
        await redis.aclose()


def _worker(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="decode", grpc_address="127.0.0.1:1", kv_uri="tcp://127.0.0.1:2",
                      model_fingerprint="ab", layout_json="{}", total_blocks=8)


def test_the_right_password_works(protected_redis):
    assert QUOTED in protected_redis.url

    async def scenario() -> list[str]:
        redis = connect(protected_redis.url)
        try:
            assert await check_credentials(redis, protected_redis.url)
            registry = Registry(redis, "auth-test")
            await registry.register(_worker("w1"))
            return [info.worker_id for info, _ in await registry.list_workers()]
        finally:
            await redis.aclose()

    assert asyncio.run(scenario()) == ["w1"]
    # the ACL form names the default user explicitly
    assert asyncio.run(_check(f"redis://default:{QUOTED}@127.0.0.1:{protected_redis.port}/0"))


@pytest.mark.parametrize("auth", [":wrong-pass@", "", "nobody:wrong-pass@"], ids=["wrong", "missing", "acl-user"])
def test_a_wrong_or_missing_password_is_a_clear_redacted_error(protected_redis, auth):
    url = f"redis://{auth}127.0.0.1:{protected_redis.port}/0"
    with pytest.raises(RedisCredentialsError) as caught:
        asyncio.run(_check(url))
    message = str(caught.value)
    assert f"127.0.0.1:{protected_redis.port}" in message and "refused the credentials" in message
    assert "wrong-pass" not in message and PASSWORD not in message


def test_a_password_redis_does_not_require_is_accepted():
    require_redis_server()
    with RedisServer.start() as server:  # no requirepass: redis-py's AUTH fallback connects anyway
        assert asyncio.run(_check(f"redis://:unneeded-pass@127.0.0.1:{server.port}/0"))


def test_an_unreachable_redis_is_not_a_credentials_error():
    from tests.redis_server import free_port

    assert asyncio.run(_check(f"redis://:pw@127.0.0.1:{free_port()}/0")) is False


def _cli(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_router_and_worker_stop_at_start_on_a_wrong_password(protected_redis, tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")  # the credentials are checked before the model is read
    url = f"redis://:wrong-pass@127.0.0.1:{protected_redis.port}/0"
    router = _cli("router.main", "--redis-url", url, "--model", str(tmp_path), "--port", "0", "--http-port", "0",
                  "--metrics-port", "0")
    worker = _cli("deploy.cli", "decode", "--redis-url", url, "--model", str(tmp_path), "--metrics-port", "0",
                  "--num-threads", "1")
    for name, result in (("router", router), ("worker", worker)):
        output = result.stdout + result.stderr
        assert result.returncode == 1, f"{name}: {output[-2000:]}"
        assert "refused the credentials" in output and "redis://:***@" in output, f"{name}: {output[-2000:]}"
        assert "wrong-pass" not in output and "Traceback" not in output, f"{name}: {output[-2000:]}"


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    require_redis_server()
    pki = make_pki(tmp_path_factory.mktemp("redis-pki"))
    try:
        server = RedisServer.start(password=PASSWORD, tls=RedisTls(pki.node_a.cert, pki.node_a.key, pki.ca_a))
    except RuntimeError as exc:  # a redis-server built without TLS says so in its log
        pytest.skip(f"this redis-server cannot serve TLS: {exc}")
    with server:
        yield server, pki


def test_rediss_with_the_ca_works_and_without_it_fails_verification(tls_redis):
    server, pki = tls_redis
    assert server.url.startswith("rediss://") and asyncio.run(_check(server.url))
    bare = f"rediss://:{QUOTED}@127.0.0.1:{server.port}/0"
    assert asyncio.run(_check(with_ca(bare, str(pki.ca_a))))  # what $BATON_REDIS_CA does
    with pytest.raises(RedisCredentialsError) as caught:  # the system roots do not know the test CA
        asyncio.run(_check(bare))
    assert "TLS to Redis" in str(caught.value) and PASSWORD not in str(caught.value)
    with pytest.raises(RedisCredentialsError):  # a server certificate from another CA
        asyncio.run(_check(with_ca(bare, str(pki.ca_b))))
