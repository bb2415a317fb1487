"""The trainer: ratio 1 on-policy, a better objective on a fixed batch, exact micro-batching, state round trips."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from flowrl.errors import CheckpointError, ConfigError
from flowrl.graph.configs import OptimizerConfig
from flowrl.operators.generation import Generator
from flowrl.operators.logprobs import completion_logprobs
from flowrl.operators.losses import advantages
from flowrl.operators.trainer import Trainer, learning_rate

from tests.tolerances import GradientMagnitudes, assert_within, k3_atol, ratio_atol, rollout_logprob_atol

from .helpers import TINY, loss_node, rollout_with_rewards, tiny_generator_node, tiny_policy_node


def test_on_policy_ratio_is_one():
    batch = rollout_with_rewards(seed=0, n_samples=4)
    trainer = Trainer(tiny_policy_node(), loss_node(rho=2.0))
    atol = rollout_logprob_atol(trainer.model, batch)  # float32 rounding of mu and pi (tests/tolerances.py)
    metrics = trainer.train_step(batch)
    assert metrics["aipo/ratio_mean"] == pytest.approx(1.0, abs=ratio_atol(atol))
    assert metrics["aipo/ratio_max"] == pytest.approx(1.0, abs=ratio_atol(atol))
    assert metrics["aipo/truncated_frac"] == 0.0
    assert abs(metrics["aipo/kl"]) < k3_atol(atol)
    assert metrics["staleness"] == 0.0
    assert trainer.version == 1


def test_the_generator_and_the_policy_start_from_the_same_weights():
    gen, trainer = Generator(tiny_generator_node(), seed=0), Trainer(tiny_policy_node(), loss_node())
    assert gen.version == trainer.version == 0
    for name, value in trainer.weights().items():
        assert torch.equal(gen.weight_targets()[name], value), name


def objectives(trainer: Trainer, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(sum A * log pi, sum pi/mu * A) over real tokens: the policy-gradient surrogate and the
    importance-weighted estimate of E_pi[A] from mu's samples."""
    adv = advantages(batch["rewards"], batch["group_ids"], baseline="group_mean", normalize_std=False)[:, None]
    mask = batch["completion_mask"]
    with torch.no_grad():
        logp = completion_logprobs(
            trainer.model, batch["sample_prompt_ids"], batch["sample_prompt_lens"], batch["completion_ids"], mask
        )
    ratio = (logp - batch["behaviour_logprobs"]).exp()
    return float((adv * logp * mask).sum()), float((adv * ratio * mask).sum())


@pytest.mark.parametrize(
    ("objective", "options"),
    [("aipo", {}), ("grpo", {}), ("grpo", {"clip_eps_high": 0.28, "loss_agg": "seq_mean"}), ("gspo", {"loss_agg": "seq_mean"}),
     ("cispo", {"clip_eps_low": 1.0, "clip_eps_high": 0.28}), ("tis", {"is_level": "sequence"}), ("mis", {}), ("pg", {"loss_agg": "dr_grpo"})],
    ids=["aipo", "grpo", "grpo-clip-higher-seq_mean", "gspo", "cispo", "tis-sequence", "mis", "pg-dr_grpo"],
)
def test_steps_on_a_fixed_batch_improve_the_objective(objective, options):
    batch = rollout_with_rewards(seed=1, n_samples=4, batch_size=6)
    assert batch["rewards"].std() > 0
    trainer = Trainer(tiny_policy_node(lr=1e-2), loss_node(objective=objective, **options))
    surrogate, weighted = objectives(trainer, batch)
    for _ in range(5):
        trainer.train_step(batch)
    surrogate_after, weighted_after = objectives(trainer, batch)
    assert surrogate_after > surrogate + 0.1
    assert weighted_after > weighted + 0.1


