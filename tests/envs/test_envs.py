"""Environments in a graph and a run: bad input refused before any work, failing environments never
crash a run, exactly-once resume with multi-turn samples (``flowrl.envs``, ``flowrl.operators.multiturn``)."""

from __future__ import annotations

import pytest

from flowrl.errors import ConfigError, GraphError, NodeExecutionError
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import ModelConfig
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph

ENVS = "tests.envs.envs_for_tests"
MODEL = ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=48)


def _graph(env: str = "flowrl.envs.games:GuessNumberEnv", *, task: str = "flowrl.envs.games:guess_task", **options):
    b = GraphBuilder("mt", model=MODEL)
    prompts = b.source("prompts", task=task, batch_size=2)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=3, env=env, **options)
    policy = b.policy("policy", b.loss("aipo", gen), lr=3e-3)
    b.weights(policy, gen, max_staleness=0)
    return b.build()


def test_the_builder_takes_env_options_and_the_loss_weighs_env_rewards():
    from flowrl.envs.games import GuessNumberEnv
    from flowrl.graph.serialize import from_json, to_json

    g = _graph(GuessNumberEnv, max_turns=3, step_timeout_s=2.0)  # a class is stored by reference
    gen = g.node("gen")
    assert gen.env.env == "flowrl.envs.games:GuessNumberEnv" and gen.env.max_turns == 3 and gen.env.step_timeout_s == 2.0
    assert g.node("aipo").loss.reward_weights == {"env_rewards": 1.0}
    assert from_json(to_json(g)).node("gen") == gen


@pytest.mark.parametrize(
    "options, match",
    [({"max_turns": 0}, "max_turns=0 must be >= 1"),
     ({"step_timeout_s": 0.0}, "step_timeout_s=0.0 must be"),
     ({"env": "not a reference"}, "is not of the form")],
    ids=["max_turns", "timeout", "reference"],
)
def test_bad_env_options_are_refused_when_the_graph_is_built(options, match):
    env = options.pop("env", "flowrl.envs.games:GuessNumberEnv")
    with pytest.raises((ConfigError, GraphError), match=match):  # a malformed reference is a GraphError, as a scorer's
        _graph(env, **options)


def test_env_options_without_an_env_are_refused():
    b = GraphBuilder("x", model=MODEL)
    with pytest.raises(ConfigError, match="apply to a generator with an environment only"):
        b.generator("gen", b.source("prompts"), max_turns=2)


def test_an_environment_without_step_is_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="has no step method"):
        run_graph(_graph(f"{ENVS}:NoStep"), RunConfig(steps=1, metrics=str(tmp_path / "m.jsonl")))
    assert not (tmp_path / "m.jsonl").exists()


def test_a_chat_template_that_rewrites_earlier_turns_is_refused():
    from flowrl.operators.env_tokens import ChatEncoder

    class DropsEarlierAnswers:
        """Renders assistant messages only when they are the last message (as templates that strip an
        earlier turn's reasoning do)."""

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            text = "".join(f"<{m['role']}>{m['content'] if m['role'] != 'assistant' or i == len(messages) - 1 else ''}</>"
                           for i, m in enumerate(messages))
            return text + ("<assistant>" if add_generation_prompt else "")

    with pytest.raises(ConfigError, match="cannot be applied incrementally"):
        ChatEncoder(DropsEarlierAnswers(), role="user", end_text="</>")


def test_a_chat_template_applied_incrementally_adds_the_new_message_only():
    from flowrl.operators.env_tokens import ChatEncoder

    class Plain:
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            return "".join(f"<{m['role']}>{m['content']}</>" for m in messages) + ("<assistant>" if add_generation_prompt else "")

    enc = ChatEncoder(Plain(), role="tool", end_text="</>")
    assert enc.text("42", model_stopped=True) == "<tool>42</><assistant>"
    assert enc.text("42", model_stopped=False) == "</><tool>42</><assistant>"  # a turn cut short gets its end marker


