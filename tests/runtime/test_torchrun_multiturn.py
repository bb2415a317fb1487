"""A multi-turn generator on two data-parallel ranks under torchrun runs its episodes against the
environment, as a one-process generator does (``ParallelGenerator.step`` samples through
``GeneratorProgram._sample``), and its metrics rows carry the whole batch's ``env/*`` numbers.

By default one torchrun job of 2 ranks (``guess_game``: generator replicas on ranks 0-1, the policy
on rank 1), about 26 s at load 15 on 2 cores; ``--runslow`` adds a tp2 generator (3 ranks).
``continuous_guess_game`` is the same game with continuous batching, for a by-hand run on a tp group
(slow on 2 loaded cores: a thread per parked environment call).
"""

from __future__ import annotations

import json

import pytest

from flowrl.examples.agents import build_guess_game
from flowrl.operators.engines import build_engine
from flowrl.operators.multiturn import MultiTurnGenerator, row_fields
from flowrl.operators.source import PromptSource
from flowrl.runtime.distributed import split_prompts

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


@pytest.mark.parametrize(
    ("placement", "nproc", "replicas"),
    [
        ({"gen": [0, 1], "policy": [1]}, 2, 2),
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
