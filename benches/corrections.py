"""Rollout corrections on a lower-precision generator: GRPO alone, with TIS, with IcePop, with sequence masking.

The Hugging Face example (``flowrl.examples.hf_copy``: a ~90K-parameter Llama learning to copy digits
from a prompt file) with its generator in ``--precision`` (bfloat16 by default: the built-in engine's
lower float precision; ``int8`` also works) while the trainer stays float32, at ``k = --max-staleness``
(2), so mu differs from the trainer's batch-start policy by both the precision and up to k versions.
``mismatch/*`` measures the precision alone (tokens drawn by the trainer's current weights,
``flowrl.operators.mismatch``); ``grpo_ratio`` is grpo's own ratio, pi / mu without a correction (the
whole gap, staleness included: its ``kl`` is KL(mu || pi) by k3) and pi / pi_old (1) with one.
The objective is ``grpo`` (one update a batch) with ``correction`` None, ``"tis"``, ``"icepop"`` and
``"seq_mask"`` at their defaults (``flowrl.graph.corrections``), each over ``--seeds``.

Per configuration, one JSON object: the reward curve (per step, mean over the seeds), the final reward
(mean of the last 5 steps) per seed, the mismatch the run measured (``mismatch/*``: KL(mu || pi) by
k3 and the mean |log pi - log mu| over the rows), and what the correction did (``correction/token_frac``,
``correction/seq_frac``, ``correction/weight_mean``, ``correction/weight_max``, means over the rows).

    python benches/corrections.py                          # 4 corrections x 3 seeds x 30 steps: ~5 min on a loaded 2-core CPU
    python benches/corrections.py --steps 40 --precision int8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from flowrl.examples.hf_copy import ASSETS
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig
from flowrl.graph.ir import Graph
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph

CORRECTIONS: tuple[str | None, ...] = (None, "tis", "icepop", "seq_mask")


def build(correction: str | None, *, precision: str, max_staleness: int) -> Graph:
    """``build_hf_copy``'s graph with a GRPO loss (and ``correction``) and its generator in ``precision``."""
    b = GraphBuilder("hf_copy", model=HFModelConfig(path=str(ASSETS), init="random", seed=0))
    prompts = b.source("prompts", data=str(ASSETS / "prompts.jsonl"), prompt_field="prompt", batch_size=16)
    gen = b.generator("gen", prompts, n_samples=8, max_new_tokens=5, temperature=1.0, precision=precision)
    score = b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text")
    loss = b.loss("grpo", gen, score, objective="grpo", normalize_std=True, correction=correction)
    policy = b.policy("policy", loss, lr=2e-3)
    b.weights(policy, gen, max_staleness=max_staleness)
    return b.build()


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return float(f"{statistics.mean(values):.4g}") if values else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--precision", default="bfloat16", choices=["bfloat16", "float16", "int8", "int8-bf16"])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out: dict = {
        "bench": "corrections", "precision": args.precision, "trainer": "float32", "max_staleness": args.max_staleness,
        "steps": args.steps, "seeds": args.seeds, "objective": "grpo", "load_1min_start": round(os.getloadavg()[0], 2),
    }  # fmt: skip
    start_all = time.perf_counter()
    for correction in CORRECTIONS:
        name = correction or "none"
        curves, finals, rows_all = [], [], []
        for seed in args.seeds:
            graph = build(correction, precision=args.precision, max_staleness=args.max_staleness)
            rows = run_graph(graph, RunConfig(steps=args.steps, max_staleness=args.max_staleness, seed=seed, progress=False)).rows
            curves.append([r["reward_mean"] for r in rows])
            finals.append(round(statistics.mean(r["reward_mean"] for r in rows[-5:]), 4))
            rows_all += rows
        mismatch = {k.split("/", 1)[1]: _mean(rows_all, k) for k in sorted({k for r in rows_all for k in r if k.startswith("mismatch/")})}
        out[name] = {
            "reward_curve": [round(statistics.mean(c[i] for c in curves), 4) for i in range(min(map(len, curves)))],
            "final_reward_per_seed": finals,
            "final_reward_mean": round(statistics.mean(finals), 4),
            "mismatch": mismatch,
            "grpo_ratio": {k: _mean(rows_all, f"ppo/{k}") for k in ("ratio_mean", "clip_frac", "kl")},
            "correction": {k: _mean(rows_all, f"correction/{k}") for k in ("token_frac", "seq_frac", "weight_mean", "weight_max")} if correction else None,
        }
    out["wall_s"] = round(time.perf_counter() - start_all, 1)
    out["load_1min_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
