"""A vLLM run (``flowrl run`` as a user starts it, the local backend) against the two ends of vLLM's processes.

- Its engine process dies (SIGKILL of vLLM's engine core): the run ends within a second and a slack,
  naming the generator and the process, and leaves none of vLLM's processes behind (before
  ``vllm_watch`` it could wait for the 300 s stall timeout).
- Ctrl-C (SIGINT to the run's whole process group, as a terminal sends it): exit 130, the final
  checkpoint at the step reached, the message naming it, no traceback from vLLM's processes, none
  of them left and no leaked shared memory reported.

- Under torchrun with ``--max-restarts`` (``benches/faults.py --vllm-only``): its engine core SIGKILLed,
  the job restarts by itself and trains every prompt once.

All behind ``--runslow``: vLLM's start takes 20-60 s on 2 shared cores. The graph is the HF example's
task on a tiny two-head model (vLLM's CPU kernels need head size 32), read from ``FLOWRL_TEST_MODEL_DIR``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability.killresume import ROOT, alive, descendants, rows_of

pytest.importorskip("vllm")

START_TIMEOUT_S = 300
SLACK_S = 15.0


def vllm_graph():
    """The graph the runs train (``tests.runtime.test_vllm_torchrun.vllm_fsdp_graph``, one process, k = 0)."""
    from tests.runtime.test_vllm_torchrun import vllm_fsdp_graph

    return vllm_fsdp_graph(os.environ["FLOWRL_TEST_MODEL_DIR"], 0, "replicate")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from flowrl.examples.hf_copy import write_assets

    return write_assets(tmp_path_factory.mktemp("hf_copy") / "heads2", heads=2)


def start_run(cwd: Path, model_dir: Path, rows: int) -> tuple[subprocess.Popen, list[int]]:
    """Start the run with a checkpoint every 5 steps; return it and its processes once ``rows`` rows are written."""
    cmd = [sys.executable, "-m", "flowrl", "run", f"{__name__}:vllm_graph", "--steps", "1000", "--quiet",
           "--checkpoint-dir", "ck", "--checkpoint-every", "5", "--metrics", "m.jsonl"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FLOWRL_TEST_MODEL_DIR": str(model_dir)}
    run = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # Ctrl-C's default, however pytest was started
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(rows_of(cwd / "m.jsonl")) < rows and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert run.poll() is None and len(rows_of(cwd / "m.jsonl")) >= rows, f"the run did not reach {rows} rows: {run.stderr.read()[-3000:] if run.poll() is not None else 'timeout'}"
    return run, descendants(run.pid)


def finish(run: subprocess.Popen, timeout: float) -> tuple[float, str]:
    t0 = time.monotonic()
    try:
        _, err = run.communicate(timeout=timeout)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    return time.monotonic() - t0, err


@pytest.mark.slow
def test_a_dead_vllm_engine_ends_the_run_at_once_naming_it(tmp_path: Path, model_dir: Path) -> None:
    run, pids = start_run(tmp_path, model_dir, 2)
    engine = [p for p in pids if Path(f"/proc/{p}/comm").read_text().strip().startswith("VLLM::EngineCor")]
    assert engine, f"no vLLM engine core among {[(p, Path(f'/proc/{p}/comm').read_text().strip()) for p in pids]}"
    os.kill(engine[0], signal.SIGKILL)
    took, err = finish(run, 60 + SLACK_S)
    assert run.returncode == 1, err[-3000:]
    assert "generator 'gen': vLLM's engine process" in err and "died under the run" in err, err[-3000:]
    assert took <= 1.0 + SLACK_S, f"the run ended {took:.1f} s after its engine died"
    time.sleep(1.0)
    assert not [p for p in pids if alive(p)], "vLLM's processes outlived the run"


@pytest.mark.slow
def test_ctrl_c_on_vllm_writes_the_final_checkpoint_and_ends_vllm_quietly(tmp_path: Path, model_dir: Path) -> None:
    run, pids = start_run(tmp_path, model_dir, 3)
    os.killpg(run.pid, signal.SIGINT)
    _, err = finish(run, 120)
    rows = rows_of(tmp_path / "m.jsonl")
    assert run.returncode == 130, err[-3000:]
    saved = (tmp_path / "ck" / "LATEST").read_text().strip()
    assert int(saved.split("-")[1]) == len(rows) == rows[-1]["step"], (saved, len(rows))  # the step reached, not the last periodic one
    assert f"interrupted; checkpoint ck/{saved} (step {len(rows)})" in err, err[-3000:]
    for noise in ("Traceback", "ERROR", "leaked shared_memory", "died under the run"):
        assert noise not in err, err[-3000:]
    time.sleep(1.0)
    assert not [p for p in pids if alive(p)], "vLLM's processes outlived the run"


@pytest.mark.slow  # two torchrun jobs, the second starting vLLM twice: ~2-3 min
def test_the_readme_job_on_vllm_survives_its_engines_death_with_every_prompt_trained_once(tmp_path: Path) -> None:
    """Issue 44's Done-when for vLLM's engine: ``benches/faults.py --vllm-only`` runs the README's torchrun
    job (``--max-restarts 3 --resume auto``) on the vLLM engine and SIGKILLs vLLM's engine core once
    training runs; the job ends by itself (exit 0) after one restart, its rows and prompts those of an
    uninterrupted run on the built-in engine (none lost, none repeated; not bit for bit: vLLM samples
    with its own kernels)."""
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benches" / "faults.py"), "--vllm-only", "--steps", "8", "--every", "2", "--timeout", "300"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    vllm = json.loads(proc.stdout)["vllm"]
    assert vllm["exit"] == 0 and len(vllm["faults"]) == 1, vllm
    assert vllm["prompts_lost"] == 0 and vllm["prompts_repeated"] == 0 and not vllm["rows_problems"], vllm
