"""``flowrl plan`` on a graph that reads a prompt file: the prompt length is measured on the file,
tokenised as the source will, and the plan says which length it assumed and where from."""

from __future__ import annotations

import json

import pytest

from flowrl.cli.main import main
from flowrl.graph.serialize import to_json

from ..data.helpers import data_graph, word_tokenizer, write_jsonl

#: Prompts of 1, 2, 3, 4, 5 and 6 words; the word tokenizer gives one id per word (no chat template here).
WORDS = ["one", "one two", "one two three", "what is one plus", "what is one plus two", "what is one plus two ?"]


@pytest.fixture(scope="module")
def graph_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("prompt_len")
    tok = word_tokenizer(d / "tok")
    data = write_jsonl(d / "p.jsonl", [{"prompt": w} for w in WORDS])
    graph = data_graph(str(data), str(tok), batch_size=3, shuffle=False)
    path = d / "graph.json"
    path.write_text(to_json(graph))
    return path


def _workload(args, capsys) -> dict:
    assert main(["plan", *args, "--cluster", "cpu:2", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["workload"]


def test_the_prompt_length_is_measured_on_the_prompt_file(graph_file, capsys):
    workload = _workload([str(graph_file)], capsys)
    # file order, steps of 3: longest of (1, 2, 3) words = 3, of (4, 5, 6) = 6; mean 4.5 -> 4 (round half to even)
    assert workload["prompt_len"] == round((3 + 6) / 2)
    assert "p.jsonl" in workload["prompt_len_from"] and "tokenised as source 'prompts' will" in workload["prompt_len_from"]


def test_the_table_says_which_prompt_length_it_assumed(graph_file, capsys):
    assert main(["plan", str(graph_file), "--cluster", "cpu:2"]) == 0
    out = capsys.readouterr().out
    assert "2 samples, 4+4 tokens" in out and "prompt length from prompt file" in out


def test_prompt_len_overrides_the_file(graph_file, capsys):
    workload = _workload([str(graph_file), "--prompt-len", "7"], capsys)
    assert workload["prompt_len"] == 7 and workload["prompt_len_from"] == "--prompt-len"


def test_a_task_source_keeps_the_upper_bound_and_says_so(capsys):
    workload = _workload(["llamarl"], capsys)
    assert workload["prompt_len_from"] == "the upper bound max_seq_len - max_new_tokens of generator 'gen'"


def test_a_prompt_file_missing_here_leaves_the_upper_bound_with_a_note(tmp_path, graph_file, capsys):
    data = json.loads(graph_file.read_text())
    for node in data["nodes"]:
        if node.get("kind") == "source":
            node["source"]["data"] = str(tmp_path / "elsewhere.jsonl")
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(data))
    assert main(["plan", str(path), "--cluster", "cpu:2", "--json"]) == 0
    captured = capsys.readouterr()
    workload = json.loads(captured.out)["workload"]
    assert workload["prompt_len"] == 24 - 4 and workload["prompt_len_from"].startswith("the upper bound")
    assert "note: the prompt file of source 'prompts' was not read here" in captured.err and "elsewhere.jsonl" in captured.err
