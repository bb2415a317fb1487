"""Helpers shared by the runtime tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from flowrl.graph.ir import Graph
from flowrl.runtime.config import RunConfig
from flowrl.runtime.synthetic import synthetic_programs


def synthetic_config(graph: Graph, **overrides) -> RunConfig:
    """A run of ``graph`` with every operator synthetic (2 ms steps unless ``options`` say otherwise)."""
    options = {"gen_s": 0.002, "train_s": 0.002, **overrides.pop("options", {})}
    return RunConfig(programs=synthetic_programs(graph), options=options, stall_timeout_s=30, **overrides)


REPO = Path(__file__).resolve().parents[2]


def launch_ranks(module: str, world: int, tmp: Path, timeout_s: float) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """Run ``python -m module RANK WORLD INIT_FILE OUT_DIR`` as ``world`` processes (a gloo group over a
    file); kill them all and fail the test if they do not finish in ``timeout_s``.

    Returns (rank -> the JSON each rank wrote to ``OUT_DIR/rank<r>.json``, for the ranks that wrote one;
    every rank's combined output).
    """
    out = tmp / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen([sys.executable, "-m", module, str(r), str(world), str(tmp / "pg.init"), str(out)], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout_s
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the {world} worker ranks of {module} did not finish in {timeout_s:.0f} s (a rank hangs)")
    results = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world) if (out / f"rank{r}.json").exists()}
    return results, logs
