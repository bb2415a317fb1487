"""The Hugging Face agent example on the built-in engine and on vLLM: reward curves as JSON.

Runs ``flowrl run hf_agent`` (a tiny Llama from random weights learns to call a ``ToolEnv`` tool and
answer with its result; ``flowrl/examples/hf_agent.py``) through the runtime for each seed and engine,
engines alternating, the same steps and k = 1. Per run: wall seconds (a vLLM run's include its
engine's start), the first and last ``--window`` steps' mean reward, the mean of
``env/turns_mean`` over the last window (2.0: every episode calls the tool), the windowed curve every
``--every`` steps, and the best a policy that ignores the tool's result can reach (call, then answer
the most common digit) to compare with.

    python benches/hf_agent.py                          # 400 steps, seed 0, both engines
    python benches/hf_agent.py --seeds 0 1 --steps 400
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter

from flowrl.examples.hf_agent import ASSETS, CALL_CREDIT, build_hf_agent
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def no_tool_ceiling() -> float:
    counts = Counter(json.loads(line)["secret"] for line in (ASSETS / "prompts.jsonl").read_text().splitlines())
    return CALL_CREDIT + (1 - CALL_CREDIT) * max(counts.values()) / sum(counts.values())


def run(engine: str, steps: int, seed: int, window: int, every: int) -> dict:
    start = time.perf_counter()
    rows = run_graph(build_hf_agent(engine=engine), RunConfig(steps=steps, seed=seed, progress=False)).rows
    wall = time.perf_counter() - start
    reward = [r["reward_mean"] for r in rows]
    return {
        "engine": engine,
        "seed": seed,
        "steps": steps,
        "wall_s": round(wall, 1),
        "reward_first": round(_mean(reward[:window]), 3),
        "reward_last": round(_mean(reward[-window:]), 3),
        "turns_last": round(_mean([r["env/turns_mean"] for r in rows[-window:]]), 3),
        "curve": [[s, round(_mean(reward[max(0, s - window) : s]), 3)] for s in range(every, steps + 1, every)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--engines", nargs="+", default=["builtin", "vllm"], choices=["builtin", "vllm"])
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--every", type=int, default=50)
    args = ap.parse_args()
    runs = [run(engine, args.steps, seed, args.window, args.every) for seed in args.seeds for engine in args.engines]
    print(json.dumps({"no_tool_ceiling": round(no_tool_ceiling(), 3), "load_after": os.getloadavg()[0], "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
