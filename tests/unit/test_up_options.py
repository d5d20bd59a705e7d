"""`baton up` takes the workers' and the router's own options (each defined once, by that component's CLI) and
passes on exactly what was typed; every default stays the component's."""

from __future__ import annotations

from deploy.passthrough import argv_of
from deploy.up import _max_model_len, _parse
from worker.main import parser as worker_parser
from router.main import build_parser as router_parser, config_from_args


def flags(argv: list[str]) -> tuple[list[str], list[str]]:
    args = _parse(argv)
    return argv_of(args, args.worker_options), argv_of(args, args.router_options) + _max_model_len(args)


def test_nothing_typed_passes_nothing():
    assert flags([]) == ([], [])


def test_typed_options_reach_the_component_that_owns_them(tmp_path):
    worker, router = flags(["--kv-transport", "ucx,tcp", "--num-blocks", "512", "--kv-checksum", "--max-model-len",
                            "1024", "--policy", "round_robin", "--kv-layerwise", "--no-prefix-import",
                            "--itl-target-ms", "40", "--prefill", "2"])
    assert worker == ["--kv-transport", "ucx,tcp", "--kv-checksum", "--num-blocks", "512", "--max-model-len", "1024"]
    assert router == ["--policy", "round_robin", "--kv-layerwise", "--itl-target-ms", "40.0", "--no-prefix-import",
                      "--max-model-len", "1024"]
    parsed = worker_parser("decode").parse_args(["--redis-url", "redis://x", *worker])
    assert (parsed.kv_transport, parsed.num_blocks, parsed.kv_checksum, parsed.max_model_len) == ("ucx,tcp", 512,
                                                                                                   True, 1024)
    config = config_from_args(router_parser().parse_args(["--model", str(tmp_path), *router]))
    assert (config.policy.policy, config.kv_layerwise, config.policy.cost.prefix_import, config.max_model_len) == (
        "round_robin", True, False, 1024)
    assert config.policy.cost.itl_target_s == 0.04


def test_the_help_says_the_components_defaults():
    args = _parse([])
    by_flag = {a.option_strings[0]: a for a in (*args.worker_options, *args.router_options)}
    assert "(default: tcp)" in by_flag["--kv-transport"].help
    assert "(default: cost)" in by_flag["--policy"].help


def test_prefill_and_decode_workers_may_have_their_own_tensor_parallel_size():
    from deploy.up import role_flags

    args = _parse(["--tensor-parallel-size", "2", "--decode-tensor-parallel-size", "1"])
    worker = argv_of(args, args.worker_options)
    assert worker == ["--tensor-parallel-size", "2"]
    assert role_flags(args, "prefill") == [] and role_flags(args, "decode") == ["--tensor-parallel-size", "1"]
    decode = worker_parser("decode").parse_args(["--redis-url", "redis://x", *worker, *role_flags(args, "decode")])
    prefill = worker_parser("prefill").parse_args(["--redis-url", "redis://x", *worker, *role_flags(args, "prefill")])
    assert (prefill.tensor_parallel_size, decode.tensor_parallel_size) == (2, 1)


def test_the_index_mirror_is_on_by_default_and_its_flags_pass_through(tmp_path):
    assert config_from_args(router_parser().parse_args(["--model", str(tmp_path)])).index_mirror
    for typed, on in ((["--no-index-mirror"], False), (["--index-mirror"], True)):
        _, router = flags([*typed, "--index-mirror-max-entries", "1000", "--preselect-above", "8"])
        assert router == [*typed, "--index-mirror-max-entries", "1000", "--preselect-above", "8"]
        config = config_from_args(router_parser().parse_args(["--model", str(tmp_path), *router]))
        assert (config.index_mirror, config.index_mirror_max_entries, config.preselect.above) == (on, 1000, 8)