@pytest.mark.parametrize("backend", ["local", "process"])
def test_a_run_with_a_failing_environment_goes_on_and_counts_the_failures(tmp_path, backend):
    result = run_graph(_graph(f"{ENVS}:FlakyRaise", max_turns=2),
                       RunConfig(steps=2, backend=backend, metrics=str(tmp_path / "m.jsonl"), stall_timeout_s=120))
    assert [r["step"] for r in result.rows] == [1, 2]
    assert all(r["env/failed"] == 1.0 for r in result.rows)  # per batch: prompt at an odd position, its sample 0
    assert all(r["env/turns_mean"] >= 1.0 and r["env/model_tokens"] > 0 for r in result.rows)


class _Stop(Exception):
    pass


def _run(workdir, steps: int, *, resume: bool = False, stop_at: int | None = None):
    def stop(row):
        if row["step"] == stop_at:
            raise _Stop(f"stopped by the test after step {stop_at}")

    config = RunConfig(steps=steps, checkpoint_dir=str(workdir / "ck"), checkpoint_every=2, metrics=str(workdir / "m.jsonl"),
                       resume=resume, stall_timeout_s=120)
    return run_graph(_graph(max_turns=2), config, on_step=stop)


def test_a_multi_turn_run_stopped_and_resumed_equals_an_uninterrupted_one(tmp_path):
    """Lock step, k = 0: the resumed run's prompts, episode rewards and final weights equal an
    uninterrupted run's (each step's episodes are re-run from the same prompts and weights)."""
    import torch

    from flowrl.runtime.observe.metrics import read_metrics

    whole = _run(tmp_path / "a", 4)
    with pytest.raises(NodeExecutionError, match="stopped by the test"):
        _run(tmp_path / "b", 4, stop_at=3)
    resumed = _run(tmp_path / "b", 4, resume=True)
    assert [r["step"] for r in resumed.rows] == [3, 4]
    want = {r["step"]: r for r in read_metrics(tmp_path / "a" / "m.jsonl")}
    got = {r["step"]: r for r in read_metrics(tmp_path / "b" / "m.jsonl")}
    assert sorted(got) == [1, 2, 3, 4]
    for step in want:
        assert got[step]["prompt_index"] == want[step]["prompt_index"]
        assert got[step]["env/reward_mean"] == want[step]["env/reward_mean"]
        assert got[step]["env/model_tokens"] == want[step]["env/model_tokens"]
    a = torch.load(whole.checkpoint / "policy-policy.pt", weights_only=True)["model"]
    b = torch.load(resumed.checkpoint / "policy-policy.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_reference_on_a_multi_turn_generator_attends_the_environment_tokens(tmp_path):
    """The reference reads ``completion_lens``: at step 1 it is the policy's version 0, so with its
    environment tokens attended as the trainer attends them the KL penalty is 0 (within float32
    rounding of the same forward); attending only the model's tokens would give a positive KL."""
    from flowrl.runtime.observe.metrics import read_metrics

    b = GraphBuilder("ref", model=MODEL)
    gen = b.generator("gen", b.source("prompts", task="flowrl.envs.games:guess_task", batch_size=2), n_samples=2,
                      max_new_tokens=3, env="flowrl.envs.games:GuessNumberEnv", max_turns=3)
    ref = b.reference("ref", gen)
    policy = b.policy("policy", b.loss("aipo", gen, ref, kl_coef=0.1), lr=3e-3)
    b.weights(policy, gen, max_staleness=0)
    run_graph(b.build(), RunConfig(steps=1, metrics=str(tmp_path / "m.jsonl")))
    (row,) = read_metrics(tmp_path / "m.jsonl")
    assert row["env/env_tokens"] > 0  # observations were appended: there was something to attend
    assert 0.0 <= row["loss/kl_ref"] <= 1e-6  # k3 of a float32 rounding difference (~1e-7 in log-prob) is ~1e-14


def test_reset_gets_the_prompt_file_rows_fields(tmp_path, hf_qwen2_chat_dir):
    """A prompt file's other fields reach ``reset``'s row: the reward each sample gets is its row's ``want``."""
    import json

    from flowrl.graph.configs import HFModelConfig

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"q": f"a b {i}", "want": i}) + "\n" for i in range(4)))
    b = GraphBuilder("rows", model=HFModelConfig(path=str(hf_qwen2_chat_dir), max_seq_len=64))
    prompts = b.source("prompts", data=str(data), prompt_field="q", batch_size=2, shuffle=False)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=2, env=f"{ENVS}:RowReward", max_turns=1)
    policy = b.policy("policy", b.loss("aipo", gen), lr=1e-4)
    b.weights(policy, gen, max_staleness=0)
    result = run_graph(b.build(), RunConfig(steps=2, stall_timeout_s=120))
    from flowrl.data.wiring import row_of

    for r in result.rows:
        wants = [row_of(b.build(), "prompts", p) for p in r["prompt_index"]]
        assert r["env/reward_mean"] == pytest.approx(sum(wants) / len(wants))


