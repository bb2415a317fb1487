"""Every built-in example graph runs one synchronous step through these operators, as the runtime wires them."""

from __future__ import annotations

import math

import torch

from flowrl.operators.generation import Generator
from flowrl.operators.reference import Reference
from flowrl.operators.scoring import Scorer
from flowrl.operators.source import PromptSource
from flowrl.operators.text_inputs import TextInputs
from flowrl.operators.trainer import Trainer
from tests.tolerances import ratio_atol, rollout_logprob_atol


def test_one_step_of_each_example(runnable_example_graph):
    g = runnable_example_graph
    (source,), (generator,), (policy,) = (g.nodes_of_kind(k) for k in ("source", "generator", "policy"))
    if generator.env is not None:  # a multi-turn example: episodes against its environment
        from flowrl.operators.multiturn import MultiTurnGenerator

        rollout, _ = MultiTurnGenerator(Generator(generator, seed=0), generator).generate(PromptSource(source).next_batch())
    else:
        rollout = Generator(generator, seed=0).generate(PromptSource(source).next_batch())
    batch = dict(rollout)
    for scorer in g.nodes_of_kind("scorer"):
        text = TextInputs(g, scorer.name) if scorer.inputs == "text" else None
        batch.update(Scorer(scorer, text).score(rollout))
    for reference in g.nodes_of_kind("reference"):
        batch.update(Reference(reference).logprobs(rollout))
    for critic in g.nodes_of_kind("critic"):  # a PPO example: the critic's values, and a step of its own
        from flowrl.operators.critic import Critic

        model = Critic(critic, g.loss_of(policy.name).loss)
        batch["values"], critic_metrics = model.train_step(batch)
        assert model.version == 1 and all(math.isfinite(v) for v in critic_metrics.values())
    trainer = Trainer(policy, g.loss_of(policy.name))
    float32_tol = ratio_atol(rollout_logprob_atol(trainer.model, rollout, temperature=generator.sampling.temperature))  # before the step
    metrics = trainer.train_step(batch)
    assert trainer.version == 1 and all(math.isfinite(v) for v in metrics.values())
    # On-policy: ratio 1 up to float32 rounding (tests/tolerances.py); a bf16 generator (qwen_math) samples
    # from other probabilities than the fp32 trainer, beyond what a float32 bound covers: measured
    # |mean ratio - 1| = 1.4e-5 there, 50x margin, still 50x under a real bug's 0.05.
    tolerance = float32_tol if generator.sampling.precision == "float32" else 1e-3
    ratio = metrics["ppo/ratio_mean"] if g.loss_of(policy.name).loss.objective == "ppo" else metrics["aipo/ratio_mean"]
    assert abs(ratio - 1.0) < tolerance
    # The example model fits the task tokenizer, and its prompts fit its sequence length.
    assert int(rollout["completion_ids"].max()) < trainer.model.vocab_size
    assert torch.equal(rollout["group_ids"], torch.arange(source.source.batch_size).repeat_interleave(generator.sampling.n_samples))
