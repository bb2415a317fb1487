"""k = 0 in the runtime is exactly a plain synchronous loop: same seed, same weights after N steps."""

from __future__ import annotations

import torch

from flowrl.examples import build_example
from flowrl.runtime.checkpointing.store import latest_checkpoint
from flowrl.runtime.config import RunConfig
from flowrl.runtime.control.executor_placement import run_placement
from flowrl.runtime.run import run_graph


def _sync_loop(graph, steps: int, seed: int) -> dict[str, torch.Tensor]:
    from flowrl.operators.generation import Generator
    from flowrl.operators.scoring import Scorer
    from flowrl.operators.source import PromptSource
    from flowrl.operators.trainer import Trainer

    source = PromptSource(graph.nodes_of_kind("source")[0])
    generator = Generator(graph.nodes_of_kind("generator")[0], seed=seed)
    scorer = Scorer(graph.nodes_of_kind("scorer")[0])
    trainer = Trainer(graph.nodes_of_kind("policy")[0], graph.nodes_of_kind("loss")[0])
    for _ in range(steps):
        rollout = generator.generate(source.next_batch())
        trainer.train_step({**rollout, **scorer.score(rollout)})
        generator.load_weights(trainer.weights(), trainer.version)
    return {k: v.detach().clone() for k, v in trainer.weights().items()}


def test_k0_matches_a_synchronous_loop(tmp_path):
    from flowrl.operators.trainer import Trainer

    graph = build_example("llamarl")
    steps, seed = 3, 7
    threads = torch.get_num_threads()
    torch.set_num_threads(run_placement(graph, None, RunConfig(max_staleness=0)).threads_per_group())
    try:
        expected = _sync_loop(graph, steps, seed)
    finally:
        torch.set_num_threads(threads)
    result = run_graph(graph, RunConfig(steps=steps, max_staleness=0, seed=seed, checkpoint_dir=str(tmp_path)))
    assert [r["staleness"] for r in result.rows] == [0] * steps
    trainer = Trainer(graph.nodes_of_kind("policy")[0], graph.nodes_of_kind("loss")[0])
    trainer.load_state(torch.load(latest_checkpoint(tmp_path) / "policy-policy.pt", weights_only=True))
    assert trainer.version == steps
    got = trainer.weights()
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
