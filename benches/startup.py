"""Start-up: seconds from launching ``flowrl run`` to its first trainer step, and the end-to-end figure.

Every figure launches ``python -m flowrl run`` as a user would (a fresh interpreter, so every import
counts) and watches its ``--metrics`` file: a step's row is written the moment the step ends, so the
time from ``Popen`` to the first complete row is the time to the first step.

Prints JSON:
- ``first_step_s``: per backend, the seconds to the first step of ``--repeats`` launches (min,
  median, max and each), with ``--steps 2`` (so the first row is not also the run's teardown), and
  ``cpu_s_whole_run``: the CPU seconds of each whole launch (every process of it; little load-dependent);
- ``end_to_end``: the default example for ``--e2e-steps`` steps, k = 0 on the local backend and
  k = 2 on the process backend: the wall time from launch to exit (start-up included), completions
  (the sum of the rows' ``samples``), completions per second and the CPU seconds;
- ``load_avg``: the 1/5/15-minute load averages before and after (the figures depend on them).

    python benches/startup.py [--repeats 3] [--backends local process] [--e2e-steps 200] [--no-e2e]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["launch", "first_step", "end_to_end"]

ROOT = Path(__file__).resolve().parents[1]


def launch(backend: str, steps: int, k: int | None, folder: Path) -> tuple[float | None, float, float, list[dict[str, Any]]]:
    """Run ``flowrl run`` once; returns (seconds to the first step, seconds to exit, CPU seconds, the metrics rows).

    The CPU seconds (user + system of the command and every process it started and reaped) depend
    far less on the machine's load than the wall times do.

    Raises:
        RuntimeError: the run exited with a non-zero status (its stderr is in the message).
    """
    metrics = folder / f"m-{backend}-{time.monotonic_ns()}.jsonl"
    cmd = [sys.executable, "-m", "flowrl", "run", "--backend", backend, "--steps", str(steps), "--quiet",
           "--metrics", str(metrics)]
    if k is not None:
        cmd += ["--max-staleness", str(k)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    cpu = _children_cpu()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = None
    while proc.poll() is None:
        if first is None and metrics.is_file() and b"\n" in metrics.read_bytes():
            first = time.perf_counter() - start
        time.sleep(0.005)
    total = time.perf_counter() - start
    cpu = _children_cpu() - cpu
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{stderr}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return first, total, cpu, rows


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def first_step(backend: str, repeats: int, folder: Path) -> dict[str, Any]:
    """Seconds to the first step of ``repeats`` launches of the default example on ``backend``."""
    times, cpus = [], []
    for _ in range(repeats):
        first, _, cpu, _ = launch(backend, 2, None, folder)
        if first is not None:
            times.append(round(first, 3))
        cpus.append(round(cpu, 2))
    return {"min": min(times), "median": statistics.median(times), "max": max(times), "each": times,
            "cpu_s_whole_run": cpus}


def end_to_end(backend: str, k: int, steps: int, folder: Path) -> dict[str, Any]:
    """The default example for ``steps`` steps at staleness ``k``: wall time and completions per second."""
    first, total, cpu, rows = launch(backend, steps, k, folder)
    completions = sum(int(row["samples"]) for row in rows)
    return {"backend": backend, "k": k, "steps": steps, "wall_s": round(total, 2), "first_step_s": round(first or 0.0, 3),
            "cpu_s": round(cpu, 1), "completions": completions, "completions_per_s": round(completions / total, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="launches per backend for the first-step time (default 3)")
    p.add_argument("--backends", nargs="+", default=["local", "process"])
    p.add_argument("--e2e-steps", type=int, default=200, help="steps of the end-to-end runs (default 200)")
    p.add_argument("--no-e2e", action="store_true", help="only the first-step times")
    args = p.parse_args()
    out: dict[str, Any] = {"load_avg_before": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        out["first_step_s"] = {backend: first_step(backend, args.repeats, folder) for backend in args.backends}
        if not args.no_e2e:
            out["end_to_end"] = [end_to_end("local", 0, args.e2e_steps, folder),
                                 end_to_end("process", 2, args.e2e_steps, folder)]
    out["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
