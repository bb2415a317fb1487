"""GPU smoke run: the Hugging Face example end to end on one GPU with each generator engine.

For each engine (``builtin``, ``vllm``) it trains the ``hf_copy`` example (its files written with 2
attention heads of 32, a head size every vLLM attention backend takes) for ``--steps`` steps on the
local backend with ``device="cuda"``, and reports the generator's tokens/s (completion tokens over
the time spent generating) and the mean step time after ``--warmup`` steps, plus the reward at the
start and the end. An engine that fails is reported with its error, not hidden. Without CUDA it
prints a JSON object saying so and exits 0 (a skip); without vLLM the vLLM row says how to install it.

Prints one JSON object.

    python benches/gpu_smoke.py                    # 60 steps per engine
    python benches/gpu_smoke.py --steps 20 --engines vllm
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

import torch


def run_engine(engine: str, directory: str, *, steps: int, warmup: int, k: int) -> dict:
    from flowrl.examples.hf_copy import build_hf_copy
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    graph = build_hf_copy(model_dir=directory, engine=engine, max_staleness=k)  # type: ignore[arg-type]
    start = time.perf_counter()
    result = run_graph(graph, RunConfig(steps=steps, device="cuda", progress=False))
    wall = time.perf_counter() - start
    rows = result.rows[warmup:] or result.rows
    tokens = sum(r["aipo/tokens"] for r in rows)
    gen_s = sum(r["gen_s"] for r in rows)
    rewards = [r["reward_mean"] for r in result.rows]
    return {
        "engine": engine,
        "steps": len(result.rows),
        "wall_s": round(wall, 2),
        "step_s_mean": round(sum(r["time_s"] for r in rows) / len(rows), 4),
        "gen_tokens_per_s": round(tokens / gen_s, 1) if gen_s else None,
        "max_staleness_seen": max(r["staleness"] for r in result.rows),
        "reward_first_10": round(sum(rewards[:10]) / len(rewards[:10]), 3),
        "reward_last_10": round(sum(rewards[-10:]) / len(rewards[-10:]), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the means (start-up, first weight load)")
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--engines", nargs="+", default=["builtin", "vllm"], choices=("builtin", "vllm"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "gpu_smoke", "skipped": "no CUDA device: run this where a GPU is lent (torch.cuda.is_available() is False)"}))
        return
    from flowrl.examples.hf_copy import write_assets

    out: dict = {"bench": "gpu_smoke", "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        directory = str(write_assets(os.path.join(tmp, "hf_copy"), heads=2))
        for engine in args.engines:
            try:
                out["runs"].append(run_engine(engine, directory, steps=args.steps, warmup=args.warmup, k=args.max_staleness))
            except Exception as exc:  # report it and go on to the other engine
                out["runs"].append({"engine": engine, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=3)})
            print(json.dumps(out["runs"][-1]), file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
