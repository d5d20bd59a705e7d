"""``baton bench trace`` end to end (slow: four platforms, about 2 minutes here): a small conversation trace the test
writes (turns that extend earlier turns, interleaved so that a small KV pool and a smaller host tier evict between
them) replayed against a real ``baton up`` per tier configuration. Every request completes in every configuration;
each request's cached tokens, as its worker reported them, are whole blocks and never more than the trace lets a
cache reuse; the tiers were used both ways (host-tier saves and loads, store writes and fetches); every output, in
every configuration, equals the offline engine's (greedy tokens and each one's log-probability: the client is
tapped to ask for them and keep them); the report, its table and its plot are written; no process is left
behind."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import bench.client
from bench import trace_replay as tr
from workload.trace import Scale, load_trace
from engine import LLM, SamplingParams
from engine.tiny import build_model
from tests.oracle import Output, assert_same
from tests.redis_server import require_redis_server

pytestmark = pytest.mark.slow


def conversation_trace(conversations: int = 8, turns: int = 3, gap_ms: int = 250) -> list[str]:
    """Conversation ``c``'s turn ``t`` is every block of its earlier turns, then 2-3 new blocks, the last one
    partial; every prompt starts with the shared block 0. Turns are interleaved: all first turns, then all
    second turns, ...; one request every ``gap_ms``."""
    lines, now = [], 0
    history = {c: [0] for c in range(conversations)}
    for t in range(turns):
        for c in range(conversations):
            new = [1000 * (c + 1) + 10 * t + i for i in range(2 + (c + t) % 2)]
            history[c] = history[c] + new
            ids = history[c]
            lines.append(json.dumps({"timestamp": now, "input_length": 512 * len(ids) - 200, "output_length": 96,
                                     "hash_ids": ids}))
            now += gap_ms
    return lines


def tap_outputs(monkeypatch) -> list[tuple[list[int], int, list[int], list[float]]]:
    """Every request the bench's gRPC client sends, asking for each token's log-probability as well: (prompt,
    max_tokens, tokens, log-probabilities), appended as each stream ends (the bench's own figures unchanged)."""
    outputs = []
    stream_generate = bench.client.stream_generate

    async def tapped(stub, request, timeout_s=None):
        request.sampling.logprobs = 0
        responses = []

        class Tap:
            def Generate(self, request, timeout=None):  # the stub's method
                async def each():
                    async for response in stub.Generate(request, timeout=timeout):
                        responses.append(response)
                        yield response
                return each()

        stream = await stream_generate(Tap(), request, timeout_s)
        outputs.append((list(request.token_ids.ids), request.sampling.max_tokens,
                        [t for r in responses for t in r.token_ids], [lp.logprob for r in responses for lp in r.logprobs]))
        return stream

    monkeypatch.setattr(bench.client, "stream_generate", tapped)
    return outputs


def assert_offline_outputs(model: Path, outputs) -> None:
    """Each distinct prompt's outputs, in every configuration, equal the offline engine's."""
    distinct = {(tuple(prompt), max_tokens): None for prompt, max_tokens, _, _ in outputs}
    llm = LLM(str(model), num_blocks=1024)
    for prompt, max_tokens in distinct:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        out = llm.generate({"prompt_token_ids": list(prompt)}, params)[0].outputs[0]
        distinct[prompt, max_tokens] = out.token_ids, [chosen for chosen, _ in out.logprobs]
    for prompt, max_tokens, tokens, logprobs in outputs:
        assert_same(Output(tokens, logprobs), Output(*distinct[tuple(prompt), max_tokens]), f"{len(prompt)}-token prompt")


def test_a_conversation_trace_replays_on_every_configuration(tmp_path, monkeypatch):
    require_redis_server()
    outputs = tap_outputs(monkeypatch)
    configs = ["none", "host", "oracle"]
    if importlib.util.find_spec("mooncake") is not None:
        configs.insert(2, "host+store")
    trace_file = tmp_path / "conversations.jsonl"
    trace_file.write_text("\n".join(conversation_trace()) + "\n")
    model = build_model("tiny", tmp_path / "tiny", train_steps=20, progress=lambda _: None)
    out = tmp_path / "out"
    argv = ["--trace", str(trace_file), "--limit", "24", "--model", str(model), "--num-blocks", "32",
            "--host-blocks", "16", "--store-memory", "64 MB", "--store-buffer-blocks", "32",
            "--configs", ",".join(configs), "--request-timeout-s", "60", "--max-run-s", "120", "--out", str(out)]
    assert tr.main(argv) == 0

    report = json.loads((out / "trace-grpc.json").read_text())
    assert [r["config"] for r in report["runs"]] == configs
    requests = tr.scaled_requests(load_trace(trace_file), Scale(length_scale=32), vocab_size=4096, max_model_len=2048)
    ceiling = tr.reusable_blocks(requests, 16)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    assert report["slice"]["ceiling_hit_rate"] == pytest.approx(sum(ceiling) * 16 / prompt_tokens)
    assert report["slice"]["working_set_blocks"] > 32  # the pool cannot hold the slice
    for run in report["runs"]:
        assert (run["completed"], run["errors"]) == (24, {}), run
        outcomes = [json.loads(line) for line in
                    (out / f"outcomes-grpc-{run['config'].replace('+', '-')}.jsonl").read_text().splitlines()]
        for o, blocks in zip(outcomes, ceiling):
            assert o["cached_tokens"] % 16 == 0 and o["cached_tokens"] <= blocks * 16, (run["config"], o)
        assert set(run["counters"]) == {"prefill-0", "decode-0"}
    runs = {r["config"]: r for r in report["runs"]}
    assert runs["oracle"]["hit_rate"] > 0  # the shared first block, at least
    total = lambda config, counter: sum(w.get(counter, 0) for w in runs[config]["counters"].values())
    # the host tier was written and read: its workers' calibration found loading a hit cheaper than recomputing
    assert total("host", "kv_host_tier_saved") > 0 and total("host", "kv_host_tier_loaded") > 0
    if "host+store" in runs:
        assert total("host+store", "kv_store_blocks_written") > 0 and total("host+store", "kv_store_blocks_fetched") > 0
    assert len(outputs) == len(configs) * (24 + 2)  # the slice and the client's two warm-up prompts, per run
    assert_offline_outputs(model, outputs)
    assert (out / "trace-grpc.png").exists()
    assert "| oracle |" in tr.table(report)
    assert not _running_with(str(model))  # every router and worker of every platform was stopped


def _running_with(word: str) -> list[str]:
    """Command lines of the processes on this machine that mention ``word``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if word in cmdline:
                out.append(cmdline)
    return out
