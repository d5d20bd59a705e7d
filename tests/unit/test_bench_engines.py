"""``bench engines``: its workload draws fresh prompts, its table takes the best run and states Baton's ratio the
right way round, the float32 GGUF it gives llama.cpp holds Baton's own numbers, and a whole run of Baton alone
works end to end (a real child process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.engines import Result, Workload, format_table, main, summarize
from bench.gguf_f32 import export_f32
from engine import LLM, SamplingParams
from engine.gguf_file import GGUFFile
from tests.gguf_writer import write_gguf

WORKLOAD = Workload(prefill=(2, 8), stream_tokens=4, batches=(1, 3), batch_shape=(5, 2), ttft=(6,), repeat=2, seed=7)


def test_every_phase_and_repetition_draws_fresh_prompts_the_same_for_every_engine():
    first, second = WORKLOAD.phases(500, 0), WORKLOAD.phases(500, 1)
    assert [p["name"] for p in first] == ["prefill", "stream", "batch1", "batch3", "ttft6"]
    assert [len(p["prompts"]) for p in first] == [2, 1, 1, 3, 1]
    assert [len(p["prompts"][0]) for p in first] == [8, 16, 5, 5, 6]
    prompts = [tuple(p) for rep in (first, second) for phase in rep for p in phase["prompts"]]
    assert len(set(prompts)) == len(prompts)  # nothing repeats: no prefix cache can help any engine
    assert first == WORKLOAD.phases(500, 0)  # seeded: every engine gets these very ids
    assert all(100 <= t < 500 for p in prompts for t in p)
    assert WORKLOAD.kv_tokens() == max(2 * 9, 3 * 7, 7)


def test_the_table_takes_each_metrics_best_run_and_gives_batons_ratio():
    def runs(scale: float) -> list[dict]:
        one = [("prefill", 1.0), ("stream", 2.0), ("batch1", 1.0), ("batch3", 3.0), ("ttft6", 0.5)]
        two = [("prefill", 2.0), ("stream", 1.0), ("batch1", 1.0), ("batch3", 2.0), ("ttft6", 1.0)]
        return [{"name": n, "seconds": s * scale, "output_tokens": 0} for n, s in one + two]

    rows = summarize([Result("Baton", "baton", "float32", False, runs=runs(1.0)),
                      Result("vLLM", "vllm", "float32", False, runs=runs(2.0))], WORKLOAD)
    baton, vllm = rows
    assert baton["prefill_tok_s"] == 16 / 1.0 and baton["stream_tok_s"] == 4 / 1.0
    assert baton["batch3_tok_s"] == 3 * 7 / 2.0 and baton["batch3_first_tok_s"] == 3 * 7 / 3.0
    assert baton["ttft6_s"] == 0.5 and vllm["ttft6_s"] == 1.0
    table = format_table(rows, WORKLOAD)
    vllm_line = next(line for line in table.splitlines() if line.startswith("| vLLM"))
    assert vllm_line.count("(Baton 2.00x)") == 5  # twice as fast on every metric, TTFT included
    assert "first batch 1 after start" in table


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_the_float32_gguf_for_llama_cpp_holds_the_numbers_baton_computes_with(tiny_checkpoints, tmp_path, qtype):
    quantized = write_gguf(tiny_checkpoints["llama"].path, tmp_path / f"llama-{qtype}.gguf", qtype)
    f32 = export_f32(quantized, tmp_path / "f32" / "llama.F32.gguf", progress=lambda _: None)
    out = GGUFFile(f32)
    assert {t.type_name for t in out.tensors} == {"F32"} and out.get("general.file_type") == 0
    assert out.config_dict() == GGUFFile(quantized).config_dict()
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompt = [5, 17, 99, 3, 250, 1, 7, 8, 9, 10]
    tokens = [LLM(str(p), num_blocks=32, block_size=4).generate([prompt], greedy)[0].outputs[0].token_ids
              for p in (quantized, f32)]
    assert tokens[0] == tokens[1]
    assert export_f32(quantized, f32) == f32  # reused once complete


def test_a_run_of_baton_alone_reports_every_phase(tiny_checkpoints, tmp_path):
    out = tmp_path / "engines.json"
    assert main(["--model", str(tiny_checkpoints["llama"].path), "--peers", "", "--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["table"]
    assert row["side"] == "Baton" and not row["error"] and row["peak_rss_mib"] > 50
    assert all(row[key] > 0 for key in ("prefill_tok_s", "stream_tok_s", "batch1_tok_s", "batch4_tok_s", "ttft64_s"))
    assert [r["output_tokens"] for r in report["results"][0]["runs"]] == [2, 16, 8, 32, 1]
    assert Path(report["args"]["out"]) == out
