"""The critic operator: where its values sit, that a training step lowers its loss, and its state round trip."""

from __future__ import annotations

import msgspec
import pytest
import torch

from flowrl.errors import CheckpointError
from flowrl.graph.configs import HFModelConfig, LossConfig, ModelConfig
from flowrl.graph.critic import CriticNode
from flowrl.operators.critic import Critic

MODEL = ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, max_seq_len=32)
LOSS = LossConfig(objective="ppo")


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    S, Tp, C = 4, 3, 5
    lens = torch.tensor([5, 3, 4, 1])
    mask = torch.arange(C)[None, :] < lens[:, None]
    return {
        "sample_prompt_ids": torch.randint(1, 16, (S, Tp), generator=g), "sample_prompt_lens": torch.tensor([3, 2, 3, 1]),
        "completion_ids": torch.where(mask, torch.randint(1, 16, (S, C), generator=g), 0), "completion_mask": mask,
        "completion_lens": lens, "group_ids": torch.tensor([0, 0, 1, 1]), "rewards": torch.tensor([1.0, 0.0, 0.5, 0.25]),
    }  # fmt: skip


def _critic(**options) -> Critic:
    critic = Critic(CriticNode(name="critic", model=MODEL, **options), LOSS)
    with torch.no_grad():  # a head that is not zero, so values differ by position
        head = critic.model.output
        head.weight.normal_(generator=torch.Generator().manual_seed(3))
    return critic


def test_a_value_reads_the_state_before_its_token():
    """V[:, t] = V(x, y_<t): changing token t leaves V[:, :t+1] as they were and moves V[:, t+1]."""
    critic = _critic()
    batch = _batch()
    before = critic.values(batch)
    changed = dict(batch)
    ids = batch["completion_ids"].clone()
    ids[0, 2] = (ids[0, 2] % 15) + 1
    changed["completion_ids"] = ids
    after = critic.values(changed)
    assert torch.equal(after[0, :3], before[0, :3])
    assert not torch.equal(after[0, 3], before[0, 3])
    assert torch.equal(after[1:], before[1:])
    assert not before[~batch["completion_mask"]].any()


def test_a_fresh_critic_values_everything_zero():
    critic = Critic(CriticNode(name="critic", model=MODEL), LOSS)
    assert not critic.values(_batch()).any()


def test_training_on_one_batch_lowers_its_value_loss_and_counts_versions():
    node = CriticNode(name="critic", model=MODEL, value_clip=None)
    critic = Critic(msgspec.structs.replace(node, optimizer=msgspec.structs.replace(node.optimizer, lr=1e-2)), LOSS)
    batch = _batch()
    losses = []
    for step in range(15):
        values, metrics = critic.train_step(batch)
        assert metrics["critic/version"] == step
        losses.append(metrics["critic/value_loss"])
    assert critic.version == 15
    assert losses[-1] < 0.1 * losses[0], losses  # seen here: 0.19 -> 0.0075
    assert metrics["critic/explained_variance"] > 0.5  # seen here: 0.93


def test_its_state_round_trips_exactly():
    critic = _critic()
    batch = _batch()
    critic.train_step(batch)
    state = critic.state()
    other = Critic(CriticNode(name="critic", model=MODEL), LOSS)
    other.load_state(state)
    assert other.version == 1
    assert torch.equal(other.values(batch), critic.values(batch))
    _, m1 = critic.train_step(batch)
    _, m2 = other.train_step(batch)
    assert m1 == m2
    with pytest.raises(CheckpointError, match="lacks \\['optimizer'\\]"):
        other.load_state({k: v for k, v in state.items() if k != "optimizer"})
    bigger = Critic(CriticNode(name="critic", model=msgspec.structs.replace(MODEL, dim=64)), LOSS)
    with pytest.raises(CheckpointError, match="a model of another config"):
        bigger.load_state(state)


def test_a_hugging_face_critic_has_a_scalar_head_and_trains(hf_dir):
    """Tied (Llama) or untied (Qwen2) embeddings: the value head replaces the LM head alone."""
    critic = Critic(CriticNode(name="critic", model=HFModelConfig(path=str(hf_dir), init="random", seed=0)), LOSS)
    embed = critic.model.hf.get_input_embeddings().weight
    assert critic.model.hf.get_output_embeddings().weight.shape == (1, embed.shape[1])
    assert "lm_head.weight" in critic.trainable and "lm_head.bias" in critic.trainable
    batch = _batch()
    batch["sample_prompt_ids"] = batch["sample_prompt_ids"] % embed.shape[0]
    batch["completion_ids"] = batch["completion_ids"] % embed.shape[0]
    values, _ = critic.train_step(batch)
    assert not values.any()  # the zero-initialised head
    assert critic.values(batch)[batch["completion_mask"]].abs().sum() > 0


def test_a_hugging_face_critic_with_lora_trains_its_adapters_and_head(hf_llama_dir):
    pytest.importorskip("peft", reason="LoRA critics need peft (pip install flowrl[lora])")
    node = CriticNode(name="critic", model=HFModelConfig(path=str(hf_llama_dir), init="random", lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}))
    critic = Critic(node, LOSS)
    names = sorted(critic.trainable)
    assert all(".lora_" in n or n.startswith("lm_head.") for n in names) and "lm_head.weight" in names


def test_the_critic_shapes_the_batch_as_its_loss_does_and_writes_every_sample():
    """With dynamic sampling a group of equal rewards drops out of the critic's training, as out of the
    policy's; the values written still cover the whole batch, which the trainer then shapes alike."""
    batch = _batch()
    batch["rewards"] = torch.tensor([1.0, 1.0, 0.5, 0.0])  # group 0: all equal, no signal
    critic = Critic(CriticNode(name="critic", model=MODEL), LossConfig(objective="ppo", dynamic_sampling=True, lam=1.0))
    values, metrics = critic.train_step(batch)
    assert values.shape == batch["completion_mask"].shape
    assert metrics["critic/return_mean"] == pytest.approx((0.5 * 4 + 0.0 * 1) / 5)  # group 1's 4 + 1 tokens, zero values, lam 1: G = R
