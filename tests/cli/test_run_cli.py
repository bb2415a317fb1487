"""``flowrl run``: outputs users rely on, and every user mistake exits 2 with a message, no traceback."""

from __future__ import annotations

import json

import pytest

from flowrl.backend_traits import BackendTraits
from flowrl.cli.main import main
from flowrl.runtime.observe.metrics import REQUIRED_KEYS, read_metrics


def test_synthetic_run_writes_metrics_and_trace(tmp_path, capsys):
    metrics, trace = tmp_path / "m.jsonl", tmp_path / "t.json"
    code = main(["run", "--synthetic", "--steps", "4", "--metrics", str(metrics), "--trace", str(trace), "--quiet"])
    assert code == 0
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert set(REQUIRED_KEYS) <= set(row)
    events = json.loads(trace.read_text())["traceEvents"]
    assert {"generate", "score", "train", "weight publish", "weight fetch"} <= {e["name"] for e in events}
    out = capsys.readouterr().out
    assert "done: 4 steps" in out and str(metrics) in out


def test_progress_bar_lines_when_not_a_tty(capsys):
    assert main(["run", "--synthetic", "--steps", "10"]) == 0
    err = capsys.readouterr().err
    assert "step 10/10" in err and "samples/s" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "--steps", "0"], "--steps 0 must be >= 1"),  # the RunConfig message in the flag's name
        (["run", "--max-staleness", "-1"], "max_staleness=-1 must be >= 0"),
        (["run", "--checkpoint-every", "5"], "--checkpoint-dir"),
        (["run", "--resume"], "--checkpoint-dir"),
        (["run", "no_such_example"], "cannot find graph 'no_such_example'"),
        (["run", "missing.json"], "does not exist"),
        (["run", "--plan", "missing-plan.json"], "no such file"),
        (["run", "--metrics", "/no/such/dir/m.jsonl"], "does not exist"),
        (["run", "--synthetic", "--option", "gen_ss=1"], "--option gen_ss: unknown option (did you mean 'gen_s'?); the synthetic operators read gen_s, train_s"),
        (["run", "llamarl", "--engine", "vllm"], "engine='vllm' needs a Hugging Face model"),
        (["run", "hf_copy", "--engine", "vllm", "--steps", "1"], "head size is 16"),
        (["run", "hf_copy", "--sharding", "fsdp", "--steps", "1"], "sharding='fsdp'"),  # FSDP2 runs under torchrun only
        (["run", "--liveness-timeout", "5"], "--liveness-timeout 5.0 bounds how long a torchrun rank may stop answering, but backend='local' "
         "runs no heartbeat"),  # the heartbeat is torchrun's
        (["run", "--backend", "torchrun", "--liveness-timeout", "0"], "--liveness-timeout 0.0 must be > 0"),
    ],
    ids=["steps", "staleness", "ckpt-every", "resume", "example", "graph-file", "plan", "metrics-dir", "option-typo", "engine-builtin-model",
         "engine-head-size", "fsdp-without-torchrun", "liveness-off-torchrun", "liveness-zero"],
)
def test_user_mistakes_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in " ".join(err.split())  # main wraps the paragraph at 100 columns
    assert "Traceback" not in err


