"""A dead or stopped torchrun rank ends every rank within ``--liveness-timeout``, naming it, with no process left.

One 2-rank job per fault on the default pipeline with synthetic operators (sleeps; weights over files;
the generator on rank 0, the policy on rank 1: what is tested is the ranks, not the model), ``--liveness-timeout 4`` and no ``--max-restarts`` (so the job's end is observable):
the test SIGKILLs or SIGSTOPs the policy's rank once the metrics hold a row, then checks that the job
ended within the bound and a slack for the shared machine, that rank 0's message names rank 1, its
node and the cause, and that no process the job started is alive. The stall timeout stays at its
300 s, so without the heartbeat the stopped rank would hold the job for minutes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability.killresume import ROOT, alive, descendants, free_port, rank_pid, rows_of

pytest.importorskip("torch.distributed")

BOUND_S = 4.0
SLACK_S = 20.0  # torchrun's own stop, the agent's exit and a loaded 2-core machine's scheduling
JOB_TIMEOUT_S = 120






def fault_job(tmp_path: Path, sig: signal.Signals) -> tuple[float, str, list[int]]:
    """Start the job, send ``sig`` to rank 1 after the first metrics row; returns (seconds from the
    signal to the job's end, its stderr, the pids it had that are still alive)."""
    (tmp_path / "place.json").write_text('{"gen": [0], "policy": [1]}')
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           "-m", "flowrl", "run", "tests.reliability.test_torchrun_faults:file_graph", "--synthetic", "--option", "gen_s=0.05",
           "--option", "train_s=0.05", "--backend", "torchrun", "--plan", "place.json", "--quiet",
           "--steps", "5000", "--max-staleness", "1", "--metrics", "m.jsonl", "--liveness-timeout", str(BOUND_S)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FLOWRL_DIST_TIMEOUT_S": "300"}
    job = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not rows_of(tmp_path / "m.jsonl") and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        victim = rank_pid(job.pid, 1)
        pids = descendants(job.pid)
        assert victim is not None and job.poll() is None, f"the job ended before rank 1 could be hit: {job.communicate()[1][-3000:]}"
        os.kill(victim, sig)
        hit = time.monotonic()
        _, err = job.communicate(timeout=BOUND_S + SLACK_S + 30)
        took = time.monotonic() - hit
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    time.sleep(1.0)  # a reaper's SIGKILL lands within its own poll
    return took, err, [p for p in pids if alive(p)]


@pytest.mark.slow  # ~8 s of torchrun (the heartbeat's detection and naming are tested in one process by tests/runtime/test_heartbeat.py)
def test_a_sigstopped_rank_ends_every_rank_within_the_bound(tmp_path: Path) -> None:
    took, err, left = fault_job(tmp_path, signal.SIGSTOP)
    assert "rank 1 (node 'policy') is stopped" in err and "its heartbeat stood still" in err, err[-4000:]
    assert "--liveness-timeout 4" in err, err[-4000:]
    assert took <= BOUND_S + SLACK_S, f"the job ended {took:.1f} s after the SIGSTOP (bound {BOUND_S} s + slack {SLACK_S} s)"
    assert not left, f"processes of the job still alive: {left}"


@pytest.mark.slow  # CI time (~15 s): a SIGKILLed rank is seen by torchrun's agent itself; the stopped rank's test covers the heartbeat
def test_a_sigkilled_rank_ends_every_rank_naming_it(tmp_path: Path) -> None:
    took, err, left = fault_job(tmp_path, signal.SIGKILL)
    # the controller, reading the dead rank's closed socket, or rank 0's SIGTERM from torchrun names it
    assert re.search(r"rank 1 (of node 'policy'|\(node 'policy'\)) died", err), err[-4000:]
    assert took <= BOUND_S + SLACK_S, f"the job ended {took:.1f} s after the SIGKILL (bound {BOUND_S} s + slack {SLACK_S} s)"
    assert not left, f"processes of the job still alive: {left}"
