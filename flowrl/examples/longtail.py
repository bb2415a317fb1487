"""The long-tail example: the default pipeline on the ``longtail`` task, whose completion lengths are heavy-tailed.

Completions run from 2 to 32 tokens (``flowrl.operators.tasks.LongTailTask``: mean 5.3), so a
lock-step generator waits on the longest of each batch; ``batching="continuous"`` keeps its slots
busy instead (``SamplingConfig.batching``). Learning is slow: a single-digit variant went from reward 0.06 to 0.26 in 120 steps,
this two-digit one stayed near 0.07 over 250 steps (``flowrl run longtail``); tune before relying on it.
"""

from __future__ import annotations

from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import ModelConfig
from flowrl.graph.ir import Graph

__all__ = ["build_longtail", "LONGTAIL_MODEL"]

#: The example model with room for a 6-token prompt and a 32-token completion.
LONGTAIL_MODEL = ModelConfig(vocab_size=16, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, max_seq_len=40)


def build_longtail(*, max_staleness: int = 1) -> Graph:
    """prompts(longtail) -> gen -> reward -> aipo -> policy, and policy ~> gen.

    Args:
        max_staleness: k of the weight edge.
    """
    b = GraphBuilder("longtail", model=LONGTAIL_MODEL)
    prompts = b.source("prompts", task="longtail", batch_size=8)
    gen = b.generator("gen", prompts, n_samples=8, max_new_tokens=32, temperature=1.0)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:longtail_reward")
    aipo = b.loss("aipo", gen, reward, objective="aipo", rho=4.0, normalize_std=True)
    policy = b.policy("policy", aipo, lr=4e-3)
    b.weights(policy, gen, max_staleness=max_staleness)
    return b.build()
