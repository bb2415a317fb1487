"""The OpenAI-compatible endpoint (``flowrl.serve``) driven by the ``openai`` client on localhost: an agent
loop of a few turns becomes samples built from the ids the engine sampled (mu equal to the trainer's
pi at k = 0), what the program added is masked, its return is the reward; bad requests get clear
errors and the endpoint goes on; a program that hangs or raises fails its sample only. The built-in
engine samples (the endpoint is engine-agnostic; ``tests/operators/test_vllm_multiturn.py`` covers vLLM's episodes)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import torch

from flowrl.graph.configs import ModelConfig, SamplingConfig
from flowrl.graph.envs import EnvConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.models.families.builtin.tokenizer import DEFAULT_TOKENIZER
from flowrl.operators.generation import Generator
from flowrl.operators.logprobs import completion_logprobs
from tests.tolerances import rollout_logprob_atol

openai = pytest.importorskip("openai")

MODEL = ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=64)
SAMPLING = SamplingConfig(n_samples=2, max_new_tokens=4)
SEEN: dict[tuple[int, int], list[Any]] = {}  # (prompt index, sample) -> the replies the program got


def calc_agent(session: Any, row: dict[str, Any]) -> float:
    """Three turns: the question, then two follow-ups; the reward is the number of reply tokens of the last."""
    client = session.client(max_retries=0, timeout=60)
    messages = [{"role": "user", "content": row["prompt"]}]
    replies = []
    for follow_up in ("12=", "3="):
        r = client.chat.completions.create(model=session.model, messages=messages, temperature=0.3)  # temperature: ignored
        replies.append(r)
        messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": follow_up}]
    replies.append(client.chat.completions.create(model=session.model, messages=messages))
    SEEN[(row["prompt_index"], row["sample"])] = replies
    return float(len(replies[-1].choices[0].token_ids))


#: set by the test that hangs a program once it is done: the abandoned program's thread then ends
RELEASE_HUNG = threading.Event()


def hang_or_raise(session: Any, row: dict[str, Any]) -> float:
    """Prompt 1's sample 0 hangs after one request (until ``RELEASE_HUNG``, 30 s at most), its sample 1
    raises; prompt 0's samples are fine."""
    client = session.client(max_retries=0, timeout=60)
    client.chat.completions.create(model=session.model, messages=[{"role": "user", "content": "1="}])
    if row["prompt_index"] == 1:
        if row["sample"] == 0:
            RELEASE_HUNG.wait(30)
        raise RuntimeError("the agent broke")
    return 1.0


def silent_or_wordy(session: Any, row: dict[str, Any]) -> Any:
    """Prompt 0 never asks the endpoint; prompt 1 asks, then returns text instead of a reward."""
    if row["prompt_index"] == 0:
        return 1.0
    session.client(max_retries=0, timeout=60).chat.completions.create(model=session.model, messages=[{"role": "user", "content": "1="}])
    return "great"


@pytest.fixture(scope="module")
def generator() -> Generator:
    return Generator(GeneratorNode(name="gen", model=MODEL, sampling=SAMPLING), seed=0)


def _prompts(texts: list[str]) -> dict[str, torch.Tensor]:
    rows = [DEFAULT_TOKENIZER.encode(t) for t in texts]
    width = max(map(len, rows))
    return {"prompt_ids": torch.tensor([[0] * (width - len(r)) + r for r in rows]), "prompt_lens": torch.tensor([len(r) for r in rows]),
            "prompt_index": torch.arange(len(rows))}  # fmt: skip


