"""Text scorers: decoded prompts and completions (cut at the stop token) with each sample's row fields."""

from __future__ import annotations

import pytest
import torch

from flowrl.errors import ConfigError, NodeBuildError, NodeExecutionError
from flowrl.models.tokenizer import load_tokenizer
from flowrl.operators.scoring import Scorer
from flowrl.runtime.programs.table import build_program
from flowrl.runtime.programs.nodes import ProgramEnv, SharedTransports
from tests.data.helpers import data_graph, word_tokenizer, write_jsonl

from . import userfns

ROWS = [{"prompt": "what is one plus two ?", "answer": "3", "id": 10},
        {"prompt": "what is two plus two ?", "answer": "4", "id": 11},
        {"prompt": "what is one plus one ?", "answer": "2", "id": 12}]


@pytest.fixture
def setup(tmp_path):
    tok_dir = word_tokenizer(tmp_path / "tok")
    data = write_jsonl(tmp_path / "p.jsonl", ROWS)
    return str(data), str(tok_dir), load_tokenizer(str(tok_dir))


def program(graph):
    return build_program(graph, "reward", ProgramEnv(), SharedTransports(()))


def rollout_for(graph, tok, positions, completions):
    """A rollout of two samples per prompt at ``positions`` with the given completion texts (EOS appended)."""
    src = build_program(graph, "prompts", ProgramEnv(), SharedTransports(())).source
    prompts = [src.prompt(p) for p in positions]
    width = max(map(len, prompts))
    sample_prompts = [p for p in prompts for _ in range(2)]
    ids = [tok(c)["input_ids"] + [tok.eos_token_id, 7] for c in completions]  # a token after EOS must be cut
    cw = max(map(len, ids))
    return {
        "sample_prompt_ids": torch.tensor([[0] * (width - len(p)) + p for p in sample_prompts]),
        "sample_prompt_lens": torch.tensor([len(p) for p in sample_prompts]),
        "completion_ids": torch.tensor([c + [0] * (cw - len(c)) for c in ids]),
        "completion_lens": torch.tensor([len(c) for c in ids]),
        "group_ids": torch.arange(len(positions)).repeat_interleave(2),
        "prompt_index": torch.tensor(positions),
    }


