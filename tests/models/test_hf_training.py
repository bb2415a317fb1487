"""Training Hugging Face models: the trainer's gradient against plain autograd on the HF model itself."""

from __future__ import annotations

import pytest
import torch

from flowrl.graph.nodes import LossNode
from flowrl.operators.generation import Generator
from flowrl.operators.trainer import Trainer
from tests.models.helpers import hf_generator_node, hf_policy_node, hf_reference_model, left_padded, reference_logprobs
from tests.tolerances import GradientMagnitudes, assert_within, ratio_atol, rollout_logprob_atol

pytest.importorskip("transformers")

PROMPTS = [[1, 5, 6, 7], [1, 12], [1, 20, 21, 22, 23]]


def _rollout(directory, temperature: float = 1.0, seed: int = 0) -> dict[str, torch.Tensor]:
    out = Generator(hf_generator_node(directory, n_samples=2, temperature=temperature), seed=seed).generate(left_padded(PROMPTS))
    rewards = torch.linspace(-1, 1, out["completion_ids"].shape[0])
    return {**out, "rewards": rewards}


@pytest.mark.parametrize("micro_batch_size", [0, 2], ids=["whole", "micro2"])
def test_trainer_gradient_equals_autograd_on_the_hf_model(hf_dir, micro_batch_size):
    batch = _rollout(hf_dir, temperature=0.8)
    trainer = Trainer(hf_policy_node(hf_dir, grad_clip=0.0, micro_batch_size=micro_batch_size), LossNode(name="aipo"))
    trainer.train_step(batch)
    ref = hf_reference_model(hf_dir)
    with GradientMagnitudes(ref) as mags:  # the reference's |delta|.|x| sums (tests/tolerances.py)
        logprobs = reference_logprobs(ref, batch, temperature=0.8)  # each row alone: no padding, no flowrl code
        # AIPO written out (defaults: rho 4, group-mean baseline), summed over real tokens / their count
        mask, rewards, groups = batch["completion_mask"], batch["rewards"], batch["group_ids"].tolist()
        adv = [float(rewards[s]) - sum(float(rewards[j]) for j in range(len(groups)) if groups[j] == g) / groups.count(g)
               for s, g in enumerate(groups)]
        total = torch.zeros(())
        for s in range(mask.shape[0]):
            for t in range(int(mask[s].sum())):
                ratio = float((logprobs[s, t].detach() - batch["behaviour_logprobs"][s, t]).exp())
                total = total - min(ratio, 4.0) * adv[s] * logprobs[s, t]
        loss = total / int(mask.sum())
        loss.backward()
    # each element within the bound of two float32 sums of its contributions: the trainer's padded batch
    # (its positions, its micro-batches) against rows alone
    S, width = batch["completion_ids"].shape[0], batch["sample_prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
    partials = -(-S // micro_batch_size) if micro_batch_size else 1
    tolerances = mags.tolerances(seq_len=width, positions=S * width, partials=partials, temperature=0.8)
    mine = dict(trainer.model.named_parameters())
    checked = 0
    for name, param in ref.named_parameters():
        assert name in mine, name
        assert_within(mine[name].grad, param.grad, tolerances[name], msg=name)
        checked += 1
    assert checked == len(list(ref.parameters()))


@pytest.mark.parametrize("sampling", [dict(top_p=0.9), dict(top_k=8, temperature=0.8)], ids=["top-p", "top-k"])
def test_on_policy_ratio_is_one_with_truncation_on_the_hf_model(hf_dir, sampling):
    """The HF path truncates pi by its own kept set too: at k = 0 ratio 1 and mismatch 0 within float32 rounding."""
    trainer = Trainer(hf_policy_node(hf_dir), LossNode(name="aipo"))
    out = Generator(hf_generator_node(hf_dir, n_samples=2, **sampling), seed=0).generate(left_padded(PROMPTS))
    atol = rollout_logprob_atol(trainer.model, out, temperature=sampling.get("temperature", 1.0))
    metrics = trainer.train_step({**out, "rewards": torch.linspace(-1, 1, out["completion_ids"].shape[0])})
    assert metrics["aipo/ratio_mean"] == pytest.approx(1.0, abs=ratio_atol(atol)) and metrics["aipo/ratio_max"] == pytest.approx(1.0, abs=ratio_atol(atol))
    assert metrics["mismatch/tokens"] == int(out["completion_mask"].sum()) and metrics["mismatch/abs_logp_max"] < atol

def test_gradient_checkpointing_gives_the_same_gradient(hf_llama_dir):
    batch = _rollout(hf_llama_dir)
    grads = []
    for ckpt in (False, True):
        trainer = Trainer(hf_policy_node(hf_llama_dir, grad_clip=0.0, gradient_checkpointing=ckpt), LossNode(name="aipo"))
        assert getattr(trainer.model.model.layers[0], "gradient_checkpointing", False) == ckpt
        if ckpt:
            trainer.train_step(batch)
        else:  # the |delta|.|x| sums of the plain backward (a recomputing one would count its forwards twice)
            with GradientMagnitudes(trainer.model) as mags:
                trainer.train_step(batch)
            width = batch["sample_prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
            tolerances = mags.tolerances(seq_len=width)
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
    # recomputed blocks run the same kernels on the same inputs: usually the same bits, within float32
    # rounding of the same sums otherwise (tests/tolerances.py)
    for name in grads[0]:
        assert_within(grads[1][name], grads[0][name], tolerances[name], msg=name)


def test_bf16_autocast_trains_float32_master_weights(hf_llama_dir):
    batch = _rollout(hf_llama_dir)
    trainer = Trainer(hf_policy_node(hf_llama_dir, autocast="bfloat16"), LossNode(name="aipo"))
    before = {n: t.clone() for n, t in trainer.weights().items()}
    metrics = trainer.train_step(batch)
    assert all(t.dtype == torch.float32 for t in trainer.weights().values())
    assert any(not torch.equal(before[n], t) for n, t in trainer.weights().items())
    assert abs(metrics["aipo/ratio_mean"] - 1.0) < 0.05  # bf16 forward: close to, not exactly, on-policy


def test_policy_generator_and_reference_from_one_random_config_start_equal(hf_llama_dir, tmp_path):
    from tests.hf_fixtures import make_hf_dir

    from flowrl.graph.configs import HFModelConfig
    from flowrl.graph.nodes import GeneratorNode, PolicyNode
    from flowrl.models import build_model

    directory = make_hf_dir(tmp_path / "cfg", "llama", weights=False)
    config = HFModelConfig(path=str(directory), init="random", seed=7)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a = build_model(config)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is untouched
    torch.rand(5)
    b = build_model(config)
    c = build_model(HFModelConfig(path=str(directory), init="random", seed=8))
    for (name, x), y, z in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(x, y), name
    assert any(not torch.equal(x, z) for x, z in zip(a.state_dict().values(), c.state_dict().values()))
    gen = Generator(GeneratorNode(name="gen", model=config), seed=0)
    trainer = Trainer(PolicyNode(name="policy", model=config), LossNode(name="aipo"))
    assert all(torch.equal(gen.weight_targets()[n], t) for n, t in trainer.weights().items())
