"""Cadences count trainer steps: ``eval_every``, ``log_samples`` and ``checkpoint_every`` fire after the
same steps whatever the updates per batch (here 2: ``num_iterations=2``, so the version is twice the
step), and an evaluation cadence that would never fire within ``steps`` is refused before any work."""

from __future__ import annotations

import json

import pytest

from flowrl.cli.main import main
from flowrl.errors import ConfigError
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig
from flowrl.graph.ir import Graph
from flowrl.runtime.config import RunConfig


def _two_update_hf_copy(batch_size: int = 4) -> Graph:
    """hf_copy (its model, prompt file and text reward: a file source, which evaluation needs) with two
    optimizer steps per batch."""
    from flowrl.examples.hf_copy import ASSETS

    b = GraphBuilder("hf_copy_u2", model=HFModelConfig(path=str(ASSETS), init="random", seed=0))
    prompts = b.source("prompts", data=str(ASSETS / "prompts.jsonl"), prompt_field="prompt", batch_size=batch_size)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=4)
    score = b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text")
    loss = b.loss("loss", gen, score, objective="grpo")
    policy = b.policy("policy", loss, lr=1e-3, num_iterations=2)
    b.weights(policy, gen, max_staleness=1)
    return b.build()


def _held(path, n: int = 3):
    from flowrl.examples.hf_copy import make_prompts

    path.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in make_prompts(600 + n, seed=7)[600:]))
    return path


def test_eval_samples_and_checkpoints_fire_on_trainer_steps_with_two_updates_per_batch(tmp_path):
    from flowrl.runtime.run import run_graph

    graph = _two_update_hf_copy()
    assert graph.updates_per_batch() == 2
    ck = tmp_path / "ck"
    config = RunConfig(
        steps=4, eval_every=2, eval_data=str(_held(tmp_path / "held.jsonl")), eval_samples=1, log_samples=2,
        checkpoint_dir=str(ck), checkpoint_every=2, keep_checkpoints=5, progress=False,
    )  # fmt: skip
    result = run_graph(graph, config)
    assert [(r["step"], r["policy_version"]) for r in result.rows] == [(1, 2), (2, 4), (3, 6), (4, 8)]
    assert [r["step"] for r in result.rows if "eval/greedy_reward_mean" in r] == [2, 4]  # not every version 2: steps 1..4
    assert [r.get("eval/version") for r in result.rows] == [None, 4, None, 8]  # the policy after that step
    assert [r["step"] for r in result.rows if "samples_text" in r] == [2, 4]
    metas = sorted((p.name, json.loads((p / "meta.json").read_text())["version"]) for p in ck.glob("step-*"))
    assert metas == [("step-00000002", 4), ("step-00000004", 8)]  # named by the trainer step, holding versions 4 and 8


def test_an_eval_cadence_that_never_fires_is_refused_for_python_users():
    with pytest.raises(ConfigError, match=r"eval_every=5 never fires within steps=4 \(it counts trainer steps\)"):
        RunConfig(steps=4, eval_every=5, eval_data="held.jsonl")
    assert RunConfig(steps=4, eval_every=4, eval_data="held.jsonl").eval_every == 4  # fires once, at the last step


def test_an_eval_cadence_that_never_fires_is_a_cli_error_before_any_work(tmp_path, capsys):
    held = _held(tmp_path / "held.jsonl")
    argv = ["run", "hf_copy", "--steps", "3", "--quiet", "--checkpoint-dir", str(tmp_path / "ck"), "--eval-every", "5", "--eval-data", str(held)]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--eval-every 5 never fires within --steps 3 (it counts trainer steps): set --eval-every to at most 3, or --steps 5 or more" in err, err
    assert "Traceback" not in err
    assert "flowrl run: graph" not in err and not (tmp_path / "ck").exists()  # refused before the run starts

