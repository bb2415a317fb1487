"""Calibration at the widths a graph uses: ``calibration_needs`` reads them (and a vLLM generator's
model), ``measure(widths=...)``'s pass rates cover them, with fewer rows above ``WIDTHS``."""

from __future__ import annotations

import pytest

import importlib
import json
from flowrl.calibration.measure import PASS_ROWS, WIDTHS, _pass_rates, measure, pass_flops, pass_rows
from flowrl.calibration.needs import calibration_needs
from flowrl.calibration.vllm_rates import qwen2_config
from flowrl.errors import PlanError
from flowrl.examples import build_example
from flowrl.examples.hf_copy import ASSETS
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig
from flowrl.modelspec import ModelSpec, model_from_config

SHAPE = ModelSpec(name="t", n_layers=2, dim=96, n_heads=3, n_kv_heads=1, ffn_dim=160, vocab_size=64, tie_embeddings=True)


def _hf_graph(path, engine: str):
    b = GraphBuilder("g", model=HFModelConfig(path=str(path), init="random", seed=0))
    prompts = b.source("prompts", data=str(ASSETS / "prompts.jsonl"), prompt_field="prompt", batch_size=1)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=4, engine=engine)
    score = b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text")
    policy = b.policy("policy", b.loss("aipo", gen, score, objective="aipo"))
    b.weights(policy, gen)
    return b.build()


def test_the_needs_of_a_built_in_graph_are_its_width_and_no_vllm():
    needs = calibration_needs(build_example("llamarl"))
    assert needs.widths == (build_example("llamarl").nodes[1].model.dim,) and needs.vllm_model is None


def test_the_needs_of_a_hf_graph_are_its_configs_width_and_its_vllm_generators_model(tmp_path):
    model_dir = tmp_path / "m"  # its config.json is all the planner reads (no weights, no tokenizer)
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(qwen2_config(SHAPE, layers=2, vocab=64)))
    needs = calibration_needs(_hf_graph(model_dir, "vllm"))
    assert needs.widths == (96,)
    spec = model_from_config(HFModelConfig(path=str(model_dir)))
    assert (spec.dim, spec.n_heads, spec.n_kv_heads, spec.ffn_dim, spec.n_layers) == (96, 3, 1, 160, 2)  # the shape written
    assert needs.vllm_model == spec
    assert (needs.vllm_rows, needs.vllm_new_tokens) == (1 * 2, 4)  # one call: batch_size 1 x 2 samples, max_new_tokens 4


@pytest.fixture
def small_widths(monkeypatch):
    """The default table stops at 32 (as it stops at 256): widths above it are cheap to measure here."""
    monkeypatch.setattr(importlib.import_module("flowrl.calibration.measure"), "WIDTHS", (16, 32))  # the package re-exports measure(), the function


def test_pass_rows_keep_the_defaults_and_shrink_above_them(small_widths):
    assert pass_rows(16) == pass_rows(32) == PASS_ROWS
    assert pass_rows(64) == PASS_ROWS // 2 and pass_rows(10**6) == 32
    # a pass's FLOPs: rows x tokens x the forward FLOPs per token (x3 with the backward), rows as pass_rows says
    assert pass_flops(64, "train") == pytest.approx(3 * pass_flops(64, "forward"))
    assert pass_flops(64, "forward") / pass_flops(32, "forward") < 3  # above the table: rows shrink as the width grows


def test_pass_rates_at_a_width_beyond_the_defaults_are_measured_there(small_widths):
    rates = _pass_rates((16, 48), repeats=1, statistic="median")
    for kind in ("forward", "decode", "train"):
        assert [w for w, _ in rates[kind]] == [16, 48] and all(rate > 0 for _, rate in rates[kind])


@pytest.mark.parametrize("widths", [(8,), (64.5,)])
def test_measure_refuses_a_bad_width_before_any_work(widths):
    with pytest.raises(PlanError, match="each must be an integer >= 16"):
        measure(widths=widths)


def test_the_default_table_stops_at_256():
    assert WIDTHS[-1] == 256 and pass_rows(896) == PASS_ROWS * 256 // 896

def test_the_policys_shape_and_batch_are_what_the_split_passes_run_at():
    """``flowrl calibrate --graph`` runs ``rank_passes`` at the first policy's model and its batch: the
    sources' prompts per step x the generator's samples, its ``max_new_tokens`` (capped)."""
    from flowrl.examples import build_example
    from flowrl.modelspec import model_from_config

    graph = build_example("llamarl")
    needs = calibration_needs(graph)
    policy = graph.nodes_of_kind("policy")[0]
    gen = graph.nodes_of_kind("generator")[0]
    prompts = sum(s.source.batch_size for s in graph.nodes_of_kind("source"))
    assert needs.policy_model == model_from_config(policy.model)
    assert needs.policy_rows == min(64, prompts * gen.sampling.n_samples)
    assert needs.policy_tokens == min(32, gen.sampling.max_new_tokens)
