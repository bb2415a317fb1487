"""On-policy distillation on the Hugging Face example: a student learns ``hf_copy``'s task from a teacher trained on it; prints JSON.

First the bench trains the teacher: the ``hf_copy`` pipeline (a ~90K-parameter Llama, random init,
aipo) for ``--teacher-steps`` steps, checkpointed at its end and exported as a Hugging Face directory
(``flowrl.models.hf_export``, what ``flowrl export`` writes). Then three students, each the same
random-init model and seed for ``--steps`` steps (k = 0):

- ``reward``: the example as shipped (aipo on the reward, group baseline, std-normalised);
- ``opd``: ``objective="opd"`` with the reward's weight 0: the teacher's per-token reverse KL alone
  (the reward is still measured);
- ``both``: ``objective="opd"`` with the reward's weight 1 and ``distill_coef`` 1.

Per run: the final reward (mean of the last ``--window`` steps), the first step where the windowed
reward reaches the reward-only run's final reward, the mean reverse KL of the first and last window,
the wall time, and the windowed curve. The goal the issue sets: OPD reaches the reward-only run's
final reward in at most half its steps (``goal_met``).

    python benches/distill.py                     # teacher 400 steps, students 200 steps, seed 0
    python benches/distill.py --steps 300 --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from flowrl.examples.hf_copy import ASSETS, build_hf_copy
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig
from flowrl.graph.ir import Graph
from flowrl.models.hf_export import export_hf
from flowrl.runtime.checkpointing.store import read_policy_state
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph

LR = 2e-3  # build_hf_copy's


def train_teacher(steps: int, seed: int, out: Path) -> dict:
    """Train ``hf_copy`` for ``steps`` steps, checkpoint it, export the policy to ``out / "teacher"``."""
    start = time.perf_counter()
    rows = run_graph(build_hf_copy(max_staleness=0), RunConfig(steps=steps, seed=seed, progress=False, checkpoint_dir=str(out / "ckpt"))).rows
    export_hf(read_policy_state(out / "ckpt", optimizer=False), out / "teacher")
    window = rows[-20:]
    return {"steps": steps, "wall_s": round(time.perf_counter() - start, 1), "final_reward": round(sum(r["reward/rewards"] for r in window) / len(window), 3)}


def student_graph(mode: str, teacher_dir: Path) -> Graph:
    """The ``hf_copy`` pipeline (k = 0) with ``mode``'s loss: ``reward`` (aipo), ``opd`` (teacher alone) or ``both``."""
    b = GraphBuilder(f"distill_{mode}", model=HFModelConfig(path=str(ASSETS), init="random", seed=0))
    prompts = b.source("prompts", data=str(ASSETS / "prompts.jsonl"), prompt_field="prompt", batch_size=16)
    gen = b.generator("gen", prompts, n_samples=8, max_new_tokens=5, temperature=1.0)
    score = b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text")
    if mode == "reward":
        loss = b.loss("aipo", gen, score, objective="aipo", rho=4.0, normalize_std=True)
    else:
        teacher = b.teacher("teacher", gen, model=HFModelConfig(path=str(teacher_dir), init="pretrained"))
        weight = 0.0 if mode == "opd" else 1.0
        loss = b.loss("opd", gen, score, teacher, objective="opd", rho=4.0, normalize_std=True, reward_weights={"rewards": weight})
    b.weights(b.policy("policy", loss, lr=LR), gen, max_staleness=0)
    return b.build()


def _windowed(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i + 1 - window) : i + 1]) / len(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def run_student(mode: str, teacher_dir: Path, steps: int, seed: int, window: int, every: int) -> dict:
    start = time.perf_counter()
    rows = run_graph(student_graph(mode, teacher_dir), RunConfig(steps=steps, seed=seed, progress=False)).rows
    wall = time.perf_counter() - start
    rewards = [r["reward/rewards"] for r in rows]
    curve = _windowed(rewards, window)
    out = {
        "wall_s": round(wall, 1),
        "final_reward": round(sum(rewards[-window:]) / min(window, len(rewards)), 3),
        "curve": [[i + 1, round(curve[i], 3)] for i in range(every - 1, len(rows), every)],
        "_windowed": curve,
    }
    if mode != "reward":
        kl = [r["distill/reverse_kl"] for r in rows]
        out["reverse_kl_first_last"] = [round(sum(kl[:window]) / window, 3), round(sum(kl[-window:]) / window, 3)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher-steps", type=int, default=400)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--every", type=int, default=10, help="print every N-th point of the curves")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result: dict = {"steps": args.steps, "window": args.window, "threads": args.threads, "load": os.getloadavg()[0], "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        result["teacher"] = train_teacher(args.teacher_steps, 0, Path(tmp))
        for seed in args.seeds:
            runs = {mode: run_student(mode, Path(tmp) / "teacher", args.steps, seed, args.window, args.every) for mode in ("reward", "opd", "both")}
            target = runs["reward"]["final_reward"]
            for mode, run in runs.items():
                windowed = run.pop("_windowed")
                run["steps_to_reward_only_final"] = next((i + 1 for i, v in enumerate(windowed) if v >= target), None)
                result["runs"][f"{mode}/seed{seed}"] = run
            reached = runs["opd"]["steps_to_reward_only_final"]
            result.setdefault("goal_met", {})[f"seed{seed}"] = reached is not None and reached <= args.steps // 2
    result["load_after"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
