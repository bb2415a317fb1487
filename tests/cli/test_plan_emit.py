"""``flowrl plan --emit DIR`` as a user runs it: the emitted launch runs the plan for real under torchrun,
the run's arguments follow what the plan changed, and what the run could not reproduce is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.cli.main import main
from flowrl.planners.plan import load_plan

ROOT = Path(__file__).resolve().parents[2]
PLACED = "gen:d1@0 | policy:d2@1-2"


def _emit(tmp_path, capsys, *flags: str, graph: str = "llamarl", cluster: str = "cpu:3", strategy: str = PLACED, name: str = "my launch") -> Path:
    out = tmp_path / name
    assert main(["plan", graph, "--cluster", cluster, "--strategy", strategy, "--emit", str(out), *flags]) == 0, capsys.readouterr().err
    return out


def _run_line(directory: Path) -> str:
    script = (directory / "host0.sh").read_text()
    return script.split("exec ", 1)[1]


def test_the_emitted_launch_runs_the_plan_under_torchrun(tmp_path, capsys):
    """cpu:3, the generator on rank 0 and an FSDP2 policy on ranks 1-2: the script (in a directory with a
    space, run from another directory) trains 2 steps; the run read the emitted plan, and its checkpoint
    holds one shard per policy rank: the policy ran on the plan's 2 ranks."""
    launch = _emit(tmp_path, capsys, "--sharding", "fsdp")
    assert sorted(p.name for p in launch.iterdir()) == ["README.txt", "host0.sh", "plan.json"]
    assert os.access(launch / "host0.sh", os.X_OK) and str(load_plan(launch / "plan.json")) == PLACED
    assert "--standalone --nnodes 1 --nproc-per-node 3" in _run_line(launch)
    assert "run llamarl --backend torchrun --device cpu --sharding fsdp --plan" in _run_line(launch)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FLOWRL_DIST_TIMEOUT_S": "30", "FLOWRL_CONNECT_TIMEOUT_S": "30",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    done = subprocess.run(
        ["bash", str(launch / "host0.sh"), "--steps", "2", "--quiet", "--metrics", "m.jsonl", "--checkpoint-dir", "ck", "--checkpoint-every", "2"],
        cwd=work, env=env, capture_output=True, text=True, timeout=150,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "flowrl run: plan for cpu:3 on torchrun ranks: aipo on 1-2, gen on 0, policy on 1-2" in done.stderr
    rows = [json.loads(line) for line in (work / "m.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2]
    shards = sorted(p.name for p in (work / "ck" / "step-00000002" / "policy-policy.dcp").glob("*.distcp"))
    assert len(shards) == 2, shards  # one per policy rank: FSDP2 over ranks 1-2, as planned


def test_the_run_arguments_follow_what_the_plan_changed(tmp_path, capsys):
    launch = _emit(tmp_path, capsys, "--max-staleness", "0")
    assert "run llamarl --backend torchrun --device cpu --max-staleness 0 --plan" in _run_line(launch)
    assert "launch written to" in capsys.readouterr().err
    gpu = _emit(tmp_path, capsys, cluster="2x8xH100", strategy="gen:d8@0-7 | policy:d8@8-15", name="gpu")
    assert sorted(p.name for p in gpu.iterdir()) == ["README.txt", "host0.sh", "host1.sh", "plan.json"]
    assert "--nnodes 2 --node-rank 1 --nproc-per-node 8" in (gpu / "host1.sh").read_text()
    assert "run llamarl --backend torchrun --device cuda --plan" in _run_line(gpu)


def test_a_graph_file_keeps_its_path_and_the_script_checks_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my graph.py").write_text("from flowrl.examples import build_example\ngraph = build_example('llamarl')\n")
    launch = _emit(tmp_path, capsys, graph="my graph.py", name="out")
    assert "run 'my graph.py' --backend torchrun" in _run_line(launch)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run(["bash", str(launch / "host0.sh")], cwd=elsewhere, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and f"GRAPH my graph.py is not here; run this script from the directory flowrl plan ran in ({tmp_path})" in done.stderr


def test_json_output_stays_json_with_emit(tmp_path, capsys):
    assert main(["plan", "--cluster", "cpu:3", "--json", "--emit", str(tmp_path / "j")]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["graph"] == "llamarl" and "launch written to" in captured.err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "qwen2.5-0.5b"], "--emit: --model qwen2.5-0.5b is a published shape, not a model directory: 'flowrl run' has no weights of it"),
        (["--prompts-per-step", "32"], "--emit: the plan priced another step than graph llamarl runs: prompts per step: 32 in the plan, 16 here (--prompts-per-step 16)"),
        (["--gen-precision", "bfloat16"], "generator 'gen' weights: bfloat16 in the plan, float32 here (--gen-precision float32)"),
    ],
    ids=["preset-model", "other-batch", "other-precision"],
)
def test_a_plan_the_run_would_not_reproduce_is_refused_and_nothing_written(tmp_path, capsys, flags, message):
    out = tmp_path / "launch"
    assert main(["plan", "llamarl", "--cluster", "cpu:3", "--emit", str(out), *flags]) == 2
    assert message in " ".join(capsys.readouterr().err.split())
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_directory_with_files_is_refused(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["plan", "--cluster", "cpu:3", "--emit", str(tmp_path)]) == 2
    assert f"--emit {tmp_path}: holds files (notes.txt); emit into a new or empty directory" in " ".join(capsys.readouterr().err.split())
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"] and (tmp_path / "notes.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["plan", "--cluster", "cpu:3", "--emit", str(empty)]) == 0  # an empty one is filled
    assert (empty / "host0.sh").exists()


def test_the_current_directory_when_empty_is_filled_in_place(tmp_path, capsys, monkeypatch):
    """'--emit .' in an empty directory: the files are moved in, the directory itself stays (a shell may be in it)."""
    here = tmp_path / "here"
    here.mkdir()
    inode = here.stat().st_ino
    monkeypatch.chdir(here)
    assert main(["plan", "--cluster", "cpu:3", "--emit", "."]) == 0
    assert sorted(p.name for p in here.iterdir()) == ["README.txt", "host0.sh", "plan.json"] and here.stat().st_ino == inode
    assert [p.name for p in tmp_path.iterdir()] == ["here"]  # no staging directory left beside it
