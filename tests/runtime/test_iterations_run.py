"""Runs whose policy takes several optimizer steps per batch: versions, the staleness bound, exact resume.

With ``U = num_iterations * num_mini_batches`` the policy's version advances by ``U`` per trainer step
and ``max_staleness`` k counts trainer steps: the generator samples step ``seq`` with weights of
version ``>= U * (seq - k)``, so a consumed batch is at most ``U * k`` versions old.
"""

from __future__ import annotations

import io

import pytest
import torch

from flowrl.errors import NodeExecutionError
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import ModelConfig
from flowrl.runtime.config import RunConfig
from flowrl.runtime.observe.progress import ProgressBar
from flowrl.runtime.run import run_graph

from tests.runtime.helpers import synthetic_config

MODEL = ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, max_seq_len=32)


def graph(*, k: int, iterations: int = 2, mini_batches: int = 2, objective: str = "decoupled_ppo"):
    b = GraphBuilder("iters", model=MODEL)
    prompts = b.source("prompts", task="copy", batch_size=4)
    gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=4)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    loss = b.loss("loss", gen, reward, objective=objective, normalize_std=True)
    policy = b.policy("policy", loss, lr=1e-2, num_iterations=iterations, num_mini_batches=mini_batches)
    b.weights(policy, gen, max_staleness=k)
    return b.build()


@pytest.mark.parametrize("k", [0, 1, 2])
def test_the_bound_counts_trainer_steps_of_u_versions(k):
    """A fast generator and a slow trainer (synthetic programs): every batch is at most ``U * k``
    versions old, and the generator does run that far ahead (so k counts steps, not versions)."""
    g = graph(k=k)  # U = 4
    result = run_graph(g, synthetic_config(g, steps=8, options={"gen_s": 0.0, "train_s": 0.02}))
    assert [r["policy_version"] for r in result.rows] == [4 * s for s in range(1, 9)]
    stale = [r["staleness"] for r in result.rows]
    assert all(r["rollout_version"] % 4 == 0 for r in result.rows)  # only whole batches are published
    assert all(0 <= s <= 4 * k for s in stale), stale
    assert max(stale) == 4 * k, stale
    # the rows also say it in the bound's unit (batches) beside k, and the bar prints both, named
    assert [r["staleness_batches"] for r in result.rows] == [s // 4 for s in stale]
    assert {r["max_staleness"] for r in result.rows} == {k}
    worst = next(r for r in result.rows if r["staleness"] == 4 * k)
    out = io.StringIO()
    ProgressBar(8, stream=out)(worst)
    assert f"staleness {k}/{k} batch{'es' if k != 1 else ''}{f' ({4 * k} versions)' if k else ''} " in out.getvalue(), out.getvalue()


def _real(workdir, steps: int, *, resume: bool = False, stop_at: int | None = None, k: int = 0, backend: str = "local"):
    def stop(row):
        if row["step"] == stop_at:
            raise RuntimeError(f"stopped by the test after step {stop_at}")

    config = RunConfig(steps=steps, backend=backend, checkpoint_dir=str(workdir / "ck"), checkpoint_every=1, metrics=str(workdir / "m.jsonl"),
                       resume=resume, progress=False, stall_timeout_s=120)  # fmt: skip
    return run_graph(graph(k=k), config, on_step=stop)


@pytest.mark.slow  # three short real runs: ~10 s on an idle machine, ~45 s at load 9 (CI time)
@pytest.mark.parametrize("backend", ["local", "process"])
def test_a_real_run_advances_u_versions_a_step_and_resumes_exactly(tmp_path, backend):
    """Real operators, K=2 passes of M=2 mini-batches: versions 4, 8; the old-policy ratio is reported;
    a run stopped after step 2 resumes from its step-1 checkpoint (version 4) and ends with the
    uninterrupted run's weights, bit for bit (the mini-batch order is drawn from the version)."""
    whole = _real(tmp_path / "whole", 2, backend=backend)
    assert [r["policy_version"] for r in whole.rows] == [4, 8]
    assert all(r["staleness"] == 0 for r in whole.rows)  # k = 0: synchronous
    assert all("old/ratio_mean" in r and "dppo/behav_weight_mean" in r for r in whole.rows)
    assert all(abs(r["old/ratio_mean"] - 1.0) > 1e-4 for r in whole.rows)  # later updates move away from the old policy
    with pytest.raises(NodeExecutionError, match="stopped by the test"):
        _real(tmp_path / "cut", 2, stop_at=2, backend=backend)
    assert (tmp_path / "cut" / "ck" / "LATEST").read_text() == "step-00000001"  # named by trainer step (version 4)
    resumed = _real(tmp_path / "cut", 2, resume=True, backend=backend)
    assert [(r["step"], r["policy_version"]) for r in resumed.rows] == [(2, 8)]
    want = torch.load(whole.checkpoint / "policy-policy.pt", weights_only=True)
    got = torch.load(resumed.checkpoint / "policy-policy.pt", weights_only=True)
    assert got["version"] == want["version"] == 8
    assert all(torch.equal(got["model"][n], want["model"][n]) for n in want["model"]), "the resumed run's weights differ"
    assert resumed.rows[0]["prompt_index"] == whole.rows[1]["prompt_index"]
