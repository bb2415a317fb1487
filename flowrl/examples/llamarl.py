"""The canonical LlamaRL pipeline and two variants, written with the builder API as a user would."""

from __future__ import annotations

from typing import Any

from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import ModelConfig
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import Node

__all__ = ["build_llamarl", "build_llamarl_ref", "build_two_scorers", "train_with_aipo", "DEFAULT_MODEL"]

#: The tiny model of the built-in examples (~100K parameters): with the settings below it learns the
#: copy task from scratch (reward 0.07 -> 0.9) in about 250 steps, well under a minute on a laptop
#: CPU (``benches/learning.py``). Group size 16 and std-normalised advantages keep the sparse early
#: signal alive; with 4 samples per prompt the policy collapses onto one wrong answer first.
DEFAULT_MODEL = ModelConfig(vocab_size=16, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, max_seq_len=32)


def train_with_aipo(
    b: GraphBuilder, gen: Node, *inputs: Node, lr: float = 1e-3, max_staleness: int = 1, transport: str = "inprocess", **loss: Any
) -> Node:
    """The built-in examples' training half: an AIPO loss (``rho=4``, std-normalised advantages, and
    ``loss``'s options) over ``gen`` and ``inputs``, a policy at ``lr``, weights policy ~> ``gen``; returns the policy."""
    options: dict[str, Any] = {"objective": "aipo", "rho": 4.0, "normalize_std": True, **loss}
    policy = b.policy("policy", b.loss("aipo", gen, *inputs, **options), lr=lr)
    b.weights(policy, gen, transport=transport, max_staleness=max_staleness)
    return policy


def build_llamarl(*, max_staleness: int = 1, transport: str = "inprocess", precision: str = "float32", objective: str = "aipo") -> Graph:
    """prompts -> gen -> reward -> aipo -> policy, and policy ~> gen over ``transport``; the generator
    samples in ``precision`` (``"int8"``: a quantized generator) and the loss node runs ``objective``
    (``"pg"``: ignore mu), so ``benches/quantized.py`` compares them on the default example."""
    b = GraphBuilder("llamarl", model=DEFAULT_MODEL)
    prompts = b.source("prompts", task="copy", batch_size=16)
    gen = b.generator("gen", prompts, n_samples=16, max_new_tokens=5, temperature=1.0, precision=precision)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    train_with_aipo(b, gen, reward, objective=objective, transport=transport, max_staleness=max_staleness)
    return b.build()


def build_llamarl_ref(*, max_staleness: int = 1) -> Graph:
    """The default pipeline with a frozen reference model and a KL(pi || ref) penalty."""
    b = GraphBuilder("llamarl_ref", model=DEFAULT_MODEL)
    prompts = b.source("prompts", task="copy", batch_size=16)
    gen = b.generator("gen", prompts, n_samples=16, max_new_tokens=5)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    ref = b.reference("ref", gen)
    train_with_aipo(b, gen, reward, ref, kl_coef=0.01, max_staleness=max_staleness)
    return b.build()


def build_two_scorers(*, max_staleness: int = 1) -> Graph:
    """Two scorers: correctness (weight 1.0) and brevity (weight 0.1), combined by the loss."""
    b = GraphBuilder("two_scorers", model=DEFAULT_MODEL)
    prompts = b.source("prompts", task="copy", batch_size=16)
    gen = b.generator("gen", prompts, n_samples=16, max_new_tokens=5)
    correct = b.scorer("correct", gen, fn="flowrl.operators.tasks:copy_reward", output="reward_correct")
    brief = b.scorer("brief", gen, fn="flowrl.operators.tasks:brevity_reward", output="reward_brief")
    loss = b.loss(
        "aipo", gen, correct, brief, objective="aipo", normalize_std=True, reward_weights={"reward_correct": 1.0, "reward_brief": 0.1}
    )
    policy = b.policy("policy", loss, lr=1e-3)
    b.weights(policy, gen, max_staleness=max_staleness)
    return b.build()
