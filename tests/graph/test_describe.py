"""``print(graph)`` shows every option a node was given that is not its default (``Node.describe``)."""

from __future__ import annotations

import msgspec
import pytest

from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import LossConfig, OptimizerConfig, ReferenceConfig
from flowrl.graph.corrections import CorrectionConfig
from flowrl.graph.objectives import ObjectiveRow
from flowrl.graph.nodes import LossNode, PolicyNode, ReferenceNode


def test_a_trl_style_grpo_graph_prints_its_loss_options_and_updates_per_batch():
    b = GraphBuilder("grpo")
    gen = b.generator("gen", b.source("prompts", task="copy"))
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    ref = b.reference("ref", gen, sync_steps=8, sync_alpha=0.9)
    loss = b.loss("loss", gen, reward, ref, objective="grpo", loss_agg="dr_grpo", clip_eps_high=0.28, kl_coef=0.04)
    policy = b.policy("policy", loss, num_iterations=2)
    b.weights(policy, gen)
    b.weights(policy, ref)
    text = str(b.build())
    assert "loss = loss(grpo, eps=0.2, baseline=group_mean, clip_eps_high=0.28, loss_agg=dr_grpo, kl_coef=0.04) <- " in text
    assert "policy = policy(model=2L64d, lr=0.001, num_iterations=2) <- " in text
    assert "ref = reference(model=2L64d, sync_steps=8, sync_alpha=0.9) <- " in text


# one non-default value per field (types as the configs take them)
_LOSS = dict(objective="gspo", rho=2.0, clip_eps=0.1, clip_eps_low=0.3, clip_eps_high=0.28, rho_low=0.5, is_level="sequence",
             loss_agg="seq_mean", mask_truncated_completions=True, overlong_buffer=4, overlong_penalty=0.5,
             dynamic_sampling=True, dynamic_sampling_groups=2, baseline="leave_one_out", normalize_std=True, kl_coef=0.1,
             reward_weights={"a": 0.5, "b": 1.0}, gamma=0.9, lam=0.5, distill_coef=0.5, correction=CorrectionConfig(kind="tis"),
             options={"tau_pos": 2.0}, row=ObjectiveRow(name="mine", fn="tests.graph.test_objectives:scaled_pg"))  # fmt: skip
_GIVEN = {"options": {"objective": "sapo"}, "row": {"objective": "mine"}, "correction": {"objective": "grpo"}, "distill_coef": {"objective": "opd"},
          "gamma": {"objective": "ppo"}, "lam": {"objective": "ppo"}}  # what a field needs beside it
_OPT = dict(lr=0.5, betas=(0.8, 0.9), weight_decay=0.1, grad_clip=0.5, schedule="cosine", warmup_steps=3, total_steps=9,
            micro_batch_size=2, num_iterations=2, num_mini_batches=2, seed=1, gradient_checkpointing=True, autocast="bfloat16",
            sharding="fsdp", param_dtype="bfloat16", reduce_dtype="bfloat16", packing=True, router_aux_loss_coef=0.01)  # fmt: skip


@pytest.mark.parametrize(
    ("config", "values", "node"),
    [
        (LossConfig, _LOSS, lambda c: LossNode(name="l", loss=c)),
        (OptimizerConfig, _OPT, lambda c: PolicyNode(name="p", optimizer=c)),
        (ReferenceConfig, dict(sync_steps=2, sync_alpha=0.5, packing=True), lambda c: ReferenceNode(name="r", reference=c)),
    ],
    ids=["loss", "policy", "reference"],
)
def test_every_option_off_its_default_is_in_the_description(config, values, node):
    assert sorted(values) == sorted(config.__struct_fields__)  # the table covers every field (a new one must be added here)
    for name, value in values.items():
        base = msgspec.structs.replace(config(), **{k: v for k, v in values.items() if k in ("dynamic_sampling", "sync_steps", "sharding")}, **_GIVEN.get(name, {}))
        text = node(msgspec.structs.replace(base, **{name: value})).describe()
        shown_as = {"objective": "gspo, ", "clip_eps": "eps=0.1"}.get(name, f"{name}=")  # the loss's lead: objective and its knob
        assert shown_as in text, (name, text)
