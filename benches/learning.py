"""Learning: the operators in a plain loop (no runtime) train the example model; prints reward curves as JSON.

The loop is the synchronous one (generate -> score -> train -> copy weights), built from the nodes of
the ``llamarl`` example so that it measures the settings users run. ``--task add`` swaps in the
harder task (source task and scorer); ``--staleness k`` makes the generator sample with the weights
of k steps ago, as an asynchronous run with ``max_staleness = k`` may, so AIPO's ratios are exercised.

Prints one JSON object: per task the wall time, the time split (generate / score / train), the
reward of the first steps (chance), the steps and seconds until the moving average (``--window``
steps) reaches ``--target``, and the curve (step, seconds, windowed mean reward, AIPO ratio stats).

    python benches/learning.py                       # copy: chance -> 0.9, then add for --add-seconds
    python benches/learning.py --tasks copy --threads 1 --staleness 1
    python benches/learning.py --runtime-only        # the runtime: k = 0 vs k = 1, 2: time to target, final reward
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

import msgspec
import torch

from flowrl.examples.llamarl import build_llamarl
from flowrl.graph.nodes import GeneratorNode, LossNode, PolicyNode, ScorerNode, SourceNode
from flowrl.operators.generation import Generator
from flowrl.operators.model import count_parameters
from flowrl.operators.scoring import Scorer
from flowrl.operators.source import PromptSource
from flowrl.operators.trainer import Trainer

REWARD_FNS = {"copy": "flowrl.operators.tasks:copy_reward", "add": "flowrl.operators.tasks:add_reward"}


def example_nodes(task: str, seed: int) -> tuple[SourceNode, GeneratorNode, ScorerNode, LossNode, PolicyNode]:
    graph = build_llamarl()
    (source,), (gen,), (scorer,), (loss,), (policy,) = (graph.nodes_of_kind(k) for k in ("source", "generator", "scorer", "loss", "policy"))
    source = msgspec.structs.replace(source, source=msgspec.structs.replace(source.source, task=task, seed=seed))
    scorer = msgspec.structs.replace(scorer, fn=REWARD_FNS[task])
    return source, gen, scorer, loss, policy


def run(task: str, *, max_steps: int, max_seconds: float, target: float, window: int, every: int, staleness: int, seed: int, stop_after_target: int) -> dict:
    source_node, gen_node, scorer_node, loss_node, policy_node = example_nodes(task, seed)
    source, scorer = PromptSource(source_node), Scorer(scorer_node)
    generator, trainer = Generator(gen_node, seed=seed), Trainer(policy_node, loss_node)
    snapshots: collections.deque[dict[str, torch.Tensor]] = collections.deque(maxlen=staleness + 1)
    rewards: list[float] = []
    curve: list[dict] = []
    spent = {"generate_s": 0.0, "score_s": 0.0, "train_s": 0.0, "sync_s": 0.0}
    reached: dict | None = None
    start = time.perf_counter()
    step = 0
    while step < max_steps and time.perf_counter() - start < max_seconds:
        t0 = time.perf_counter()
        rollout = generator.generate(source.next_batch())
        t1 = time.perf_counter()
        scored = {**rollout, **scorer.score(rollout)}
        t2 = time.perf_counter()
        metrics = trainer.train_step(scored)
        t3 = time.perf_counter()
        if staleness:  # the generator lags: it gets the weights of `staleness` steps ago
            snapshots.append({k: v.clone() for k, v in trainer.weights().items()})
            generator.load_weights(snapshots[0], trainer.version - len(snapshots) + 1)
        else:
            generator.load_weights(trainer.weights(), trainer.version)
        t4 = time.perf_counter()
        for key, dt in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            spent[key] += dt
        step += 1
        rewards.append(metrics["reward_mean"])
        smooth = sum(rewards[-window:]) / len(rewards[-window:])
        elapsed = t4 - start
        if step % every == 0 or step == 1:
            curve.append(
                {
                    "step": step,
                    "seconds": round(elapsed, 2),
                    "reward": round(smooth, 4),
                    "staleness": metrics.get("staleness", 0.0),
                    "ratio_mean": round(metrics.get("aipo/ratio_mean", 1.0), 4),
                    "truncated_frac": round(metrics.get("aipo/truncated_frac", 0.0), 4),
                    "kl": round(metrics.get("aipo/kl", 0.0), 5),
                }
            )
            print(f"[{task}] step {step:4d}  {elapsed:6.1f}s  reward {smooth:.3f}", file=sys.stderr, flush=True)
        if reached is None and len(rewards) >= window and smooth >= target:
            reached = {"steps": step, "seconds": round(elapsed, 2)}
        if reached is not None and step >= reached["steps"] + stop_after_target:
            break
    wall = time.perf_counter() - start
    return {
        "task": task,
        "steps": step,
        "wall_s": round(wall, 2),
        "seconds_per_step": round(wall / max(step, 1), 4),
        "time_split": {k: round(v / max(wall, 1e-9), 3) for k, v in spent.items()},
        "reward_first": round(sum(rewards[:window]) / max(len(rewards[:window]), 1), 4),
        "reward_final": round(sum(rewards[-window:]) / max(len(rewards[-window:]), 1), 4),
        "target": target,
        "reached_target": reached,
        "settings": {
            "batch_size": source_node.source.batch_size,
            "n_samples": gen_node.sampling.n_samples,
            "max_new_tokens": gen_node.sampling.max_new_tokens,
            "lr": policy_node.optimizer.lr,
            "objective": loss_node.loss.objective,
            "rho": loss_node.loss.rho,
            "normalize_std": loss_node.loss.normalize_std,
            "staleness": staleness,
            "seed": seed,
        },
        "curve": curve,
    }


# -- the runtime: the default example through flowrl's controller, synchronous (k = 0) and async ---------
def runtime_curve(k: int, *, steps: int, target: float, window: int, seed: int, backend: str, threads: int) -> dict:
    """Train the default example with ``run_graph`` at staleness ``k``; time to the target and final reward."""
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    graph = build_llamarl(max_staleness=k)
    result = run_graph(graph, RunConfig(steps=steps, seed=seed, backend=backend, threads=threads))
    rows = result.rows
    reached = None
    for i in range(window - 1, len(rows)):
        mean = sum(r["reward_mean"] for r in rows[i - window + 1 : i + 1]) / window
        if mean >= target:
            reached = {"step": rows[i]["step"], "seconds": round(rows[i]["time_s"], 2)}
            break
    tail = rows[-20:]
    return {
        "max_staleness": k,
        "backend": backend,
        "threads": threads or "auto",
        "steps": len(rows),
        "wall_s": round(result.wall_s, 2),
        "reached_target": reached,
        "final_reward": round(sum(r["reward_mean"] for r in tail) / len(tail), 4),
        "staleness_max": max(r["staleness"] for r in rows),
        "mean_step_s": round(result.wall_s / len(rows), 4),
        "curve": [
            {"step": r["step"], "time_s": round(r["time_s"], 2), "reward": round(r["reward_mean"], 3), "staleness": r["staleness"]}
            for r in rows[:: max(1, len(rows) // 20)]
        ],
    }


def _median(values: list[float]) -> float | None:
    values = sorted(values)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def runtime_comparison(args: argparse.Namespace) -> dict:
    """Synchronous k = 0 (local backend, 1 thread: the fastest for this tiny model in a plain loop)
    against async k = 1 and k = 2 on ``--backend`` (process by default: one process per executor,
    so generation and training run on their own cores without sharing the GIL), for every seed of
    ``--seeds``: same seed and steps for all three. Per seed: time-to-target speedup of each k over
    k = 0 and the final rewards; over seeds: median speedup and mean final reward (one seed is noise:
    some seeds plateau below the target whatever k is)."""
    common = dict(steps=args.runtime_steps, target=args.target, window=args.window)
    per_seed = []
    for seed in args.seeds:
        runs = [runtime_curve(0, backend="local", threads=1, seed=seed, **common)]
        runs += [runtime_curve(k, backend=args.backend, threads=0, seed=seed, **common) for k in (1, 2)]
        sync = runs[0]
        entry: dict = {"seed": seed, "runs": runs}
        for r in runs[1:]:
            key = f"k{r['max_staleness']}"
            both = sync["reached_target"] and r["reached_target"]
            entry[f"{key}_time_to_target_speedup"] = round(sync["reached_target"]["seconds"] / r["reached_target"]["seconds"], 3) if both else None
        per_seed.append(entry)
        print(f"[runtime] seed {seed}: " + ", ".join(f"k{r['max_staleness']} reached {r['reached_target']} final {r['final_reward']}" for r in runs), file=sys.stderr, flush=True)
    summary: dict = {}
    for k in (0, 1, 2):
        runs = [e["runs"][k] for e in per_seed]
        summary[f"k{k}"] = {
            "reached_target": f"{sum(r['reached_target'] is not None for r in runs)}/{len(runs)}",
            "median_seconds_to_target": _median([r["reached_target"]["seconds"] for r in runs if r["reached_target"]]),
            "mean_final_reward": round(sum(r["final_reward"] for r in runs) / len(runs), 4),
            "mean_step_s": round(sum(r["mean_step_s"] for r in runs) / len(runs), 4),
        }
        if k:
            speedups = [e[f"k{k}_time_to_target_speedup"] for e in per_seed if e[f"k{k}_time_to_target_speedup"] is not None]
            summary[f"k{k}"]["time_to_target_speedup_median"] = _median(speedups)
            summary[f"k{k}"]["time_to_target_speedup_per_seed"] = [e[f"k{k}_time_to_target_speedup"] for e in per_seed]
    return {"target": args.target, "window": args.window, "steps": args.runtime_steps, "baseline": "k=0 local threads=1", "summary": summary, "per_seed": per_seed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=["copy", "add"], choices=sorted(REWARD_FNS))
    p.add_argument("--copy-seconds", type=float, default=180.0, help="time limit of the copy run (the bar is 3 minutes)")
    p.add_argument("--add-seconds", type=float, default=120.0, help="time limit of the add run")
    p.add_argument("--max-steps", type=int, default=5000)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--window", type=int, default=10, help="steps in the moving average of the reward")
    p.add_argument("--every", type=int, default=10, help="steps between curve points")
    p.add_argument("--stop-after-target", type=int, default=20, help="steps to keep going once the target is reached")
    p.add_argument("--staleness", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for this tiny model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runtime", action="store_true", help="also train through flowrl's runtime: k=0 vs k=1 and k=2")
    p.add_argument("--runtime-only", action="store_true", help="only the runtime comparison")
    p.add_argument("--runtime-steps", type=int, default=400, help="trainer steps of each runtime run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="seeds of the runtime comparison")
    p.add_argument("--backend", default="process", choices=("local", "process"), help="backend of the async runs (process: no shared GIL)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    _, gen_node, *_ = example_nodes("copy", args.seed)
    out = {
        "bench": "learning",
        "model": gen_node.model.short(),
        "parameters": count_parameters(Generator(gen_node).model),
        "threads": args.threads,
        "runs": [],
    }
    if args.runtime or args.runtime_only:
        out["runtime"] = runtime_comparison(args)
    for task in ([] if args.runtime_only else args.tasks):
        seconds = args.copy_seconds if task == "copy" else args.add_seconds
        out["runs"].append(
            run(
                task, max_steps=args.max_steps, max_seconds=seconds, target=args.target, window=args.window,
                every=args.every, staleness=args.staleness, seed=args.seed, stop_after_target=args.stop_after_target,
            )
        )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
