"""Overlap: with synthetic operators of known durations G and T, a sync step costs G + T and an async step max(G, T).

Prints JSON: for each backend, the measured step times, ``sync_step / (G + T)`` and
``async_step / max(G, T)`` (both should be <= 1.05), and the async speedup.

    python benches/overlap.py [--gen 0.2] [--train 0.3] [--steps 12] [--backends local process]
"""

from __future__ import annotations

import argparse
import json
import statistics

from flowrl.examples.llamarl import build_llamarl
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph
from flowrl.runtime.programs.synthetic import synthetic_programs


def step_time(backend: str, k: int, gen_s: float, train_s: float, steps: int) -> float:
    """Median seconds per step after the first two (warm-up and pipeline fill)."""
    graph = build_llamarl(max_staleness=k)
    config = RunConfig(
        steps=steps, backend=backend, programs=synthetic_programs(graph),
        options={"gen_s": gen_s, "train_s": train_s, "weight_numel": 1 << 20},
    )
    rows = run_graph(graph, config).rows
    times = [b["time_s"] - a["time_s"] for a, b in zip(rows[1:], rows[2:])]
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gen", type=float, default=0.2, help="G: seconds per generate")
    p.add_argument("--train", type=float, default=0.3, help="T: seconds per train step")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--backends", nargs="+", default=["local", "process"])
    args = p.parse_args()
    g, t = args.gen, args.train
    out = {"G_s": g, "T_s": t, "steps": args.steps, "weights_bytes": 4 << 20, "backends": {}}
    for backend in args.backends:
        sync = step_time(backend, 0, g, t, args.steps)
        asyn = step_time(backend, 1, g, t, args.steps)
        out["backends"][backend] = {
            "sync_step_s": round(sync, 4),
            "async_step_s": round(asyn, 4),
            "sync_over_G_plus_T": round(sync / (g + t), 4),
            "async_over_max_G_T": round(asyn / max(g, t), 4),
            "async_speedup": round(sync / asyn, 3),
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
