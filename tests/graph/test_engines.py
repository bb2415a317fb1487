"""A generator's engine is node data: ``engine="vllm"`` round-trips, prints, and refuses what vLLM cannot honour."""

from __future__ import annotations

import pytest

from flowrl.errors import ConfigError, GraphError
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig, ModelConfig, SamplingConfig
from flowrl.graph.engines import VLLMConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.graph.serialize import from_json, to_json

HF = HFModelConfig(path="/models/tiny", init="random")


def _graph(engine: str, **sampling: object):
    b = GraphBuilder("g", model=HF)
    prompts = b.source("prompts", data="/data/p.jsonl", tokenizer="/models/tiny")
    gen = b.generator("gen", prompts, engine=engine, **sampling)  # type: ignore[arg-type]
    score = b.scorer("reward", gen, fn="tests.operators.userfns:length_reward")
    policy = b.policy("policy", b.loss("aipo", gen, score))
    b.weights(policy, gen)
    return b.build()


def test_the_engine_round_trips_through_json_and_shows_in_the_graph():
    g = _graph("vllm")
    assert g.node("gen").engine == "vllm"
    assert from_json(to_json(g)).node("gen").engine == "vllm"
    assert "engine=vllm" in str(g)
    assert "engine=" not in _graph("builtin").node("gen").describe()  # the default prints as before


@pytest.mark.parametrize(
    ("model", "sampling", "match"),
    [
        (ModelConfig(), {}, r"needs a Hugging Face model .*flowrl export"),
        (HF, {"use_kv_cache": False}, r"drop use_kv_cache=False"),
        (HF, {"precision": "int8"}, r"not precision='int8'"),
        (HF, {"precision": "float8"}, r"not precision='float8'"),
    ],
    ids=["builtin-model", "no-kv-cache", "int8", "float8"],
)
def test_vllm_refuses_settings_it_cannot_honour(model, sampling, match):
    with pytest.raises(ConfigError, match=match):
        GeneratorNode(name="gen", model=model, sampling=SamplingConfig(**sampling), engine="vllm")


@pytest.mark.parametrize("sampling", [{"batching": "continuous"}, {"batching": "continuous", "slots": 4}], ids=["continuous", "slots"])
def test_vllm_takes_continuous_batching(sampling):
    node = GeneratorNode(name="gen", model=HF, sampling=SamplingConfig(**sampling), engine="vllm")
    assert node.sampling.batching == "continuous"


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "float16"])
def test_vllm_takes_the_float_precisions(precision):
    node = GeneratorNode(name="gen", model=HF, sampling=SamplingConfig(precision=precision), engine="vllm")
    assert node.sampling.precision == precision


def test_an_unknown_engine_in_a_graph_file_is_an_error():
    text = to_json(_graph("builtin")).replace('"engine": "builtin"', '"engine": "sglang"')
    assert '"sglang"' in text
    with pytest.raises(GraphError, match="sglang"):
        from_json(text)


def test_every_table_of_engines_has_the_same_names():
    """The capability table, the node field's type (what graph files decode) and the operators' classes."""
    from typing import get_args

    from flowrl.graph.engines import ENGINE_CAPS, Engine
    from flowrl.operators.engines import ENGINES

    assert get_args(Engine) == tuple(ENGINE_CAPS) == tuple(ENGINES)


def test_what_an_engine_refuses_comes_from_its_capabilities(monkeypatch):
    """An engine's row, not its name: a row that takes built-in models lets a ``ModelConfig`` through."""
    import msgspec

    from flowrl.graph import engines

    with pytest.raises(ConfigError, match=r"engine='vllm' needs a Hugging Face model"):
        GeneratorNode(name="gen", model=ModelConfig(), engine="vllm")
    monkeypatch.setitem(engines.ENGINE_CAPS, "vllm", msgspec.structs.replace(engines.ENGINE_CAPS["vllm"], builtin_models=True))
    assert GeneratorNode(name="gen", model=ModelConfig(), engine="vllm").engine == "vllm"


# -- vLLM's own settings (VLLMConfig) ----------------------------------------------------------------
def test_vllms_settings_are_generator_options_that_round_trip_and_print():
    g = _graph("vllm", gpu_memory_utilization=0.3, max_model_len=48, max_num_seqs=16)
    assert g.node("gen").vllm == VLLMConfig(gpu_memory_utilization=0.3, max_model_len=48, max_num_seqs=16)
    assert from_json(to_json(g)).node("gen").vllm == g.node("gen").vllm
    assert "engine=vllm, gpu_memory_utilization=0.3, max_model_len=48, max_num_seqs=16" in str(g)
    assert _graph("vllm").node("gen").vllm is None  # none given: flowrl's defaults, nothing printed


@pytest.mark.parametrize(("option", "value"), [("gpu_memory_utilization", 0.3), ("max_model_len", 48), ("max_num_seqs", 16)])
def test_the_builtin_engine_refuses_each_vllm_setting_by_name(option, value):
    with pytest.raises(ConfigError, match=rf"generator 'gen': {option}={value} is vLLM's setting, which engine='builtin' does not use .*pass engine='vllm', or drop {option}"):
        _graph("builtin", **{option: value})


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(gpu_memory_utilization=0.0), r"gpu_memory_utilization=0.0 must be in \(0, 1\]"),
        (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization=1.5 must be in \(0, 1\]"),
        (dict(max_num_seqs=0), r"max_num_seqs=0 must be >= 1"),
        (dict(max_model_len=8), r"max_model_len=8 leaves no room for a prompt beside max_new_tokens=8"),
        (dict(max_num_seqs=4, batching="continuous", slots=8), r"max_num_seqs=4 and slots=8: under batching='continuous' slots is"),
    ],
)
def test_vllms_settings_out_of_range_or_contradicting_the_sampling_are_refused(options, match):
    with pytest.raises(ConfigError, match=match):
        _graph("vllm", **options)


def test_max_num_seqs_equal_to_slots_is_taken():
    assert _graph("vllm", max_num_seqs=8, batching="continuous", slots=8).node("gen").vllm.max_num_seqs == 8
