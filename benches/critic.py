"""PPO with a critic against GRPO on the default example, the same budget: prints both curves as JSON.

Both run the ``llamarl`` pipeline through the runtime (k = 1, the same seed, the same steps): GRPO is
``build_llamarl(objective="grpo")`` (group baseline, std-normalised advantages); PPO is
``build_llamarl_ppo`` (a critic of the same tiny model, GAE advantages, ``gamma=1``, ``lam=0.95``).
Per run: the wall time, the final reward (mean of the last ``--window`` steps), the first step where
the windowed reward reaches ``--target``, and the curves (step, windowed reward; for PPO also the
critic's explained variance and value loss, windowed).

    python benches/critic.py                      # 200 steps each, seed 0
    python benches/critic.py --steps 250 --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from flowrl.examples.llamarl import build_llamarl
from flowrl.examples.ppo import build_llamarl_ppo
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph


def _windowed(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i + 1 - window) : i + 1]) / len(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def run(name: str, steps: int, seed: int, window: int, target: float, every: int) -> dict:
    graph = build_llamarl(objective="grpo") if name == "grpo" else build_llamarl_ppo()
    start = time.perf_counter()
    rows = run_graph(graph, RunConfig(steps=steps, seed=seed)).rows
    wall = time.perf_counter() - start
    reward = _windowed([r["reward_mean"] for r in rows], window)
    out = {
        "wall_s": round(wall, 1),
        "final_reward": round(sum(r["reward_mean"] for r in rows[-window:]) / min(window, len(rows)), 3),
        "steps_to_target": next((i + 1 for i, v in enumerate(reward) if v >= target), None),
        "curve": [[i + 1, round(reward[i], 3)] for i in range(every - 1, len(rows), every)],
    }
    if name == "ppo":
        ev = _windowed([r["critic/explained_variance"] for r in rows], window)
        vl = _windowed([r["critic/value_loss"] for r in rows], window)
        out["explained_variance"] = [[i + 1, round(ev[i], 3)] for i in range(every - 1, len(rows), every)]
        out["value_loss"] = [[i + 1, round(vl[i], 4)] for i in range(every - 1, len(rows), every)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--target", type=float, default=0.5)
    parser.add_argument("--every", type=int, default=10, help="print every N-th point of the curves")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {"steps": args.steps, "window": args.window, "target": args.target, "threads": args.threads,
              "load": os.getloadavg()[0], "runs": {}}  # fmt: skip
    for seed in args.seeds:
        for name in ("grpo", "ppo"):
            result["runs"][f"{name}/seed{seed}"] = run(name, args.steps, seed, args.window, args.target, args.every)
    result["load_after"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
