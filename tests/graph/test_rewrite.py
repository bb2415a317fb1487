"""``--model DIR`` (``rewrite.with_model_path``) repoints the policy's model, not a reward model's own."""

from __future__ import annotations

import pytest

from flowrl.errors import ConfigError
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig
from flowrl.graph.rewrite import with_model_path


def _graph():
    b = GraphBuilder("rm", model=HFModelConfig(path="/models/base", init="random"))
    prompts = b.source("prompts", data="/data/prompts.jsonl", tokenizer="/models/base", batch_size=2)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=4)
    rm = b.reward_model("rm", gen, model="/models/classifier", output="rm_rewards")
    ref = b.reference("ref", gen)
    b.weights(b.policy("policy", b.loss("aipo", gen, rm, ref, kl_coef=0.1), lr=1e-3), gen)
    return b.build()


def test_the_policys_models_move_and_the_reward_models_stays():
    """Before, every HF model moved: the reward model then loaded the policy's directory as its classifier."""
    graph = with_model_path(_graph(), "/models/mine")
    paths = {n.name: n.model.path for n in graph.nodes if hasattr(n, "model")}
    assert paths == {"gen": "/models/mine", "ref": "/models/mine", "policy": "/models/mine", "rm": "/models/classifier"}
    assert graph.node("prompts").source.tokenizer == "/models/mine"


def test_a_graph_without_a_hugging_face_model_is_refused():
    from flowrl.examples import build_example

    with pytest.raises(ConfigError, match="has no Hugging Face model"):
        with_model_path(build_example("llamarl"), "/models/mine")
