"""torchrun restarts a job whose rank was SIGKILLed, and ``--resume auto`` continues it by itself.

One command, as a cluster user writes it: ``torchrun --max-restarts 1 --nproc-per-node 2 -m flowrl run
--backend torchrun --plan place.json --checkpoint-dir ck --checkpoint-every 2
--resume auto`` (place.json: ``{"gen": [0], "policy": [1]}``) on the default example (its real tiny
model, weights over the collective transport).
Its first start finds no checkpoint and starts fresh; the test SIGKILLs the policy's rank once the
metrics hold a few rows; torchrun's elastic agent restarts both workers with the same command, rank 0
finds the newest checkpoint and the job finishes by itself: exit 0, the metrics rows 1..steps once
each, consuming exactly the prompts of an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability.killresume import ROOT, check_run, children, reference_prompts, rows_of

pytest.importorskip("torch.distributed")

JOB_TIMEOUT_S = 240
STEPS, K, EVERY, KILL_AFTER = 14, 1, 2, 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_pid(agent: int, rank: int) -> int | None:
    """The pid of the worker of ``rank`` that torchrun's agent (pid ``agent``) started (from /proc)."""
    for pid in children(agent):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


def _wait(proc: subprocess.Popen, ready, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if (found := ready()) is not None:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout:.0f} s")
        time.sleep(0.02)
    return ready()


@pytest.mark.slow  # CI time (23 s on 2 shared cores at load 2: two launches of a 2-rank job); the restart logic is tested in-process by tests/cli/test_run_resume_auto.py
def test_a_killed_rank_is_restarted_by_torchrun_and_the_run_continues(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
           "-m", "flowrl", "run", "--backend", "torchrun", "--plan", "place.json", "--quiet",
           "--steps", str(STEPS), "--max-staleness", str(K), "--checkpoint-dir", "ck", "--checkpoint-every", str(EVERY),
           "--resume", "auto", "--metrics", "m.jsonl"]
    (tmp_path / "place.json").write_text('{"gen": [0], "policy": [1]}')
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "FLOWRL_DIST_TIMEOUT_S": "30", "FLOWRL_CONNECT_TIMEOUT_S": "60"}
    job = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        _wait(job, lambda: True if len(rows_of(tmp_path / "m.jsonl")) >= KILL_AFTER else None, JOB_TIMEOUT_S / 2, f"{KILL_AFTER} rows")
        victim = _rank_pid(job.pid, 1)
        assert victim is not None and job.poll() is None, f"the job ended before the policy's rank could be killed: {job.communicate()[1][-3000:]}"
        killed_at = len(rows_of(tmp_path / "m.jsonl"))
        os.kill(victim, signal.SIGKILL)
        out, err = job.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert killed_at < STEPS, f"the kill came after the last step ({killed_at} rows)"
    assert job.returncode == 0, err[-4000:]
    # the first start found nothing and started fresh; the restart resumed from a checkpoint before the kill
    assert "--resume auto: ck holds no complete checkpoint; starting fresh" in err, err[-4000:]
    assert "torchrun restart 1 of at most 1" in err and "resuming from ck/step-" in err, err[-4000:]
    resumed = int(err.split("resuming from ck/step-", 1)[1][:8])
    assert 0 < resumed <= killed_at and resumed % EVERY == 0, (resumed, killed_at)
    problems: list[str] = []
    lost, repeated = check_run(tmp_path / "m.jsonl", reference_prompts(STEPS, K), K, problems)
    assert not problems and lost == 0 and repeated == 0, problems
