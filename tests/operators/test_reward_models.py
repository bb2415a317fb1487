"""Reward models as nodes: a sequence classifier's and a generative judge's rewards against the HF
model called directly, batching, the verdicts of a judge whose answer is set by hand, and the
refusals made before any work.

The policy side is the ``hf_copy`` example's tokenizer (``flowrl/examples/assets/hf_copy``); every
reward model has ``tests/hf_fixtures.py``'s other word tokenizer (with ``yes`` and ``no``), so the
text really is decoded by one tokenizer and encoded again by another.
"""

from __future__ import annotations

import json
import os
import logging
import math
from pathlib import Path

import msgspec
import pytest
import torch

from flowrl.errors import ConfigError, NodeBuildError
from flowrl.examples.hf_copy import ASSETS
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig
from flowrl.graph.judges import JudgeConfig
from flowrl.models.tokenizer import load_tokenizer
from flowrl.runtime.programs.table import build_program
from flowrl.runtime.programs.nodes import ProgramEnv, SharedTransports
from tests.hf_fixtures import WORDS, hf_config, make_hf_dir
from tests.tolerances import logit_atol

transformers = pytest.importorskip("transformers")

#: Prompts in words both tokenizers know (digits, a-h, =).
PROMPTS = [{"prompt": "a b = 3"}, {"prompt": "c = 4 4"}, {"prompt": "d e f = 1"}, {"prompt": "g = 2"}]
TEMPLATE = "{prompt} = {completion} ?"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run on one intra-op thread: on this shared 2-core machine two OpenMP threads wait on
    each other (measured at load 8: 0.9 s for one 4-text forward of a width-32 classifier, 0.02 s on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_classifier_dir(path: Path, *, num_labels: int = 1, chat_template: bool = False, seed: int = 1) -> Path:
    """A tiny Llama sequence classifier (``num_labels`` outputs) with the fixtures' word tokenizer."""
    make_hf_dir(path, "llama", weights=False, chat_template=chat_template)  # config + tokenizer
    config = hf_config("llama")
    config.num_labels = num_labels
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForSequenceClassification.from_config(config)
        torch.nn.init.normal_(model.score.weight, std=1.0)  # rewards of order 1, not 0.02
    model.save_pretrained(str(path))
    return path


def make_controlled_judge_dir(path: Path, answers: dict[str, float]) -> Path:
    """A Llama judge whose next-token logits are set by hand: every block's output projections are
    zero, so the last hidden state is the embedding of the last input token, which is ``e_0`` for
    every token; the final RMSNorm makes it ``e_0 / sqrt(1/h + eps)``; the LM head is zero but for
    column 0 of the rows of ``answers`` (word -> weight). So ``z[word] = answers[word] * sqrt(h)``
    (to 1e-5) whatever the input, and every other logit is 0."""
    make_hf_dir(path, "llama", tie=False, weights=False)
    config = hf_config("llama", tie=False)
    model = transformers.AutoModelForCausalLM.from_config(config)
    vocab = {w: i + 3 for i, w in enumerate(WORDS)}
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight.zero_()
        for word, weight in answers.items():
            model.lm_head.weight[vocab[word], 0] = weight
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rm")
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return {
        "data": data,
        "classifier": make_classifier_dir(root / "cls"),
        "chat_classifier": make_classifier_dir(root / "cls_chat", chat_template=True, seed=2),
        "two_labels": make_classifier_dir(root / "cls2", num_labels=2),
        "judge": make_hf_dir(root / "judge", "llama", tie=False, seed=3),  # (a qwen2 directory loads Qwen2Tokenizer in transformers 5, which splits "yes")
        "chat_judge": make_hf_dir(root / "judge_chat", "llama", seed=4, chat_template=True),
    }


def rm_graph(dirs: dict[str, Path], model: str | Path, *, judge: JudgeConfig | None = None, batch_size: int = 0, n_samples: int = 2):
    b = GraphBuilder("rm", model=HFModelConfig(path=str(ASSETS), init="random"))
    prompts = b.source("prompts", data=str(dirs["data"]), prompt_field="prompt", batch_size=2, shuffle=False)
    gen = b.generator("gen", prompts, n_samples=n_samples, max_new_tokens=4)
    rm = b.reward_model("rm", gen, model=str(model), judge=judge, output="rm_rewards", batch_size=batch_size)
    b.weights(b.policy("policy", b.loss("aipo", gen, rm), lr=2e-3), gen)
    return b.build()


def reward_model(graph):
    return build_program(graph, "rm", ProgramEnv(), SharedTransports(())).reward_model


#: (prompt, completion) texts of the hand-made rollout; each completion ends at EOS, then a token that must be cut.
SAMPLES = [("a b = 3", "3 3"), ("a b = 3", "1"), ("c = 4 4", "4 4 = 8 b"), ("d e f = 1", "")]


def rollout(samples=SAMPLES) -> dict[str, torch.Tensor]:
    """The policy tokenizer's ids of ``samples``: prompts left-padded, completions + EOS + a stray token, right-padded."""
    tok = load_tokenizer(str(ASSETS))
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p, _ in samples]
    comps = [tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id, 5] for _, c in samples]
    pw, cw = max(map(len, prompts)), max(map(len, comps))
    return {
        "sample_prompt_ids": torch.tensor([[0] * (pw - len(p)) + p for p in prompts]),
        "sample_prompt_lens": torch.tensor([len(p) for p in prompts]),
        "completion_ids": torch.tensor([c + [0] * (cw - len(c)) for c in comps]),
        "completion_lens": torch.tensor([len(c) for c in comps]),
    }


