"""``flowrl plan --emit`` of an expert-parallel layout at tiny size: the plan a user would make for
Qwen3-30B-A3B on 8 H100s (``policy:d8e8``, ``tests/planners/test_ep_plan.py``) has the same shape as
``policy:d2e2`` here, on a tiny Qwen3-MoE directory (8 experts, top-2) and 3 CPU ranks; its emitted
launch carries ``ep`` in the plan file, and the launch runs it under torchrun, the policy reporting the
layout it built (dp=2 split into one expert-parallel group of 2)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.cli.main import main
from flowrl.planners.plan import load_plan

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
PLACED = "gen:d1@0 | policy:d2e2@1-2"
#: The runtime half of expert parallelism (issue 43, item 3): until it is in the tree the emitted launch
#: cannot run an ep layout, and the run test says so as its skip reason.
EP_RUNTIME = importlib.util.find_spec("flowrl.runtime.parallel.expert_parallel") is not None


def _emit(tmp_path: Path, capsys: pytest.CaptureFixture[str], model_dir: Path) -> Path:
    from flowrl.graph.serialize import to_json
    from tests.runtime.test_moe_run import moe_fsdp_graph

    (tmp_path / "graph.json").write_text(to_json(moe_fsdp_graph(str(model_dir))))
    out = tmp_path / "launch"
    assert main(["plan", str(tmp_path / "graph.json"), "--cluster", "cpu:3", "--strategy", PLACED, "--emit", str(out)]) == 0, capsys.readouterr().err
    return out


def test_the_emitted_plan_carries_the_ep_it_priced(hf_qwen3_moe_dir, tmp_path, capsys):
    launch = _emit(tmp_path, capsys, hf_qwen3_moe_dir)
    out = capsys.readouterr().out
    assert "placement: gen:d1@0 | policy:d2e2@1-2" in out and "experts split over ep=2: all-to-all at gloo all-to-all between CPU ranks" in out
    plan = load_plan(launch / "plan.json")
    assert plan.placement().mesh("policy").ep == 2 and plan.placement().mesh("policy").devices == (1, 2)
    assert "--nproc-per-node 3" in (launch / "host0.sh").read_text()


@pytest.mark.slow  # a 3-rank torchrun job, ~20 s on the shared 2-core machine; h-ep's ep=2 run test covers the runtime path (--runslow)
@pytest.mark.skipif(not EP_RUNTIME, reason="needs the expert-parallel runtime (flowrl.runtime.parallel.expert_parallel, branch h-ep), not merged here yet")
def test_the_emitted_expert_parallel_launch_runs(hf_qwen3_moe_dir, tmp_path, capsys):
    """2 steps of the emitted script: the policy's first row reports the mesh it built, dp=2 with ep=2,
    as planned; its FSDP2 checkpoint holds one shard per policy rank."""
    launch = _emit(tmp_path, capsys, hf_qwen3_moe_dir)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FLOWRL_DIST_TIMEOUT_S": "30", "FLOWRL_CONNECT_TIMEOUT_S": "30",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}  # fmt: skip
    done = subprocess.run(
        ["bash", str(launch / "host0.sh"), "--steps", "2", "--quiet", "--metrics", "m.jsonl", "--checkpoint-dir", "ck", "--checkpoint-every", "2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2]
    layout = rows[0]["layout"]["policy"]
    assert layout["devices"] == [1, 2] and layout["mesh"] == {"dp": 2, "ep": 2}, layout
    shards = sorted(p.name for p in (tmp_path / "ck" / "step-00000002" / "policy-policy.dcp").glob("*.distcp"))
    assert len(shards) == 2, shards
