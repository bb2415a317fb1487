"""Operators on a device: the model lives there, inputs move there, every output returns on the CPU.

The CPU cases run everywhere (device="cpu" passed explicitly, and the "meta" device standing in for an
accelerator where only placement is checked); the CUDA cases are skipped visibly without a GPU and,
on a GPU machine, check that sampling and training happen on it and the on-policy ratio stays 1.
"""

from __future__ import annotations

import io

import pytest
import torch

from flowrl.graph.nodes import LossNode, ReferenceNode
from flowrl.operators.generation import Generator
from flowrl.operators.reference import Reference
from flowrl.operators.source import PromptSource
from flowrl.operators.trainer import Trainer
from tests.operators.helpers import source_node, tiny_generator_node, tiny_policy_node

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")


def _on_policy(device: str, temperature: float = 0.7) -> tuple[Generator, Trainer, dict[str, torch.Tensor]]:
    gen = Generator(tiny_generator_node(n_samples=4, max_new_tokens=6, temperature=temperature), seed=0, device=device)
    trainer = Trainer(tiny_policy_node(), LossNode(name="aipo"), device=device)
    gen.load_weights(trainer.weights(), trainer.version)
    rollout = gen.generate(PromptSource(source_node("copy", 4)).next_batch())
    return gen, trainer, {**rollout, "rewards": torch.linspace(0, 1, rollout["completion_ids"].shape[0])}


def _devices(tensors) -> set[str]:
    return {t.device.type for t in tensors}


@pytest.mark.parametrize("kind", ["generator", "policy", "reference"])
def test_models_are_built_on_the_device_given(kind):
    """The "meta" device stands in for an accelerator: nothing but placement is checked."""
    node = tiny_policy_node()
    built = {
        "generator": lambda: Generator(tiny_generator_node(), device="meta").model,
        "policy": lambda: Trainer(node, LossNode(name="aipo"), device="meta").model,
        "reference": lambda: Reference(ReferenceNode(name="ref", model=node.model), device="meta").model,
    }[kind]()
    assert _devices(built.parameters()) == {"meta"}


def test_cpu_given_explicitly_is_todays_cpu_path():
    default = Generator(tiny_generator_node(n_samples=3, max_new_tokens=5), seed=3)
    explicit = Generator(tiny_generator_node(n_samples=3, max_new_tokens=5), seed=3, device="cpu")
    prompts = PromptSource(source_node("copy", 2)).next_batch()
    a, b = default.generate(prompts), explicit.generate(prompts)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert _devices(b.values()) == {"cpu"}


def test_trainer_state_is_on_the_cpu_and_loads_into_a_fresh_trainer():
    _, trainer, batch = _on_policy("cpu")
    trainer.train_step(batch)
    state = trainer.state()
    tensors = [*state["model"].values()] + [v for s in state["optimizer"]["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert _devices(tensors) == {"cpu"}
    assert all(t.data_ptr() != w.data_ptr() for t, w in zip(state["model"].values(), trainer.model.state_dict().values()))
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    fresh = Trainer(tiny_policy_node(), LossNode(name="aipo"), device="cpu")
    fresh.load_state(torch.load(buf, weights_only=True, map_location="cpu"))
    assert fresh.version == 1
    assert all(torch.equal(fresh.weights()[k], v) for k, v in trainer.weights().items())


@needs_cuda
def test_cuda_generator_and_trainer_stay_on_policy():
    gen, trainer, batch = _on_policy("cuda:0")
    assert _devices(gen.model.parameters()) == {"cuda"} and _devices(gen.weight_targets().values()) == {"cuda"}
    assert _devices(trainer.model.parameters()) == {"cuda"} and _devices(trainer.weights().values()) == {"cuda"}
    assert _devices(batch.values()) == {"cpu"}  # channels and the wire carry CPU tensors
    metrics = trainer.train_step(batch)
    assert metrics["aipo/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["aipo/kl"] == pytest.approx(0.0, abs=1e-5)
    assert _devices(v for s in trainer.state()["optimizer"]["state"].values() for v in s.values() if isinstance(v, torch.Tensor)) == {"cpu"}
    ref = Reference(ReferenceNode(name="ref", model=trainer.node.model), device="cuda:0")
    assert ref.logprobs(batch)["ref_logprobs"].device.type == "cpu"


@needs_cuda
def test_cuda_sampling_is_reproducible_on_the_device():
    prompts = PromptSource(source_node("copy", 2)).next_batch()
    a = Generator(tiny_generator_node(n_samples=3, max_new_tokens=5), seed=3, device="cuda:0").generate(prompts)
    b = Generator(tiny_generator_node(n_samples=3, max_new_tokens=5), seed=3, device="cuda:0").generate(prompts)
    assert all(torch.equal(a[k], b[k]) for k in a)
