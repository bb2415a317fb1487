"""Where a step's time goes on a small workload, and what the runtime adds to the operators' work.

The default example (``flowrl run``'s graph: the copy task, a 102K-parameter built-in transformer,
16 prompts x 16 samples of at most 5 tokens a step) on one torch thread, three ways, interleaved and
repeated:

- ``operators``: the operators flowrl's programs call (``PromptSource``, ``Generator``, ``Scorer``,
  ``Trainer``, a weight copy into the generator), called in a plain Python loop: the step's work
  with no runtime around it (the floor a hand-written trainer of the same arithmetic reaches);
- ``run k=0`` and ``run k=2``: ``run_graph`` on the local backend (``RunConfig(threads=1)``), its
  per-step ``gen_s`` / ``train_s`` / ``sync_s`` / ``idle_s`` from the metrics rows.

Prints one JSON object: per way the median seconds per step of each phase and in all, completions
per second, each as [median, min, max] over the repeats (each repeat's figure a median over steps); ``runtime_overhead_s`` (run k=0's step minus the operators'
step: what the controller, channels, metrics rows and thread hand-offs cost), and the load.

Run: python benches/step_overhead.py [--steps 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def operators_loop(steps: int) -> dict[str, list[float]]:
    """The step's operators in a plain loop: seconds per phase per step."""
    from flowrl.examples.llamarl import build_llamarl
    from flowrl.operators.generation import Generator
    from flowrl.operators.scoring import Scorer
    from flowrl.operators.source import PromptSource
    from flowrl.operators.trainer import Trainer

    g = build_llamarl(max_staleness=0)
    source, gen = PromptSource(g.node("prompts")), Generator(g.node("gen"), seed=0)
    scorer, trainer = Scorer(g.node("reward")), Trainer(g.node("policy"), g.node("aipo"))
    gen.load_weights(trainer.weights(), 0)
    out: dict[str, list[float]] = {k: [] for k in ("source_s", "gen_s", "score_s", "train_s", "sync_s", "time_s", "bare_train_s")}
    bare_model = copy.deepcopy(trainer.model)
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-3)
    for _ in range(steps):
        t0 = time.perf_counter()
        prompts = source.next_batch()
        t1 = time.perf_counter()
        rollout = gen.generate(prompts)
        t2 = time.perf_counter()
        batch = {**rollout, **scorer.score(rollout)}
        t3 = time.perf_counter()
        trainer.train_step(batch)
        t4 = time.perf_counter()
        gen.load_weights(trainer.weights(), trainer.version)
        t5 = time.perf_counter()
        for k, v in zip(out, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0)):
            out[k].append(v)
        out["bare_train_s"].append(bare_train_step(bare_model, bare_opt, batch))
    return out


def bare_train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> float:
    """The model's arithmetic of a policy-gradient step on ``batch`` and nothing else: one forward
    over prompt + completion, log-softmax at the completion tokens, a reward-weighted loss, backward,
    AdamW. Seconds."""
    t0 = time.perf_counter()
    prompt, completion, mask = batch["sample_prompt_ids"], batch["completion_ids"], batch["completion_mask"]
    ids = torch.cat([prompt, completion], dim=1)
    logits = model(ids[:, :-1])
    logits = logits if isinstance(logits, torch.Tensor) else logits[0]
    logp = torch.log_softmax(logits[:, prompt.shape[1] - 1 :].float(), dim=-1).gather(-1, completion[..., None]).squeeze(-1)
    advantage = batch["rewards"] - batch["rewards"].mean()
    loss = -((logp * mask) * advantage[:, None]).sum() / mask.sum().clamp(min=1)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return time.perf_counter() - t0


def run_loop(steps: int, k: int) -> dict[str, list[float]]:
    from flowrl.examples.llamarl import build_llamarl
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    rows: list[dict] = []
    t0 = time.perf_counter()
    run_graph(build_llamarl(max_staleness=k), RunConfig(steps=steps, threads=1), on_step=rows.append)
    wall = time.perf_counter() - t0
    rows = rows[5:]  # the first steps hold start-up
    out = {key: [float(r[key]) for r in rows] for key in ("gen_s", "train_s", "sync_s", "idle_s")}
    out["wall_per_step_s"] = [wall / steps]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from flowrl.examples.llamarl import build_llamarl

    g = build_llamarl()
    completions = g.node("prompts").source.batch_size * g.node("gen").sampling.n_samples
    ways = {"operators": lambda: operators_loop(args.steps), "run_k0": lambda: run_loop(args.steps, 0), "run_k2": lambda: run_loop(args.steps, 2)}
    medians: dict[str, dict[str, list[float]]] = {w: {} for w in ways}
    load = [os.getloadavg()[0]]
    operators_loop(5)  # warm-up: imports, allocator
    for _ in range(args.repeats):
        for way, fn in ways.items():  # interleaved: each repeat runs every way once
            for key, values in fn().items():
                medians[way].setdefault(key, []).append(statistics.median(values))
        load.append(os.getloadavg()[0])

    def summary(values: list[float]) -> list[float]:
        return [round(statistics.median(values), 5), round(min(values), 5), round(max(values), 5)]

    result: dict = {"workload": {"completions_per_step": completions, "steps": args.steps, "repeats": args.repeats, "torch_threads": 1}}
    for way, phases in medians.items():
        step_key = "wall_per_step_s" if way != "operators" else "time_s"
        result[way] = {key: summary(v) for key, v in phases.items()}
        result[way]["completions_per_s"] = summary([completions / s for s in phases[step_key]])
    result["trainer_over_bare"] = summary([t / b for t, b in zip(medians["operators"]["train_s"], medians["operators"]["bare_train_s"])])
    result["runtime_overhead_s"] = summary([r - o for r, o in zip(medians["run_k0"]["wall_per_step_s"], medians["operators"]["time_s"])])
    result["run_k0_over_operators"] = summary([r / o for r, o in zip(medians["run_k0"]["wall_per_step_s"], medians["operators"]["time_s"])])
    result["run_k2_speedup_over_k0"] = summary([a / b for a, b in zip(medians["run_k0"]["wall_per_step_s"], medians["run_k2"]["wall_per_step_s"])])
    result["load_1min"] = [round(x, 2) for x in load]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
