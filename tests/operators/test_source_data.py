"""A source over a prompt file: config checks without the file, the graph's tokenizer, batches, epochs, resume."""

from __future__ import annotations

import msgspec
import pytest
import torch

from flowrl.data.wiring import default_max_prompt_len, open_source_stream, row_of, tokenizer_path
from flowrl.errors import ConfigError, GraphError
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig, SourceConfig
from flowrl.graph.nodes import SourceNode
from flowrl.graph.serialize import from_json, to_json
from flowrl.models.tokenizer import load_tokenizer
from flowrl.operators.source import PromptSource
from flowrl.runtime.programs.nodes import SourceProgram
from tests.data.helpers import data_graph, model_config, word_tokenizer, write_jsonl

ROWS = [{"prompt": f"what is {a} plus {b} ?", "answer": str(a + b), "id": i} for i, (a, b) in enumerate([(1, 2), (3, 4), (2, 2), (5, 1), (0, 3)])]


@pytest.fixture
def files(tmp_path):
    tok = word_tokenizer(tmp_path / "tok")
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    return str(data), str(tok)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"task": "add", "data": "a.jsonl"}, "both set; a source reads one"),
        ({"data": "prompts.txt"}, r"extension '\.txt'"),
        ({"data": "prompts"}, r"extension '\(none\)'"),
        ({"data": "a.jsonl", "max_prompt_len": -1}, "max_prompt_len=-1 must be >= 0"),
        ({"data": "a.jsonl", "overlong": "cut"}, "overlong='cut' must be 'drop' or 'truncate'"),
        ({"data": "a.jsonl", "prompt_field": ""}, "prompt_field must name"),
    ],
    ids=["task-and-data", "bad-ext", "no-ext", "negative-len", "bad-overlong", "empty-field"],
)
def test_bad_source_configs(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SourceConfig(**kwargs)


def test_the_default_is_still_the_add_task_and_data_replaces_it():
    assert SourceConfig().task == "add"
    assert SourceConfig(data="a.parquet").task == ""
    b = GraphBuilder("g")
    assert b.source("p", data="x.csv", tokenizer="t").source.task == ""


def test_a_graph_with_a_missing_file_still_loads_prints_and_round_trips(tmp_path):
    g = data_graph(str(tmp_path / "nowhere.jsonl"), str(tmp_path / "no-tokenizer"))
    again = from_json(to_json(g))
    assert again == g
    assert "data=nowhere.jsonl, batch=3" in str(g)


def test_the_builder_fills_the_tokenizer_from_the_hf_model_it_feeds():
    hf = HFModelConfig(path="/models/qwen", tokenizer="/models/qwen-tok")
    b = GraphBuilder("g", model=hf)
    prompts = b.source("prompts", data="/data/math.jsonl")
    gen = b.generator("gen", prompts)
    loss = b.loss("aipo", gen, b.scorer("reward", gen, fn="m:f"))
    b.weights(b.policy("policy", loss), gen)
    g = b.build()
    assert g.node("prompts").source.tokenizer == "/models/qwen-tok"
    assert tokenizer_path(g, "prompts") == "/models/qwen-tok"


def test_a_data_source_without_any_tokenizer_is_a_graph_error():
    with pytest.raises(GraphError, match=r"source 'prompts' reads prompt file 'a\.jsonl' but has no tokenizer"):
        data_graph("a.jsonl", "")


def test_batches_hold_stream_positions_left_padded_with_the_tokenizers_pad(files):
    data, tok_dir = files
    g = data_graph(data, tok_dir, seed=3)
    tok = load_tokenizer(tok_dir)
    program = SourceProgram(g.node("prompts"), g)
    stream = program.source.stream
    seen = []
    for step in range(4):  # 12 positions over 5 rows: epochs 0, 1 and 2
        batch, info = program.step(step, {}, 0)
        assert batch["prompt_index"].tolist() == list(range(3 * step, 3 * step + 3))
        assert info["data/epoch"] == (3 * step) // 5
        width = batch["prompt_ids"].shape[1]
        for ids, n, p in zip(batch["prompt_ids"], batch["prompt_lens"], batch["prompt_index"].tolist()):
            row = row_of(g, "prompts", p)
            assert stream.row_of(p) == row
            assert ids[width - n :].tolist() == tok(ROWS[row]["prompt"])["input_ids"]
            assert (ids[: width - n] == tok.pad_token_id).all()
            seen.append(row)
    assert sorted(seen[:5]) == sorted(seen[5:10]) == list(range(5))  # each epoch visits every row once
    assert seen[:5] != seen[5:10]  # and in a new order


def test_seek_resumes_the_exact_stream(files):
    data, tok_dir = files
    g = data_graph(data, tok_dir)
    straight = SourceProgram(g.node("prompts"), g)
    want = [straight.step(i, {}, 0)[0] for i in range(5)]
    resumed = SourceProgram(g.node("prompts"), g)
    resumed.seek(6)
    for i in range(2, 5):
        got = resumed.step(i, {}, 0)[0]
        assert all(torch.equal(got[k], want[i][k]) for k in got)


def test_the_length_limit_defaults_to_the_models_room_for_a_prompt(files, tmp_path):
    data, tok_dir = files
    g = data_graph(data, tok_dir)
    assert default_max_prompt_len(g, "prompts") == model_config().max_seq_len - 4
    long_rows = [*ROWS, {"prompt": " ".join(["one"] * 30), "answer": "x"}]
    g = data_graph(str(write_jsonl(tmp_path / "long.jsonl", long_rows)), tok_dir)
    with pytest.warns(UserWarning, match=r"1 of 6 prompts .* longer than max_prompt_len=20 tokens \(the longest has 30\) and are dropped"):
        program = SourceProgram(g.node("prompts"), g)
    assert len(program.source.stream) == 5 and 5 not in {program.source.stream.row_of(p) for p in range(50)}
    assert program.step(0, {}, 0)[1]["data/prompts_dropped"] == 1


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"prompt_field": "question"}, r"no row has the prompt field 'question'; the fields present are \['answer', 'id', 'prompt'\]"),
        ({"chat_template": True, "notemplate": True}, "chat_template=True, but the tokenizer has no chat template"),
        ({"vocab": 16}, "the tokenizer has 28 tokens but the model's embedding has 16 rows"),
    ],
    ids=["field-absent", "no-chat-template", "vocab-too-big"],
)
def test_bad_data_is_an_error_when_the_source_is_built(files, tmp_path, change, match):
    data, tok_dir = files
    if change.pop("notemplate", False):
        tok_dir = str(word_tokenizer(tmp_path / "plain", chat_template=None))
    vocab = change.pop("vocab", None)
    g = data_graph(data, tok_dir, **change)
    if vocab:
        spec = g.spec
        nodes = tuple(
            msgspec.structs.replace(n, model=msgspec.structs.replace(n.model, vocab_size=vocab)) if hasattr(n, "model") else n
            for n in spec.nodes
        )
        g = type(g)(msgspec.structs.replace(spec, nodes=nodes))
    with pytest.raises(ConfigError, match=match):
        open_source_stream(g, "prompts")


def test_a_source_node_alone_opens_its_file_with_its_own_settings(files):
    data, tok_dir = files
    src = PromptSource(SourceNode(name="p", source=SourceConfig(data=data, tokenizer=tok_dir, batch_size=2, shuffle=False)))
    assert src.next_batch()["prompt_index"].tolist() == [0, 1]
    assert [src.stream.row_of(p) for p in range(7)] == [0, 1, 2, 3, 4, 0, 1]
