"""The reference model: frozen initial weights, the trainer's log-probs, so the KL starts at 0."""

from __future__ import annotations

import pytest
import torch

from flowrl.graph.nodes import ReferenceNode
from flowrl.operators.logprobs import completion_logprobs
from flowrl.operators.reference import Reference
from flowrl.operators.trainer import Trainer

from tests.tolerances import k3_atol, rollout_logprob_atol

from .helpers import TINY, loss_node, rollout_with_rewards, tiny_policy_node


def test_reference_equals_the_initial_policy_and_stays_frozen():
    batch = rollout_with_rewards(seed=0)
    ref = Reference(ReferenceNode(name="ref", model=TINY))
    trainer = Trainer(tiny_policy_node(lr=1e-2), loss_node(kl_coef=0.1))
    out = ref.logprobs(batch)
    assert list(out) == ["ref_logprobs"] and out["ref_logprobs"].shape == batch["behaviour_logprobs"].shape
    pi = completion_logprobs(trainer.model, batch["sample_prompt_ids"], batch["sample_prompt_lens"], batch["completion_ids"], batch["completion_mask"])
    atol = rollout_logprob_atol(trainer.model, batch)  # float32 rounding (tests/tolerances.py)
    torch.testing.assert_close(out["ref_logprobs"], pi.detach(), rtol=0, atol=atol)
    first = trainer.train_step({**batch, **out})
    assert first["loss/kl_ref"] == pytest.approx(0.0, abs=k3_atol(atol))
    second = trainer.train_step({**batch, **ref.logprobs(batch)})
    assert second["loss/kl_ref"] > 0
    assert not any(p.requires_grad for p in ref.model.parameters())
