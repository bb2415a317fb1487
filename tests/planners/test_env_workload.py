"""The planner and multi-turn generators: model tokens per completion count every model turn, and
environment time is a generator-side delay (``Workload.env_s``)."""

from __future__ import annotations

import msgspec
import pytest

from flowrl.errors import PlanError
from flowrl.examples import build_example
from flowrl.planners.cluster import parse_cluster
from flowrl.planners.estimate.common import Context
from flowrl.planners.estimate.generate import estimate_generate
from flowrl.modelspec import model_preset
from flowrl.planners.parallel import ParallelDims
from flowrl.planners.tuning import Tuning
from flowrl.planners.workload import Workload, workload_from_graph


def test_a_multi_turn_generator_samples_max_new_tokens_per_model_turn():
    w = workload_from_graph(build_example("calc_agent"))  # max_new_tokens=6, max_turns=2, max_seq_len=32
    assert (w.gen_len, w.prompt_len, w.env_s) == (12, 20, 0.0)


def test_environment_seconds_add_to_the_generators_time_and_show_in_its_breakdown():
    base = Workload(prompts_per_step=64, samples_per_prompt=4, prompt_len=256, gen_len=256)
    ctx = Context(cluster=parse_cluster("8xH100"), tuning=Tuning(), workload=base)
    model, dims = model_preset("llama3-8b"), ParallelDims(dp=8)
    plain = estimate_generate(model, dims, range(8), ctx)
    slow = estimate_generate(model, dims, range(8), msgspec.structs.replace(ctx, workload=msgspec.structs.replace(base, env_s=3.0)))
    assert slow.time_s == pytest.approx(plain.time_s + 3.0)
    assert slow.breakdown["env"] == 3.0 and "env" not in plain.breakdown
    with pytest.raises(PlanError, match="env_s=-1.0 must be"):
        msgspec.structs.replace(base, env_s=-1.0)


def test_flowrl_plan_takes_environment_seconds(tmp_path):
    """``flowrl plan --env-s`` reaches the plan's workload and the generator's estimate."""
    from flowrl.cli.main import main
    from flowrl.planners.plan_data import load_plan

    assert main(["plan", "calc_agent", "--cluster", "cpu:2", "--env-s", "0.4", "-o", str(tmp_path / "p.json")]) == 0
    plan = load_plan(str(tmp_path / "p.json"))
    assert plan.workload.env_s == 0.4


def test_lengths_from_a_multi_turn_runs_metrics_bring_its_environment_seconds(tmp_path):
    """``--lengths-from`` a run whose rows record ``env/seconds`` (0.2 and 0.6): the workload's ``env_s``
    is their mean, 0.4; ``--env-s`` given as well wins."""
    import json

    from flowrl.cli.main import main
    from flowrl.planners.plan_data import load_plan

    metrics = tmp_path / "m.jsonl"
    rows = [{"step": i + 1, "completion_len_hist": [[6, 200], [12, 56]], "env/seconds": s} for i, s in enumerate((0.2, 0.6))]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for extra, want in (([], 0.4), (["--env-s", "1.5"], 1.5)):
        out = tmp_path / f"p{len(extra)}.json"
        assert main(["plan", "calc_agent", "--cluster", "cpu:2", "--lengths-from", str(metrics), *extra, "-o", str(out)]) == 0
        assert load_plan(str(out)).workload.env_s == pytest.approx(want)
