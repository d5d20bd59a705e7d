"""The offline API end to end on the project's own tiny checkpoint: text in, text out, typed errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequest
from tests.tiny_model import shared_tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # A briefly trained tiny model: same architecture and tokenizer as `baton model tiny`, built fast.
    return shared_tiny(tmp_path_factory)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), num_blocks=256, max_num_seqs=8)


@pytest.fixture(autouse=True)
def pool_returns_to_full(request):
    yield
    if "llm" in request.fixturenames:
        pool = request.getfixturevalue("llm").engine.kv_cache_manager.pool
        pool.check_invariants()
        assert pool.num_free_blocks == pool.num_blocks


def test_text_prompts_stream_into_the_decoded_text(llm):
    outs = llm.generate(["def main():", "import os\n"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for out in outs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == 12 and completion.finish_reason == "length"
        assert completion.text == llm.tokenizer.decode(completion.token_ids)
        assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt)


def test_stop_string_truncates_and_finishes_with_stop(llm):
    free_run = llm.generate("def main():", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    text = free_run.outputs[0].text
    stop = text[5:8]  # a string the greedy run is known to produce
    assert len(stop) == 3, text
    out = llm.generate("def main():", SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]


def test_seeded_sampling_ignores_batch_composition(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate("class A:", params)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, seed=s, max_tokens=9, ignore_eos=True) for s in range(3)]
    batch = llm.generate(["x = 1", "class A:", "def f(", "import re"], [others[0], params, others[1], others[2]])
    assert batch[1].outputs[0].token_ids == alone
    unseeded = llm.generate(["class A:"] * 2, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True))
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids  # fresh seeds differ


def test_logprobs_are_returned_per_token(llm):
    out = llm.generate("def f(", SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 5
    for token, (chosen, top) in zip(completion.token_ids, completion.logprobs):
        assert len(top) == 3 and top[0][0] == token  # greedy: the sampled token is the top-1
        assert chosen == pytest.approx(top[0][1]) and chosen <= 0
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", SamplingParams(), "prompt must not be empty"),
        ([], SamplingParams(), "prompt must not be empty"),
        ([5] * 5000, SamplingParams(), "max_model_len"),
        ([10**6], SamplingParams(), "prompt token ids must be in"),
    ],
)
def test_bad_input_raises_typed_errors(llm, prompt, params, message):
    with pytest.raises(InvalidRequest, match=message):
        llm.generate([prompt], params)
    assert not llm.engine.has_unfinished()


def _greedy(llm, prompt, max_tokens, **params):
    run = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
    return llm.generate(prompt, run)[0].outputs[0]


def test_a_stop_string_the_final_token_completes_is_cut_and_finishes_with_stop(llm):
    free = _greedy(llm, "def main():", 12)
    text = free.text
    last = llm.tokenizer.decode(free.token_ids[-1:])
    # the longest proper suffix that occurs nowhere earlier: only the final token completes it
    stop = next(text[k:] for k in range(1, len(text)) if text.find(text[k:]) == k)
    assert last and len(stop) > len(last), (text, last)
    out = _greedy(llm, "def main():", 12, stop=[stop])
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == text[: -len(stop)] and out.token_ids == free.token_ids


def test_text_held_back_for_a_stop_string_that_never_completes_is_flushed_at_the_end(llm):
    text = _greedy(llm, "def main():", 12).text
    out = _greedy(llm, "def main():", 12, stop=[text[-2:] + "\x00never"])  # the text ends with its prefix
    assert (out.text, out.finish_reason) == (text, "length")


def test_an_interrupted_generate_aborts_its_requests_and_the_next_call_works(llm):
    def interrupt(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.generate(["def main():", "import os"], SamplingParams(temperature=0, max_tokens=20), progress=interrupt)
    assert not llm.engine.has_unfinished()
    assert len(_greedy(llm, "x = 1", 4).token_ids) == 4


def test_vllm_prompt_dicts_are_accepted(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = llm.tokenizer.encode("def main():")
    plain = llm.generate("def main():", params)[0]
    as_dicts = llm.generate([{"prompt": "def main():"}, {"prompt_token_ids": ids}, ids], params)
    assert [o.outputs[0].token_ids for o in as_dicts] == [plain.outputs[0].token_ids] * 3
    assert as_dicts[0].prompt == "def main():" and as_dicts[1].prompt is None
    assert llm.generate({"prompt_token_ids": ids}, params)[0].prompt_token_ids == ids


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (3.5, "got a float"),
        ([1.5, 2], "got a list of float, int"),
        ({"prompt": 5}, "'prompt' must be a str, got a int"),
        ({"prompt_token_ids": "abc"}, "'prompt_token_ids' must be a list of ints, got a str"),
        ({"text": "hi"}, "unsupported keys \\['text'\\]"),
        (None, "got a NoneType"),
    ],
)
def test_a_prompt_of_another_type_is_refused_naming_it(llm, prompt, message):
    with pytest.raises(InvalidRequest, match=message):
        llm.generate([prompt], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("field", [dict(max_tokens=0), dict(max_tokens=-1), dict(top_p=0.0), dict(top_p=1.5),
                                   dict(temperature=-0.5)])
def test_bad_sampling_values_name_the_field(field):
    with pytest.raises(InvalidRequest, match=next(iter(field))):
        SamplingParams(**field)


def test_demo_cli_streams_and_reports_timings(tiny_dir):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "demo", "def main():", "--model", str(tiny_dir), "--max-tokens", "8"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.lstrip().startswith("def main():")
    assert "[8 tokens, finish=length, TTFT" in proc.stdout


def test_admission_control_refuses_past_the_waiting_limit(tiny_dir):
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.errors import CapacityExceeded

    engine = Engine(EngineConfig(model=str(tiny_dir), num_blocks=64, max_num_waiting=2))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("b", [5, 6, 8], params)
    with pytest.raises(CapacityExceeded, match="waiting queue is full"):
        engine.add_request("c", [5, 6, 9], params)
    engine.step()  # a and b are admitted: the queue has room again
    engine.add_request("c", [5, 6, 9], params)
    while engine.has_unfinished():
        engine.step()
    pool = engine.kv_cache_manager.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks
