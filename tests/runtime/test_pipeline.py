"""A pipeline-parallel policy (a ``pp`` mesh axis) under torchrun on gloo: equal to one process, resumable.

The jobs run with ``python -m torch.distributed.run`` (CPU, gloo, 2-4 ranks). This file is also their
entry point (``python tests/runtime/test_pipeline.py MODE OUT ...``).
"""

from __future__ import annotations

from flowrl.examples.llamarl import build_llamarl
from flowrl.graph.builder import GraphBuilder


def pp_graph(transport: str = "inprocess", micro_batch_size: int = 8, num_iterations: int = 1):
    """The default example (built-in model, 2 layers, tied head) with weights over ``transport``; the
    placement gives the policy its pp mesh."""
    g = build_llamarl()
    b = GraphBuilder("llamarl_pp", model=g.node("policy").model)
    prompts = b.source("prompts", task="copy", batch_size=16)
    gen = b.generator("gen", prompts, n_samples=16, max_new_tokens=5, temperature=1.0)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    aipo = b.loss("aipo", gen, reward, objective="aipo", rho=4.0, normalize_std=True)
    policy = b.policy("policy", aipo, lr=1e-3, micro_batch_size=micro_batch_size, num_iterations=num_iterations)
    b.weights(policy, gen, max_staleness=1, transport=transport)
    return b.build()


def pp_file_graph():
    return pp_graph(transport="file")
