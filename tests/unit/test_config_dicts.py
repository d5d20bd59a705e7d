"""vLLM's nested configs as the dicts vLLM users pass them (issue 40): ``speculative_config`` and
``compilation_config`` made Baton's fields (equal to the object forms), ``kv_transfer_config`` refused with where
to go instead, every bad key or value refused by name, and an n-gram dict driving a real generation."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.config import DEFAULT_GRAPH_SIZES, EngineConfig
from engine.core.speculation import SpeculativeConfig
from engine.errors import InvalidRequest
from tests.tiny_model import shared_tiny

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}  # as vLLM users write it


# ---- speculative_config ---------------------------------------------------------------------
@pytest.mark.parametrize(("raw", "spec"), [
    (NGRAM, SpeculativeConfig(method="ngram", num_speculative_tokens=3)),
    ({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
     SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_max=3, prompt_lookup_min=1)),
    ({"model": "draft", "num_speculative_tokens": 2}, SpeculativeConfig(method="draft_model", model="draft",
                                                                        num_speculative_tokens=2)),
    # vLLM's keys that restate what Baton does: its default method, greedy drafts, drafts one after another
    ({"method": None, "model": "draft", "draft_sample_method": "greedy", "parallel_drafting": False},
     SpeculativeConfig(model="draft")),
])
def test_a_speculative_dict_gives_the_config_its_object_gives(raw, spec):
    config = EngineConfig(speculative_config=raw)
    assert isinstance(config.speculative_config, SpeculativeConfig)
    assert config == EngineConfig(speculative_config=spec)


@pytest.mark.parametrize(("raw", "message"), [
    ({"method": "ngram", "num_spec_tokens": 3},
     r"speculative_config: unknown key 'num_spec_tokens' \(accepted: method, model, num_speculative_tokens, "
     r"prompt_lookup_max, .*\); did you mean 'num_speculative_tokens'\?"),
    ({"num_speculative_tokens": "3"}, r"speculative_config: 'num_speculative_tokens' must be int, got '3'"),
    ({"prompt_lookup_max": True}, r"'prompt_lookup_max' must be int, got True \(a bool\)"),
    ({"model": 7}, r"'model' must be str or None, got 7"),
    ({"parallel_drafting": True}, r"'parallel_drafting' is vLLM's; Baton has only its default False"),
    ({"rejection_sample_method": "standard"}, r"unknown key 'rejection_sample_method'"),  # not Baton's test
    ({"method": "eagle"}, r"method 'eagle' is not supported"),
    ("ngram", r"speculative_config must be a dict or a SpeculativeConfig, got a str"),
])
def test_a_bad_speculative_dict_is_refused_by_name(raw, message):
    with pytest.raises(InvalidRequest, match=message):
        EngineConfig(speculative_config=raw)


# ---- compilation_config ---------------------------------------------------------------------
@pytest.mark.parametrize(("compilation", "fields"), [
    ({"cudagraph_capture_sizes": [1, 2, 4], "mode": 0, "level": 0}, dict(cuda_graph_sizes=(1, 2, 4))),
    ({"max_cudagraph_capture_size": 48}, dict(cuda_graph_sizes=(1, 2, 4, 8, 16, 32, 48))),
    ({"cudagraph_capture_sizes": [2, 8], "max_cudagraph_capture_size": 8}, dict(cuda_graph_sizes=(2, 8))),
    ({"cudagraph_mode": "NONE"}, dict(enforce_eager=True)),
    ({"cudagraph_mode": "full_decode_only"}, {}),  # the graphs Baton captures anyway
    (0, {}),  # vLLM's int form: the mode; 0 compiles nothing
    ({"mode": None}, {}),
])
def test_a_compilation_config_reaches_the_graph_fields(compilation, fields):
    assert EngineConfig(compilation_config=compilation) == EngineConfig(**fields)


def test_compilation_sizes_agree_with_the_graph_fields_given():
    config = EngineConfig(compilation_config={"cudagraph_capture_sizes": [1, 2]}, cuda_graph_sizes=(1, 2))
    assert config.cuda_graph_sizes == (1, 2) and EngineConfig().cuda_graph_sizes == DEFAULT_GRAPH_SIZES
    assert EngineConfig(compilation_config={"mode": 0}, cuda_graph_sizes=(8,)).cuda_graph_sizes == (8,)
    assert EngineConfig(compilation_config={"mode": 0}, enforce_eager=True).enforce_eager


@pytest.mark.parametrize(("compilation", "extra", "message"), [
    (3, {}, r"compilation_config: mode 3 compiles the model \(torch.compile\), which Baton's engine does not"),
    ({"level": 1}, {}, r"level 1 compiles the model"),
    ({"mode": "0"}, {}, r"mode must be an int"),
    ({"backend": "inductor"}, {}, r"compilation_config: unknown key 'backend' \(accepted: mode, level, "
                                  r"cudagraph_capture_sizes, "),
    ({"cudagraph_capture_sizes": []}, {}, r"cudagraph_capture_sizes must be a list of positive batch sizes"),
    ({"cudagraph_capture_sizes": [1, 0]}, {}, r"cudagraph_capture_sizes must be a list of positive batch sizes"),
    ({"cudagraph_capture_sizes": [1, 2], "max_cudagraph_capture_size": 4}, {}, r"is not the largest"),
    ({"cudagraph_mode": "PIECEWISE"}, {}, r"cudagraph_mode 'PIECEWISE' is not one Baton captures"),
    ({"cudagraph_mode": "FULL_DECODE_ONLY"}, dict(enforce_eager=True), r"enforce_eager=True for none"),
    ({"cudagraph_capture_sizes": [1, 2]}, dict(cuda_graph_sizes=(8,)), r"give the sizes once"),
    ("-O3", {}, r"compilation_config must be an int \(the compilation mode\) or a dict, got a str"),
])
def test_what_baton_cannot_honour_in_a_compilation_config_is_refused(compilation, extra, message):
    with pytest.raises(InvalidRequest, match=message):
        EngineConfig(compilation_config=compilation, **extra)


# ---- kv_transfer_config and other arguments -------------------------------------------------------
def test_a_kv_transfer_config_is_refused_saying_where_disaggregation_lives():
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    with pytest.raises(InvalidRequest, match=r"kv_transfer_config: Baton's offline engine .* does not disaggregate"
                                             r".*`baton up`.*--kv-transport"):
        EngineConfig(kv_transfer_config=nixl)
    with pytest.raises(InvalidRequest, match=r"kv_transfer_config"):
        LLM(kv_transfer_config=nixl)  # refused before any model loads


def test_an_unknown_llm_argument_is_refused_by_name():
    with pytest.raises(InvalidRequest, match=r"LLM: unknown argument 'num_block' \(accepted: dtype, .*\); "
                                             r"did you mean 'num_blocks'\?"):
        LLM(num_block=64)  # refused before any model loads
    with pytest.raises(InvalidRequest, match=r"LLM: unknown arguments 'seed', 'trust_remote_code'"):
        LLM(seed=0, trust_remote_code=True)


# ---- end to end -------------------------------------------------------------------------------
def test_an_ngram_dict_speculates_and_keeps_the_greedy_output(tmp_path_factory):
    model = str(shared_tiny(tmp_path_factory))  # briefly trained: its greedy outputs loop, so n-grams match
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10] * 3}, {"prompt_token_ids": [40, 41, 42, 43]}]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model, num_blocks=32).generate(prompts, params)]
    llm = LLM(model, num_blocks=32, speculative_config=NGRAM)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    stats = llm.engine.stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0  # it did speculate
