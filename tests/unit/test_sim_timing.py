"""The simulator's time model and presets, on examples computed by hand: the roofline's terms, the models' parameter
counts and KV bytes, the KV pool a GPU leaves, the measured-curve model, and the planner fed from them."""

from __future__ import annotations

import pytest

from proto import baton_pb2 as pb
from router.admin.planner import DecodeProfile, Plan, PrefillProfile
from router.admin.profile_cli import _file_format
from sim.hardware import GPUS, LINKS, MODELS, GpuSpec, ModelSpec, WorkerShape, default_tp
from sim.metrics import Slo
from sim.plan import curves_from_profile, plan_for
from sim.timing import Chunk, CurveTimeModel, Efficiency, Roofline, profiles_of
from sim.workload import SimRequest

# 2 layers, hidden 8, 2 heads + 1 KV head of dim 4, MLP 16, vocab 10: every term below is small enough to check
TOY = ModelSpec(name="toy", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                intermediate_size=16, vocab_size=10, tied_embeddings=False, max_model_len=64)
SLOW_GPU = GpuSpec(name="slow", bf16_tflops=1e-9, hbm_tb_per_s=1e-9, memory_gb=1.0)  # 1,000 FLOP/s, 1,000 B/s


@pytest.fixture
def toy() -> Roofline:
    # x2 GPUs: 2,000 FLOP/s at 50% -> 1,000 FLOP/s; 2,000 B/s at 25% -> 500 B/s
    return Roofline(SLOW_GPU, TOY, tp=2, kv_bytes_per_token=32.0,
                    efficiency=Efficiency(compute=0.5, memory=0.25, step_overhead_s=0.001))


def test_toy_shapes():
    # per layer: q 8x8 + k, v 8x4 each + o 8x8 = 192; MLP 3 x 8 x 16 = 384
    assert TOY.layer_params == 576
    assert TOY.num_params == 2 * 576 + 2 * 80 and TOY.weight_bytes == 2 * 1312
    assert TOY.kv_layout(4).bytes_per_block / 4 == 32  # K and V x 2 layers x 1 head x 4 dims x 2 bytes


def test_a_prefill_chunk_on_the_roofline(toy):
    # 3 new tokens after 2 cached: matmuls 2 x 2 x 576 x 3 = 6,912; attention pairs 3 x (2 + 4 / 2) = 12, each
    # 4 x 2 layers x 2 heads x 4 dims = 64 FLOPs -> 768; one LM-head row 2 x 80 = 160 -> 7,840 FLOPs = 7.84 s
    # bytes: weights read (2 x 576 + 80) x 2 = 2,464 + KV of 5 tokens x 32 = 160 -> 2,624 B at 500 B/s = 5.248 s
    terms = toy.terms(0, 0, [Chunk(3, 2)])
    assert terms.flops == 7840 and terms.compute_s == pytest.approx(7.84)
    assert terms.num_bytes == 2624 and terms.memory_s == pytest.approx(5.248)
    assert terms.bound == "compute" and terms.total_s == pytest.approx(7.841)
    assert toy.terms(0, 0, [Chunk(3, 2, samples=False)]).flops == 7840 - 160  # a middle chunk samples nothing


def test_a_decode_step_on_the_roofline(toy):
    # 2 sequences holding 10 KV tokens: 2,304 x 2 + 64 x 10 + 160 x 2 = 5,568 FLOPs = 5.568 s;
    # 2,464 + 32 x (10 read + 2 written) = 2,848 B = 5.696 s: memory-bound
    terms = toy.terms(2, 10)
    assert (terms.flops, terms.num_bytes) == (5568, 2848)
    assert terms.bound == "memory" and toy.step_s(2, 10) == pytest.approx(5.697)
    explained = toy.explain(2, 10)
    assert explained["bound"] == "memory" and explained["step_s"] == pytest.approx(5.697)
    assert set(explained) == {"flops", "compute_s", "bytes", "memory_s", "overhead_s", "bound", "step_s"}


def test_a_mixed_step_adds_the_chunk_to_the_batch(toy):
    mixed = toy.terms(2, 10, [Chunk(3, 2)])
    assert mixed.flops == 5568 + 7840 - 0  # the chunk's terms on top of the batch's
    assert mixed.num_bytes == 2848 + 160  # the weights once, both KV terms


def test_the_presets_match_the_published_shapes():
    # the published counts include the RMSNorm weights (2 per layer + 1, x hidden), which the roofline leaves out
    for name, published, hidden in (("llama-3-8b", 8_030_261_248, 4096), ("llama-3-70b", 70_553_706_496, 8192),
                                    ("smollm2-135m", 134_515_008, 576)):
        model = MODELS[name]
        assert model.num_params + (2 * model.num_layers + 1) * hidden == published, name
    assert MODELS["llama-3-8b"].kv_layout(16).bytes_per_block == 16 * 131_072  # 2 x 32 x 8 x 128 x 2 bytes/token
    assert MODELS["llama-3-70b"].kv_layout(16).bytes_per_block == 16 * 327_680


