"""Expert parallelism as the planner proposes it: an explicit ``ep`` on a MoE policy's mesh, searched among
what the runtime runs (FSDP2, no tp or pp beside it), shown in the plan's table and carried into the
placement the run reads (``NodeMesh.ep``); Qwen3-30B-A3B on 8 H100s as the issue asks."""

from __future__ import annotations

import json

import pytest

from flowrl.cli.main import main
from flowrl.modelspec import model_preset
from flowrl.planners.parallel import ParallelDims
from flowrl.planners.plan import load_plan

Q30 = ["llamarl", "--cluster", "8xH100", "--model", "qwen3-30b-a3b", "--sharding", "fsdp", "--gen-precision", "float8"]


def test_the_qwen3_30b_a3b_preset_matches_its_card():
    """30.5B parameters, 3.3B active per token (the card's figures; the embedding counted active)."""
    spec = model_preset("qwen3-30b-a3b")
    assert spec.params / 1e9 == pytest.approx(30.5, rel=0.002)
    assert (spec.matmul_params + spec.vocab_size * spec.dim) / 1e9 == pytest.approx(3.3, rel=0.02)
    assert (spec.n_experts, spec.experts_per_token, spec.expert_ffn_dim, spec.moe_layers) == (128, 8, 768, 48)


def test_qwen3_30b_a3b_on_8_h100s_is_planned_expert_parallel(tmp_path, capsys):
    """The FSDP2 policy is planned at ep = dp (each H100 holds 16 of 128 experts a layer) with no tp: the
    table shows the ep column, the note names the all-to-all's rate and where it comes from (the H100
    preset's link, not this CPU's), and the plan file's placement carries the ep the run reads."""
    assert main(["plan", *Q30, "-o", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("node"))
    assert header.split()[3:7] == ["dp", "ep", "tp", "pp"]
    row = next(line for line in out.splitlines() if line.startswith("policy "))
    assert row.split()[3:7] == ["8", "8", "1", "1"], row
    assert "experts split over ep=8: all-to-all at NCCL within a host, 360 GB/s (H100 preset: intra_host_bandwidth 450 GB/s" in row
    assert "placement: gen:t8@0-7 | policy:d8e8@0-7" in out
    plan = load_plan(tmp_path / "plan.json")
    assert plan.placements["policy"].dims.ep == 8 and plan.placement().mesh("policy").ep == 8
    assert json.loads((tmp_path / "plan.json").read_text())["placements"]["policy"]["dims"]["ep"] == 8


def test_the_search_proposes_only_the_ep_the_runtime_builds():
    """The MoE FSDP2 policy's side on 8 H100s is searched over d8 and d8e8 (ep 1 or ep = dp), never d8e2 or
    d8e4, which the planner prices but the runtime does not build (``runnable.expert_split_runs``); an
    example without FSDP2 gets no ep."""
    from flowrl.examples import build_example
    from flowrl.graph.rewrite import with_sharding
    from flowrl.planners.cluster import parse_cluster
    from flowrl.planners.estimate.common import Context
    from flowrl.planners.search import evaluator, resolve_roles
    from flowrl.planners.tuning import Tuning
    from flowrl.planners.workload import LLM_DEFAULTS

    q30 = model_preset("qwen3-30b-a3b")
    c = Context(cluster=parse_cluster("8xH100"), workload=LLM_DEFAULTS, tuning=Tuning(gen_precision="float8"))
    def side(graph):
        return [d for _, d in evaluator(graph, resolve_roles(graph, c, q30), c, 0).side_dims(("policy",), range(8))]

    assert {d.ep for d in side(with_sharding(build_example("llamarl"), "fsdp")) if d.dp == 8} == {1, 8}
    replicated = side(build_example("llamarl"))
    assert replicated and all(d.ep == 1 for d in replicated), replicated


def test_a_policy_the_runtime_splits_otherwise_gets_no_ep(capsys):
    """Without FSDP2 the runtime runs no ep (``mesh_support.COMBINATIONS``), so none is proposed; a dense
    model's table has no ep column."""
    assert main(["plan", "llamarl", "--cluster", "8xH100", "--model", "qwen3-30b-a3b", "--gen-precision", "float8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert all(p["dims"].get("ep", 1) == 1 for p in plan["placements"].values())
    assert main(["plan", "llamarl", "--cluster", "8xH100", "--model", "qwen3-8b", "--sharding", "fsdp"]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("node"))
    assert "ep" not in header.split()


def test_a_given_ep_the_runtime_refuses_is_refused_by_name(capsys):
    assert main(["plan", *Q30, "--strategy", "gen:t8@0-7 | policy:d4e4t2@0-7"]) == 2
    assert "ep x tp is not built" in " ".join(capsys.readouterr().err.split())
    assert main(["plan", *Q30, "--strategy", "gen:t8@0-7 | policy:d8e4@0-7"]) == 2  # priced, but the runtime builds ep = dp only
    assert ("node 'policy' has ep=4 beside dp=8 (d8e4): the runtime splits the experts over every dp rank (ep = dp) or over none; "
            "give it d8e8 where 8 divides its experts, or d8") in " ".join(capsys.readouterr().err.split())  # fmt: skip
    assert main(["plan", *Q30, "--strategy", "gen:t8@0-7 | policy:d8e3@0-7"]) == 2
    assert "ep(3) must divide dp(8)" in " ".join(capsys.readouterr().err.split())
    dense = ["plan", "llamarl", "--cluster", "8xH100", "--model", "qwen3-8b", "--sharding", "fsdp", "--strategy", "gen:t8@0-7 | policy:d8e2@0-7"]
    assert main(dense) == 2
    assert "node 'policy': ep(2) must divide the routed experts, and qwen3-8b is dense (no experts); pick ep among [1]" in " ".join(capsys.readouterr().err.split())
