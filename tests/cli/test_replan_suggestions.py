"""The ``flowrl plan`` commands that messages suggest name the graph as the user named it (a file of
their own, not the graph's name) and paste as they are: each test runs the suggested command."""

from __future__ import annotations

import re
import shlex

import pytest

from flowrl.cli.main import main
from flowrl.errors import ConfigError
from flowrl.planners.plan import load_plan

# a graph of the user's own, named unlike its file (and like no built-in example)
SCRIPT = """
from flowrl.graph.builder import GraphBuilder

b = GraphBuilder("mine_grpo")
prompts = b.source("prompts", task="copy", batch_size=4)
gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=4)
score = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
loss = b.loss("aipo", gen, score, objective="aipo")
policy = b.policy("policy", loss)
b.weights(policy, gen, max_staleness=1)
graph = b.build()
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "my graphs" / "mine_grpo.py"  # a space: the suggestion must quote it
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


def _suggested(err: str) -> list[str]:
    """The ``flowrl plan ...`` command the message suggests (to its end, or inside backticks), as argv."""
    line = " ".join(err.split())
    match = re.search(r"flowrl plan (.+?\.json'?)(?:`|$)", line)
    assert match, line
    return ["plan", *shlex.split(match.group(1))]


def test_a_refused_gpu_plan_suggests_a_plan_of_the_users_file(script, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    gpu_plan = tmp_path / "gpu.json"
    assert main(["plan", str(script), "--cluster", "16xH100", "-o", str(gpu_plan)]) == 0
    capsys.readouterr()
    assert main(["run", str(script), "--plan", str(gpu_plan), "--synthetic", "--steps", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "flowrl plan mine_grpo " not in err and shlex.quote(str(script)) in err
    argv = _suggested(err)
    assert main(argv) == 0  # the suggestion, pasted
    capsys.readouterr()
    out = argv[argv.index("-o") + 1]  # the file it names
    plan = load_plan(tmp_path / out)
    assert plan.graph == "mine_grpo" and plan.cluster == "cpu"
    assert main(["run", str(script), "--plan", out, "--synthetic", "--steps", "1", "--quiet"]) == 0


def test_a_missing_plan_file_suggests_a_plan_of_the_users_file(script, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(script), "--plan", "new plan.json", "--synthetic", "--steps", "1", "--quiet"]) == 2
    argv = _suggested(capsys.readouterr().err)
    assert main(argv) == 0
    assert load_plan(tmp_path / "new plan.json").graph == "mine_grpo"


def test_a_graph_too_large_for_this_machine_suggests_planning_its_file(script, tmp_path, capsys):
    from flowrl.cli.graphs import load_graph
    from flowrl.runtime.preflight import check_fits_in_memory

    graph = load_graph(str(script))
    with pytest.raises(ConfigError, match="more than the") as info:
        check_fits_in_memory(graph, memory_bytes=1, graph_arg=str(script))
    message = str(info.value)
    assert f"flowrl plan {shlex.quote(str(script))} --cluster 8xH100" in message
    command = re.search(r"`(flowrl plan .+? --cluster 8xH100)`", message).group(1)
    assert main(shlex.split(command)[1:]) == 0  # pasted: plans the user's graph
    assert "plan for graph 'mine_grpo' on 8xH100" in capsys.readouterr().out
