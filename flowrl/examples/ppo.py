"""PPO with a critic: the default pipeline and the Hugging Face example with a value model and GAE advantages."""

from __future__ import annotations

from typing import Any

from flowrl.examples.hf_copy import ASSETS
from flowrl.examples.llamarl import DEFAULT_MODEL
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig
from flowrl.graph.ir import Graph

__all__ = ["build_llamarl_ppo", "build_hf_copy_ppo"]


def build_llamarl_ppo(*, max_staleness: int = 1, lr: float = 1e-3, critic_lr: float = 3e-3, gamma: float = 1.0, lam: float = 0.95) -> Graph:
    """prompts -> gen -> reward -> critic -> ppo -> policy, and policy ~> gen: the default example
    (``build_llamarl``'s source, generator and scorer) with a critic of the same tiny model whose
    values give the PPO loss its token-level GAE advantages (``gamma``, ``lam``)."""
    b = GraphBuilder("llamarl_ppo", model=DEFAULT_MODEL)
    prompts = b.source("prompts", task="copy", batch_size=16)
    gen = b.generator("gen", prompts, n_samples=16, max_new_tokens=5, temperature=1.0)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    critic = b.critic("critic", gen, reward, lr=critic_lr)
    policy = b.policy("policy", b.loss("ppo", gen, reward, critic, objective="ppo", gamma=gamma, lam=lam), lr=lr)
    b.weights(policy, gen, max_staleness=max_staleness)
    return b.build()


def build_hf_copy_ppo(*, max_staleness: int = 1, lr: float = 2e-3, critic_lr: float = 3e-3, critic_lora: dict[str, Any] | None = None) -> Graph:
    """The Hugging Face example (``flowrl.examples.hf_copy``) with a critic of the same Llama
    architecture (``critic_lora``: LoRA adapters on it, the value head in full) and a PPO loss."""
    model = HFModelConfig(path=str(ASSETS), init="random", seed=0)
    b = GraphBuilder("hf_copy_ppo", model=model)
    prompts = b.source("prompts", data=str(ASSETS / "prompts.jsonl"), prompt_field="prompt", batch_size=16)
    gen = b.generator("gen", prompts, n_samples=8, max_new_tokens=5, temperature=1.0)
    score = b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text")
    critic = b.critic("critic", gen, score, lr=critic_lr, lora=critic_lora)
    policy = b.policy("policy", b.loss("ppo", gen, score, critic, objective="ppo"), lr=lr)
    b.weights(policy, gen, max_staleness=max_staleness)
    return b.build()