def test_the_kv_pool_is_what_the_gpu_leaves_beside_the_weights():
    shape = WorkerShape(gpu=GPUS["H200"], model=MODELS["llama-3-8b"], tp=1, block_size=512)
    # 141 GB x 0.9 - 16.06 GB of weights = 110.84 GB / 64 MiB per 512-token block
    assert shape.num_blocks == (int(141e9 * 0.9) - MODELS["llama-3-8b"].weight_bytes) // (512 * 131_072) == 1651
    assert default_tp(GPUS["H100"], MODELS["llama-3-70b"]) == 4  # 141 GB of weights in 0.7 x 4 x 80 GB
    assert default_tp(GPUS["H200"], MODELS["llama-3-70b"]) == 2
    assert default_tp(GPUS["H100"], MODELS["llama-3-8b"]) == 1
    with pytest.raises(ValueError, match="raise --tp"):
        WorkerShape(gpu=GPUS["H100"], model=MODELS["llama-3-70b"], tp=1, block_size=16)


def test_links():
    assert LINKS["rdma"].transfer_s(10**9) == pytest.approx(20e-6 + 1 / 50)
    assert LINKS["nvlink"].transfer_s(0) == 0.0  # nothing to pull: no round trip either
    assert LINKS["tcp"].gb_per_s < LINKS["rdma"].gb_per_s < LINKS["nvlink"].gb_per_s


def test_the_curve_model_interpolates_measured_curves():
    model = CurveTimeModel(PrefillProfile(prompt_lens=(100, 1000), tokens_per_s=(1000.0, 2000.0)),
                           DecodeProfile(batch_sizes=(1, 4), itl_s=(0.01, 0.04)))
    # a 100-token chunk over 450 cached: a 550-token prompt's rate, 1,500 tok/s; batch 2: 0.01 + 0.03 / 3
    assert model.step_s(2, 0, [Chunk(100, 450)]) == pytest.approx(100 / 1500 + 0.02)
    assert model.step_s(0, 0) == 0.0
    assert model.explain(2, 0)["decode_curve_s"] == pytest.approx(0.02)


def test_curves_of_a_modelled_worker_give_back_its_steps(toy):
    prefill, decode = profiles_of(toy, prompt_lens=(4, 8), batch_sizes=(1, 2, 4), context=6, kv_tokens=None)
    curves = CurveTimeModel(prefill, decode)
    assert curves.step_s(0, 0, [Chunk(8, 0)]) == pytest.approx(toy.step_s(0, 0, [Chunk(8, 0)]))
    assert curves.step_s(4, 0) == pytest.approx(toy.step_s(4, 24))


def test_the_file_admin_profile_writes_is_what_the_simulator_reads():
    request = pb.StoreProfileRequest(
        prefill_curve=pb.PrefillCurve(prompt_lens=[32, 64], tokens_per_s=[900.0, 1000.0]),
        decode_curve=pb.DecodeCurve(batch_sizes=[1, 2], itl_ms=[20.0, 25.0], kv_tokens_per_worker=4096))
    prefill, decode = curves_from_profile(_file_format(request))
    assert prefill == PrefillProfile(prompt_lens=(32, 64), tokens_per_s=(900.0, 1000.0))
    assert decode == DecodeProfile(batch_sizes=(1, 2), itl_s=(0.02, 0.025), kv_tokens_per_worker=4096)
    camel = {"prefill": {"promptLens": [32], "tokensPerS": [5.0]}, "decode": {"batchSizes": [1], "itlMs": [3.0]}}
    assert curves_from_profile(camel)[1].itl_s == (0.003,)
    with pytest.raises(ValueError, match="both"):
        curves_from_profile({"prefill": {}})


def test_the_real_planner_sizes_pools_for_the_workload():
    shape = WorkerShape(gpu=GPUS["H200"], model=MODELS["llama-3-8b"], tp=1, block_size=512)
    model = Roofline(shape.gpu, shape.model, kv_bytes_per_token=131_072.0)
    requests = [SimRequest(f"r{i}", i * 0.1, 8192, 256, ()) for i in range(101)]  # 10 req/s of 8k prompts
    plan, traffic = plan_for(requests, model, Slo(ttft_s=2.0, tpot_s=0.05), kv_tokens=shape.num_blocks * 512)
    assert isinstance(plan, Plan) and traffic.rate_per_s == pytest.approx(101 / 10)
    rate = 8192 / model.step_s(0, 0, [Chunk(8192, 0)])  # tokens/s of one prompt alone
    assert plan.prefill >= traffic.rate_per_s * 8192 / rate  # at least enough prefill for the load
    assert "prefill" in plan.explain() and plan.decode >= 1
