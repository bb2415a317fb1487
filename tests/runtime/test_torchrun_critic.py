"""A critic under the torchrun backend (issue 35): it runs on one rank, as in one process.

A critic's rank program splits a ``tp`` axis only (``rank_programs.critic_ranks``, ``tp_critic``;
``tests/runtime/test_tp_critic.py``), so a ``dp`` mesh is refused before any work (``flowrl.mesh_support``:
it would run on the lead while the others idle). By default: that refusal, on every rank's path (``run_graph``).
``--runslow`` (a torchrun job is ~20 s on 2 cores): ``llamarl_ppo`` under torchrun with the critic on
its own rank gives the local backend's metrics rows with the same seed, k = 0: the same tokens and
rewards exactly, every float metric within float32 rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flowrl.examples import build_example
from tests.runtime.test_torchrun import ROOT, _rows, _torchrun
from tests.tolerances import U32, reductions

STEPS = 4
RUN = ["--steps", str(STEPS), "--max-staleness", "0", "--seed", "0", "--quiet"]


def test_a_critic_on_several_ranks_is_refused_before_any_work():
    from flowrl.errors import ConfigError
    from flowrl.placement import NodeMesh, Placement
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    placement = Placement(nodes={"gen": NodeMesh(devices=(0,)), "policy": NodeMesh(devices=(1,)), "critic": NodeMesh(devices=(1, 2))})
    with pytest.raises(ConfigError, match=r"critic 'critic' has dp=2 on its mesh .* it would run one copy on its lead rank 1 while ranks \[2\] idle"):
        run_graph(build_example("llamarl_ppo"), placement, RunConfig(steps=1, backend="torchrun", progress=False))


def _timing(key: str) -> bool:
    return key.endswith("_s")  # seconds differ from run to run


def _float_atol(value: float, n: int) -> float:
    """Two float32 evaluations of one metric that sums or averages at most ``n`` rounded terms per
    path (the model's reductions and the batch's tokens), each with a relative error of ``n * u``."""
    return 2 * n * U32 * (1.0 + abs(value))


@pytest.mark.slow  # a torchrun job and a local run, ~85 s on 2 shared cores
def test_a_critic_under_torchrun_matches_the_local_backend(tmp_path):
    placement = {"gen": [0], "policy": [1], "critic": [2]}
    (tmp_path / "place.json").write_text(json.dumps(placement))
    proc = _torchrun(3, ["-m", "flowrl", "run", "llamarl_ppo", "--backend", "torchrun", "--plan", "place.json", *RUN, "--metrics", "t.jsonl"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    local = subprocess.run(
        [sys.executable, "-m", "flowrl", "run", "llamarl_ppo", "--backend", "local", *RUN, "--metrics", "l.jsonl"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=150,
    )
    assert local.returncode == 0, local.stderr[-3000:]
    ran, ref = _rows(tmp_path / "t.jsonl"), _rows(tmp_path / "l.jsonl")
    assert len(ran) == len(ref) == STEPS

    from flowrl.models.families.builtin.model import Transformer

    model = build_example("llamarl_ppo").node("critic").model  # the policy's shape too
    n = sum(reductions(Transformer(model), model.max_seq_len)) + ref[0]["samples"] * model.max_seq_len
    for a, b in zip(ran, ref):
        keys = {k for k in a if not _timing(k) and k != "layout"}  # the first row's layout: ranks here, cores there
        assert keys == {k for k in b if not _timing(k) and k != "layout"}, sorted(keys ^ {k for k in b if not _timing(k) and k != "layout"})
        for k in sorted(keys):
            x, y = a[k], b[k]
            if isinstance(x, float) or isinstance(y, float):
                assert abs(x - y) <= _float_atol(max(abs(x), abs(y)), n), (a["step"], k, x, y)
            else:  # tokens, lengths, versions, prompts: the same draws
                assert x == y, (a["step"], k, x, y)
        assert a["reward_mean"] == b["reward_mean"]
    # the critic trained (its values moved off the zero-initialised head), far beyond the tolerance
    last = ran[-1]["critic/value_mean"]
    assert ran[-1]["critic/version"] == STEPS - 1 and abs(last) > 10 * _float_atol(abs(last), n), ran[-1]