def test_the_readmes_tool_environment_runs_on_a_chat_model(tmp_path, hf_qwen2_chat_dir):
    """The README's shape (a ToolEnv subclass passed as a class, role='tool', a prompt file with an
    ``answer`` field) runs two steps on a tiny chat model: no episode fails."""
    import json

    from flowrl.graph.configs import HFModelConfig

    from .envs_for_tests import Calculator

    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} + {i}", "answer": 2 * i}) + "\n" for i in range(4)))
    b = GraphBuilder("agent", model=HFModelConfig(path=str(hf_qwen2_chat_dir), max_seq_len=64))
    prompts = b.source("prompts", data=str(data), prompt_field="question", chat_template=True, batch_size=2)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=4, env=Calculator, max_turns=3, role="tool")
    policy = b.policy("policy", b.loss("aipo", gen), lr=1e-4)
    b.weights(policy, gen, max_staleness=1)
    graph = b.build()
    assert graph.node("gen").env.env == "tests.envs.envs_for_tests:Calculator"
    result = run_graph(graph, RunConfig(steps=2, stall_timeout_s=120))
    assert [r["env/failed"] for r in result.rows] == [0.0, 0.0]


def test_calc_env_answers_a_call_with_a_last_token_unlike_the_prompts():
    """``calc_agent``: the calculator's observation must not end with the prompt's last token. With both
    ending in ``=``, the answer turn begins in the same local context as the call turn, so learning to call
    (``=`` after ``=``) taught the tiny model to call again where it should answer (a second call earns 0),
    and its answers stalled at a constant number (reward ~0.43, copies ~0%). The observation ends with
    ``</s>``; the answer equal to the calculator's result earns 1, a second call 0."""
    from flowrl.envs.games import CalcEnv, CalcTask
    from flowrl.models.families.builtin.tokenizer import DEFAULT_TOKENIZER as tok

    task = CalcTask(0)
    for index in range(20):
        prompt = tok.decode(task.prompt(index))
        env = CalcEnv()
        env.reset({"prompt": prompt})
        obs, reward, info = env.step("=")
        assert obs is not None and reward == 0.0
        assert tok.encode(obs)[-1] != tok.encode(prompt)[-1], (prompt, obs)
        a, b = prompt.removeprefix("<s>").removesuffix("=").split("+")
        assert obs == f"{int(a) + int(b)}</s>"
        assert env.step(obs) == (None, 1.0, {"answer": int(a) + int(b)})  # copying the result is the answer
    env = CalcEnv()
    env.reset({"prompt": "<s>27+38="})
    env.step("=")
    assert env.step("=") == ("65</s>", 0.0, {"call": "27+38"})  # a second call earns nothing
    assert env.step("x") == ("-</s>", 0.0, {"call": "x"})  # a malformed call
