"""A critic under the torchrun backend (issue 35): it runs on its mesh's lead rank, as in one process.

A critic has no rank program (no entry in ``rank_programs.RANK_PROGRAMS``): on a mesh of several ranks
its lead runs the ordinary ``CriticProgram`` and the others idle (``rank_programs.rank_program``), so
its values and training are the one-process ones whatever its placement. By default: that choice,
checked in process. ``--runslow`` (a torchrun job is ~20 s on 2 cores): ``llamarl_ppo`` under torchrun
with the critic on its own rank and on two ranks (beside the policy) gives the local backend's
metrics rows with the same seed, k = 0: the same tokens and rewards exactly, every float metric
within float32 rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flowrl.examples import build_example
from flowrl.runtime.backends.rank_programs import RankContext, _Idle, rank_program, set_context
from flowrl.runtime.critic_program import CriticProgram
from flowrl.runtime.programs import ProgramEnv, SharedTransports
from tests.runtime.test_torchrun import ROOT, _rows, _torchrun
from tests.tolerances import U32, reductions

STEPS = 4
RUN = ["--steps", str(STEPS), "--max-staleness", "0", "--seed", "0", "--quiet"]


def test_a_critic_on_several_ranks_runs_on_its_lead_and_the_others_idle():
    graph = build_example("llamarl_ppo")
    node = graph.node("critic")
    try:
        built = {}
        for rank in (1, 2):
            set_context(RankContext(rank=rank, world=3, ranks={"critic": (1, 2)}, programs={}))
            built[rank] = rank_program(node, graph, ProgramEnv(), SharedTransports(()))
    finally:
        set_context(None)
    assert isinstance(built[1], CriticProgram) and built[1].critic.version == 0
    assert isinstance(built[2], _Idle)


def _timing(key: str) -> bool:
    return key.endswith("_s")  # seconds differ from run to run


def _float_atol(value: float, n: int) -> float:
    """Two float32 evaluations of one metric that sums or averages at most ``n`` rounded terms per
    path (the model's reductions and the batch's tokens), each with a relative error of ``n * u``."""
    return 2 * n * U32 * (1.0 + abs(value))


@pytest.mark.slow  # each: a torchrun job and a local run, ~85 s on 2 shared cores (both: 170 s at load ~1.5)
@pytest.mark.parametrize("placement", [{"gen": [0], "policy": [1], "critic": [2]}, {"gen": [0], "policy": [1], "critic": [1, 2]}], ids=["own-rank", "two-ranks"])
def test_a_critic_under_torchrun_matches_the_local_backend(tmp_path, placement):
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
        keys = {k for k in a if not _timing(k)}
        assert keys == {k for k in b if not _timing(k)}, sorted(keys ^ {k for k in b if not _timing(k)})
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
