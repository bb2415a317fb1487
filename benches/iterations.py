"""Several updates per batch on the default example: reward and seconds per step for each ``num_iterations``.

For each K in ``--k``: a run of the built-in ``llamarl`` pipeline (its policy with ``num_iterations=K``,
everything else as the example has it) for ``--steps`` steps, then the trainer alone on one batch,
K=1 and K=2 steps alternating (one intra-op thread, medians), so that machine load drifting during
the runs weighs on both alike.

Prints JSON: per K, the mean reward of each tenth of the run, seconds per step after the first
tenth, the mean ``train_s`` and ``gen_s``, the largest staleness (in versions), the final version;
and the trainer's median seconds per batch per K.

    python benches/iterations.py [--steps 40] [--k 1 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402
import torch  # noqa: E402

from flowrl.examples.llamarl import build_llamarl  # noqa: E402
from flowrl.graph.ir import Graph  # noqa: E402
from flowrl.runtime.config import RunConfig  # noqa: E402
from flowrl.runtime.run import run_graph  # noqa: E402


def with_iterations(graph: Graph, k: int) -> Graph:
    """``graph`` with its policy's ``num_iterations`` set to ``k`` (through JSON: a graph is plain data)."""
    from flowrl.graph.serialize import from_json, to_json

    data = json.loads(to_json(graph))
    for node in data["nodes"]:
        if node["kind"] == "policy":
            node["optimizer"]["num_iterations"] = k
    return from_json(json.dumps(data))


def run(k: int, steps: int) -> dict:
    result = run_graph(with_iterations(build_llamarl(), k), RunConfig(steps=steps, progress=False))
    rows = result.rows
    tenth = max(1, steps // 10)
    windows = [rows[i : i + tenth] for i in range(0, steps, tenth)]
    later = rows[tenth:]
    return {
        "reward_by_tenth": [round(sum(r["reward_mean"] for r in w) / len(w), 3) for w in windows],
        "s_per_step": (rows[-1]["time_s"] - rows[tenth - 1]["time_s"]) / max(1, len(later)),
        "train_s": statistics.mean(r["train_s"] for r in later),
        "gen_s": statistics.mean(r["gen_s"] for r in later),
        "staleness_max_versions": max(r["staleness"] for r in rows),
        "final_version": result.version,
    }


def trainer_seconds(ks: list[int], reps: int = 10) -> dict[str, float]:
    from flowrl.operators.generation import Generator
    from flowrl.operators.scoring import Scorer
    from flowrl.operators.source import PromptSource
    from flowrl.operators.trainer import Trainer

    torch.set_num_threads(1)
    g = build_llamarl()
    rollout = Generator(g.node("gen"), seed=0).generate(PromptSource(g.node("prompts")).next_batch())
    batch = {**rollout, **Scorer(g.node("reward")).score(rollout)}
    policy, loss = g.node("policy"), g.loss_of("policy")
    trainers = {k: Trainer(msgspec.structs.replace(policy, optimizer=msgspec.structs.replace(policy.optimizer, num_iterations=k)), loss) for k in ks}
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(reps + 2):
        for k, trainer in trainers.items():
            start = time.perf_counter()
            trainer.train_step(batch)
            times[k].append(time.perf_counter() - start)
    return {str(k): statistics.median(t[2:]) for k, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    out = {"runs": {str(k): run(k, args.steps) for k in args.k}, "trainer_s_per_batch": trainer_seconds(args.k)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
