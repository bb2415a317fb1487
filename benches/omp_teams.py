"""OpenMP teams: why the local backend runs a colocation group's steps on one compute thread.

Each case runs in a fresh process (an OpenMP team lives as long as its thread), timing a loop of
small torch operators (the default example's size) on a new thread with every core:

- ``alone``: no other thread of the process has run torch in parallel;
- ``beside_a_team``: the main thread ran one matmul with every core first and then sits idle, as a
  second executor with a team of its own did between its turns (libgomp then counts more workers
  than cores and stops spinning between parallel regions);
- ``beside_one_thread``: the same with the main thread on one intra-op thread (no team), as the
  local backend's executor threads are.

Prints JSON: microseconds per loop iteration of each case and ``beside_a_team / alone`` (about 4-6
on 2 cores). ``python benches/omp_teams.py [--iters 300] [--repeats 7]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASES = ("alone", "beside_a_team", "beside_one_thread")

_CHILD = """
import statistics, sys, threading, time
import torch
from flowrl.runtime.control.compute_threads import ComputeThread
case, iters, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cores = torch.get_num_threads()
if case == "beside_a_team":
    a = torch.randn(512, 512); a @ a
elif case == "beside_one_thread":
    torch.set_num_threads(1); a = torch.randn(512, 512); a @ a
x, w = torch.randn(256, 64), torch.randn(64, 256)
def loop():
    t = time.perf_counter()
    for _ in range(iters):
        torch.relu(x @ w).sum(-1)
    return (time.perf_counter() - t) / iters * 1e6
runner = ComputeThread("flowrl-bench", intra_op_threads=cores)
runner.call(loop)
print(statistics.median(runner.call(loop) for _ in range(repeats)))
runner.close()
"""


def case_us(case: str, iters: int, repeats: int) -> float:
    """Microseconds per iteration of ``case``, measured in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _CHILD, case, str(iters), str(repeats)], check=True, capture_output=True, text=True)
    return float(out.stdout.strip())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    us = {case: case_us(case, args.iters, args.repeats) for case in CASES}
    print(json.dumps({"us_per_iter": {k: round(v, 1) for k, v in us.items()},
                      "beside_a_team/alone": round(us["beside_a_team"] / us["alone"], 2),
                      "beside_one_thread/alone": round(us["beside_one_thread"] / us["alone"], 2)}, indent=1))


if __name__ == "__main__":
    main()
