"""A multi-turn generator on several torchrun ranks (replicas or a tp group) runs its episodes against the
environment, as a one-process generator does (``ParallelGenerator.step`` samples through
``GeneratorProgram._sample``), and its metrics rows carry the whole batch's ``env/*`` numbers.

By default a fast in-process check (``ParallelGenerator.step`` on a one-rank gloo group, ~9 s);
``--runslow`` adds the torchrun jobs of ``guess_game``: generator replicas on ranks 0-1 with the
policy on rank 1 (dp2: 26 s at load 15, up to 100 s at load 24 on 2 cores), and a tp2 generator (3 ranks).
``continuous_guess_game`` is the same game with continuous batching, for a by-hand run on a tp group
(slow on 2 loaded cores: a thread per parked environment call).
"""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.examples.agents import build_guess_game
from flowrl.operators.engines import build_engine
from flowrl.operators.multiturn import MultiTurnGenerator, row_fields
from flowrl.operators.source import PromptSource
from flowrl.runtime.parallel.distributed import split_prompts

from tests.runtime.test_torchrun import _torchrun


def _one_process_episodes(replicas: int) -> dict[str, float]:
    """The first step's ``env/*`` numbers as one-process generators (seed 0, the initial weights) give
    them over each replica's part of the first prompt batch, combined over all samples."""
    graph = build_guess_game(max_staleness=0)
    (node,) = graph.nodes_of_kind("generator")
    (source,) = graph.nodes_of_kind("source")
    prompts = PromptSource(source).next_batch()
    turns, failed, samples = 0.0, 0.0, 0
    for part in split_prompts(prompts, replicas):
        episodes = MultiTurnGenerator(build_engine(node, seed=0), node, rows=row_fields(graph, node.name))
        rollout, metrics = episodes.generate(part)
        S = int(rollout["completion_ids"].shape[0])
        turns += metrics["env/turns_mean"] * S
        failed += metrics["env/failed"]
        samples += S
    return {"env/turns_mean": turns / samples, "env/failed": failed, "samples": samples}


def test_a_generator_rank_program_samples_episodes_in_one_process(tmp_path, monkeypatch):
    """Fast check of the same path: ``ParallelGenerator.step`` on a one-rank gloo group (lock step)
    runs the environment's episodes, equal to ``MultiTurnGenerator`` over the same prompts."""
    import torch.distributed as dist

    from flowrl.runtime.backends.torchrun.rank_programs import ParallelGenerator, RankContext, set_context
    from flowrl.runtime.programs.nodes import ProgramEnv

    graph = build_guess_game(max_staleness=0)
    (node,) = graph.nodes_of_kind("generator")
    (source,) = graph.nodes_of_kind("source")
    prompts = PromptSource(source).next_batch()
    monkeypatch.setattr(ParallelGenerator, "_sync", lambda self, min_version: 0.0)  # the initial weights: no transport
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    set_context(RankContext(rank=0, world=1, ranks={node.name: (0,)}, programs={}))
    try:
        program = ParallelGenerator(node, graph, ProgramEnv(), None, group=None, ranks=(0,), mesh=None)  # type: ignore[arg-type]
        rollout, info = program.step(0, prompts, 0)
    finally:
        set_context(None)
        dist.destroy_process_group()
    want, metrics = MultiTurnGenerator(build_engine(node, seed=0), node, rows=row_fields(graph, node.name)).generate(prompts)
    assert torch.equal(rollout["env_turns"], want["env_turns"]) and torch.equal(rollout["completion_ids"], want["completion_ids"])
    assert bool((rollout["env_turns"] > 1).any())  # some first guesses were wrong: the environment answered
    assert info["env/turns_mean"] == metrics["env/turns_mean"] and info["env/failed"] == 0.0


@pytest.mark.parametrize(
    ("placement", "nproc", "replicas"),
    [
        pytest.param({"gen": [0, 1], "policy": [1]}, 2, 2, marks=pytest.mark.slow),
        pytest.param({"policy": [0], "gen": {"ranks": [1, 2], "mesh": {"tp": 2}}}, 3, 1, marks=pytest.mark.slow),
    ],
    ids=["dp2", "tp2"],
)
def test_generator_ranks_run_the_environments_episodes(tmp_path, placement, nproc, replicas):
    """dp2: two replicas, each a part of the prompts; tp2: one replica over two tp ranks, each running
    the episodes (the environment answers each rank alike, so the ranks' token checksums agree)."""
    (tmp_path / "place.json").write_text(json.dumps(placement))
    proc = _torchrun(nproc, ["-m", "flowrl", "run", "guess_game", "--backend", "torchrun", "--plan", "place.json",
                         "--steps", "2", "--quiet", "--metrics", "m.jsonl", "--max-staleness", "0"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 2
    expected = sorted(MultiTurnGenerator.metrics([], 0.0))
    for row in rows:
        assert sorted(k for k in row if k.startswith("env/")) == expected, row
        assert row["env/failed"] == 0.0
        assert row["env/env_tokens"] > 0.0  # a wrong first guess gets the environment's "+" or "-"
        # the trainer's reward is the mean of the merged rollout's env_rewards: every replica's episodes
        # (rewards 0, 0.5, 1 over 256 samples: both means are exact in float32 and float64)
        assert row["reward_mean"] == row["env/reward_mean"], row
    # step 1 samples with the initial weights: the same episodes as one-process generators over each
    # replica's part (integer turns over 256 samples: an exact mean)
    one = _one_process_episodes(replicas)
    assert rows[0]["samples"] == one["samples"]
    assert rows[0]["env/turns_mean"] == one["env/turns_mean"], (rows[0]["env/turns_mean"], one)


def continuous_guess_game():
    """``guess_game`` with continuous batching (the generator parks episodes between turns)."""
    from flowrl.examples.llamarl import train_with_aipo
    from flowrl.graph.builder import GraphBuilder

    b = GraphBuilder("guess_game_continuous", model=build_guess_game().nodes_of_kind("generator")[0].model)
    prompts = b.source("prompts", task="flowrl.envs.games:guess_task", batch_size=16)
    gen = b.generator("gen", prompts, n_samples=16, max_new_tokens=3, env="flowrl.envs.games:GuessNumberEnv", max_turns=2,
                      batching="continuous", slots=64)
    train_with_aipo(b, gen, lr=2e-3, max_staleness=1)
    return b.build()