def test_an_agent_loop_becomes_samples_of_the_ids_it_was_sent(generator):
    from flowrl.serve.agents import AgentRollouts

    SEEN.clear()
    agents = AgentRollouts(generator, calc_agent, model=MODEL, max_turns=4, episode_timeout_s=60)
    try:
        out, metrics = agents.generate(_prompts(["3=", "12="]))
    finally:
        agents.close()
    assert metrics["env/failed"] == 0 and metrics["env/turns_mean"] == 3.0
    for s in range(4):
        p, j = divmod(s, 2)
        replies = SEEN[(p, j)]
        prompt = out["sample_prompt_ids"][s, -int(out["sample_prompt_lens"][s]) :].tolist()
        assert prompt == DEFAULT_TOKENIZER.encode(["3=", "12="][p]) == replies[0].prompt_token_ids
        want_ids, want_mask, want_lp = [], [], []
        for r, follow_up in zip(replies, ("12=", "3=", None)):
            ids = r.choices[0].token_ids
            want_ids += ids
            want_mask += [True] * len(ids)
            want_lp += [c.logprob for c in r.choices[0].logprobs.content]
            assert [c.token_id for c in r.choices[0].logprobs.content] == ids
            if follow_up is not None:
                added = DEFAULT_TOKENIZER.encode(follow_up)
                want_ids, want_mask, want_lp = want_ids + added, want_mask + [False] * len(added), want_lp + [0.0] * len(added)
        k = int(out["completion_lens"][s])
        assert out["completion_ids"][s, :k].tolist() == want_ids  # the ids sampled, never re-tokenised
        assert out["completion_mask"][s, :k].tolist() == want_mask  # what the program added is masked
        assert out["behaviour_logprobs"][s, :k].tolist() == pytest.approx(want_lp, abs=0)
        assert replies[-1].prompt_token_ids == prompt + want_ids[: -len(replies[-1].choices[0].token_ids)]
        assert float(out["env_rewards"][s]) == len(replies[-1].choices[0].token_ids)
    # mu as recorded is what the trainer's pi computes over the assembled samples (same weights, k = 0)
    pi = completion_logprobs(generator.model, out["sample_prompt_ids"], out["sample_prompt_lens"], out["completion_ids"],
                             out["completion_mask"], completion_lens=out["completion_lens"])  # fmt: skip
    mask = out["completion_mask"]
    assert torch.allclose(pi[mask], out["behaviour_logprobs"][mask], atol=rollout_logprob_atol(generator.model, out), rtol=0)