def test_backend_choice_is_checked(capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", "--backend", "gpu"])
    assert info.value.code == 2
    assert "invalid choice: 'gpu'" in capsys.readouterr().err


def test_user_functions_of_a_graph_script_run_on_every_path(tmp_path, capsys):
    """The README's `fn=my_reward` pattern: on the process backend, and after a JSON round trip."""
    from tests.graph.test_refs import SCRIPT

    script, graph_json = tmp_path / "mine.py", tmp_path / "g.json"
    script.write_text(SCRIPT)
    assert main(["run", str(script), "--backend", "process", "--steps", "2", "--quiet"]) == 0, capsys.readouterr().err
    assert main(["viz", str(script), "--format", "json", "-o", str(graph_json)]) == 0
    assert main(["run", str(graph_json), "--steps", "2", "--quiet"]) == 0, capsys.readouterr().err
    assert "done: 2 steps" in capsys.readouterr().out


def test_checkpoint_directory_is_not_overwritten_silently(tmp_path, capsys):
    ck = tmp_path / "ck"
    base = ["run", "--synthetic", "--steps", "4", "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--quiet"]
    assert main(base) == 0
    assert (ck / "step-00000004" / "graph.json").is_file()
    capsys.readouterr()
    assert main(base) == 2  # a fresh run into a used directory
    err = " ".join(capsys.readouterr().err.split())
    assert "holds the checkpoints of an earlier run (newest step-00000004)" in err and "--resume" in err and "--overwrite-checkpoints" in err
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-00000002", "step-00000004"]
    assert main([*base[:3], "6", *base[4:], "--resume"]) == 0
    assert "resuming from" in capsys.readouterr().err
    assert main([*base, "--overwrite-checkpoints"]) == 0
    assert (ck / "LATEST").read_text() == "step-00000004"
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-00000002", "step-00000004"]  # step 6 of the old run is gone


@pytest.mark.parametrize(("flags", "kept"), [([], [4, 5, 6]), (["--keep-checkpoints", "2"], [5, 6]), (["--keep-checkpoints", "1"], [6])],
                         ids=["default-3", "keep-2", "keep-1"])
def test_keep_checkpoints_sets_how_many_stay(tmp_path, capsys, flags, kept):
    ck = tmp_path / "ck"
    argv = ["run", "--synthetic", "--steps", "6", "--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--quiet", *flags]
    assert main(argv) == 0, capsys.readouterr().err
    assert sorted(p.name for p in ck.glob("step-*")) == [f"step-{s:08d}" for s in kept]
    assert (ck / "LATEST").read_text() == "step-00000006"


def test_keep_checkpoints_below_1_exits_2(tmp_path, capsys):
    argv = ["run", "--synthetic", "--steps", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--keep-checkpoints", "0", "--quiet"]
    assert main(argv) == 2
    assert "keep_checkpoints=0 must be >= 1" in " ".join(capsys.readouterr().err.split())


def test_checkpoint_every_minutes_checkpoints_by_wall_time(tmp_path, capsys):
    """Every synthetic step takes 20 ms, more than 0.0002 minutes (12 ms): a checkpoint after each step."""
    ck = tmp_path / "ck"
    argv = ["run", "--synthetic", "--steps", "3", "--checkpoint-dir", str(ck), "--checkpoint-every-minutes", "0.0002", "--quiet",
            "--option", "train_s=0.02", "--keep-checkpoints", "5"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-00000001", "step-00000002", "step-00000003"]
    bad = ["run", "--synthetic", "--steps", "2", "--checkpoint-dir", str(tmp_path / "b"), "--checkpoint-every-minutes", "-1", "--quiet"]
    assert main(bad) == 2
    assert "checkpoint_every_minutes=-1.0 must be a finite number >= 0" in " ".join(capsys.readouterr().err.split())


def test_one_sample_per_prompt_is_a_warning_line_and_a_python_warning(tmp_path, capsys):
    """A graph file with n_samples=1 (no builder involved): ``flowrl run`` says it once, as a line; ``run_graph`` warns."""
    import msgspec

    from flowrl.errors import GraphWarning
    from flowrl.examples import build_example
    from flowrl.graph.ir import Graph
    from flowrl.graph.serialize import to_json
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph
    from flowrl.runtime.programs.synthetic import synthetic_programs

    spec = build_example("llamarl").spec
    one = lambda n: msgspec.structs.replace(n, sampling=msgspec.structs.replace(n.sampling, n_samples=1)) if n.kind == "generator" else n  # noqa: E731
    graph = Graph(msgspec.structs.replace(spec, nodes=tuple(one(n) for n in spec.nodes)))
    (tmp_path / "g.json").write_text(to_json(graph))
    assert main(["run", str(tmp_path / "g.json"), "--synthetic", "--steps", "1", "--quiet"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("flowrl run: warning: loss 'aipo': generator 'gen' draws n_samples=1 completion per prompt") == 1, err
    assert "leaves every advantage 0 and nothing is learned; set n_samples >= 2" in err
    with pytest.warns(GraphWarning, match=r"draws n_samples=1 completion per prompt"):
        run_graph(graph, RunConfig(steps=1, programs=synthetic_programs(graph)))


def test_a_resume_into_a_changed_graph_names_what_changed(tmp_path, capsys):
    import json

    ck, first, second = tmp_path / "ck", tmp_path / "g1.json", tmp_path / "g2.json"
    assert main(["viz", "llamarl", "--format", "json", "-o", str(first)]) == 0
    raw = json.loads(first.read_text())
    next(n for n in raw["nodes"] if n["name"] == "gen")["sampling"]["temperature"] = 0.7
    second.write_text(json.dumps(raw))
    base = ["--synthetic", "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--quiet"]
    assert main(["run", str(first), "--steps", "2", *base]) == 0
    capsys.readouterr()
    assert main(["run", str(second), "--steps", "4", *base, "--resume"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "was written for graph 'llamarl' with a different definition (checkpoint -> now: nodes['gen'].sampling.temperature: 1.0 -> 0.7)" in err, err


def test_resume_without_a_checkpoint_is_an_error(tmp_path, capsys):
    assert main(["run", "--synthetic", "--steps", "2", "--checkpoint-dir", str(tmp_path / "typo"), "--resume", "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "checkpoint directory" in err and "does not exist" in err and "drop --resume" in err
    assert not (tmp_path / "typo").exists()


def test_plan_for_another_machine_is_refused(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", "llamarl", "--cluster", "1024xH100", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["run", "--plan", str(plan), "--synthetic", "--steps", "2", "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "the plan was made for 1024xH100" in err and "make a plan for this machine: flowrl plan llamarl --cluster cpu" in err


@pytest.mark.parametrize(
    ("plan_argv", "run_argv", "message"),
    [
        (["llamarl", "--cluster", "64xH100", "--model", "qwen2.5-7b"], ["llamarl"],
         "was made for another graph than this run's: node 'gen' was planned as model qwen2.5-7b (n_layers 28, dim 3584, n_heads 28), "
         "but runs 2L64d here (n_layers 2, dim 64, n_heads 4)"),
        (["llamarl", "--cluster", "cpu:2"], ["llamarl_ref"], "the plan places no devices for node 'ref' of graph 'llamarl_ref'; "
         "re-plan for this graph: flowrl plan llamarl_ref --cluster cpu:2 -o"),
        (["llamarl_ref", "--cluster", "cpu:3"], ["llamarl"], "the plan places ['ref'], which graph 'llamarl' does not have as device nodes"),
    ],
    ids=["other-model", "node-missing", "node-extra"],
)
def test_plan_for_another_graph_is_refused_before_any_work(tmp_path, capsys, plan_argv, run_argv, message):
    plan = tmp_path / "plan.json"
    assert main(["plan", *plan_argv, "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["run", *run_argv, "--plan", str(plan), "--synthetic", "--steps", "2", "--quiet", "--metrics", str(tmp_path / "m.jsonl")]) == 2
    assert message in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "m.jsonl").exists()


def test_plan_for_more_ranks_than_the_torchrun_job_is_refused_naming_the_fix(tmp_path, capsys, monkeypatch):
    """A plan for 8 devices under a torchrun job of 3 ranks: every rank refuses before its process group."""
    plan = tmp_path / "p8.json"
    assert main(["plan", "llamarl", "--cluster", "cpu:8", "--strategy", "gen:d4@0-3 | policy:d4@4-7", "-o", str(plan)]) == 0
    capsys.readouterr()
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "3"), ("LOCAL_WORLD_SIZE", "3"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(name, value)
    assert main(["run", "llamarl", "--backend", "torchrun", "--plan", str(plan), "--steps", "2", "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert ("the plan was made for cpu:8 (CPU devices 0-7), but there are 3 ranks in this torchrun job; launch torchrun with 8 processes "
            f"in all ('flowrl plan ... --emit DIR' writes that launch), or re-plan for 3: flowrl plan llamarl --cluster cpu:3 -o {plan}") in err
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_plan_devices_are_said(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", "llamarl", "--cluster", "cpu:1", "-o", str(plan)]) == 0
    assert main(["run", "--plan", str(plan), "--synthetic", "--steps", "2", "--quiet"]) == 0
    assert "flowrl run: plan for cpu:1 on this machine's CPU cores: " in capsys.readouterr().err


def test_model_points_an_example_at_a_local_copy(hf_qwen2_chat_dir, tmp_path, capsys):
    """qwen_math ships no weights: it says how to point it at a copy; --model DIR runs it (tiny random
    Qwen2 with a chat template) and 'flowrl plan --model DIR' reads the same directory."""
    from flowrl.cli.main import main

    assert main(["run", "qwen_math", "--steps", "1", "--quiet"]) == 2
    assert "--model DIR" in " ".join(capsys.readouterr().err.split())
    metrics = tmp_path / "m.jsonl"
    assert main(["run", "qwen_math", "--model", str(hf_qwen2_chat_dir), "--steps", "1", "--quiet", "--metrics", str(metrics)]) == 0
    assert len(metrics.read_text().splitlines()) == 1
    assert main(["run", "--model", str(hf_qwen2_chat_dir), "--steps", "1"]) == 2  # llamarl has no HF model
    assert "has no Hugging Face model" in " ".join(capsys.readouterr().err.split())
    assert main(["plan", "qwen_math", "--model", str(hf_qwen2_chat_dir), "--prompt-len", "32", "--gen-len", "64"]) == 0  # its context is 128
def test_device_cpu_runs_a_short_graph(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    assert main(["run", "--device", "cpu", "--steps", "2", "--metrics", str(metrics), "--quiet"]) == 0, capsys.readouterr().err
    assert len(read_metrics(str(metrics))) == 2


def test_device_cuda_without_cuda_exits_2(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal cannot happen")
    assert main(["run", "--device", "cuda", "--steps", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "this machine has no CUDA device; use --device cpu or auto" in err and "Traceback" not in err
    assert not (tmp_path / "ck").exists()  # refused before any directory was touched


@pytest.mark.parametrize("backend", ["local", "process"])
def test_worker_user_mistake_is_one_paragraph(backend, tmp_path, capsys):
    """A flowrl check failing inside a worker (a scorer whose file is missing) reads as on the local backend."""
    graph_json = tmp_path / "g.json"
    assert main(["viz", "llamarl", "--format", "json", "-o", str(graph_json)]) == 0
    data = json.loads(graph_json.read_text())
    missing = tmp_path / "nope.py"
    for node in data["nodes"]:
        if node["kind"] == "scorer":
            node["fn"] = f"{missing}:score"
    graph_json.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["run", str(graph_json), "--backend", backend, "--steps", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"cannot load file '{missing}'" in " ".join(err.split())
    assert "Traceback" not in err and "--- traceback" not in err
    assert len(err.strip().split("\n\n")) == 1  # one paragraph


def test_worker_bug_keeps_its_traceback(capsys):
    """A non-flowrl error in a worker (a bug, here an injected RuntimeError) is a failed run with the worker's traceback."""
    argv = ["run", "--synthetic", "--backend", "process", "--steps", "3", "--quiet", "--option", "fail_node=reward", "--option", "fail_step=1"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "injected failure in reward at step 1" in err
    assert "--- traceback in worker of node 'reward'" in err and "Traceback (most recent call last)" in err


@pytest.mark.parametrize("backend, traits, starts", [
    ("process", None, True),
    ("local", None, False),
    ("torchrun", None, False),
    ("mine", BackendTraits(crosses_processes=True, zygote=True), True),  # a user's backend, by its traits alone
], ids=["process", "local", "torchrun", "declared"])
def test_flowrl_run_prestarts_the_zygote_where_the_backends_traits_say(monkeypatch, backend, traits, starts):
    import argparse
    import contextlib

    from flowrl import backend_traits
    from flowrl.cli import run as run_cli
    from flowrl.runtime.backends.process import zygote

    if traits is not None:
        monkeypatch.setitem(backend_traits._DECLARED, backend, traits)
    entered = []

    @contextlib.contextmanager
    def prestarted():
        entered.append(True)
        yield

    monkeypatch.setattr(zygote, "prestarted", prestarted)
    monkeypatch.setattr(run_cli, "_run_here", lambda args: 0)
    assert run_cli._run(argparse.Namespace(backend=backend)) == 0
    assert entered == ([True] if starts else [])
