"""The sampling temperature travels in the rollout, so the on-policy AIPO ratio is 1 at any temperature."""

from __future__ import annotations

import pytest
import torch

from flowrl.graph.nodes import LossNode
from flowrl.operators.generation import Generator
from flowrl.operators.logprobs import completion_logprobs
from flowrl.operators.reference import Reference
from flowrl.operators.source import PromptSource
from flowrl.operators.trainer import Trainer
from flowrl.graph.nodes import ReferenceNode
from tests.operators.helpers import source_node, tiny_generator_node, tiny_policy_node
from tests.tolerances import k3_atol, ratio_atol, rollout_logprob_atol


def _on_policy_batch(temperature: float) -> tuple[Trainer, dict[str, torch.Tensor]]:
    gen = Generator(tiny_generator_node(n_samples=4, max_new_tokens=6, temperature=temperature), seed=0)
    trainer = Trainer(tiny_policy_node(), LossNode(name="aipo"))  # k = 0: the generator holds the policy's weights
    gen.load_weights(trainer.weights(), trainer.version)
    rollout = gen.generate(PromptSource(source_node("copy", 4)).next_batch())
    return trainer, {**rollout, "rewards": torch.linspace(0, 1, rollout["completion_ids"].shape[0])}


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6], ids=["T0.7", "T1", "T1.6"])
def test_on_policy_aipo_ratio_is_one_at_the_sampling_temperature(temperature):
    trainer, batch = _on_policy_batch(temperature)
    assert torch.equal(batch["sampling_temperature"], torch.full_like(batch["sampling_temperature"], temperature))
    atol = rollout_logprob_atol(trainer.model, batch, temperature=temperature)  # float32 rounding of mu and pi
    metrics = trainer.train_step(batch)
    assert metrics["aipo/ratio_mean"] == pytest.approx(1.0, abs=ratio_atol(atol))
    assert metrics["aipo/ratio_max"] == pytest.approx(1.0, abs=ratio_atol(atol))
    assert metrics["aipo/kl"] == pytest.approx(0.0, abs=k3_atol(atol))


def test_without_the_temperature_the_ratio_is_not_one():
    trainer, batch = _on_policy_batch(0.7)
    del batch["sampling_temperature"]  # an old rollout: pi evaluated at temperature 1
    metrics = trainer.train_step(batch)
    assert abs(metrics["aipo/ratio_mean"] - 1.0) > 1e-3


def test_reference_uses_the_rollouts_temperature():
    trainer, batch = _on_policy_batch(0.7)
    ref = Reference(ReferenceNode(name="ref", model=trainer.node.model))
    pi = completion_logprobs(trainer.model, batch["sample_prompt_ids"], batch["sample_prompt_lens"], batch["completion_ids"],
                             batch["completion_mask"], temperature=batch["sampling_temperature"])
    atol = rollout_logprob_atol(trainer.model, batch, temperature=0.7)
    torch.testing.assert_close(ref.logprobs(batch)["ref_logprobs"], pi.detach(), rtol=0, atol=atol)
    torch.testing.assert_close(pi.detach(), batch["behaviour_logprobs"], rtol=0, atol=atol)
