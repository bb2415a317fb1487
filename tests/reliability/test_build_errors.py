"""A node whose program cannot be built (a user factory that raises) is one clear error naming the
node, in every backend, and a run that fails before its first step leaves no output file."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.errors import NodeBuildError
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import ModelConfig
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph
from flowrl.runtime.programs.synthetic import synthetic_programs
from tests.reliability.badinput import clean_error, run_cli

TINY = ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=2, max_seq_len=32)


def _graph(task: str = "copy"):
    b = GraphBuilder("tiny", model=TINY)
    prompts = b.source("prompts", task=task, batch_size=2)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=3)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    loss = b.loss("aipo", gen, reward)
    policy = b.policy("policy", loss)
    b.weights(policy, gen, max_staleness=0)
    return b.build()


@pytest.mark.parametrize("backend", ["local", "process"])
def test_a_factory_that_raises_is_a_node_build_error(backend: str, tmp_path: Path) -> None:
    g = _graph()
    programs = {**synthetic_programs(g), "gen": "tests.reliability.userfns:failing_program"}
    metrics, trace = tmp_path / "m.jsonl", tmp_path / "t.json"
    config = RunConfig(steps=3, backend=backend, programs=programs, metrics=str(metrics), trace=str(trace), stall_timeout_s=30)
    with pytest.raises(NodeBuildError, match=r"node 'gen' \(generator\): building its program failed: ValueError: cannot build a program for gen \(raised at .*userfns.py, line \d+\)") as info:
        run_graph(g, config)
    assert info.value.node == "gen" and info.value.step is None
    assert not metrics.exists() and not trace.exists()


def test_a_task_that_raises_through_the_cli_is_exit_2_naming_the_node(tmp_path: Path) -> None:
    from flowrl.graph.serialize import to_json

    path = tmp_path / "g.json"
    path.write_text(to_json(_graph(task="tests.reliability.userfns:failing_task")))
    out = tmp_path / "out"
    out.mkdir()
    outcome = run_cli(["run", str(path), "--steps", "3", "--quiet", "--metrics", str(out / "m.jsonl"), "--trace", str(out / "t.json"),
                       "--checkpoint-dir", str(out / "ck")])
    problem = clean_error(outcome, str(out), r"node 'prompts' \(source\): building its program failed: .*no dataset shard for seed 0")
    assert problem is None, problem


def test_a_run_failing_at_step_0_leaves_no_metrics_or_trace(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    outcome = run_cli(["run", "--synthetic", "--steps", "5", "--quiet", "--option", "fail_node=gen", "--option", "fail_step=0",
                       "--metrics", str(out / "m.jsonl"), "--trace", str(out / "t.json")])
    assert outcome.code == 1 and "node 'gen' (generator) failed at step 0" in outcome.stderr, outcome.stderr
    assert not any(out.iterdir()), sorted(p.name for p in out.iterdir())


def test_a_run_failing_later_keeps_its_metrics_and_says_so(tmp_path: Path) -> None:
    m = tmp_path / "m.jsonl"
    outcome = run_cli(["run", "--synthetic", "--steps", "8", "--quiet", "--option", "fail_node=policy", "--option", "fail_step=4",
                       "--metrics", str(m)])
    assert outcome.code == 1
    assert f"the metrics of the 4 steps done are kept in {m}" in " ".join(outcome.stderr.split())
    from flowrl.runtime.observe.metrics import read_metrics

    assert [r["step"] for r in read_metrics(m)] == [1, 2, 3, 4]
