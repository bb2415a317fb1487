"""A rank's process ends without interpreter teardown, losing nothing of a normal exit (``flowrl.runtime.backends.torchrun.rank_exit``).

``flowrl`` run as a rank (``RANK`` and ``WORLD_SIZE`` set, as torchrun sets them) with a gloo group
still alive at the end (its threads running, as after every torchrun job) keeps its exit status,
its error paragraph or traceback and what it printed; ``atexit`` handlers run and a non-daemon
thread is joined, while an object freed only at teardown is never freed: the teardown, where such a
thread can abort a rank, did not run. A rank that stopped before any group (a refused input) exits
as any process does, teardown included: the control, showing the probe sees a teardown. A 2-rank
job (``rank_exit_job.py``) whose rank 0 ends while its gloo worker thread waits for the GIL exits 0;
ending it with ``sys.exit`` instead aborts it as CI saw (``--runslow``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: the process: an atexit handler, a non-daemon thread still running at the end, an object freed only
#: by interpreter teardown (module globals cleared), each writing a line to MARKS; with GROUP, a gloo
#: group kept alive past destroy_process_group; then ``flowrl ARGS`` (``planted-bug``: a flowrl bug)
PROGRAM = """
import atexit, sys, threading, time
marks = open(sys.argv[1], "a", buffering=1)
atexit.register(lambda: marks.write("atexit\\n"))
threading.Thread(target=lambda: (time.sleep(0.5), marks.write("thread\\n"))).start()
class Teardown:
    write = marks.write  # its own reference: teardown sets the module's names to None first
    def __del__(self):
        self.write("teardown\\n")
KEEP = Teardown()
if sys.argv[2] == "group":
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    GROUP = dist.group.WORLD  # outlives destroy_process_group, its gloo threads running
    dist.destroy_process_group()
print("flowrl's stdout follows")
sys.argv = ["flowrl", *sys.argv[3:]]
import flowrl.cli.main as cli
if sys.argv[1:] == ["planted-bug"]:
    def _bug(argv):
        raise RuntimeError("a planted flowrl bug")
    cli._command = _bug
sys.exit(cli.main())
"""


def _flowrl(tmp_path: Path, *args: str, group: bool) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """``flowrl ARGS`` as rank 0 of 1, with or without a live gloo group; its exit and the MARKS lines."""
    marks = tmp_path / f"marks-{group}-{args[0]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}  # as torchrun sets them
    proc = subprocess.run([sys.executable, "-c", PROGRAM, str(marks), "group" if group else "none", *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    return proc, sorted(marks.read_text().split()) if marks.exists() else []


@pytest.mark.parametrize("group", [True, False], ids=["live-group", "control-no-group"])
def test_a_user_error_on_a_rank_exits_2_with_its_paragraph_and_skips_only_the_teardown(tmp_path, group):
    proc, marks = _flowrl(tmp_path, "run", "--eval-every", "0", group=group)
    assert proc.returncode == 2, proc.stderr
    assert "flowrl run: error: --eval-every 0: N must be >= 1" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == "flowrl's stdout follows\n"  # flushed before the process ends
    assert marks == (["atexit", "thread"] if group else ["atexit", "teardown", "thread"])


def test_a_flowrl_bug_on_a_rank_prints_its_traceback_and_exits_1(tmp_path):
    proc, marks = _flowrl(tmp_path, "planted-bug", group=True)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "RuntimeError: a planted flowrl bug" in proc.stderr
    assert proc.stdout == "flowrl's stdout follows\n"
    assert marks == ["atexit", "thread"]


def _gil_job(tmp_path: Path, ending: str) -> subprocess.CompletedProcess[str]:
    from tests.runtime.test_torchrun import _torchrun

    return _torchrun(2, [str(ROOT / "tests" / "runtime" / "rank_exit_job.py"), ending], tmp_path)


def test_a_rank_whose_gloo_thread_waits_for_the_gil_at_exit_ends_cleanly(tmp_path):
    """``rank_exit_job.py``: rank 0 ends while a gloo worker thread waits for the GIL; without teardown
    it exits 0 (with ``sys.exit``: the slow case below)."""
    from tests.runtime.test_torchrun import CXX_ABORT

    proc = _gil_job(tmp_path, "end_rank_process")
    assert proc.returncode == 0 and CXX_ABORT not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_the_same_rank_ending_with_sys_exit_aborts_in_cxx(tmp_path):
    """The control: the job above reproduces CI's abort when rank 0 finalizes its interpreter."""
    from tests.runtime.test_torchrun import CXX_ABORT

    proc = _gil_job(tmp_path, "sys.exit")
    assert proc.returncode != 0 and CXX_ABORT in proc.stderr and "Fatal Python error: Aborted" in proc.stderr, proc.stderr[-3000:]