def hf_classifier_rewards(directory: Path, texts: list[str], *, special: bool) -> list[float]:
    """The classifier's one logit on each text, one text at a time, no padding: transformers alone."""
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(directory), dtype=torch.float32)
    with torch.no_grad():
        return [float(model(input_ids=tok(t, add_special_tokens=special, return_tensors="pt")["input_ids"]).logits[0, 0]) for t in texts]


def score_atol(directory: Path, texts: list[str], *, special: bool, classifier: bool) -> float:
    """float32 rounding of two evaluations of a reward model's score on ``texts`` (``tests/tolerances.py``):
    a classifier's score is a logit; a judge's p(yes) / (p(yes) + p(no)) = sigmoid(z_yes - z_no) moves
    by at most half a logit's tolerance (sigmoid's slope <= 1/4, two logits)."""
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    auto = transformers.AutoModelForSequenceClassification if classifier else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(str(directory), dtype=torch.float32)
    atol = logit_atol(model, [tok(t, add_special_tokens=special, return_tensors="pt")["input_ids"][0] for t in texts])
    return atol if classifier else atol / 2


@pytest.mark.parametrize("which", ["classifier", "chat_classifier"])
def test_classifier_rewards_equal_the_hf_models_own_forward_on_the_same_texts(dirs, which):
    rm = reward_model(rm_graph(dirs, dirs[which]))
    got = rm.score(rollout())[0]["rm_rewards"]
    if which == "classifier":  # no chat template: the prompt and completion as one text, with the tokenizer's specials
        texts = [f"{p} {c}".strip() for p, c in SAMPLES]
        expected = hf_classifier_rewards(dirs[which], texts, special=True)
    else:  # tests/hf_fixtures.py's CHAT_TEMPLATE, rendered by hand
        texts = [f"user : {p}\nassistant : {c}\n" for p, c in SAMPLES]
        expected = hf_classifier_rewards(dirs[which], texts, special=False)
    assert rm.texts(rollout()) == texts
    assert len(set(expected)) == len(expected), "the texts should score differently, or the check is weak"
    # float32 matmuls over padded vs unpadded rows: rounding at these logits' magnitudes
    atol = score_atol(dirs[which], texts, special=which == "classifier", classifier=True)
    assert got.tolist() == pytest.approx(expected, abs=atol)


def hf_judge_rewards(directory: Path, texts: list[str], *, special: bool) -> list[float]:
    """p(yes) / (p(yes) + p(no)) of the judge's next token after each text, one at a time: transformers alone."""
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    out = []
    for text in texts:
        with torch.no_grad():
            p = torch.softmax(model(input_ids=tok(text, add_special_tokens=special, return_tensors="pt")["input_ids"]).logits[0, -1].double(), -1)
        out.append(float(p[yes] / (p[yes] + p[no])))
    return out


