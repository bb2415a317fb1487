"""A reference that syncs with its policy (TRL's ``sync_ref_model``), from real graph runs.

Every ``sync_steps`` trainer steps the reference becomes ``alpha * policy + (1 - alpha) * reference``:
the checkpoint of the step the sync falls on holds the policy it mixes in, and the reference's own
checkpoint holds the mix, which must equal the same formula computed here, bit for bit in float32
(same operations on the same float32 tensors; no tolerance is involved).
"""

from __future__ import annotations

import pytest
import torch

from flowrl.errors import ConfigError, GraphError
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import ModelConfig
from flowrl.models.causal_lm import weight_dict
from flowrl.models.registry import build_model
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph

MODEL = ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, max_seq_len=32)


def _graph(*, sync_steps: int = 2, alpha: float = 0.6, k: int = 0, iterations: int = 1, ref_edge: bool = True):
    b = GraphBuilder("ref_sync", model=MODEL)
    prompts = b.source("prompts", task="copy", batch_size=2)
    gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=4)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    ref = b.reference("ref", gen, sync_steps=sync_steps, sync_alpha=alpha) if sync_steps else b.reference("ref", gen)
    loss = b.loss("loss", gen, reward, ref, objective="grpo", kl_coef=0.1)
    policy = b.policy("policy", loss, lr=5e-2, num_iterations=iterations)
    b.weights(policy, gen, max_staleness=k)
    if ref_edge:
        b.weights(policy, ref)
    return b.build()


def _parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    names = {n for n, _ in model.named_parameters()}
    return {n: t for n, t in weight_dict(model).items() if n in names}


@pytest.mark.parametrize(
    ("k", "iterations", "backend"), [(0, 1, "local"), (1, 2, "local"), (1, 1, "process")], ids=["k0", "k1-two-updates", "k1-processes"]
)
def test_the_reference_is_the_hand_mix_after_its_sync(tmp_path, k, iterations, backend):
    alpha = 0.6
    graph = _graph(sync_steps=2, alpha=alpha, k=k, iterations=iterations)
    result = run_graph(graph, RunConfig(steps=4, checkpoint_dir=str(tmp_path), checkpoint_every=2, device="cpu", backend=backend))
    assert result.version == 4 * iterations
    at_2, at_4 = sorted(tmp_path.glob("step-*"))  # the checkpoints of steps 2 and 4
    policy_at_2 = torch.load(at_2 / "policy-policy.pt", weights_only=True)  # what the sync after step 2 mixes in
    assert policy_at_2["version"] == 2 * iterations
    policy_at_2 = policy_at_2["model"]
    reference = torch.load(at_4 / "reference-ref.pt", weights_only=True)
    assert reference["synced_at"] == 2  # one sync in 4 steps: after step 2 (the one after step 4 is past the run's end)
    before = _parameters(build_model(MODEL))  # the reference starts as the policy's version 0
    assert sorted(reference["weights"]) == sorted(before)
    changed = 0
    for name, ref_before in before.items():
        expected = alpha * policy_at_2[name] + (1 - alpha) * ref_before
        assert torch.equal(reference["weights"][name], expected), name
        changed += not torch.equal(expected, ref_before)
    assert changed  # the policy moved, so the mix is not the initial reference
    syncs = [r for r in result.rows if "ref/sync_s/ref" in r]
    assert [r["step"] for r in syncs] == [3]  # the sync's time is in the row of the batch it scored first


def test_a_frozen_reference_keeps_no_state(tmp_path):
    graph = _graph(sync_steps=0, ref_edge=False)
    run_graph(graph, RunConfig(steps=2, checkpoint_dir=str(tmp_path), checkpoint_every=2, device="cpu"))
    (checkpoint,) = tmp_path.glob("step-*")
    assert sorted(p.name for p in checkpoint.glob("*.pt")) == ["policy-policy.pt"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(sync_steps=2, ref_edge=False), GraphError, r"reference 'ref' has sync_steps=2 .* b\.weights\('policy', 'ref'\)"),
        (dict(sync_steps=0, ref_edge=True), GraphError, r"reference 'ref', which is frozen \(sync_steps=0\)"),
        (dict(sync_steps=-1), ConfigError, r"sync_steps=-1 must be an integer >= 0"),
        (dict(sync_steps=2, alpha=1.5), ConfigError, r"sync_alpha=1.5 must be in \(0, 1\]"),
        (dict(sync_steps=2, alpha=0.0), ConfigError, r"sync_alpha=0.0 must be in \(0, 1\]"),
    ],
    ids=["no-weight-edge", "edge-into-frozen", "negative-steps", "alpha-above-1", "alpha-0"],
)
def test_bad_reference_sync_is_refused_at_build(kwargs, error, match):
    with pytest.raises(error, match=match):
        _graph(**kwargs)