@pytest.mark.parametrize(
    "loss",
    [{}, {"loss_agg": "seq_mean"}, {"loss_agg": "dr_grpo", "objective": "grpo", "clip_eps_high": 0.28}, {"loss_agg": "seq_mean", "objective": "gspo"}],
    ids=["token_mean", "seq_mean", "dr_grpo-grpo", "seq_mean-gspo"],
)
def test_micro_batches_accumulate_to_the_whole_batch_gradient(loss):
    batch = rollout_with_rewards(seed=2, n_samples=4, batch_size=3)
    assert len(set(batch["completion_mask"].sum(1).tolist())) > 1  # unequal lengths: seq_mean differs from token_mean
    # no clipping: .grad after the step is the accumulated gradient itself
    whole = Trainer(tiny_policy_node(lr=1e-2, grad_clip=0.0), loss_node(**loss))
    micro = Trainer(tiny_policy_node(lr=1e-2, grad_clip=0.0, micro_batch_size=5), loss_node(**loss))  # 12 samples: 5 + 5 + 2
    with GradientMagnitudes(whole.model) as mags:  # the |delta|.|x| sums of the whole batch's backward
        m_whole = whole.train_step(batch)
    m_micro = micro.train_step(batch)
    width = batch["sample_prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
    tolerances = mags.tolerances(seq_len=width, partials=3)  # float32 rounding of both sums (tests/tolerances.py)
    assert m_micro["loss"] == pytest.approx(m_whole["loss"], rel=1e-5, abs=1e-7)
    # the norm of a gradient within tolerances t moves by at most ||t|| (triangle inequality)
    grad_norm_atol = math.sqrt(sum(float(t.double().pow(2).sum()) for t in tolerances.values()))
    assert m_micro["policy/grad_norm"] == pytest.approx(m_whole["policy/grad_norm"], abs=grad_norm_atol)
    # pi's entropy per token from the same weights, summed in float64 over the micro-batches: the
    # per-token values differ only by the forward's float32 rounding at other batch shapes (a few
    # ulps of ~log 16 = 2.8, i.e. ~1e-6 relative), so rel=1e-5 leaves a 10x margin
    assert m_micro["policy/entropy"] == pytest.approx(m_whole["policy/entropy"], rel=1e-5)
    assert m_micro["policy/tokens"] == m_whole["policy/tokens"] == int(batch["completion_mask"].sum())
    # the gradients themselves (left in .grad after the step), each element within its float32 bound
    grads = dict(micro.model.named_parameters())
    for name, param in whole.model.named_parameters():
        assert_within(grads[name].grad, param.grad, tolerances[name], msg=name)


def test_weights_export_and_import_exactly():
    batch = rollout_with_rewards(seed=3)
    trainer = Trainer(tiny_policy_node(lr=1e-2), loss_node())
    live = trainer.weights()
    trainer.train_step(batch)
    assert trainer.weights() is live  # no copy: the transport copies
    gen = Generator(tiny_generator_node(), seed=0)
    gen.load_weights(trainer.weights(), trainer.version)
    other = Trainer(tiny_policy_node(), loss_node())
    other.load_weights(trainer.weights())
    for name, value in trainer.weights().items():
        assert torch.equal(gen.weight_targets()[name], value) and torch.equal(other.weights()[name], value)
    assert gen.version == 1 and other.version == 0  # importing weights is not an optimizer step


def test_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    batches = [rollout_with_rewards(seed=s) for s in range(3)]
    node = tiny_policy_node(lr=5e-3, schedule="cosine", warmup_steps=1, total_steps=10)
    straight = Trainer(node, loss_node())
    for b in batches:
        straight.train_step(b)
    first = Trainer(node, loss_node())
    first.train_step(batches[0])
    first.train_step(batches[1])
    torch.save(first.state(), tmp_path / "policy.pt")
    resumed = Trainer(node, loss_node())
    resumed.load_state(torch.load(tmp_path / "policy.pt", weights_only=True))
    assert resumed.version == 2
    resumed.train_step(batches[2])
    for name, value in straight.weights().items():
        assert torch.equal(resumed.weights()[name], value), name


def test_state_is_a_copy():
    trainer = Trainer(tiny_policy_node(lr=1e-2), loss_node())
    state = trainer.state()
    trainer.train_step(rollout_with_rewards(seed=0))
    assert not torch.equal(state["model"]["tok_embeddings.weight"], trainer.weights()["tok_embeddings.weight"])


def test_a_checkpoint_of_another_model_is_refused():
    state = Trainer(tiny_policy_node(), loss_node()).state()
    other = Trainer(tiny_policy_node(msgspec.structs.replace(TINY, dim=64)), loss_node())
    with pytest.raises(CheckpointError, match=r"'dim': \(32, 64\)"):
        other.load_state(state)
    with pytest.raises(CheckpointError, match=r"lacks \['optimizer'\]"):
        other.load_state({"version": 0, "model": {}})


@pytest.mark.parametrize(
    ("config", "lrs"),
    [
        (OptimizerConfig(lr=1.0), [1.0, 1.0, 1.0]),
        (OptimizerConfig(lr=1.0, warmup_steps=2), [0.5, 1.0, 1.0]),
        (OptimizerConfig(lr=1.0, schedule="linear", total_steps=4), [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]),
        (OptimizerConfig(lr=1.0, schedule="cosine", warmup_steps=1, total_steps=3), [1.0, 1.0, 0.5, 0.0]),
    ],
    ids=["constant", "warmup", "linear", "cosine"],
)
def test_learning_rate_schedule(config, lrs):
    assert [learning_rate(config, s) for s in range(len(lrs))] == pytest.approx(lrs)


def test_the_step_uses_the_scheduled_rate():
    trainer = Trainer(tiny_policy_node(lr=1e-2, warmup_steps=4), loss_node())
    assert [trainer.train_step(rollout_with_rewards(seed=s))["policy/lr"] for s in range(2)] == pytest.approx([2.5e-3, 5e-3])


def test_unknown_objective_fails_at_construction():
    with pytest.raises(ConfigError, match="unknown loss objective 'reinforce'"):
        Trainer(tiny_policy_node(), loss_node(objective="reinforce"))


def test_missing_fields_are_named():
    batch = rollout_with_rewards(seed=0)
    del batch["behaviour_logprobs"]
    with pytest.raises(ConfigError, match=r"lacks \['behaviour_logprobs'\]"):
        Trainer(tiny_policy_node(), loss_node()).train_step(batch)


def _reference_aipo(
    model: torch.nn.Module, samples: list[dict], *, temperature: float, rho: float, agg: str = "token_mean", width: int = 0,
    masked: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """AIPO's loss written out by hand, one sample at a time with no padding anywhere:
    ``-sum_{s,t} min(pi/mu, rho) * A_s * log pi(y_t) / (real completion tokens in the batch)``,
    ``A_s`` = reward minus the mean reward of the sample's prompt. ``agg="seq_mean"``: each sample's sum
    divided by its length, then by the number of samples; ``"dr_grpo"``: divided by samples * ``width``.
    The samples numbered in ``masked`` keep their reward in the baseline but add no term and no token."""
    by_group: dict[int, list[float]] = {}
    for s in samples:
        by_group.setdefault(s["group"], []).append(s["reward"])
    tokens = sum(len(s["completion"]) for i, s in enumerate(samples) if i not in masked)
    total = torch.zeros(())
    for i, s in enumerate(samples):
        if i in masked:
            continue
        prompt, completion = s["prompt"], s["completion"]
        seq = torch.tensor([prompt + completion])
        logits = model(seq, valid=torch.ones_like(seq, dtype=torch.bool))[0].float()  # [T, V]
        adv = s["reward"] - sum(by_group[s["group"]]) / len(by_group[s["group"]])
        term = torch.zeros(())
        for t, (y, mu) in enumerate(zip(completion, s["mu"])):
            logp = torch.log_softmax(logits[len(prompt) - 1 + t] / temperature, dim=-1)[y]
            weight = min(math.exp(float(logp.detach()) - mu), rho)  # a constant, as AIPO treats it
            term = term - weight * adv * logp
        total = total + (term / len(completion) if agg == "seq_mean" else term)
    if agg == "seq_mean":
        return total / len(samples)
    if agg == "dr_grpo":
        return total / (len(samples) * width)
    return total / tokens


SHAPING_CASES = {  # id: (loss options, completion width C, samples masked as truncated, rewards changed, samples dropped)
    "token_mean": ({}, 7, (), {}, ()),
    "seq_mean": ({"loss_agg": "seq_mean"}, 7, (), {}, ()),
    "dr_grpo": ({"loss_agg": "dr_grpo"}, 7, (), {}, ()),
    # width 6: sample 0 (6 tokens, no completion_stopped field) reached it: truncated
    "mask_truncated": ({"mask_truncated_completions": True}, 6, (0,), {}, ()),
    "mask_truncated-seq_mean": ({"mask_truncated_completions": True, "loss_agg": "seq_mean"}, 6, (0,), {}, ()),
    # Lmax 7, buffer 3: lengths 6, 1, 2, 4, 2, 3 -> penalties -0.5 * (6 - 4) / 3 for sample 0, 0 elsewhere
    "overlong": ({"overlong_buffer": 3, "overlong_penalty": 0.5}, 7, (), {0: 1.0 - 0.5 * 2 / 3}, ()),
    # group 2's rewards made equal (1, 1): dropped; groups 0 and 1 train alone
    "dynamic_sampling": ({"dynamic_sampling": True}, 7, (), {4: 1.0}, (4, 5)),
    # ...and capped at one group (over-sampling's refill): the first group with a signal, group 0, trains alone
    "dynamic_sampling_cap": ({"dynamic_sampling": True, "dynamic_sampling_groups": 1}, 7, (), {4: 1.0}, (2, 3, 4, 5)),
}


@pytest.mark.parametrize("case", list(SHAPING_CASES))
def test_loss_and_gradient_on_a_padded_batch_equal_a_per_sample_reference_normalised_by_real_tokens(case):
    """Prompts of 2-5 tokens (left padding) and completions of 1-6 tokens (right padding, garbage ids
    and log-probs in the padding): loss and gradient equal the hand-written reference above, which
    never sees padding. Normalising by padded tokens, or per sample then over samples, changes both.
    Each aggregation and each shaping option against the reference's own form of it."""
    import copy

    options, C, masked, changed, dropped = SHAPING_CASES[case]
    temperature, rho = 0.8, 1.5
    samples = [  # mu's log-probs are made up: ratios above and below rho
        {"group": 0, "reward": 1.0, "prompt": [1, 4, 5, 13], "completion": [6, 7, 8, 9, 10, 2], "mu": [-2.0, -3.0, -1.0, -2.5, -0.5, -3.5]},
        {"group": 0, "reward": 0.0, "prompt": [1, 4, 5, 13], "completion": [3], "mu": [-2.2]},
        {"group": 1, "reward": 0.5, "prompt": [1, 9], "completion": [11, 12], "mu": [-4.0, -1.5]},
        {"group": 1, "reward": 2.0, "prompt": [1, 9], "completion": [5, 5, 5, 2], "mu": [-2.0, -2.0, -9.0, -0.1]},
        {"group": 2, "reward": -1.0, "prompt": [1, 3, 3, 3, 14], "completion": [4, 2], "mu": [-1.0, -2.0]},
        {"group": 2, "reward": 1.0, "prompt": [1, 3, 3, 3, 14], "completion": [7, 7, 7], "mu": [-3.0, -2.0, -2.5]},
    ]
    for i, r in changed.items():
        if case.startswith("dynamic_sampling"):
            samples[i]["reward"] = r
    S, Tp = len(samples), 5  # C = 7: one padding column beyond the longest completion
    batch = {
        "sample_prompt_ids": torch.tensor([[0] * (Tp - len(s["prompt"])) + s["prompt"] for s in samples]),
        "sample_prompt_lens": torch.tensor([len(s["prompt"]) for s in samples]),
        "completion_ids": torch.tensor([s["completion"] + [15] * (C - len(s["completion"])) for s in samples]),  # 15: not the pad id
        "completion_mask": torch.tensor([[t < len(s["completion"]) for t in range(C)] for s in samples]),
        "behaviour_logprobs": torch.tensor([s["mu"] + [-7.0] * (C - len(s["mu"])) for s in samples]),
        "sampling_temperature": torch.full((S,), temperature),
        "group_ids": torch.tensor([s["group"] for s in samples]),
        "rewards": torch.tensor([s["reward"] for s in samples]),
    }
    trainer = Trainer(tiny_policy_node(grad_clip=0.0), loss_node(rho=rho, **options))
    reference = copy.deepcopy(trainer.model)
    metrics = trainer.train_step(batch)
    kept = [dict(s, reward=changed.get(i, s["reward"])) for i, s in enumerate(samples) if i not in dropped]
    with GradientMagnitudes(reference) as mags:  # the reference's |delta|.|x| sums, rows alone
        want = _reference_aipo(
            reference, kept, temperature=temperature, rho=rho, agg=options.get("loss_agg", "token_mean"), width=C, masked=frozenset(masked)
        )
        want.backward()
    # float32 throughout: each gradient element within the bound of two float32 sums of its
    # contributions (the trainer's padded batch: S x (Tp + C) positions, tests/tolerances.py)
    tolerances = mags.tolerances(seq_len=Tp + C, positions=S * (Tp + C), temperature=temperature)
    assert metrics["loss"] == pytest.approx(float(want.detach()), rel=1e-5, abs=1e-6)
    grads = dict(reference.named_parameters())
    for name, param in trainer.model.named_parameters():
        assert_within(param.grad, grads[name].grad, tolerances[name], msg=name)
    if case.startswith("dynamic_sampling"):
        assert metrics["shaping/dropped_groups"] == 1 and metrics["shaping/dropped_samples"] == 2
        assert metrics["shaping/kept_groups"] == 3 - 1 - metrics.get("shaping/surplus_groups", 0.0)
    if case == "dynamic_sampling_cap":
        assert metrics["shaping/surplus_groups"] == 1 and metrics["shaping/kept_groups"] == 1
    if masked:
        assert metrics["shaping/truncated_frac"] == pytest.approx(1 / 6)
