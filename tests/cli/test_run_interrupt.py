"""Ctrl-C stops a run cleanly: exit 130, a complete checkpoint, and a resume that continues from it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flowrl.runtime.checkpointing.store import latest_checkpoint
from flowrl.runtime.observe.metrics import read_metrics


def test_sigint_checkpoints_and_exits_130(tmp_path: Path):
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "flowrl", "run", "--synthetic", "--steps", "100000", "--quiet",
           "--checkpoint-dir", str(ckpt), "--metrics", str(metrics)]
    # A shell without job control starts background commands with SIGINT ignored, and a child inherits
    # that (Python then installs no KeyboardInterrupt handler): give the run Ctrl-C's default, as a
    # terminal would, however this test was started.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not metrics.exists() or len(read_metrics(metrics)) < 5):
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # never leave the run behind for later tests to find
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    path = latest_checkpoint(ckpt)
    assert path is not None and (path / "meta.json").is_file()
    done = int(path.name.split("-")[1])
    assert done >= 5
    assert f"interrupted; checkpoint {path} (step {done})" in err, err  # the step saved, named (vLLM's run: tests/reliability/test_vllm_faults.py)
    assert done == len(read_metrics(metrics))  # the final state, at the step reached
    # resume continues right after the checkpoint
    resumed = subprocess.run(
        [sys.executable, "-m", "flowrl", "run", "--synthetic", "--steps", str(done + 3), "--quiet",
         "--checkpoint-dir", str(ckpt), "--resume", "--metrics", str(tmp_path / "m2.jsonl")],
        capture_output=True, text=True, timeout=60,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "m2.jsonl")] == [done + 1, done + 2, done + 3]
    assert not os.path.exists(str(ckpt) + "/LATEST.tmp")
