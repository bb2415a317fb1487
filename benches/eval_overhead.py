"""What evaluation during training costs the trainer: hf_copy with and without ``--eval-every``.

Runs, in this process, ``run_graph(build_hf_copy(), RunConfig(steps=S, ...))`` alternately without
evaluation and with ``eval_every=N`` on ``--rows`` held-out rows (``eval_samples=K``), ``--repeats``
times each, after one warm-up run. Per run it reads the metrics rows:

- ``train_s``: the trainer's step (forward, backward, optimizer, publish) as the policy measured it;
- ``step_s``: wall seconds between consecutive rows' ``time_s`` (what a step costs the run, the
  policy saving its state at an evaluated step included); ``eval_step_s`` / ``other_step_s``: the
  same split into the evaluated steps and the rest;
- ``wall_s``: the whole run; ``eval_time_s``: the evaluations' own seconds (in their thread);
  ``eval_save_s``: the policy's save at an evaluated step, all the trainer waits for.

Prints JSON: per mode the median over repeats of each run's mean, and the load averages before and
after (on a shared machine the evaluation thread competes with training for the same cores).

    python benches/eval_overhead.py [--steps 40] [--every 10] [--rows 32] [--samples 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__ = ["measure"]


def measure(steps: int, every: int, data: str | None, samples: int) -> dict[str, float]:
    """One run's figures (see the module docstring); ``data`` None runs without evaluation."""
    from flowrl.examples.hf_copy import build_hf_copy
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    extra: dict[str, Any] = dict(eval_every=every, eval_data=data, eval_samples=samples) if data else {}
    result = run_graph(build_hf_copy(), RunConfig(steps=steps, **extra))
    rows = result.rows
    times = [0.0] + [r["time_s"] for r in rows]
    step_s = [b - a for a, b in zip(times, times[1:])]
    evaluated = [s for s, r in zip(step_s, rows) if data and r["step"] % every == 0]
    others = [s for s, r in zip(step_s, rows) if not (data and r["step"] % every == 0)]
    return {
        "train_s": statistics.mean(r["train_s"] for r in rows),
        "step_s": statistics.mean(step_s[1:]),  # the first step includes start-up
        "eval_step_s": statistics.mean(evaluated) if evaluated else float("nan"),
        "other_step_s": statistics.mean(others[1:]),
        "wall_s": result.wall_s,
        "eval_time_s": statistics.mean(r["eval/time_s"] for r in rows if "eval/time_s" in r) if data else 0.0,
        "eval_save_s": statistics.mean(r["eval/save_s"] for r in rows if "eval/save_s" in r) if data else 0.0,
    }


def main() -> None:
    from flowrl.examples.hf_copy import make_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        held = Path(folder) / "held.jsonl"
        held.write_text("".join(json.dumps(r) + "\n" for r in make_prompts(args.rows, seed=99)))
        measure(4, 2, str(held), args.samples)  # warm-up: imports, first HF build
        runs: dict[str, list[dict[str, float]]] = {"without_eval": [], "with_eval": []}
        for _ in range(args.repeats):
            runs["without_eval"].append(measure(args.steps, args.every, None, args.samples))
            runs["with_eval"].append(measure(args.steps, args.every, str(held), args.samples))
    out: dict[str, Any] = {"steps": args.steps, "every": args.every, "rows": args.rows, "samples": args.samples, "repeats": args.repeats}
    for mode, figures in runs.items():
        out[mode] = {key: round(statistics.median(f[key] for f in figures), 4) for key in figures[0]}
    out["load_avg"] = {"before": load_before, "after": os.getloadavg()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