@pytest.mark.parametrize("which", ["judge", "chat_judge"])
def test_judge_rewards_equal_the_hf_models_own_answer_probabilities(dirs, which):
    judge = JudgeConfig(template=TEMPLATE, yes="yes", no="no")
    rm = reward_model(rm_graph(dirs, dirs[which], judge=judge))
    got = rm.score(rollout())[0]["rm_rewards"]
    if which == "judge":
        texts = [f"{p} = {c} ?" for p, c in SAMPLES]
        expected = hf_judge_rewards(dirs[which], texts, special=True)
    else:
        texts = [f"user : {p} = {c} ?\nassistant :" for p, c in SAMPLES]
        expected = hf_judge_rewards(dirs[which], texts, special=False)
    assert rm.texts(rollout()) == texts
    assert got.tolist() == pytest.approx(expected, abs=score_atol(dirs[which], texts, special=which == "judge", classifier=False))


@pytest.mark.parametrize(
    "which, judge",
    [("classifier", None), ("judge", JudgeConfig(template=TEMPLATE, yes="yes", no="no"))],
    ids=["classifier", "judge"],
)
def test_batched_equals_one_at_a_time(dirs, which, judge):
    """Texts of 4 to 10 tokens: padded on the right (classifier) or left (judge) in one batch, or none."""
    rm = reward_model(rm_graph(dirs, dirs[which], judge=judge))
    whole = rm.score(rollout())[0]["rm_rewards"]
    rm.node = msgspec.structs.replace(rm.node, batch_size=1)  # the same model, chunked as batch_size=1 would
    one = rm.score(rollout())[0]["rm_rewards"]
    rm.node = msgspec.structs.replace(rm.node, batch_size=3)
    pairs = rm.score(rollout())[0]["rm_rewards"]
    atol = score_atol(dirs[which], rm.texts(rollout()), special=True, classifier=judge is None)  # float32 rounding
    assert whole.tolist() == pytest.approx(one.tolist(), abs=atol)
    assert pairs.tolist() == pytest.approx(one.tolist(), abs=atol)


def test_a_judge_whose_answer_is_set_by_hand(tmp_path, dirs, caplog):
    """z[yes] = 2 sqrt(h), z[no] = -sqrt(h) (``make_controlled_judge_dir``): p(yes) / (p(yes) + p(no)) =
    sigmoid(3 sqrt(32)); swapped: sigmoid(-3 sqrt(32)). A greedy answer is ``7`` every token: a pattern
    finding a digit reads 7, one that wants ``score: N`` finds nothing: reward 0, counted, logged."""
    h, eps = 32, 1e-6  # hf_config's hidden size; LlamaConfig's rms_norm_eps
    scale = 1 / math.sqrt(1 / h + eps)
    yes_dir = make_controlled_judge_dir(tmp_path / "yes", {"yes": 2.0, "no": -1.0, "7": 0.5})
    no_dir = make_controlled_judge_dir(tmp_path / "no", {"yes": -1.0, "no": 2.0})
    judge = JudgeConfig(template=TEMPLATE, yes="yes", no="no")
    for directory, sign in ((yes_dir, 1), (no_dir, -1)):
        got = reward_model(rm_graph(dirs, directory, judge=judge)).score(rollout())[0]["rm_rewards"]
        assert got.tolist() == pytest.approx([1 / (1 + math.exp(-sign * 3 * scale))] * len(SAMPLES), rel=1e-5)
    # greedy: "yes" (2 sqrt h) wins over "7" (0.5 sqrt h): the answer is "yes yes ..."; with "yes" removed, "7 7 ..."
    seven = make_controlled_judge_dir(tmp_path / "seven", {"7": 1.0, "no": -1.0})
    digit = JudgeConfig(template=TEMPLATE, verdict="regex", pattern=r"(\d+)", max_new_tokens=3)
    rewards, metrics = reward_model(rm_graph(dirs, seven, judge=digit)).score(rollout())
    assert rewards["rm_rewards"].tolist() == [7.0] * len(SAMPLES)  # the answer "7 7 7" (words decode joined by spaces)
    assert metrics["judge/unparsed/rm"] == 0
    wants_score = JudgeConfig(template=TEMPLATE, verdict="regex", pattern=r"score: (\d+)", max_new_tokens=3)
    with caplog.at_level(logging.WARNING, logger="flowrl.operators.reward_models"):
        rewards, metrics = reward_model(rm_graph(dirs, seven, judge=wants_score)).score(rollout())
    assert rewards["rm_rewards"].tolist() == [0.0] * len(SAMPLES)
    assert metrics["judge/unparsed/rm"] == len(SAMPLES)
    assert sum("has no number matching" in r.message for r in caplog.records) == len(SAMPLES)


