"""Reliability figures: long runs without drift, faults contained, resumes that lose and repeat nothing.

Prints JSON with:
- ``load``: for each k in 0..4, a long synthetic run (random operator timings): steps, wall time, and
  RSS / open file descriptors sampled over the run (drift = last sample - first after warm-up);
- ``faults``: failures injected into every node kind, in each backend: how many were contained
  (the run raised NodeExecutionError naming the node within the time limit, no thread left);
- ``resumes``: runs killed at random steps and resumed: prompts lost and repeated (must be 0).

    python benches/reliability.py [--steps 2000] [--backends local process]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import tempfile
import threading
import time

from flowrl.errors import NodeExecutionError
from flowrl.examples.llamarl import build_llamarl
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph
from flowrl.runtime.synthetic import synthetic_programs


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def load(k: int, steps: int, backend: str) -> dict:
    g = build_llamarl(max_staleness=k)
    samples: list[tuple[int, float, int]] = []

    def on_step(row: dict) -> None:
        if row["step"] % max(1, steps // 20) == 0:
            samples.append((row["step"], _rss_mb(), _fds()))

    config = RunConfig(steps=steps, backend=backend, seed=k, programs=synthetic_programs(g),
                       options={"gen_s": 0.0005, "train_s": 0.0005, "jitter": 1.0})
    t0 = time.perf_counter()
    result = run_graph(g, config, on_step=on_step)
    warm = samples[len(samples) // 4]
    return {
        "k": k, "backend": backend, "steps": len(result.rows), "wall_s": round(time.perf_counter() - t0, 2),
        "max_staleness_seen": max(r["staleness"] for r in result.rows),
        "rss_mb_first_last": [round(warm[1], 1), round(samples[-1][1], 1)],
        "rss_drift_mb": round(samples[-1][1] - warm[1], 2),
        "fd_first_last": [warm[2], samples[-1][2]],
        "fd_drift": samples[-1][2] - warm[2],
    }


def faults(backends: list[str]) -> dict:
    tried = contained = 0
    for backend in backends:
        for node in ("prompts", "gen", "reward", "policy"):
            for step in (0, 3):
                tried += 1
                g = build_llamarl(max_staleness=1)
                config = RunConfig(steps=10, backend=backend, programs=synthetic_programs(g),
                                   options={"fail_node": node, "fail_step": step}, stall_timeout_s=30)
                t0 = time.perf_counter()
                try:
                    run_graph(g, config)
                except NodeExecutionError as exc:
                    left = [t for t in threading.enumerate() if t.name.startswith("flowrl-")]
                    if exc.node == node and exc.step == step and not left and time.perf_counter() - t0 < 30:
                        contained += 1
    return {"injected": tried, "contained": contained}


def resumes(n: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    lost = repeated = 0
    for i in range(n):
        k = rng.randint(0, 3)
        steps = 15
        g = build_llamarl(max_staleness=k)
        base = dict(programs=synthetic_programs(g), stall_timeout_s=30)
        full = run_graph(g, RunConfig(steps=steps, **base)).consumed
        with tempfile.TemporaryDirectory() as d:
            fail = rng.randint(1, steps - 1)
            try:
                run_graph(g, RunConfig(steps=steps, checkpoint_dir=d, checkpoint_every=rng.randint(1, 4),
                                       options={"fail_node": rng.choice(["gen", "policy", "reward"]), "fail_step": fail}, **base))
            except NodeExecutionError:
                pass
            resumed = run_graph(g, RunConfig(steps=steps, checkpoint_dir=d, resume=True, **base))
        done = resumed.rows[0]["step"] - 1
        got = [p for batch in full[:done] + resumed.consumed for p in batch]
        want = [p for batch in full for p in batch]
        lost += len(set(want) - set(got))
        repeated += len(got) - len(set(got))
    return {"resumes": n, "prompts_lost": lost, "prompts_repeated": repeated}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--backends", nargs="+", default=["local", "process"])
    p.add_argument("--resumes", type=int, default=10)
    args = p.parse_args()
    out = {
        "load": [load(k, args.steps, "local") for k in range(5)],
        "faults": faults(args.backends),
        "resumes": resumes(args.resumes),
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
