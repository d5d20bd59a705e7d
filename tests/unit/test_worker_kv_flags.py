"""The worker's engine and KV data-plane flags reach its config and its transport settings (what it pulls with)."""

from __future__ import annotations

import pytest

from worker.main import parser, worker_config
from worker.config import transport_config


def config(role: str, *flags: str):
    return worker_config(role, parser(role).parse_args(["--redis-url", "redis://127.0.0.1:1/0", *flags]))


def test_defaults_advertise_what_is_served_and_pull_without_checksums():
    c = config("decode")
    assert c.kv_advertise_uri is None and c.kv_checksum is False and c.kv_io_timeout_s == 10.0
    pull = transport_config(c)
    assert pull.checksum is False and pull.io_timeout_s == 10.0


def test_flags_set_the_advertised_uri_checksums_and_the_pull_timeout():
    c = config("decode", "--kv-advertise-uri", "tcp://10.0.0.7:6000", "--kv-checksum", "--kv-io-timeout-s", "2")
    assert c.kv_advertise_uri == "tcp://10.0.0.7:6000"
    pull = transport_config(c)
    assert pull.checksum is True and pull.io_timeout_s == 2.0
    assert config("prefill", "--kv-advertise-uri", "tcp://proxy:1").kv_advertise_uri == "tcp://proxy:1"


def test_kv_transport_list_and_secret_reach_the_config(tmp_path, monkeypatch):
    monkeypatch.delenv("BATON_KV_SECRET", raising=False)
    assert config("decode").kv_transport == "tcp" and config("decode").kv_secret is None
    assert config("decode", "--kv-transport", "nccl,tcp").kv_transport == "nccl,tcp"
    secret = tmp_path / "kv.secret"
    secret.write_text("0123456789abcdef0123\n")
    c = config("decode", "--kv-secret-file", str(secret))
    assert c.kv_secret == b"0123456789abcdef0123" and "0123456789abcdef" not in repr(c)
    assert transport_config(c).secret == c.kv_secret
    monkeypatch.setenv("BATON_KV_SECRET", "from-the-environment-0123")
    assert config("prefill").kv_secret == b"from-the-environment-0123"
    with pytest.raises(ValueError, match="carrier-pigeon"):
        config("decode", "--kv-transport", "tcp,carrier-pigeon")
    secret.write_text("short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        config("decode", "--kv-secret-file", str(secret))


def test_kv_staging_flags_reach_the_config_and_bad_values_are_refused():
    assert (config("decode").kv_staging, config("decode").kv_staging_blocks) == ("auto", None)
    c = config("prefill", "--kv-staging", "always", "--kv-staging-blocks", "64")
    assert (c.kv_staging, c.kv_staging_blocks) == ("always", 64)
    with pytest.raises(ValueError, match="kv-staging-blocks"):
        config("decode", "--kv-staging-blocks", "0")
    with pytest.raises(SystemExit):  # argparse: not a mode
        config("decode", "--kv-staging", "sometimes")


def test_engine_flags_reach_the_engine_config_and_bad_graph_sizes_are_refused():
    engine = config("decode").engine
    assert (engine.attention_backend, engine.enforce_eager) == ("auto", False)
    assert engine.cuda_graph_sizes == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    engine = config("decode", "--device", "cuda:1", "--attention-backend", "torch", "--cuda-graph-sizes", "1,2,8",
                    "--enforce-eager").engine
    assert (engine.device, engine.attention_backend, engine.cuda_graph_sizes, engine.enforce_eager) == (
        "cuda:1", "torch", (1, 2, 8), True)
    assert config("decode", "--kv-host-blocks", "128").engine.kv_host_blocks == 128
    assert config("decode", "--kv-host-blocks", "8", "--preemption-mode", "swap").engine.preemption_mode == "swap"
    with pytest.raises(ValueError, match="kv_host_blocks"):  # swap needs the host tier to swap into
        config("decode", "--preemption-mode", "swap")
    spec = config("decode", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}').engine
    assert spec.speculative_config.num_speculative_tokens == 3 and config("decode").engine.speculative_config is None
    for bad in ("{", "[1]", '{"method": "eagle"}', '{"draft": 1}'):
        with pytest.raises(ValueError, match="speculative-config"):
            config("decode", "--speculative-config", bad)
    with pytest.raises(ValueError, match="kv-host-blocks"):
        config("decode", "--kv-host-blocks", "-1")
    for bad in ("0,2", "a,b", ""):
        with pytest.raises(ValueError, match="cuda-graph-sizes"):
            config("decode", "--cuda-graph-sizes", bad)


def test_store_flags_reach_the_config_with_a_write_policy_per_role():
    assert config("decode").kv_store is None and config("decode").engine.kv_store_buffer_blocks == 0
    uri = "mooncake://127.0.0.1:7000?metadata=127.0.0.1:7001"
    prefill, decode = config("prefill", "--kv-store", uri), config("decode", "--kv-store", uri)
    assert prefill.kv_store.master_address == "127.0.0.1:7000" and prefill.engine.kv_store_buffer_blocks == 64
    assert (prefill.engine.kv_store_write, decode.engine.kv_store_write) == ("evict", "evict")  # the default
    per_role = [config(role, "--kv-store", uri, "--kv-store-write", "auto") for role in ("prefill", "decode")]
    assert [c.engine.kv_store_write for c in per_role] == ["through", "evict"]  # auto: through on prefill
    chosen = config("prefill", "--kv-store", uri, "--kv-store-write", "evict", "--kv-store-buffer-blocks", "8")
    assert (chosen.engine.kv_store_write, chosen.engine.kv_store_buffer_blocks) == ("evict", 8)
    with pytest.raises(ValueError, match="metadata="):
        config("decode", "--kv-store", "mooncake://127.0.0.1:7000")
    with pytest.raises(ValueError, match="kv-store-buffer-blocks"):
        config("decode", "--kv-store", uri, "--kv-store-buffer-blocks", "0")


def test_tensor_parallel_size_reaches_the_engine_with_a_share_of_the_cores_per_rank(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert config("decode").engine.tensor_parallel_size == 1 and config("decode").engine.num_threads is None
    c = config("prefill", "--tensor-parallel-size", "2")
    assert c.engine.tensor_parallel_size == 2 and c.engine.num_threads == 4
    assert config("prefill", "--tensor-parallel-size", "2", "--num-threads", "3").engine.num_threads == 3
    with pytest.raises(ValueError, match="--kv-staging always is not combined with --tensor-parallel-size"):
        config("decode", "--tensor-parallel-size", "2", "--kv-staging", "always")


def test_heartbeat_interval_defaults_to_a_third_of_the_ttl_at_most_2_s_and_must_stay_below_the_ttl():
    assert config("decode").heartbeat_interval_s == 2.0
    assert config("decode", "--heartbeat-ttl-s", "3").heartbeat_interval_s == 1.0
    assert config("decode", "--heartbeat-interval-s", "0.25").heartbeat_interval_s == 0.25
    c = config("decode", "--heartbeat-ttl-s", "20", "--heartbeat-interval-s", "6")
    assert (c.heartbeat_ttl_s, c.heartbeat_interval_s) == (20.0, 6.0)
    for flags in (["--heartbeat-interval-s", "6"], ["--heartbeat-interval-s", "0"], ["--heartbeat-ttl-s", "0"]):
        with pytest.raises(ValueError, match="heartbeat"):
            config("decode", *flags)