@pytest.mark.parametrize(
    "which, judge, message",
    [
        ("judge", None, r"\['LlamaForCausalLM'\], not a sequence classifier: its reward head would be random"),
        ("two_labels", None, r"a classifier with num_labels=2; a reward model has one label"),
        ("classifier", JudgeConfig(template=TEMPLATE, yes="yes", no="no"), r"\['LlamaForSequenceClassification'\], not a causal LM"),
        ("judge", JudgeConfig(template=TEMPLATE, yes="yes no", no="no"), r"yes='yes no' is 2 tokens \['yes', 'no'\] of its tokenizer, not one"),
    ],
    ids=["causal-lm-as-classifier", "two-labels", "classifier-as-judge", "two-token-answer"],
)
def test_a_wrong_model_is_refused_when_the_run_starts_before_any_step(dirs, tmp_path, capsys, which, judge, message):
    """The operator refuses it (``NodeBuildError`` naming the node); ``flowrl run`` prints that one
    paragraph, no traceback, and writes no metrics row."""
    from flowrl.cli.main import main
    from flowrl.graph.serialize import to_json

    graph = rm_graph(dirs, dirs[which], judge=judge)
    with pytest.raises(NodeBuildError, match=message):
        reward_model(graph)
    path = tmp_path / "g.json"
    path.write_text(to_json(graph))
    metrics = tmp_path / "metrics.jsonl"
    assert main(["run", str(path), "--steps", "1", "--metrics", str(metrics)]) == 2
    err = capsys.readouterr().err
    assert "reward_model 'rm'" in err and "Traceback" not in err
    assert not metrics.exists() or metrics.read_text() == ""


@pytest.mark.parametrize(
    "template, message",
    [
        ("Is it right? {prompt}", r"has no \{completion\}: the judge would not see the completion"),
        ("{prompt} {completion} {answer}", r"names \['answer'\]; a template may name only \['prompt', 'completion'\]"),
        ("{prompt} {completion} {", r"is not str.format syntax"),
    ],
    ids=["no-completion", "unknown-field", "lone-brace"],
)
def test_a_bad_template_is_refused_when_the_graph_is_built(template, message):
    b = GraphBuilder("rm")
    gen = b.generator("gen", b.source("prompts", task="copy"))
    with pytest.raises(ConfigError, match=message):
        b.reward_model("rm", gen, model="/nowhere", judge=template)


