"""Reliability figures: bad inputs, long runs without drift, faults contained, resumes that lose and repeat nothing.

Prints JSON with:
- ``bad_inputs``: inputs tried through the CLI and how many got a clean error (``benches/bad_inputs.py``);
- ``load``: for each k in 0..4 and each backend, a long synthetic run (random operator timings):
  steps, wall time, and RSS / open file descriptors of the controller process and (process
  backend) of its workers, sampled ~20 times over the run (drift = last sample - first after
  a quarter of the run, the warm-up);
- ``faults``: failures injected into every node kind in each backend (contained: the run raised
  NodeExecutionError naming the node and step within 30 s, no thread left), a worker SIGKILLed
  (process backend) and a rank SIGKILLed (torchrun);
- ``resumes``: runs stopped and resumed from their checkpoints: by an injected exception (in
  process), by SIGKILL of the whole ``flowrl run`` (random moments and mid-checkpoint; local and
  process backends), by a SIGKILLed worker and a SIGKILLed torchrun rank; prompts lost and
  repeated over all of them (must be 0), orphaned workers;
- ``longest_run``: the longest load run with its memory and descriptor drift.

    python benches/reliability.py                 # default size (1000 steps per load run)
    python benches/reliability.py --long          # 5000 steps per k and backend
    python benches/reliability.py --steps 2000 --backends local process --kills 12 --bad-n 200
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benches"))

from flowrl.errors import NodeExecutionError  # noqa: E402
from flowrl.examples.llamarl import build_llamarl  # noqa: E402
from flowrl.runtime.config import RunConfig  # noqa: E402
from flowrl.runtime.run import run_graph  # noqa: E402
from flowrl.runtime.programs.synthetic import synthetic_programs  # noqa: E402
from tests.reliability.killresume import descendants, kill_and_resume, reference_prompts, worker_dies_and_resume  # noqa: E402


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _sample() -> dict:
    """RSS (MiB) and open descriptors of this process and of each process under it (the zygote and its workers)."""
    me = os.getpid()
    workers = {}
    for pid in descendants(me):
        try:
            workers[pid] = (_rss_mb(pid), _fds(pid))
        except OSError:
            pass
    return {"t": time.perf_counter(), "rss": _rss_mb(me), "fds": _fds(me), "workers": workers}


def load(k: int, steps: int, backend: str) -> dict:
    g = build_llamarl(max_staleness=k)
    samples: list[tuple[int, dict]] = []
    every = max(1, steps // 20)

    def on_step(row: dict) -> None:
        if row["step"] % every == 0:
            samples.append((row["step"], _sample()))

    config = RunConfig(steps=steps, backend=backend, seed=k, programs=synthetic_programs(g),
                       options={"gen_s": 0.0005, "train_s": 0.0005, "jitter": 1.0}, stall_timeout_s=60)
    t0 = time.perf_counter()
    result = run_graph(g, config, on_step=on_step)
    wall = time.perf_counter() - t0
    warm, last = samples[len(samples) // 4][1], samples[-1][1]
    out = {
        "k": k, "backend": backend, "steps": len(result.rows), "wall_s": round(wall, 2),
        "steps_per_s": round(len(result.rows) / wall, 1),
        "steady_steps_per_s": round((samples[-1][0] - samples[len(samples) // 4][0]) / max(last["t"] - warm["t"], 1e-9), 1),
        "max_staleness_seen": max(r["staleness"] for r in result.rows),
        "samples": len(samples),
        "parent": {
            "rss_mb_warm_last": [round(warm["rss"], 1), round(last["rss"], 1)],
            "rss_drift_mb": round(last["rss"] - warm["rss"], 2),
            "rss_max_mb": round(max(s["rss"] for _, s in samples), 1),
            "fds_warm_last": [warm["fds"], last["fds"]],
            "fd_drift": last["fds"] - warm["fds"],
        },
    }
    if backend == "process":
        pids = sorted(set(warm["workers"]) & set(last["workers"]))
        out["workers"] = {
            "count": len(pids),
            "rss_mb_warm_last": [[round(warm["workers"][p][0], 1), round(last["workers"][p][0], 1)] for p in pids],
            "rss_drift_mb_max": round(max((last["workers"][p][0] - warm["workers"][p][0] for p in pids), default=0.0), 2),
            "fds_warm_last": [[warm["workers"][p][1], last["workers"][p][1]] for p in pids],
            "fd_drift_max": max((last["workers"][p][1] - warm["workers"][p][1] for p in pids), default=0),
        }
        out["workers_left_after_run"] = len(descendants(os.getpid()))
    return out


def faults(backends: list[str], workdir: Path, torchrun: bool) -> dict:
    tried = contained = 0
    details = []
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
                    if exc.node == node and exc.step == step and not left and not descendants(os.getpid()) and time.perf_counter() - t0 < 30:
                        contained += 1
                    else:
                        details.append(f"{backend}/{node}@{step}: {exc.node}@{exc.step}, threads {left}")
    return {"injected_exceptions": tried, "contained_exceptions": contained, "problems": details}


def resumes(n_exception: int, n_kills: int, workdir: Path, backends: list[str], torchrun: bool, seed: int = 0) -> dict:
    rng = random.Random(seed)
    lost = repeated = orphans = 0
    problems: list[str] = []
    # 1. exceptions injected in process, resumed in process
    for _ in range(n_exception):
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
    # 2. SIGKILL of the whole `flowrl run` (CLI subprocess), resumed with --resume
    steps = 30
    wants = {k: reference_prompts(steps, k) for k in range(5)}
    kills = {"done": 0, "mid_checkpoint": 0, "finished_before_kill": 0, "by_backend": {}}
    for i in range(n_kills):
        k, every = rng.randint(0, 4), rng.randint(1, 4)
        backend = backends[i % len(backends)]
        mode = "checkpoint" if i % 3 == 2 else "random"
        out = kill_and_resume(workdir / f"kill{i}", steps=steps, k=k, every=every, backend=backend, mode=mode, rng=rng, want=wants[k])
        kills["done"] += 1
        kills["mid_checkpoint"] += out.mid_checkpoint
        kills["finished_before_kill"] += out.finished
        kills["by_backend"][backend] = kills["by_backend"].get(backend, 0) + 1
        lost += out.lost
        repeated += out.repeated
        orphans += len(out.orphans)
        problems += [f"kill {i} ({backend}, k={k}, every={every}, {mode}): {p}" for p in out.problems]
    # 3. a worker of the process backend SIGKILLed, resumed
    worker = {"done": 0, "failed_naming_node": 0}
    if "process" in backends:
        for i, node in enumerate(("gen", "policy")):
            out = worker_dies_and_resume(workdir / f"worker{i}", steps=steps, k=1, every=3, node=node, die_step=8 + i, want=wants[1])
            worker["done"] += 1
            worker["failed_naming_node"] += not any("did not fail naming" in p for p in out.problems)
            lost += out.lost
            repeated += out.repeated
            orphans += len(out.orphans)
            problems += [f"worker {node}: {p}" for p in out.problems]
    # 4. a torchrun rank SIGKILLed, resumed
    rank = {"done": 0}
    if torchrun:
        from tests.reliability.test_torchrun_faults import kill_rank_and_resume

        (workdir / "torchrun").mkdir()
        out = kill_rank_and_resume(workdir / "torchrun")
        rank = {"done": 1, "resumed_from": out["resumed_from"], "killed_rows": out["killed_rows"]}
        lost += out["lost"]
        repeated += out["repeated"]
        problems += [f"torchrun: {p}" for p in out["problems"]]
    total = n_exception + kills["done"] + worker["done"] + rank["done"]
    return {
        "resumes": total,
        "after_exception": n_exception,
        "after_sigkill_of_the_run": kills,
        "after_sigkill_of_a_worker": worker,
        "after_sigkill_of_a_torchrun_rank": rank,
        "prompts_lost": lost,
        "prompts_repeated": repeated,
        "orphaned_workers": orphans,
        "problems": problems,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000, help="steps of each load run (default 1000)")
    p.add_argument("--long", action="store_true", help="5000 steps per load run (k 0..4, every backend)")
    p.add_argument("--backends", nargs="+", default=["local", "process"], choices=["local", "process"])
    p.add_argument("--resumes", type=int, default=10, help="in-process resumes after an injected exception")
    p.add_argument("--kills", type=int, default=6, help="SIGKILLs of a whole `flowrl run`, each resumed")
    p.add_argument("--no-torchrun", action="store_true", help="skip the torchrun rank kill")
    p.add_argument("--bad-n", type=int, default=100, help="generated bad inputs per fuzzed family")
    args = p.parse_args()
    steps = 5000 if args.long else args.steps
    t0 = time.perf_counter()
    from bad_inputs import summary

    bad = summary(args.bad_n)
    out: dict = {
        "bad_inputs": {"tried": bad["tried"], "clean_errors": bad["clean_errors"], "valid_generated": bad["valid_generated"],
                       "not_clean": bad["failures"], "failure_list": bad["failure_list"][:5]},
        "load": [load(k, steps, backend) for backend in args.backends for k in range(5)],
    }
    with tempfile.TemporaryDirectory(prefix="flowrl-reliability-") as d:
        work = Path(d)
        out["faults"] = faults(args.backends, work, not args.no_torchrun)
        out["resumes"] = resumes(args.resumes, args.kills, work, args.backends, not args.no_torchrun)
    r = out["resumes"]
    out["faults"]["worker_sigkills"] = r["after_sigkill_of_a_worker"]["done"]
    out["faults"]["worker_sigkills_contained"] = r["after_sigkill_of_a_worker"]["failed_naming_node"]
    out["faults"]["torchrun_rank_sigkills"] = r["after_sigkill_of_a_torchrun_rank"]["done"]
    out["faults"]["torchrun_rank_sigkills_contained"] = r["after_sigkill_of_a_torchrun_rank"]["done"] - sum(
        1 for p in r["problems"] if p.startswith("torchrun: the job with a dying rank"))
    longest = max(out["load"], key=lambda x: (x["steps"], x["wall_s"]))
    out["longest_run"] = {
        "k": longest["k"], "backend": longest["backend"], "steps": longest["steps"], "wall_s": longest["wall_s"],
        "rss_drift_mb": longest["parent"]["rss_drift_mb"], "fd_drift": longest["parent"]["fd_drift"],
        "worker_rss_drift_mb_max": longest.get("workers", {}).get("rss_drift_mb_max"),
        "worker_fd_drift_max": longest.get("workers", {}).get("fd_drift_max"),
    }
    out["max_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
