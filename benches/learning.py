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
    python benches/learning.py --runtime-only --example hf_copy --ks 0 2 --sync-backend process --seeds 0 1 2
                                                     # the Hugging Face example, k = 0 vs k = 2, both on the process backend
    python benches/learning.py --runtime-only --example longtail --modes lockstep:0 continuous-inflight:2 --target 0.3
                                                     # the long-tail task: k = 0 lock step vs k = 2 continuous batching
                                                     # with in-flight weight updates (--modes replaces --ks)
    python benches/learning.py --torchrun-only       # the torchrun backend (3 CPU ranks: gen rank 0, policy dp ranks 1-2,
                                                     # weights over the collective transport): k = 0 vs k = 1

``--torchrun`` launches ``python -m torch.distributed.run --nproc-per-node 3 -m flowrl run llamarl --backend torchrun``
as a subprocess per k (placement ``--torchrun-plan``), reads its metrics JSONL, and reports the wall time
to the target (``time_s`` of the row where the windowed reward first reaches it, measured from the
controller's start: process start-up and rendezvous excluded, reported separately as ``launch_s``)
and the final reward (mean of the last 20 steps).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch

from flowrl.examples.llamarl import build_llamarl
from flowrl.graph.nodes import GeneratorNode, LossNode, PolicyNode, ScorerNode, SourceNode
from flowrl.operators.generation import Generator
from flowrl.models.families.builtin.model import count_parameters
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
#: ``--modes`` names: the example builder's generator and weight-edge options besides ``max_staleness``.
MODES = {
    "lockstep": {},
    "continuous": {"batching": "continuous"},
    "continuous-inflight": {"batching": "continuous", "in_flight": True},
}


def parse_mode(text: str) -> tuple[str, int]:
    """``"continuous-inflight:2"`` -> ``("continuous-inflight", 2)``; argparse's type for ``--modes``."""
    name, _, k = text.partition(":")
    if name not in MODES or not k.isdigit():
        raise argparse.ArgumentTypeError(f"mode {text!r}: write NAME:K with NAME one of {', '.join(MODES)} and K a staleness bound >= 0")
    return name, int(k)


def runtime_curve(
    k: int, *, steps: int, target: float, window: int, seed: int, backend: str, threads: int, example: str = "llamarl", mode: str | None = None
) -> dict:
    """Train a built-in example with ``run_graph`` at staleness ``k`` (and ``mode``'s options); time to the target and final reward."""
    from flowrl.examples import EXAMPLES
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    graph = EXAMPLES[example][0](max_staleness=k, **(MODES[mode] if mode else {}))
    result = run_graph(graph, RunConfig(steps=steps, seed=seed, backend=backend, threads=threads))
    return {
        **({"mode": mode} if mode else {}),
        "max_staleness": k,
        "backend": backend,
        "threads": threads or "auto",
        "wall_s": round(result.wall_s, 2),
        "mean_step_s": round(result.wall_s / len(result.rows), 4),
        **_summarise_rows(result.rows, target=target, window=window),
    }


def _median(values: list[float]) -> float | None:
    values = sorted(values)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _summarise_rows(rows: list[dict], *, target: float, window: int) -> dict:
    reached = None
    for i in range(window - 1, len(rows)):
        mean = sum(r["reward_mean"] for r in rows[i - window + 1 : i + 1]) / window
        if mean >= target:
            reached = {"step": rows[i]["step"], "seconds": round(rows[i]["time_s"], 2)}
            break
    tail = rows[-20:]
    return {
        "steps": len(rows),
        "reached_target": reached,
        "final_reward": round(sum(r["reward_mean"] for r in tail) / len(tail), 4),
        "staleness_max": max(r["staleness"] for r in rows),
        "curve": [
            {"step": r["step"], "time_s": round(r["time_s"], 2), "reward": round(r["reward_mean"], 3), "staleness": r["staleness"]}
            for r in rows[:: max(1, len(rows) // 20)]
        ],
    }


def torchrun_curve(k: int, *, steps: int, target: float, window: int, seed: int, plan: dict, timeout_s: float) -> dict:
    """The default example under torchrun at staleness ``k`` (a subprocess); time to target and final reward."""
    nproc = 1 + max(r for v in plan.values() for r in (v["ranks"] if isinstance(v, dict) else v))
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="flowrl-bench-torchrun-") as tmp:
        Path(tmp, "place.json").write_text(json.dumps(plan))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "flowrl", "run", "llamarl", "--backend", "torchrun",
            "--plan", "place.json", "--steps", str(steps), "--max-staleness", str(k), "--seed", str(seed),
            "--quiet", "--metrics", "m.jsonl",
        ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout_s)
        total = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"torchrun k={k} failed ({proc.returncode}): {proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in Path(tmp, "m.jsonl").read_text().splitlines()]
    wall = rows[-1]["time_s"]
    out = {"max_staleness": k, "backend": "torchrun", "ranks": nproc, "plan": plan, "wall_s": round(wall, 2),
           "launch_s": round(total - wall, 2), "mean_step_s": round(wall / len(rows), 4)}
    out.update(_summarise_rows(rows, target=target, window=window))
    out["collective_bytes_per_step"] = rows[-1].get("weights/collective_bytes")
    return out


def torchrun_comparison(args: argparse.Namespace) -> dict:
    """Synchronous k = 0 against async k = 1 on the torchrun backend, same seed, steps and placement."""
    plan = json.loads(args.torchrun_plan)
    common = dict(steps=args.runtime_steps, target=args.target, window=args.window, seed=args.seed, plan=plan, timeout_s=args.torchrun_timeout)
    runs = [torchrun_curve(k, **common) for k in (0, 1)]
    sync, fast = runs
    out: dict = {"target": args.target, "window": args.window, "runs": runs}
    if sync["reached_target"] and fast["reached_target"]:
        out["k1_time_to_target_speedup"] = round(sync["reached_target"]["seconds"] / fast["reached_target"]["seconds"], 3)
    else:
        out["k1_time_to_target_speedup"] = None
    out["k1_final_reward_vs_sync"] = [fast["final_reward"], sync["final_reward"]]
    return out


def runtime_comparison(args: argparse.Namespace) -> dict:
    """Synchronous k = 0 (local backend, its default intra-op threads: the colocated generator and trainer
    take turns on one compute thread with all cores) against async k = 1 and k = 2 on ``--backend`` (process by default: one process per executor,
    so generation and training run on their own cores without sharing the GIL), for every seed of
    ``--seeds``: same seed and steps for all three. Per seed: time-to-target speedup of each k over
    k = 0 and the final rewards; over seeds: median speedup and mean final reward (one seed is noise:
    some seeds plateau below the target whatever k is)."""
    common = dict(steps=args.runtime_steps, target=args.target, window=args.window, example=args.example)
    # (label, k, mode): the first is the baseline; --modes, or k = 0 then the nonzero --ks
    specs = [(f"{m}:{k}", k, m) for m, k in args.modes] if args.modes else [(f"k{k}", k, None) for k in [0, *(k for k in args.ks if k)]]
    sync_backend = args.sync_backend
    per_seed = []
    for seed in args.seeds:
        runs = [runtime_curve(specs[0][1], mode=specs[0][2], backend=sync_backend, threads=0, seed=seed, **common)]
        runs += [runtime_curve(k, mode=m, backend=args.backend, threads=0, seed=seed, **common) for _, k, m in specs[1:]]
        sync = runs[0]
        entry: dict = {"seed": seed, "runs": runs}
        for (key, _, _), r in zip(specs[1:], runs[1:]):
            both = sync["reached_target"] and r["reached_target"]
            entry[f"{key}_time_to_target_speedup"] = round(sync["reached_target"]["seconds"] / r["reached_target"]["seconds"], 3) if both else None
        per_seed.append(entry)
        print(f"[runtime] seed {seed}: " + ", ".join(f"{key} reached {r['reached_target']} final {r['final_reward']}" for (key, _, _), r in zip(specs, runs)), file=sys.stderr, flush=True)
    summary: dict = {}
    for i, (key, k, _) in enumerate(specs):
        runs = [e["runs"][i] for e in per_seed]
        summary[key] = {
            "reached_target": f"{sum(r['reached_target'] is not None for r in runs)}/{len(runs)}",
            "median_seconds_to_target": _median([r["reached_target"]["seconds"] for r in runs if r["reached_target"]]),
            "mean_final_reward": round(sum(r["final_reward"] for r in runs) / len(runs), 4),
            "median_final_reward": _median([r["final_reward"] for r in runs]),
            "mean_step_s": round(sum(r["mean_step_s"] for r in runs) / len(runs), 4),
            "final_reward_per_seed": [r["final_reward"] for r in runs],
        }
        if i:
            speedups = [e[f"{key}_time_to_target_speedup"] for e in per_seed if e[f"{key}_time_to_target_speedup"] is not None]
            summary[key]["time_to_target_speedup_median"] = _median(speedups)
            summary[key]["time_to_target_speedup_per_seed"] = [e[f"{key}_time_to_target_speedup"] for e in per_seed]
    baseline = f"{specs[0][0]} {sync_backend}"
    return {"example": args.example, "target": args.target, "window": args.window, "steps": args.runtime_steps, "baseline": baseline,
            "load_1min": round(os.getloadavg()[0], 2), "summary": summary, "per_seed": per_seed}


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
    p.add_argument("--example", default="llamarl", help="built-in example of the runtime comparison (hf_copy: the Hugging Face one)")
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2], help="staleness bounds of the runtime comparison (k=0 always runs first)")
    p.add_argument("--modes", type=parse_mode, nargs="+", default=None, metavar="NAME:K",
                   help=f"instead of --ks: runs as NAME:K, NAME one of {', '.join(MODES)} (the first is the baseline), "
                   "e.g. lockstep:0 continuous-inflight:2; the example's builder must take the mode's options (longtail does)")
    p.add_argument("--sync-backend", default="local", choices=("local", "process"), help="backend of the k=0 run")
    p.add_argument("--backend", default="process", choices=("local", "process"), help="backend of the async runs (process: no shared GIL)")
    p.add_argument("--torchrun", action="store_true", help="also train under torchrun (collective weights): k=0 vs k=1")
    p.add_argument("--torchrun-only", action="store_true", help="only the torchrun comparison")
    p.add_argument("--torchrun-plan", default='{"gen": [0], "policy": [1, 2]}', help="JSON placement of the torchrun runs")
    p.add_argument("--torchrun-timeout", type=float, default=900, help="seconds before a torchrun run is killed")
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
    if args.torchrun or args.torchrun_only:
        out["torchrun"] = torchrun_comparison(args)
    for task in ([] if args.runtime_only or args.torchrun_only else args.tasks):
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
