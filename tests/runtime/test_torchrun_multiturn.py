"""A multi-turn generator on two data-parallel ranks under torchrun runs its episodes against the
environment, as a one-process generator does (``ParallelGenerator.step`` samples through
``GeneratorProgram._sample``), and its metrics rows carry the whole batch's ``env/*`` numbers.

One torchrun job of 2 ranks (``guess_game``: generator replicas on ranks 0-1, the policy on rank 1),
about 30 s at load 15 on 2 cores.
"""

from __future__ import annotations

import json

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


def test_generator_replicas_run_the_environments_episodes(tmp_path):
    (tmp_path / "place.json").write_text(json.dumps({"gen": [0, 1], "policy": [1]}))
    proc = _torchrun(2, ["-m", "flowrl", "run", "guess_game", "--backend", "torchrun", "--plan", "place.json",
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
        assert row["reward_mean"] == row["env/reward_mean"], row
    # step 1 samples with the initial weights: the same episodes as one-process generators over each replica's part
    one = _one_process_episodes(replicas=2)
    assert rows[0]["samples"] == one["samples"]
    assert rows[0]["env/turns_mean"] == one["env/turns_mean"], (rows[0]["env/turns_mean"], one)
