"""`baton admin profile` against a real tiny platform (redis, router, 1 prefill + 1 decode worker): it stores
well-formed curves in Redis and writes the same to -o; `plan` (no --profile) then uses them."""

from __future__ import annotations

import io
import json

import pytest
import redis as redis_lib

from router.admin import cli as admin_cli
from tests.integration.test_e2e import start_cluster
from tests.tiny_model import shared_tiny


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model_dir = shared_tiny(tmp_path_factory)
    cluster, redis = start_cluster(model_dir, tmp_path_factory.mktemp("logs"), prefill=1, decode=1)
    yield cluster
    cluster.stop_all()
    redis.stop()


def admin(cluster, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = admin_cli.main(["--router", cluster.router.address, "--timeout", "30", *argv], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_profile_stores_well_formed_curves_that_plan_uses(cluster, tmp_path, capsys):
    path = tmp_path / "profile.json"
    code, out, err = admin(cluster, "profile", "-o", str(path), "--prompt-lens", "16,64,128", "--batch-sizes",
                           "1,2,4", "--contexts", "16,64", "--decode-tokens", "8", "--repeats", "2")
    assert code == 0, err
    progress = capsys.readouterr().err
    assert "profiling prefill worker p0" in progress and "profiling decode worker d0" in progress
    assert "prefill [3/3] 128 tokens" in progress and "decode [6/6] batch 4 at context 64" in progress
    client = redis_lib.Redis.from_url(cluster.redis_url, decode_responses=True)
    prefill = json.loads(client.get("baton:profile:prefill"))
    decode = json.loads(client.get("baton:profile:decode"))
    client.close()
    assert prefill["prompt_lens"] == [16, 64, 128] and all(r > 0 for r in prefill["tokens_per_s"])
    assert decode["batch_sizes"] == [1, 2, 4] and decode["context_lens"] == [16, 64]
    assert len(decode["itl_ms_grid"]) == 6 and all(x > 0 for x in decode["itl_ms_grid"])
    for row in (decode["itl_ms_grid"][:3], decode["itl_ms_grid"][3:]):
        assert row == sorted(row)  # ITL never decreases with batch size
    assert decode["itl_ms"] == decode["itl_ms_grid"][3:] and decode["kv_tokens_per_worker"] == 256 * 4
    assert prefill["measured_on"] == decode["measured_on"] == "p0,d0"
    written = json.loads(path.read_text())
    assert written["prefill"]["tokens_per_s"] == prefill["tokens_per_s"]
    assert written["decode"]["itl_ms_grid"] == decode["itl_ms_grid"]
    assert written["decode"]["kv_tokens_per_worker"] == 1024
    code, out, err = admin(cluster, "--json", "plan", "--ttft-p90", "1000", "--itl-p90", "1000", "--rate", "1",
                           "--isl", "64", "--osl", "8", "--profile", str(path))
    assert code == 0, err

    # plan picks up the stored profile: its prefill throughput at isl 64 is the measured one
    code, out, err = admin(cluster, "--json", "plan", "--ttft-p90", "1000", "--itl-p90", "1000", "--rate", "1",
                           "--isl", "64", "--osl", "8")
    assert code == 0, err
    terms = {(t["pool"], t["name"]): t["value"] for t in json.loads(out)["terms"]}
    assert terms[("prefill", "throughput at isl")] == pytest.approx(prefill["tokens_per_s"][1])
    assert terms[("decode", "batch by KV capacity")] == pytest.approx(1024 / 72)


def test_profile_of_an_unknown_worker_fails_clearly(cluster):
    code, out, err = admin(cluster, "profile", "--worker", "ghost")
    assert code == 1 and out == "" and "no live worker ghost" in err
