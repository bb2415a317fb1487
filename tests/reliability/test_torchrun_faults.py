"""torchrun backend: a rank SIGKILLed mid-run stops the job naming rank and node; a resume from the
last checkpoint consumes exactly the prompts an uninterrupted run does (read from the metrics JSONL).

Two torchrun jobs of 3 ranks on CPU (gloo), synthetic operators, weights over files: gen on rank 1, policy on rank 2,
the controller on rank 0 (about 20-30 s on 2 shared cores). The rank kills itself with
``--option die_node=gen --option die_step=N`` (``flowrl.runtime.programs.synthetic``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability.killresume import ROOT, check_run, reference_prompts, rows_of

pytest.importorskip("torch.distributed")

JOB_TIMEOUT_S = 150
STEPS, K, EVERY, DIE_STEP = 12, 1, 2, 5


def file_graph():
    """The default pipeline with weights over files: a transport synthetic weights can cross on any
    rank layout (the collective transport carries the real model's layout only)."""
    from flowrl.examples.llamarl import build_llamarl

    return build_llamarl(max_staleness=K, transport="file")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_job(cwd: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node 3 -m flowrl run --synthetic --backend torchrun ...`` in ``cwd``."""
    (cwd / "place.json").write_text(json.dumps({"gen": [1], "policy": [2]}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "-m", "flowrl", "run", f"{__name__}:file_graph", "--synthetic", "--quiet",
           "--backend", "torchrun", "--plan", "place.json", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLOWRL_DIST_TIMEOUT_S": "30", "FLOWRL_CONNECT_TIMEOUT_S": "30"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)


def kill_rank_and_resume(cwd: Path, *, steps: int = STEPS, k: int = K, every: int = EVERY, die_step: int = DIE_STEP) -> dict:
    """Run with the gen rank dying at ``die_step``, then resume; returns what happened (``problems`` empty: exact)."""
    args = ["--steps", str(steps), "--max-staleness", str(k), "--checkpoint-dir", "ck", "--checkpoint-every", str(every),
            "--metrics", "m.jsonl", "--option", "gen_s=0.005", "--option", "train_s=0.005"]
    problems: list[str] = []
    died = torchrun_job(cwd, [*args, "--option", "die_node=gen", "--option", f"die_step={die_step}"])
    if died.returncode == 0 or "rank 1 of node 'gen' died" not in died.stderr:
        problems.append(f"the job with a dying rank did not fail naming rank 1 and node 'gen' (exit {died.returncode}): {died.stderr[-2000:]}")
    killed_rows = len(rows_of(cwd / "m.jsonl"))
    latest = (cwd / "ck" / "LATEST").read_text().strip() if (cwd / "ck" / "LATEST").is_file() else None
    resumed = torchrun_job(cwd, [*args, "--resume"])
    if resumed.returncode != 0:
        problems.append(f"the resumed job exited {resumed.returncode}: {resumed.stderr[-2000:]}")
    lost, repeated = check_run(cwd / "m.jsonl", reference_prompts(steps, k), k, problems)
    return {"killed_rows": killed_rows, "resumed_from": latest, "lost": lost, "repeated": repeated, "problems": problems}


@pytest.mark.slow  # CI time (~15 s, a 3-rank job killed and resumed): the process backend's kill-and-resume tests run by default
def test_a_killed_rank_then_resume_is_exact(tmp_path: Path) -> None:
    out = kill_rank_and_resume(tmp_path)
    assert not out["problems"], "\n".join(out["problems"])
    assert out["lost"] == 0 and out["repeated"] == 0
    # the gen rank died at step 5 (k=1): the policy had done at most 5 steps, checkpointed every 2
    assert out["resumed_from"] in ("step-00000002", "step-00000004"), out