def test_each_sample_gets_its_decoded_text_and_its_rows_fields(setup):
    data, tok_dir, tok = setup
    g = data_graph(data, tok_dir, scorer="tests.operators.userfns:text_echo", inputs="text", seed=1)
    scorer = program(g).scorer
    stream = scorer.text.stream
    positions = [4, 5]  # epoch 1 of 3 rows
    # each position's row, found by its prompt's tokens (the tokenizer's encoding of each row), not by row_of
    rows = [next(i for i, r in enumerate(ROWS) if tok(r["prompt"])["input_ids"] == stream.prompt_ids(p)) for p in positions]
    userfns.SEEN.clear()
    got = scorer.score(rollout_for(g, tok, positions, [ROWS[rows[0]]["answer"], "9", "9", ROWS[rows[1]]["answer"]]))
    assert got["rewards"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert userfns.SEEN == [
        (ROWS[rows[0]]["prompt"], ROWS[rows[0]]["answer"], ROWS[rows[0]]["answer"], ROWS[rows[0]]["id"]),
        (ROWS[rows[0]]["prompt"], "9", ROWS[rows[0]]["answer"], ROWS[rows[0]]["id"]),
        (ROWS[rows[1]]["prompt"], "9", ROWS[rows[1]]["answer"], ROWS[rows[1]]["id"]),
        (ROWS[rows[1]]["prompt"], ROWS[rows[1]]["answer"], ROWS[rows[1]]["answer"], ROWS[rows[1]]["id"]),
    ]


def test_the_batched_form_gets_lists_of_texts_and_fields(setup):
    data, tok_dir, tok = setup
    g = data_graph(data, tok_dir, scorer="tests.operators.userfns:text_batched", inputs="text", batched=True, shuffle=False)
    userfns.SEEN.clear()
    got = program(g).scorer.score(rollout_for(g, tok, [0, 1], ["3", "4", "4", "4"]))
    assert got["rewards"].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert userfns.SEEN == [([ROWS[0]["prompt"]] * 2 + [ROWS[1]["prompt"]] * 2, ["3", "4", "4", "4"], ["3", "3", "4", "4"])]


def test_optional_and_catch_all_parameters_get_what_the_row_has(setup):
    data, tok_dir, tok = setup
    g = data_graph(data, tok_dir, scorer="tests.operators.userfns:text_optional", inputs="text", shuffle=False)
    userfns.SEEN.clear()
    program(g).scorer.score(rollout_for(g, tok, [2], ["2", "2"]))
    assert userfns.SEEN[0] == {"answer": "2", "id": 12, "solution": ""}


def test_a_required_field_the_rows_lack_is_an_error_at_start(setup):
    data, tok_dir, _ = setup
    g = data_graph(data, tok_dir, scorer="tests.operators.userfns:text_needs_solution", inputs="text")
    with pytest.raises(NodeBuildError, match=r"asks for row field\(s\) \['solution'\], which the prompt rows lack; the fields present are \['answer', 'id'\]"):
        program(g)


def test_a_field_missing_from_some_rows_is_an_error_at_start(setup, tmp_path):
    _, tok_dir, _ = setup
    data = write_jsonl(tmp_path / "holes.jsonl", [ROWS[0], {"prompt": "what is one ?", "id": 3}])
    g = data_graph(str(data), tok_dir, scorer="tests.operators.userfns:text_echo", inputs="text")
    with pytest.raises(NodeBuildError, match=r"row field 'answer', which 1 row\(s\) of .*holes.jsonl' lack \(first: row 1\)"):
        program(g)


def test_bad_text_rewards_keep_naming_the_sample_with_its_text(setup):
    data, tok_dir, tok = setup
    g = data_graph(data, tok_dir, scorer="tests.operators.userfns:text_nan", inputs="text", shuffle=False)
    with pytest.raises(NodeExecutionError, match=r"returned nan for sample 0 \(prompt 'what is one plus two \?', completion '3'\)"):
        program(g).scorer.score(rollout_for(g, tok, [0], ["3", "3"]))


def test_a_text_scorer_on_a_task_source_decodes_with_the_builtin_tokenizer():
    from flowrl.graph.builder import GraphBuilder

    b = GraphBuilder("t")
    gen = b.generator("gen", b.source("prompts", task="copy"))
    loss = b.loss("aipo", gen, b.scorer("reward", gen, fn="flowrl.operators.rewards:exact_match_strict", inputs="text"))
    b.weights(b.policy("policy", loss), gen)
    g = b.build()
    with pytest.raises(NodeBuildError, match=r"asks for row field\(s\) \['answer'\].*fields present are \[\]"):
        program(g)


def test_a_text_scorer_needs_its_text_inputs():
    from flowrl.graph.nodes import ScorerNode

    with pytest.raises(ConfigError, match="reads text: build it with TextInputs"):
        Scorer(ScorerNode(name="r", fn="m:f", inputs="text"))


# -- the function's form against the scorer's flags (issue 25): a hint at start, TRL's form accepted --
@pytest.mark.parametrize(
    ("fn", "flags", "match"),
    [
        ("text_echo", {}, r"scorer 'reward': tests.operators.userfns:text_echo takes text \(its parameter 'prompt' is annotated str\), "
         r"but inputs='ids' calls it with token-id lists and no row fields; set inputs='text'"),
        ("text_untyped", {}, r"text_untyped takes text \(it takes \*\*fields, the prompt row's fields\).*set inputs='text'"),
        ("text_batched", {"batched": True}, r"text_batched takes text \(its parameter 'prompts' is annotated list\[str\]\).*set inputs='text'"),
        ("trl_length", {}, r"trl_length has the form of TRL's reward functions, f\(completions, \*\*kwargs\) -> list\[float\], "
         r"called once per batch with keyword arguments; set inputs='text' and batched=True"),
        ("trl_length", {"inputs": "text"}, r"has the form of TRL's reward functions.*set inputs='text' and batched=True"),
        ("trl_typo", {"inputs": "text", "batched": True}, r"trl_typo takes 1 positional parameter \['completion'\], but inputs='text', "
         r"batched=True calls it as fn\(prompts, completions, \*\*fields\); for TRL's reward-function form .* name its first "
         r"parameter 'completions' \(not 'completion'\)"),
    ],
    ids=["typed-text-as-ids", "untyped-text-as-ids", "batched-text-as-ids", "trl-as-ids", "trl-per-sample", "trl-typo"],
)
def test_a_function_whose_form_contradicts_the_flags_is_refused_at_start_with_the_flags_to_set(setup, fn, flags, match):
    data, tok_dir, _ = setup
    g = data_graph(data, tok_dir, scorer=f"tests.operators.userfns:{fn}", **flags)
    with pytest.raises(NodeBuildError, match=match):
        program(g)


def test_the_builder_gives_the_same_hint_for_a_function_it_is_handed():
    from flowrl.graph.builder import GraphBuilder

    b = GraphBuilder("t")
    gen = b.generator("gen", b.source("prompts", task="copy"))
    with pytest.raises(ConfigError, match=r"scorer 'reward': tests.operators.userfns:text_untyped takes text .* set inputs='text'"):
        b.scorer("reward", gen, fn=userfns.text_untyped)
    with pytest.raises(ConfigError, match=r"scorer 'reward': tests.operators.userfns:trl_length has the form of TRL's reward functions"):
        b.scorer("reward", gen, fn=userfns.trl_length, inputs="text")
    b.scorer("reward", gen, fn=userfns.trl_length, inputs="text", batched=True)  # accepted


def test_a_trl_reward_with_a_typo_is_refused_when_the_graph_is_built_suggesting_completions():
    """``def r(completion, **kw)`` with ``inputs="text", batched=True`` would build and fail after the first
    generation (``r() takes 1 positional argument but 2 were given``): the builder refuses it, and a
    function with too few positional parameters for its call in any form."""
    from flowrl.graph.builder import GraphBuilder

    b = GraphBuilder("t")
    gen = b.generator("gen", b.source("prompts", task="copy"))
    with pytest.raises(ConfigError, match=r"scorer 'reward': tests.operators.userfns:trl_typo takes 1 positional parameter \['completion'\], but inputs='text', batched=True "
                       r"calls it as fn\(prompts, completions, \*\*fields\); .*name its first parameter 'completions' \(not 'completion'\) "
                       r"and set inputs='text', batched=True"):
        b.scorer("reward", gen, fn=userfns.trl_typo, inputs="text", batched=True)
    with pytest.raises(ConfigError, match=r"ids_one takes 1 positional parameter \['prompt_ids'\], but inputs='ids' calls it as "
                       r"fn\(prompt_ids, completion_ids\); take the prompt and the completion as its first two parameters"):
        b.scorer("reward", gen, fn=userfns.ids_one)
    b.scorer("reward", gen, fn=userfns.ids_star)  # *args takes both


def test_trl_reward_functions_get_completions_prompts_and_row_fields_as_keyword_lists(setup):
    data, tok_dir, tok = setup
    g = data_graph(data, tok_dir, scorer="tests.operators.userfns:trl_accuracy", inputs="text", batched=True, shuffle=False)
    userfns.SEEN.clear()
    got = program(g).scorer.score(rollout_for(g, tok, [0, 1], ["3", "4", "4", "4"]))
    assert got["rewards"].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert userfns.SEEN == [(["3", "4", "4", "4"], ["3", "3", "4", "4"], [ROWS[0]["prompt"]] * 2 + [ROWS[1]["prompt"]] * 2)]
    g = data_graph(data, tok_dir, scorer="tests.operators.userfns:trl_length", inputs="text", batched=True, shuffle=False)
    userfns.SEEN.clear()
    got = program(g).scorer.score(rollout_for(g, tok, [0, 1], ["3", "4 4", "4", "4 4 4"]))
    assert got["rewards"].tolist() == [-2.0, 0.0, -2.0, -2.0]  # len("4 4") == 3
    assert userfns.SEEN == [["answer", "completion_ids", "id", "prompts"]]


def test_trl_reward_functions_get_the_conversational_form_for_chat_prompts(setup, tmp_path):
    """Rows whose prompts are chat messages: TRL passes ``prompts`` as those messages and each completion
    as one assistant message, ``[{"role": "assistant", "content": text}]``; so does flowrl."""
    _, tok_dir, tok = setup
    chats = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in ROWS]
    data = write_jsonl(tmp_path / "chat.jsonl", chats)
    g = data_graph(str(data), tok_dir, scorer="tests.operators.userfns:trl_conversational", inputs="text", batched=True,
                   shuffle=False, chat_template=True)  # fmt: skip
    userfns.SEEN.clear()
    got = program(g).scorer.score(rollout_for(g, tok, [0, 1], ["3", "4", "4", "4"]))
    assert got["rewards"].tolist() == [1.0, 0.0, 1.0, 1.0]
    ((completions, prompts),) = userfns.SEEN
    assert completions == [[{"role": "assistant", "content": c}] for c in ["3", "4", "4", "4"]]
    assert prompts == [chats[0]["prompt"]] * 2 + [chats[1]["prompt"]] * 2