def test_sync_alpha_without_sync_steps_is_refused():
    b = GraphBuilder("x", model=MODEL)
    gen = b.generator("gen", b.source("prompts", task="copy"))
    with pytest.raises(ConfigError, match=r"sync_alpha=0.5 applies when the reference syncs: set sync_steps=N"):
        b.reference("ref", gen, sync_alpha=0.5)


@pytest.mark.parametrize("option", ["sync_ref_model", "ref_model_sync_steps", "ref_model_mixup_alpha", "sync_steps"])
def test_a_reference_sync_option_without_a_reference_node_says_how_to_add_one(option):
    b = GraphBuilder("x", model=MODEL)
    gen = b.generator("gen", b.source("prompts", task="copy"))
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    with pytest.raises(ConfigError, match=r"this graph has none yet: declare one with the sync, ref = b\.reference\('ref', gen, sync_steps=N"):
        b.loss("loss", gen, reward, **{option: 1})


def test_a_resumed_run_continues_the_synced_reference(tmp_path):
    """Checkpointed after step 3 (one sync done) and resumed to step 5, the reference is the one an
    uninterrupted 5-step run ends with: the mix is saved, and not applied twice."""
    graph = _graph(sync_steps=2)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_graph(graph, RunConfig(steps=5, checkpoint_dir=str(whole), device="cpu"))
    run_graph(graph, RunConfig(steps=3, checkpoint_dir=str(parts), device="cpu"))
    resumed = run_graph(graph, RunConfig(steps=5, checkpoint_dir=str(parts), resume=True, device="cpu"))
    assert [r["step"] for r in resumed.rows] == [4, 5]
    end_whole = torch.load(max(whole.glob("step-*")) / "reference-ref.pt", weights_only=True)
    end_parts = torch.load(max(parts.glob("step-*")) / "reference-ref.pt", weights_only=True)
    assert end_whole["synced_at"] == end_parts["synced_at"] == 4
    for name, t in end_whole["weights"].items():
        assert torch.equal(end_parts["weights"][name], t), name


def test_a_lora_policy_cannot_sync_a_reference():
    from flowrl.graph.configs import HFModelConfig

    b = GraphBuilder("lora_ref", model=HFModelConfig(path="/models/qwen", init="random"))
    gen = b.generator("gen", b.source("prompts", task="copy"))
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    ref = b.reference("ref", gen, sync_steps=4)
    policy = b.policy("policy", b.loss("loss", gen, reward, ref, kl_coef=0.1), lora=dict(r=4))
    b.weights(policy, gen)
    b.weights(policy, ref)
    with pytest.raises(GraphError, match=r"reference 'ref' syncs with 'policy', a LoRA policy, which sends its adapters only"):
        b.build()


def torchrun_graph():
    """The graph the torchrun case runs (``flowrl run tests.runtime.test_reference_sync:torchrun_graph``)."""
    return _graph(sync_steps=2, k=1, iterations=2)


@pytest.mark.slow  # a 3-rank torchrun job, ~29 s (CI time); the same mix is checked on the process backend in the default run
def test_under_torchrun_the_reference_on_its_own_rank_is_the_hand_mix(tmp_path):
    """Generator, reference and policy on ranks 0, 1, 2: the policy's weights reach the reference over
    the collective transport, and its mix after step 2 is the formula's, bit for bit."""
    from tests.runtime.test_torchrun import _torchrun

    (tmp_path / "place.json").write_text('{"gen": [0], "ref": [1], "policy": [2]}')
    proc = _torchrun(3, ["-m", "flowrl", "run", "tests.runtime.test_reference_sync:torchrun_graph", "--backend", "torchrun",
                         "--plan", "place.json", "--steps", "3", "--quiet", "--checkpoint-dir", "ck", "--checkpoint-every", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    at_2, at_3 = sorted((tmp_path / "ck").glob("step-*"))
    policy = torch.load(at_2 / "policy-policy.pt", weights_only=True)
    reference = torch.load(at_3 / "reference-ref.pt", weights_only=True)
    assert (policy["version"], reference["synced_at"]) == (4, 2)
    for name, before in _parameters(build_model(MODEL)).items():
        assert torch.equal(reference["weights"][name], 0.6 * policy["model"][name] + (1 - 0.6) * before), name
