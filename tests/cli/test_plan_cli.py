"""``flowrl plan`` and ``flowrl calibrate`` as a user runs them: tables, JSON, plan files, and exit 2 on mistakes."""

from __future__ import annotations

import inspect
import json

import pytest

from flowrl.cli.main import main
from flowrl.cli.plan import OWN_ARGUMENTS
from flowrl.planners.plan import load_plan, plan_graph


def test_plan_default_example_on_cpu(capsys):
    assert main(["plan", "llamarl", "--cluster", "cpu:2"]) == 0
    out = capsys.readouterr().out
    for text in ("node", "devices", "dp", "memory/device", "time/step", "predicted step: sync (k=0)", "speedup", "bottleneck:", "placement: gen:"):
        assert text in out
    assert "aipo" in out and "inside the policy's step" in out


@pytest.mark.parametrize("strategy, placement", [("colocated", "gen:d2@0-1 | policy:d2@0-1"), ("disaggregated", "gen:d1@0 | policy:d1@1")])
def test_plan_file_written_and_loadable(tmp_path, capsys, strategy, placement):
    path = tmp_path / "plan.json"
    assert main(["plan", "--cluster", "cpu:2", "--strategy", strategy, "-o", str(path)]) == 0
    assert f"plan written to {path}" in capsys.readouterr().out
    plan = load_plan(path)
    assert str(plan) == placement and plan.strategy == strategy


def test_plan_json_to_stdout(capsys):
    assert main(["plan", "--cluster", "cpu:2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["graph"] == "llamarl" and set(data["placements"]) == {"prompts", "gen", "reward", "aipo", "policy"}
    assert data["workload"]["prompts_per_step"] == 16


def test_plan_published_model_on_1024_h100s(capsys):
    assert main(["plan", "llamarl", "--cluster", "1024xH100", "--model", "llama3-8b", "--gen-len", "512"]) == 0
    out = capsys.readouterr().out
    assert "1024xH100 (128 hosts x 8 H100)" in out and "model llama3-8b" in out
    assert "256 prompts x 8 samples, 512+512 tokens" in out
    assert "baseline synchronous colocated (DeepSpeed-Chat-like) on all 1024 devices" in out and "runners-up:" in out


def test_plan_with_a_calibrated_cluster(tmp_path, capsys):
    spec = tmp_path / "cpu.json"
    assert main(["calibrate", "-o", str(spec), "--matmul-size", "32", "--repeats", "1"]) == 0
    captured = capsys.readouterr()
    assert "GFLOP/s per core" in captured.err and "calibrated cluster written" in captured.out
    assert main(["plan", "--cluster", str(spec), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == "cpu-calibrated"


def test_manual_placement_and_tuning_flags(capsys):
    argv = ["plan", "--cluster", "cpu:2", "--strategy", "gen:d1@0 | policy:d1@1", "--set", "mfu_train=0.2", "--set", "ops_per_layer=32", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["strategy"] == "manual" and data["tuning"]["mfu_train"] == 0.2 and data["tuning"]["ops_per_layer"] == 32


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--cluster", "lots"], "cannot parse cluster 'lots'"),
        (["plan", "--cluster", "cpu:2", "--strategy", "fast"], "unknown strategy 'fast'"),
        (["plan", "--cluster", "64xH100", "--model", "llama2"], "unknown model preset 'llama2'"),
        (["plan", "--cluster", "cpu:2", "--set", "mfu"], "--set 'mfu': write NAME=VALUE"),
        (["plan", "--cluster", "cpu:2", "--set", "speed=2"], "unknown tuning parameter(s) 'speed'"),
        (["plan", "--cluster", "cpu:2", "--set", "strategy=colocated"], "--set 'strategy=colocated': 'strategy' is an argument of the plan, not a tuning constant"),
        (["plan", "--cluster", "cpu:2", "--set", "baseline=1"], "'baseline' is an argument of the plan, not a tuning constant"),
        (["plan", "--cluster", "cpu:2", "--prompt-len", "0"], "workload prompt_len=0 must be >= 1"),
        (["plan", "--cluster", "8xH100", "--model", "llama3-405b"], "no placement of graph 'llamarl' fits on 8xH100"),
        (["plan", "no_such_graph"], "cannot find graph 'no_such_graph'"),
        (
            ["plan", "--cluster", "16xH100", "--model", "llama3-8b", "--gen-len", "1000000"],
            "node 'gen': prompt_len 512 + max_new_tokens 1,000,000 = 1,000,512 tokens, longer than the 8,192-token context of model "
            "llama3-8b; lower --gen-len (the generator's max_new_tokens) to at most 7,680, or plan a model with a longer context",
        ),
        (["plan", "--cluster", "16xH100", "--model", "llama3-8b", "--prompt-len", "9000"], "shorten --prompt-len"),
        (["calibrate", "--cores", "0"], "--cores 0: must be >= 1"),
        (["plan", "--cluster", "cpu:2", "--gen-len-mean", "99"], "mean completion length 99.0 must be in [1, max_len=5]"),
        (["plan", "--cluster", "cpu:2", "--gen-len-mean", "3", "--lengths-from", "m.jsonl"], "give either --lengths-from or --gen-len-mean"),
        (["plan", "--cluster", "cpu:2", "--lengths-from", "no_such_metrics.jsonl"], "cannot read metrics file 'no_such_metrics.jsonl'"),
    ],
    ids=[
        "cluster", "strategy", "model", "set-form", "set-name", "set-strategy", "set-baseline", "workload", "too-big", "graph", "context", "context-prompt", "cores",
        "mean-over-max", "two-length-sources", "no-metrics",
    ],
)
def test_user_mistakes_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in " ".join(err.split()) and "Traceback" not in err  # main wraps the paragraph at 100 columns


def test_a_set_of_each_of_plan_graphs_own_arguments_is_refused_with_its_flag(capsys):
    named = [p.name for p in inspect.signature(plan_graph).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert sorted(OWN_ARGUMENTS) == sorted(named), "plan.OWN_ARGUMENTS says how the command sets each of plan_graph's arguments"
    for name in named:
        assert main(["plan", "--cluster", "cpu:2", "--set", f"{name}=1"]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"'{name}' is an argument of the plan, not a tuning constant" in err and OWN_ARGUMENTS[name] in err, err


def test_failed_plan_leaves_no_file(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", "--cluster", "8xH100", "--model", "llama3-405b", "-o", str(path)]) == 2
    assert list(tmp_path.iterdir()) == []
    assert main(["plan", "--cluster", "cpu:2", "-o", str(tmp_path / "missing" / "plan.json")]) == 2
    assert "folder" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def test_help_states_workload_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "--prompts-per-step 256 --samples 8 --prompt-len 512 --gen-len 2048" in out and "mfu_train=0.45" in out


def test_plan_with_lengths_and_continuous_batching(capsys):
    argv = ["plan", "--cluster", "64xH100", "--model", "llama3-8b", "--gen-len-mean", "800", "--batching", "continuous"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "completions mean 800, max 2048, continuous batching" in out and "continuous, " in out
    assert "on its best subset (" in out


@pytest.mark.parametrize("engine", ["builtin", "vllm"])
def test_plan_says_which_generator_engine_it_assumed(tmp_path, capsys, engine):
    from flowrl.examples.hf_copy import build_hf_copy
    from flowrl.graph.serialize import to_json

    path = tmp_path / "g.json"
    path.write_text(to_json(build_hf_copy(engine=engine)))
    assert main(["plan", str(path), "--cluster", "cpu:2"]) == 0
    gen = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("gen "))
    assert f"{engine} engine" in gen, gen