def test_bad_requests_get_clear_errors_and_the_endpoint_goes_on(generator):
    from flowrl.serve.agents import AgentRollouts, AgentSession

    agents = AgentRollouts(generator, calc_agent, model=MODEL, max_turns=4)
    try:
        ep = agents.endpoint.open(seed=0)
        session = AgentSession(base_url=agents.endpoint.base_url(ep), model="gen")
        client = session.client(max_retries=0, timeout=30)
        user = [{"role": "user", "content": "3="}]
        assert [m.id for m in client.models.list().data] == ["gen"]
        with pytest.raises(openai.NotFoundError, match="'gpt-4o' does not exist here; this endpoint serves 'gen'"):
            client.chat.completions.create(model="gpt-4o", messages=user)
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\] must be an object with a string 'role' and a string 'content'"):
            client.chat.completions.create(model="gen", messages=[{"role": "user", "content": 3}])
        with pytest.raises(openai.BadRequestError, match="'messages' must be a non-empty list"):
            client.chat.completions.create(model="gen", messages=[])
        first = client.chat.completions.create(model="gen", messages=user)
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\] .* differs from the episode's conversation"):
            client.chat.completions.create(model="gen", messages=[{"role": "user", "content": "9="}, {"role": "user", "content": "1="}])
        request = urllib.request.Request(session.base_url + "/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=30)
        assert err.value.code == 400 and "is not JSON" in json.loads(err.value.read())["error"]["message"]
        other = AgentSession(base_url=session.base_url.replace(ep.id, "nosuchepisode"), model="gen").client(max_retries=0)
        with pytest.raises(openai.NotFoundError, match="no open episode 'nosuchepisode'"):
            other.chat.completions.create(model="gen", messages=user)
        again = [*user, {"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "1="}]
        second = client.chat.completions.create(model="gen", messages=again)  # the episode goes on after its bad requests
        assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
        assert agents.endpoint.errors == 6
    finally:
        agents.close()


def test_a_hanging_or_raising_program_fails_its_sample_only(generator):
    from flowrl.serve.agents import AgentRollouts

    RELEASE_HUNG.clear()
    agents = AgentRollouts(generator, hang_or_raise, model=MODEL, episode_timeout_s=3.0)
    try:
        t0 = time.perf_counter()
        out, metrics = agents.generate(_prompts(["3=", "12="]))
        assert time.perf_counter() - t0 < 20  # the hung program did not hold the batch past its timeout (3 s)
    finally:
        agents.close()
        RELEASE_HUNG.set()  # a thread cannot be stopped: the program abandoned at its limit ends now, not 30 s on
    deadline = time.monotonic() + 10
    while [t for t in threading.enumerate() if t.name == "flowrl-env"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t for t in threading.enumerate() if t.name == "flowrl-env"]  # none outlives this test (later ones check)
    assert out["env_failed"].tolist() == [False, False, True, True] and metrics["env/failed"] == 2.0
    assert (metrics["env/failed/timeout"], metrics["env/failed/raised"], metrics["env/failed/no_request"]) == (1.0, 1.0, 0.0)  # why each failed
    assert not out["completion_mask"][2:].any() and out["completion_mask"][:2].any(1).all()
    assert out["env_rewards"].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_an_agent_generator_trains_in_a_run(tmp_path):
    """A graph whose generator's episodes are an agent program (``agent=True``) runs, the reward is the program's."""
    from flowrl.graph.builder import GraphBuilder
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.observe.metrics import read_metrics
    from flowrl.runtime.run import run_graph

    b = GraphBuilder("agent", model=MODEL)
    gen = b.generator("gen", b.source("prompts", task="flowrl.envs.games:guess_task", batch_size=2), n_samples=2,
                      max_new_tokens=3, env=f"{__name__}:calc_agent", agent=True, max_turns=4)  # fmt: skip
    policy = b.policy("policy", b.loss("aipo", gen), lr=3e-3)
    b.weights(policy, gen, max_staleness=0)
    run_graph(b.build(), RunConfig(steps=2, metrics=str(tmp_path / "m.jsonl")))
    rows = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["env/failed"] == 0 and r["env/turns_mean"] == 3.0 for r in rows)


def test_an_agent_program_of_the_wrong_form_is_refused_before_any_work(tmp_path):
    from flowrl.errors import ConfigError
    from flowrl.graph.builder import GraphBuilder
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    b = GraphBuilder("agent", model=MODEL)
    gen = b.generator("gen", b.source("prompts", task="flowrl.envs.games:guess_task"), env="flowrl.envs.games:GuessNumberEnv", agent=True)
    b.weights(b.policy("policy", b.loss("aipo", gen)), gen)
    with pytest.raises(ConfigError, match="the agent program GuessNumberEnv must be a function program"):
        run_graph(b.build(), RunConfig(steps=1, metrics=str(tmp_path / "m.jsonl")))
    with pytest.raises(ConfigError, match="runs its episodes in lock step"):
        GeneratorNode(name="g", model=MODEL, sampling=SamplingConfig(batching="continuous"), env=EnvConfig(env=f"{__name__}:calc_agent", agent=True))


def test_a_program_that_never_asks_or_returns_no_number_fails_its_sample(generator, caplog):
    from flowrl.serve.agents import AgentRollouts

    agents = AgentRollouts(generator, silent_or_wordy, model=MODEL)
    try:
        out, metrics = agents.generate(_prompts(["3=", "12="]))
    finally:
        agents.close()
    assert out["env_failed"].all() and metrics["env/failed"] == 4.0 and not out["completion_mask"].any()
    assert (metrics["env/failed/no_request"], metrics["env/failed/protocol"], metrics["env/failed/raised"]) == (2.0, 2.0, 0.0)
    assert "returned without a reply from the endpoint" in caplog.text
    assert "returned 'great'; it returns the episode's reward, a finite real number" in caplog.text