def test_an_id_scorer_named_like_text_that_fails_gets_the_hint(setup):
    """fn(prompt, completion) has nothing that says text until it fails on a list of ids: the failure carries the hint."""
    from flowrl.graph.nodes import ScorerNode

    rollout = {"sample_prompt_ids": torch.tensor([[1, 4]]), "sample_prompt_lens": torch.tensor([2]),
               "completion_ids": torch.tensor([[4, 2]]), "completion_lens": torch.tensor([2])}
    with pytest.raises(NodeExecutionError, match=r"raised AttributeError.*inputs='ids' passes token-id lists; for text set inputs='text'"):
        Scorer(ScorerNode(name="r", fn="tests.operators.userfns:text_strip")).score(rollout)


@pytest.mark.parametrize("batching", ["lockstep", "continuous"])
def test_with_over_long_rows_dropped_each_sample_gets_the_fields_of_its_own_row(tmp_path, batching):
    """Rows 1 and 3 are longer than the model leaves room for (20 tokens) and are dropped, so kept
    prompt i is not file row i. In a run over several shuffled epochs, the scorer gets with every
    sample the fields of the row its prompt came from (each row's ``id`` names its prompt)."""
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    long = " ".join(["one plus two"] * 8)  # 24 tokens
    rows = [{"prompt": "what is one plus two ?", "answer": "3", "id": 0},
            {"prompt": long, "answer": "9", "id": 1},
            {"prompt": "what is two plus two ?", "answer": "4", "id": 2},
            {"prompt": long + " ?", "answer": "9", "id": 3},
            {"prompt": "what is one plus one ?", "answer": "2", "id": 4},
            {"prompt": "what is three plus one ?", "answer": "4", "id": 5}]
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    g = data_graph(str(data), str(word_tokenizer(tmp_path / "tok")), scorer="tests.operators.userfns:text_echo", inputs="text",
                   batching=batching, seed=3)
    userfns.SEEN.clear()
    with pytest.warns(UserWarning, match="2 of 6 prompts"):
        run_graph(g, RunConfig(steps=4, progress=False))
    assert len(userfns.SEEN) == 4 * 3 * 2
    for prompt, _completion, answer, id_ in userfns.SEEN:
        assert (prompt, answer) == (rows[id_]["prompt"], rows[id_]["answer"])
    assert {id_ for *_, id_ in userfns.SEEN} == {0, 2, 4, 5}
