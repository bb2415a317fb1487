"""A rank's process ends without interpreter teardown, losing nothing of a normal exit (``flowrl.runtime.backends.rank_exit``).

``flowrl`` run as a rank (``RANK`` and ``WORLD_SIZE`` set, as torchrun sets them) keeps its exit
status, its error paragraph or traceback and what it printed; ``atexit`` handlers run and a
non-daemon thread is joined, while an object freed only at teardown is never freed: the teardown,
where gloo's leftover threads abort a rank, did not run. The same program without ``RANK`` is the
control (it does tear down), so the probe would see a rank that still did. A 2-rank job
(``rank_exit_job.py``) whose rank 0 ends while its gloo worker thread waits for the GIL exits 0;
ending with ``sys.exit`` instead aborts it as CI saw (``--runslow``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: the process: an atexit handler, a non-daemon thread still running at the end, an object freed only
#: by interpreter teardown (module globals cleared); each writes a line to MARKS; then ``flowrl ARGS``
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
print("flowrl's stdout follows")
sys.argv = ["flowrl", *sys.argv[2:]]
import flowrl.cli.main as cli
if sys.argv[1:] == ["planted-bug"]:
    def _bug(argv):
        raise RuntimeError("a planted flowrl bug")
    cli._command = _bug
sys.exit(cli.main())
"""


def _flowrl(tmp_path: Path, *args: str, rank: bool) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    marks = tmp_path / f"marks-{rank}-{args[0]}"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT)
    if rank:
        env.update(RANK="0", WORLD_SIZE="1")
    proc = subprocess.run([sys.executable, "-c", PROGRAM, str(marks), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    return proc, sorted(marks.read_text().split()) if marks.exists() else []


@pytest.mark.parametrize("rank", [pytest.param(False, marks=pytest.mark.slow), True], ids=["control", "rank"])  # the control: --runslow (CI time)
def test_a_user_error_exits_2_with_its_paragraph_and_a_rank_skips_only_the_teardown(tmp_path, rank):
    proc, marks = _flowrl(tmp_path, "run", "--eval-every", "0", rank=rank)
    assert proc.returncode == 2, proc.stderr
    assert "flowrl run: error: --eval-every 0: N must be >= 1" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == "flowrl's stdout follows\n"  # flushed before the process ends
    assert marks == (["atexit", "thread"] if rank else ["atexit", "teardown", "thread"])


def test_a_flowrl_bug_on_a_rank_prints_its_traceback_and_exits_1(tmp_path):
    proc, marks = _flowrl(tmp_path, "planted-bug", rank=True)
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