def test_the_planner_places_reward_models_and_counts_their_memory(dirs, tmp_path, capsys):
    """Each reward model gets devices of its own kind; its weights are the HF model's parameter count
    (``numel``, another count than the planner's shape formulas) x 4 bytes (float32 on the CPU preset);
    ``flowrl plan`` lists both on a row of their own."""
    from flowrl.cli.main import main
    from flowrl.graph.serialize import to_json
    from flowrl.planners.plan import plan_graph

    b = GraphBuilder("rm", model=HFModelConfig(path=str(ASSETS), init="random"))
    prompts = b.source("prompts", data=str(dirs["data"]), prompt_field="prompt", batch_size=2)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=4)
    rm = b.reward_model("rm", gen, model=str(dirs["classifier"]), output="rm_rewards")
    judge = b.reward_model("judge", gen, model=str(dirs["judge"]), judge=JudgeConfig(template=TEMPLATE, yes="yes", no="no"), output="judged")
    b.weights(b.policy("policy", b.loss("aipo", gen, rm, judge), lr=2e-3), gen)
    graph = b.build()
    plan = plan_graph(graph, "cpu:2")
    numel = {
        "rm": sum(p.numel() for p in transformers.AutoModelForSequenceClassification.from_pretrained(str(dirs["classifier"])).parameters()),
        "judge": sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(str(dirs["judge"])).parameters()),
    }
    for name in ("rm", "judge"):
        placed = plan.placements[name]
        assert placed.kind == "reward_model" and placed.devices and placed.time_s > 0
        assert placed.memory.weights == numel[name] * 4, name
        assert placed.memory_bytes >= placed.memory.total
    # float32 logits in one micro-batch of all 4 sequences of s tokens: the classifier's one per token
    # (not one per vocabulary entry, 100, and token); the logprob judge's 100 at the last position only
    sequences, s = 4, plan.workload.prompt_len + plan.workload.gen_len
    assert plan.placements["rm"].memory.workspace == sequences * s * 1 * 4
    assert plan.placements["judge"].memory.workspace == sequences * 100 * 4
    assert "rm:" in str(plan) and "judge:" in str(plan)
    path = tmp_path / "g.json"
    path.write_text(to_json(graph))
    assert main(["plan", str(path), "--cluster", "cpu:2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert {r[0] for r in rows if len(r) > 1 and r[1] == "reward_model"} == {"rm", "judge"}


def test_a_regex_judge_is_costed_with_its_answer_tokens(dirs):
    """A regex judge reads its greedy answer too: its forward covers max_new_tokens more tokens per
    sequence than a logprob judge's on the same model. Compute is FLOPs over a measured rate, so the
    ratio of the two is that of the FLOPs, computed here from the model shape with
    ``flowrl/planners/estimate/train.py``'s convention on a CPU (unpacked sequences of
    ``s = prompt + completion - 1`` tokens, each attending ``s / 2`` keys)."""
    from flowrl.modelspec import model_from_hf_config
    from flowrl.planners.plan import plan_graph

    def compute(judge: JudgeConfig) -> float:
        b = GraphBuilder("rm", model=HFModelConfig(path=str(ASSETS), init="random"))
        gen = b.generator("gen", b.source("prompts", data=str(dirs["data"]), prompt_field="prompt", batch_size=2), n_samples=2, max_new_tokens=4)
        rm = b.reward_model("rm", gen, model=str(dirs["judge"]), judge=judge, output="judged")
        b.weights(b.policy("policy", b.loss("aipo", gen, rm), lr=2e-3), gen)
        plan = plan_graph(b.build(), "cpu:2", strategy="gen:d1@0 | policy:d1@1 | rm:d1@1")
        return plan.placements["rm"].breakdown["compute"], plan.workload.prompt_len

    logprob, prompt_len = compute(JudgeConfig(template=TEMPLATE, yes="yes", no="no"))
    regex, _ = compute(JudgeConfig(template=TEMPLATE, verdict="regex", pattern=r"(\d+)", max_new_tokens=8))
    spec = model_from_hf_config(dirs["judge"] / "config.json")
    s = prompt_len + 4 - 1
    flops = {n: n * spec.forward_flops_per_token(n / 2) for n in (s, s + 8)}
    assert regex / logprob == pytest.approx(flops[s + 8] / flops[s], rel=1e-6)


def make_ends_in_seven_dir(path: Path) -> Path:
    """A classifier on the policy's (hf_copy's) tokenizer rewarding +1 a text whose last token is ``7``
    and -1 any other: every block's output projections zero, so the last hidden state is the last
    token's embedding, ``+-e_0`` (+ for ``7``), which the final RMSNorm scales to ``+-sqrt(64)``; the
    score head reads column 0 / 8. (RMSNorm's eps makes it +-0.99968.)"""
    tok = transformers.AutoTokenizer.from_pretrained(str(ASSETS))
    tok.save_pretrained(str(path))
    model = transformers.AutoModelForSequenceClassification.from_config(transformers.AutoConfig.from_pretrained(str(ASSETS), num_labels=1))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = -1.0
        model.model.embed_tokens.weight[tok.convert_tokens_to_ids("7"), 0] = 1.0
        model.score.weight.zero_()
        model.score.weight[0, 0] = 1 / 8
    model.save_pretrained(str(path))
    return path


def test_a_local_run_learns_what_its_reward_model_rewards(tmp_path):
    """hf_copy's random policy against a classifier that rewards completions ending in ``7``: the
    mean reward goes from about -0.9 (a 1-in-30 chance) to about +1 in 24 steps (measured: -0.87 ->
    1.0 over 30 steps, lr 5e-3); every row carries the reward model's reward and truncation count."""
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    b = GraphBuilder("seven", model=HFModelConfig(path=str(ASSETS), init="random"))
    prompts = b.source("prompts", data=str(ASSETS / "prompts.jsonl"), batch_size=8)
    gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=4)
    rm = b.reward_model("rm", gen, model=str(make_ends_in_seven_dir(tmp_path / "seven")), output="ends_in_7")
    b.weights(b.policy("policy", b.loss("aipo", gen, rm), lr=5e-3), gen)
    rows = run_graph(b.build(), RunConfig(steps=24, threads=1)).rows
    assert [r["policy_version"] for r in rows] == list(range(1, 25))
    assert all(r["reward_model/truncated/rm"] == 0 for r in rows)
    rewards = [r["reward/ends_in_7"] for r in rows]
    assert all(-1.0 <= x <= 1.0 for x in rewards)
    assert sum(rewards[:4]) / 4 < -0.5 and sum(rewards[-4:]) / 4 > 0.5, rewards


@pytest.mark.slow  # the process backend starts a worker per node, each importing torch and transformers: ~60 s at load 10
def test_the_process_backend_scores_as_the_local_one(dirs):
    """The reward model rebuilt in a worker process from the graph's plain data gives every step the
    rewards the local backend's gives (same seed: same samples, so the same rewards, bit for bit)."""
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    graph = rm_graph(dirs, dirs["classifier"])
    local = run_graph(graph, RunConfig(steps=2)).rows
    process = run_graph(graph, RunConfig(steps=2, backend="process")).rows
    assert [r["reward/rm_rewards"] for r in process] == [r["reward/rm_rewards"] for r in local]
    assert [r["reward_model/truncated/rm"] for r in process] == [0.0, 0.0]


def test_flowrl_eval_and_sample_score_with_the_reward_model(dirs):
    """``flowrl eval``/``sample`` and evaluation during training (``policy_samples``) score with the
    graph's reward models too: before, a reward-model field counted as 0 in every eval score."""
    from flowrl.runtime.evaluation.policy_samples import policy_on_rows, rollout as sample_rollout

    graph = rm_graph(dirs, dirs["classifier"])
    policy = policy_on_rows(graph)
    scored = sample_rollout(policy, [0, 1], n_samples=2, greedy=False)
    assert len(scored) == 4
    values = [s.rewards["rm_rewards"] for s in scored]
    assert all(s.reward == s.rewards["rm_rewards"] for s in scored)
    assert len(set(values)) > 1  # a real classifier's scores, not a constant
    model = reward_model(graph)  # the same classifier scoring the same decoded texts directly
    tok = load_tokenizer(str(ASSETS))
    texts = [(s.prompt, s.completion) for s in scored]
    direct = model.score(rollout([(p, c.replace(tok.eos_token, "")) for p, c in texts]))[0]["rm_rewards"].tolist()
    assert values == pytest.approx(direct, abs=1e-6)


def seven_graph():
    """``test_a_local_run_learns_what_its_reward_model_rewards``'s graph, for torchrun (the classifier's
    directory in ``FLOWRL_TEST_RM_DIR``: each rank builds the graph from this reference)."""
    b = GraphBuilder("seven", model=HFModelConfig(path=str(ASSETS), init="random"))
    prompts = b.source("prompts", data=str(ASSETS / "prompts.jsonl"), batch_size=8)
    gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=4)
    rm = b.reward_model("rm", gen, model=os.environ["FLOWRL_TEST_RM_DIR"], output="ends_in_7")
    b.weights(b.policy("policy", b.loss("aipo", gen, rm), lr=5e-3), gen)
    return b.build()


@pytest.mark.slow  # a 2-rank torchrun job, ~30 s on 2 cores
def test_a_torchrun_run_learns_what_its_reward_model_rewards(tmp_path):
    """The reward model on the policy's rank, the generator on its own, under torchrun (gloo):
    measured -0.87 -> 1.0 over 24 steps, as the local run."""
    from tests.runtime.test_torchrun import _rows, _torchrun

    (tmp_path / "place.json").write_text(json.dumps({"gen": [0], "rm": [1], "policy": [1]}))
    env = {"FLOWRL_TEST_RM_DIR": str(make_ends_in_seven_dir(tmp_path / "seven"))}
    proc = _torchrun(2, ["-m", "flowrl", "run", "tests.operators.test_reward_models:seven_graph", "--backend", "torchrun",
                         "--plan", "place.json", "--steps", "24", "--quiet", "--metrics", "m.jsonl"], tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = [r["reward/ends_in_7"] for r in _rows(tmp_path / "m.jsonl")]
    assert len(rewards) == 24 and sum(rewards[:4]) / 4 < -0.5 and sum(rewards[-4:]) / 4 > 0.5, rewards
