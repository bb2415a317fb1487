"""A user's objective, registered in their graph script, runs from ``flowrl run`` on the script and on
the graph file saved from it; a saved row whose function cannot be imported exits 2 naming it."""

from __future__ import annotations

import json
import textwrap

import pytest

from flowrl.cli.main import main
from flowrl.graph.objectives import OBJECTIVES
from flowrl.runtime.observe.metrics import read_metrics

SCRIPT = textwrap.dedent(
    """
    from flowrl import GraphBuilder, ModelConfig, register_objective
    from flowrl.operators.losses import pg_loss

    def scaled_pg(config, logprobs, old, advantages, mask, *, options, normalizer=None, lengths=None):
        loss, metrics = pg_loss(logprobs, old, advantages, mask, rho=config.rho, normalizer=normalizer, lengths=lengths, agg=config.loss_agg)
        return options["scale"] * loss, {**metrics, "scaled_pg/scale": options["scale"]}

    register_objective("scaled_pg", scaled_pg, options={"scale": 1.0})

    b = GraphBuilder("mine", model=ModelConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2, n_kv_heads=2, max_seq_len=32))
    gen = b.generator("gen", b.source("prompts", task="copy", batch_size=2), n_samples=2, max_new_tokens=4)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    policy = b.policy("policy", b.loss("loss", gen, reward, objective="scaled_pg", options={"scale": 0.5}, correction="icepop"), lr=1e-3)
    b.weights(policy, gen, max_staleness=1)
    graph = b.build()
    """
)


@pytest.fixture(autouse=True)
def _unregister():
    yield
    OBJECTIVES.pop("scaled_pg", None)  # the script registered it in this process


def test_a_users_objective_runs_from_its_script_and_its_graph_file(tmp_path, capsys):
    script, graph_json, metrics = tmp_path / "mine.py", tmp_path / "g.json", tmp_path / "m.jsonl"
    script.write_text(SCRIPT)
    assert main(["viz", str(script), "--format", "json", "-o", str(graph_json)]) == 0
    assert main(["run", str(graph_json), "--steps", "2", "--quiet", "--metrics", str(metrics)]) == 0, capsys.readouterr().err
    rows = read_metrics(metrics)
    assert [r["scaled_pg/scale"] for r in rows] == [0.5, 0.5]  # the user's function ran, with the file's option
    assert all("correction/token_frac" in r for r in rows)  # and the correction layered on it
    assert "done: 2 steps" in capsys.readouterr().out


def test_a_saved_objective_that_cannot_be_imported_exits_2(tmp_path, capsys):
    script, graph_json = tmp_path / "mine.py", tmp_path / "g.json"
    script.write_text(SCRIPT)
    assert main(["viz", str(script), "--format", "json", "-o", str(graph_json)]) == 0
    text = graph_json.read_text()
    data = json.loads(text)
    fn = next(n for n in data["nodes"] if n.get("kind") == "loss")["loss"]["row"]["fn"]
    graph_json.write_text(text.replace(fn, "no_such_module_xyz:scaled_pg"))
    capsys.readouterr()
    assert main(["run", str(graph_json), "--steps", "1", "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "objective 'scaled_pg''s function 'no_such_module_xyz:scaled_pg' cannot be imported" in err and "PYTHONPATH" in err
    assert "Traceback" not in err
