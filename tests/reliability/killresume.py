"""SIGKILL a ``flowrl run`` and resume it: the exactly-once checks the tests and ``benches/reliability.py`` share.

A run is the CLI as a user starts it (``python -m flowrl run --synthetic ...``, operators replaced
by sleeps of known length), with ``--metrics`` and ``--checkpoint-dir``. What it consumed is read
back from the metrics file alone: every row carries ``prompt_index``, and a resumed run first drops
the rows after the checkpoint it resumes from, so the file of a killed-then-resumed run must equal,
row for row, the prompts of an uninterrupted one.

``kill_and_resume`` kills the whole run (the controller process; in the process backend its
workers must die with it) at a random moment or while a checkpoint is being written, checks what
the kill left (every ``step-*`` directory complete and loadable, LATEST naming one of them, no
worker process alive), resumes with ``--resume`` and compares. ``worker_dies_and_resume`` lets one
worker of the process backend SIGKILL itself (``--option die_node=...``): the run must fail naming
the node, and a resume must be exact too.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

__all__ = ["Outcome", "kill_and_resume", "worker_dies_and_resume", "reference_prompts", "children", "descendants", "alive", "check_run"]

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180


@dataclass
class Outcome:
    """What one kill (or worker death) and resume did.

    Attributes:
        killed_rows: metrics rows on disk when the run died; finished: it ended before the kill came.
        mid_checkpoint: a checkpoint was being written at the kill (its staging directory was there).
        resumed_from: the step of the checkpoint the resume started from (0: none, a fresh start).
        workers: worker pids of the killed run; orphans: those still alive 10 s after the kill.
        lost / repeated: prompts of the uninterrupted run missing from / twice in the final metrics.
        problems: every broken expectation, in words (empty: exactly-once held).
    """

    killed_rows: int = 0
    finished: bool = False
    mid_checkpoint: bool = False
    resumed_from: int = 0
    workers: list[int] = field(default_factory=list)
    orphans: list[int] = field(default_factory=list)
    lost: int = 0
    repeated: int = 0
    problems: list[str] = field(default_factory=list)


def command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "flowrl", "run", "--synthetic", "--quiet", *args]


def environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}


def reference_prompts(steps: int, k: int) -> list[list[int]]:
    """The prompts an uninterrupted run of the default example consumes, step by step (in this process)."""
    from flowrl.examples import build_example
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph
    from flowrl.runtime.programs.synthetic import synthetic_programs

    graph = build_example("llamarl")
    config = RunConfig(steps=steps, max_staleness=k, programs=synthetic_programs(graph),
                       options={"gen_s": 0.0, "train_s": 0.0}, stall_timeout_s=60)
    return run_graph(graph, config).consumed


def rows_of(path: Path) -> list[dict]:
    """The complete rows of a metrics file (a torn last line, from a kill mid-write, is skipped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_bytes().split(b"\n"):
        try:
            rows.append(msgspec.json.decode(line))
        except msgspec.DecodeError:
            pass
    return rows


def children(pid: int) -> list[int]:
    """Pids of the live children of ``pid`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    """Pids of the live descendants of ``pid``: the process backend's zygote and the workers it forked.

    multiprocessing's resource tracker is left out: one per process, started by the first spawned
    child (vLLM's engine, in an earlier test of the session) and living as long as its parent, by design.
    """
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker._resource_tracker, "_pid", None) if pid == os.getpid() else None
    found, todo = [], [pid]
    while todo:
        below = [c for c in children(todo.pop()) if c != tracker]
        found += below
        todo += below
    return found

def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a torchrun rendezvous endpoint)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_pid(agent: int, rank: int) -> int | None:
    """The pid of the torchrun worker of ``rank`` among the descendants of torchrun's agent (pid
    ``agent``), read from /proc (its ``RANK`` and ``TORCHELASTIC_RUN_ID``); None when there is none."""
    for pid in descendants(agent):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in env):
            return pid
    return None



def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _check_checkpoints(ck: Path, problems: list[str]) -> None:
    """Every ``step-*`` directory is complete and loadable; LATEST names one of them."""
    from flowrl.runtime.checkpointing.store import CheckpointMeta

    for step in sorted(ck.glob("step-*")):
        try:
            meta = msgspec.json.decode((step / "meta.json").read_bytes(), type=CheckpointMeta)
            for fname in meta.files.values():
                state = torch.load(step / fname, weights_only=True)
                if int(state["version"]) != meta.version:
                    problems.append(f"{step.name}/{fname} holds version {int(state['version'])}, meta says {meta.version}")
            if step.name != f"step-{meta.version:08d}":
                problems.append(f"{step.name} holds version {meta.version}")
        except Exception as exc:  # noqa: BLE001 - any unreadable part is the finding
            problems.append(f"{step.name} looks complete but is not: {type(exc).__name__}: {exc}")
    latest = ck / "LATEST"
    if latest.is_file() and not (ck / latest.read_text().strip() / "meta.json").is_file():
        problems.append(f"LATEST names {latest.read_text().strip()!r}, which is not a complete checkpoint")


def check_run(metrics: Path, want: list[list[int]], k: int, problems: list[str]) -> tuple[int, int]:
    """Compare the metrics of a finished (maybe resumed) run with the uninterrupted prompts ``want``.

    Returns:
        (lost, repeated) prompts.
    """
    rows = rows_of(metrics)
    steps = [r["step"] for r in rows]
    if steps != list(range(1, len(want) + 1)):
        problems.append(f"metrics steps are {_short(steps)}, not 1..{len(want)} once each")
    if [r["policy_version"] for r in rows] != steps:
        problems.append("policy versions do not continue step by step")
    bad = [(r["step"], r["staleness"]) for r in rows if not 0 <= r["staleness"] <= k or r["policy_version"] - 1 - r["rollout_version"] != r["staleness"]]
    if bad:
        problems.append(f"staleness outside 0..{k} (step, staleness): {bad[:5]}")
    got = [p for r in rows for p in r.get("prompt_index", [])]
    flat = [p for batch in want for p in batch]
    if [r.get("prompt_index") for r in rows] != want and got == flat:
        problems.append("the prompts are right but split differently into steps")
    elif got != flat:
        problems.append(f"prompts consumed differ from the uninterrupted run's (first difference at index "
                        f"{next((i for i, (a, b) in enumerate(zip(got, flat)) if a != b), min(len(got), len(flat)))})")
    return len(set(flat) - set(got)), len(got) - len(set(got))


def _short(xs: list[int]) -> str:
    return str(xs) if len(xs) < 12 else f"{xs[:5]}...{xs[-5:]} ({len(xs)} rows)"


def _wait_rows(proc: subprocess.Popen, metrics: Path, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(rows_of(metrics)) < n and proc.poll() is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {n} metrics rows in {timeout:.0f} s")
        time.sleep(0.01)


def _resume(args: list[str], out: Outcome, timeout: float) -> None:
    ck = Path(args[args.index("--checkpoint-dir") + 1])
    # killed before its first checkpoint: nothing to resume (--resume would refuse), a fresh start
    again = [*args, "--resume"] if (ck / "LATEST").is_file() else args
    proc = subprocess.run(command(again), env=environment(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        out.problems.append(f"the resume exited {proc.returncode}: {proc.stderr[-1500:]}")
    found = re.search(r"resuming from \S*step-(\d+)", proc.stderr)
    out.resumed_from = int(found.group(1)) if found else 0


def kill_and_resume(
    workdir: Path,
    *,
    steps: int,
    k: int,
    every: int,
    backend: str = "local",
    mode: str = "random",
    step_s: float = 0.01,
    save_s: float = 0.02,
    rng: random.Random | None = None,
    want: list[list[int]] | None = None,
) -> Outcome:
    """SIGKILL a run (``mode``: ``random`` moment after its first step, or ``checkpoint``: while one
    is being written), check what it left, resume it, compare with the uninterrupted prompts."""
    rng = rng or random.Random(0)
    workdir.mkdir(parents=True, exist_ok=True)
    ck, metrics = workdir / "ck", workdir / "m.jsonl"
    args = ["--steps", str(steps), "--max-staleness", str(k), "--backend", backend, "--checkpoint-dir", str(ck),
            "--checkpoint-every", str(every), "--metrics", str(metrics), "--option", f"gen_s={step_s}",
            "--option", f"train_s={step_s}", "--option", f"save_s={save_s}", "--option", "jitter=0.5"]
    out = Outcome()
    proc = subprocess.Popen(command(args), env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_rows(proc, metrics, 1, TIMEOUT_S)
        out.workers = descendants(proc.pid) if backend == "process" else []
        if mode == "checkpoint":
            deadline = time.monotonic() + TIMEOUT_S
            while proc.poll() is None and not any(p.is_dir() and any(p.iterdir()) for p in ck.glob(".step-*.tmp-*")):
                if time.monotonic() > deadline:
                    raise TimeoutError("no checkpoint was started")
                time.sleep(0.002)
        else:
            time.sleep(rng.uniform(0.0, steps * 0.8 * step_s))  # a step takes about step_s or more: mid-run
        out.mid_checkpoint = any(ck.glob(".step-*.tmp-*"))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()
    # ended before the kill, or killed after its final checkpoint (nothing left to resume)
    out.finished = proc.returncode == 0 or (ck / "LATEST").is_file() and (ck / "LATEST").read_text().strip() == f"step-{steps:08d}"
    deadline = time.monotonic() + 10
    while any(alive(p) for p in out.workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    out.orphans = [p for p in out.workers if alive(p)]
    for p in out.orphans:  # do not leave them to the next test; the finding is recorded
        os.kill(p, signal.SIGKILL)
    if out.orphans:
        out.problems.append(f"worker processes {out.orphans} outlived their SIGKILLed controller")
    killed = rows_of(metrics)
    out.killed_rows = len(killed)
    want = want if want is not None else reference_prompts(steps, k)
    if [r.get("prompt_index") for r in killed] != want[: len(killed)]:
        out.problems.append("the killed run's rows already differ from the uninterrupted run's")
    _check_checkpoints(ck, out.problems)
    if out.finished:  # the run ended before the kill came: nothing to resume, its metrics must be whole
        out.lost, out.repeated = check_run(metrics, want, k, out.problems)
        return out
    _resume(args, out, TIMEOUT_S)
    if out.resumed_from and out.resumed_from > out.killed_rows:
        out.problems.append(f"resumed from step {out.resumed_from}, after the {out.killed_rows} steps the metrics show")
    out.lost, out.repeated = check_run(metrics, want, k, out.problems)
    _check_checkpoints(ck, out.problems)
    left = sorted(p.name for p in ck.glob(".*"))
    if left:
        out.problems.append(f"temporary files left in the checkpoint directory after the resume: {left}")
    if (ck / "LATEST").read_text().strip() != f"step-{steps:08d}":
        out.problems.append(f"LATEST after the resume is {(ck / 'LATEST').read_text().strip()}, not step-{steps:08d}")
    if backend == "process":
        segments = [p.name for p in Path("/dev/shm").glob(f"flowrl-{proc.pid}-*")]
        if segments:
            out.problems.append(f"shared-memory segments of the killed run left after the resume: {segments}")
    return out


def worker_dies_and_resume(workdir: Path, *, steps: int, k: int, every: int, node: str, die_step: int,
                           step_s: float = 0.01, want: list[list[int]] | None = None) -> Outcome:
    """One worker of the process backend SIGKILLs itself at ``die_step``: the run must fail within
    the time limit naming the node and SIGKILL, leave no worker, and resume exactly."""
    workdir.mkdir(parents=True, exist_ok=True)
    ck, metrics = workdir / "ck", workdir / "m.jsonl"
    args = ["--steps", str(steps), "--max-staleness", str(k), "--backend", "process", "--checkpoint-dir", str(ck),
            "--checkpoint-every", str(every), "--metrics", str(metrics), "--option", f"gen_s={step_s}", "--option", f"train_s={step_s}"]
    out = Outcome()
    proc = subprocess.Popen(command([*args, "--option", f"die_node={node}", "--option", f"die_step={die_step}"]),
                            env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_rows(proc, metrics, 1, TIMEOUT_S)  # the workers are up once a step is done
        out.workers = descendants(proc.pid)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    if proc.returncode != 1 or not re.search(rf"node '{node}'.*SIGKILL", err, re.S):
        out.problems.append(f"the run did not fail naming node {node!r} and SIGKILL (exit {proc.returncode}): {err[-1500:]}")
    out.orphans = [p for p in out.workers if alive(p)]
    if out.orphans:
        out.problems.append(f"worker processes {out.orphans} outlived the failed run")
    out.killed_rows = len(rows_of(metrics))
    want = want if want is not None else reference_prompts(steps, k)
    _check_checkpoints(ck, out.problems)
    _resume(args, out, TIMEOUT_S)
    out.lost, out.repeated = check_run(metrics, want, k, out.problems)
    return out


def final_state(ck: Path, steps: int, pattern: str = "*") -> dict[str, object]:
    """Every tensor in the files of step ``steps``' checkpoint that ``pattern`` matches (``"policy-*"``: the
    policy's, one file or every rank's shards), flattened by file and key."""
    flat: dict[str, object] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{prefix}/{i}", item)
        else:
            flat[prefix] = value

    step = ck / f"step-{steps:08d}"
    for path in sorted(step.rglob(pattern)):
        if path.is_file() and path.suffix in (".pt", ".distcp"):
            if path.suffix == ".pt":
                walk(str(path.relative_to(step)), torch.load(path, map_location="cpu", weights_only=True))
            else:
                flat[str(path.relative_to(step))] = path.read_bytes()
    return flat


def equal_states(a: dict[str, object], b: dict[str, object]) -> tuple[bool, int]:
    """Whether ``final_state``s ``a`` and ``b`` hold the same entries bit for bit, and how many differ (-1: other keys)."""
    if a.keys() != b.keys():
        return False, -1
    differ = sum(1 for k in a if (not torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] != b[k]))
    return differ == 0 and len(a) > 0, differ
