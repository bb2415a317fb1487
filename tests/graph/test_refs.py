"""References to user code: both forms check, resolve, and stay the same in every process and load."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from flowrl.errors import GraphError
from flowrl.cli.graphs import load_graph
from flowrl.graph.refs import check_reference, reference_of, resolve
from flowrl.graph.serialize import from_json, references, to_json

SCRIPT = textwrap.dedent(
    """
    from flowrl import GraphBuilder, ModelConfig
    from flowrl.operators.tasks import CopyTask

    def my_reward(prompt_ids, completion_ids):
        return float(len(completion_ids) > 0)

    def my_task(seed):
        return CopyTask(seed)

    b = GraphBuilder("mine", model=ModelConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2, n_kv_heads=2, max_seq_len=32))
    prompts = b.source("prompts", task=my_task, batch_size=4)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=4)
    reward = b.scorer("reward", gen, fn=my_reward)
    aipo = b.loss("aipo", gen, reward, objective="aipo")
    policy = b.policy("policy", aipo, lr=1e-3)
    b.weights(policy, gen, max_staleness=1)
    graph = b.build()
    """
)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize(
    "ref, ok",
    [
        ("flowrl.operators.tasks:copy_reward", True),
        ("/abs/dir/mine.py:my_reward", True),
        ("rel/mine.py:Cls.method", True),
        ("my_reward", False),
        ("mine.py:", False),
        ("dir/mine.txt:fn", False),
        ("/a/mine.py:fn\n", False),
    ],
    ids=["module", "abs-file", "rel-file", "bare", "no-qualname", "not-py", "newline"],
)
def test_check_reference(ref, ok):
    assert (check_reference(ref) is None) is ok


def test_script_functions_are_referenced_by_file_path(script):
    graph = load_graph(str(script))
    expected = {f"{script.resolve()}:my_reward", f"{script.resolve()}:my_task"}
    assert set(references(graph)) == expected
    assert references(load_graph(str(script))) == references(graph)  # the same on every load


def test_json_round_trip_keeps_references_and_imports_nothing(script, tmp_path):
    text = to_json(load_graph(str(script)))
    code = (
        "import sys; from flowrl.graph.serialize import from_json, references;"
        f"g = from_json(open({str(tmp_path / 'g.json')!r}).read());"
        "print(references(g)); print(any('mine' in m for m in sys.modules))"
    )
    (tmp_path / "g.json").write_text(text)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == str(sorted(references(from_json(text))))
    assert out[1] == "False"  # loading the JSON graph did not run the script


def test_file_reference_resolves_in_a_fresh_process(script):
    ref = f"{script.resolve()}:my_reward"
    code = f"from flowrl.graph.refs import resolve; print(resolve({ref!r})([1], [2, 3]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1.0"


def test_resolve_names_a_missing_file(tmp_path):
    with pytest.raises(GraphError, match="no such file here"):
        resolve(f"{tmp_path / 'gone.py'}:fn")


def test_reference_of_a_lambda_is_refused():
    with pytest.raises(GraphError, match="not a lambda"):
        reference_of(lambda p, c: 0.0)
