"""Multi-turn rollouts: token in / token out, environment tokens masked and attended, mu's log-probs,
failed samples that never crash a run (``flowrl.operators.multiturn``)."""

from __future__ import annotations

import time

import pytest
import torch

from flowrl.graph.configs import HFModelConfig, ModelConfig, SamplingConfig
from flowrl.graph.envs import EnvConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.operators.generation import Generator
from flowrl.operators.logprobs import completion_logprobs
from flowrl.operators.multiturn import FAIL_CAUSES, MultiTurnGenerator
from flowrl.models.families.builtin.tokenizer import DEFAULT_TOKENIZER

from tests.tolerances import ratio_atol, rollout_logprob_atol

from .helpers import prompts_of

ENVS = "tests.envs.envs_for_tests"
MODEL = ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
PROMPTS = [[1, 4, 5, 14], [1, 9, 8, 7, 6, 14]]


def _node(env: str, model=MODEL, *, max_turns: int = 3, temperature: float = 1.0, **env_options) -> GeneratorNode:
    return GeneratorNode(
        name="gen", model=model, sampling=SamplingConfig(n_samples=2, max_new_tokens=4, temperature=temperature),
        env=EnvConfig(env=f"{ENVS}:{env}", max_turns=max_turns, **env_options),
    )


def _spied(node: GeneratorNode, seed: int = 0) -> tuple[MultiTurnGenerator, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """The node's multi-turn generator, with every model turn's sampled (tokens, log-probs, mask) recorded."""
    gen = Generator(node, seed=seed)
    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    sample = gen._sample

    def spy(*args, **kwargs):
        out = sample(*args, **kwargs)
        calls.append(tuple(t.clone() for t in out))  # type: ignore[arg-type]
        return out

    gen._sample = spy  # type: ignore[method-assign]
    return MultiTurnGenerator(gen, node), calls


def _sampled_per_sample(calls, S: int) -> list[list[tuple[list[int], list[float]]]]:
    """Per sample, each model turn's sampled tokens and log-probs (every sample active in every turn)."""
    turns: list[list[tuple[list[int], list[float]]]] = [[] for _ in range(S)]
    for tokens, logprobs, mask in calls:
        assert tokens.shape[0] == S
        for s in range(S):
            k = int(mask[s].sum())
            turns[s].append((tokens[s, :k].tolist(), logprobs[s, :k].tolist()))
    return turns


@pytest.mark.parametrize("env", ["Echo", "AsyncEcho"])
def test_trained_tokens_are_the_sampled_ones_and_env_tokens_are_encoded_once_with_mask_0(env):
    """Built-in model: the completion is obs0, turn 1, obs, turn 2, obs, turn 3 with the turns' tokens as
    sampled (recorded by a spy on the sampler), the observations' tokens as the tokenizer encodes them,
    and the mask True exactly on the model's tokens."""
    mt, calls = _spied(_node(env))
    out, metrics = mt.generate(prompts_of(PROMPTS))
    S = 4
    assert len(calls) == 3
    turns = _sampled_per_sample(calls, S)
    obs0, obs = DEFAULT_TOKENIZER.encode("3="), DEFAULT_TOKENIZER.encode("12=")
    for s in range(S):
        want_ids, want_mask, want_lp = list(obs0), [False] * len(obs0), [0.0] * len(obs0)
        for t, (ids, lps) in enumerate(turns[s]):
            want_ids += ids
            want_mask += [True] * len(ids)
            want_lp += lps
            if t < 2:
                want_ids += obs
                want_mask += [False] * len(obs)
                want_lp += [0.0] * len(obs)
        n = int(out["completion_lens"][s])
        assert n == len(want_ids)
        assert out["completion_ids"][s, :n].tolist() == want_ids
        assert out["completion_mask"][s].tolist() == want_mask + [False] * (out["completion_ids"].shape[1] - n)
        assert torch.allclose(out["behaviour_logprobs"][s, :n], torch.tensor(want_lp))
    assert out["env_turns"].tolist() == [3] * S
    assert out["env_rewards"].tolist() == [3.0] * S
    assert out["env_failed"].tolist() == [False] * S
    assert metrics["env/turns_mean"] == 3.0 and metrics["env/failed"] == 0.0
    assert metrics["env/env_tokens"] == len(obs0) + 2 * len(obs)


def test_hf_chat_model_keeps_its_sampled_ids_even_those_its_tokenizer_cannot_round_trip(hf_qwen2_chat_dir):
    """A Hugging Face model whose embeddings (100) outnumber its tokenizer's words (45): ids past the
    words decode to nothing, so re-tokenising the conversation would drop them. The trained ids at the
    mask's positions are the sampled ones, turn by turn; each observation is the chat template's text for
    the new message only, between the turns, with mask 0."""
    node = _node("Words", HFModelConfig(path=str(hf_qwen2_chat_dir), max_seq_len=128), max_turns=3)
    mt, calls = _spied(node, seed=1)
    out, _ = mt.generate(prompts_of([[1, 4, 5], [1, 9, 8, 7]]))
    turns = _sampled_per_sample(calls, 4)
    tok = mt.encoder.tok  # type: ignore[attr-defined]
    words = len(tok.get_vocab())
    assert any(i >= words for s in range(4) for ids, _ in turns[s] for i in ids), "pick a seed that samples an id past the words"
    for s in range(4):
        n = int(out["completion_lens"][s])
        ids, mask = out["completion_ids"][s, :n].tolist(), out["completion_mask"][s, :n].tolist()
        assert [i for i, m in zip(ids, mask) if m] == [i for turn, _ in turns[s] for i in turn]
        # between two model turns, a non-empty run of env tokens: the observation as the template renders it
        runs = [m for i, m in enumerate(mask) if i == 0 or m != mask[i - 1]]
        assert runs == [True, False, True, False, True]
        text = tok.decode([i for i, m in zip(ids, mask) if not m])
        assert "user" in text and "yes" in text


def test_mu_equals_the_models_forward_over_the_whole_conversation_on_model_tokens():
    """``behaviour_logprobs`` equal ``completion_logprobs`` with the env tokens attended (``completion_lens``),
    and an independent per-sample forward over prompt + completion (no padding), at T = 0.7."""
    node = _node("Echo", temperature=0.7)
    mt, _ = _spied(node)
    out, _ = mt.generate(prompts_of(PROMPTS))
    model = mt.gen.model
    with torch.no_grad():
        lp = completion_logprobs(model, out["sample_prompt_ids"], out["sample_prompt_lens"], out["completion_ids"],
                                 out["completion_mask"], temperature=0.7, completion_lens=out["completion_lens"])
        mask = out["completion_mask"]
        atol = rollout_logprob_atol(model, out, temperature=0.7)  # float32 rounding at these logits' magnitudes
        assert torch.allclose(lp[mask], out["behaviour_logprobs"][mask], rtol=0, atol=atol)
        assert (lp[~mask] == 0).all()
        for s in range(4):
            P, n = int(out["sample_prompt_lens"][s]), int(out["completion_lens"][s])
            seq = torch.cat([out["sample_prompt_ids"][s, -P:], out["completion_ids"][s, :n]])[None]
            logits = model(seq, valid=torch.ones_like(seq, dtype=torch.bool))[0].float() / 0.7
            ref = torch.log_softmax(logits, -1)[P - 1 : P + n - 1].gather(-1, seq[0, P:, None]).squeeze(-1)
            assert torch.allclose(ref[mask[s, :n]], out["behaviour_logprobs"][s, :n][mask[s, :n]], rtol=0, atol=atol)


def test_environment_tokens_get_no_gradient_and_model_tokens_do():
    from flowrl.models.families.builtin.model import Transformer

    mt, _ = _spied(_node("Echo"))
    out, _ = mt.generate(prompts_of(PROMPTS))
    model = Transformer(MODEL)
    params = [p for p in model.parameters()]
    lp = completion_logprobs(model, out["sample_prompt_ids"], out["sample_prompt_lens"], out["completion_ids"],
                             out["completion_mask"], completion_lens=out["completion_lens"])
    mask = out["completion_mask"]
    env = (~mask) & (torch.arange(mask.shape[1])[None] < out["completion_lens"][:, None])
    assert env.any() and mask.any()
    g_env = torch.autograd.grad(lp[env].sum(), params, allow_unused=True, retain_graph=True)
    assert all(g is None or bool((g == 0).all()) for g in g_env)
    g_model = torch.autograd.grad(lp[mask].sum(), params, allow_unused=True)
    assert any(g is not None and bool((g != 0).any()) for g in g_model)


@pytest.mark.parametrize(
    "env, why, cause",
    [("FlakyRaise", "RuntimeError: the environment broke", "raised"), ("FlakyHang", "timed out", "timeout"),
     ("FlakyGarbage", "not a tuple", "protocol"), ("FlakyNan", "finite real", "protocol"),
     ("FlakyBadObs", "cannot be encoded", "observation"), ("ResetRaises", "ValueError: no episode today", "raised")],
    ids=["raises", "hangs", "garbage", "nan-reward", "unencodable-observation", "reset-raises"],
)
def test_a_failing_environment_fails_its_sample_only(env, why, cause, caplog):
    """Sample 2 (prompt 1, sample 0) fails: reward 0, mask all False, counted and logged; the others are untouched."""
    from tests.envs.envs_for_tests import HANG_RELEASE

    node = _node(env, max_turns=2, step_timeout_s=0.3)
    mt, _ = _spied(node)
    start = time.perf_counter()
    HANG_RELEASE.clear()
    try:
        with caplog.at_level("WARNING", logger="flowrl.envs"):
            out, metrics = mt.generate(prompts_of(PROMPTS))
    finally:
        HANG_RELEASE.set()  # the abandoned call returns now, its thread ends
    assert time.perf_counter() - start < 20.0  # a hung step (30 s) is abandoned at its limit (0.3 s), not awaited
    assert out["env_failed"].tolist() == [False, False, True, False]
    assert not out["completion_mask"][2].any()
    assert out["env_rewards"].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert all(out["completion_mask"][s].any() for s in (0, 1, 3))
    assert metrics["env/failed"] == 1.0
    assert {c: metrics[f"env/failed/{c}"] for c in FAIL_CAUSES} == {c: float(c == cause) for c in FAIL_CAUSES}  # the row says why
    assert why in caplog.text and "sample 2" in caplog.text


def test_episode_time_limit_counts_all_of_an_episodes_calls():
    """Each step (~0.2 s with a 1 s step limit) is fine alone; three of them pass the 0.5 s episode limit."""
    node = _node("SlowEcho", max_turns=3, step_timeout_s=1.0, episode_timeout_s=0.5)
    mt, _ = _spied(node)
    out, metrics = mt.generate(prompts_of(PROMPTS[:1]))
    assert out["env_failed"].tolist() == [True, True]
    assert metrics["env/failed"] == 2.0 and metrics["env/failed/timeout"] == 2.0


def test_the_trainer_attends_environment_tokens_so_an_on_policy_ratio_is_one():
    """At version 0 the trainer's pi is the generator's mu: AIPO's ratio is 1 on every model token (also
    those of later turns, which condition on environment tokens), and the loss counts model tokens only."""
    from flowrl.operators.trainer import Trainer

    from .helpers import loss_node, tiny_policy_node

    mt, _ = _spied(_node("Echo", temperature=0.7))
    out, _ = mt.generate(prompts_of(PROMPTS))
    out["env_rewards"] = out["env_rewards"] + torch.tensor([0.0, 1.0, 0.0, 2.0])  # some advantage to step on
    trainer = Trainer(tiny_policy_node(MODEL), loss_node(reward_weights={"env_rewards": 1.0}))
    metrics = trainer.train_step(out)
    tol = ratio_atol(rollout_logprob_atol(mt.gen.model, out, temperature=0.7))  # float32 rounding of mu and pi
    assert abs(metrics["aipo/ratio_max"] - 1.0) < tol and abs(metrics["aipo/ratio_mean"] - 1.0) < tol
    assert metrics["aipo/tokens"] == float(out["completion_mask"].sum())


def test_a_batch_whose_samples_all_failed_trains_nothing_and_does_not_crash():
    """Every reset raises: no token to train; the step still runs (the weights do not move) and the version advances."""
    from flowrl.operators.trainer import Trainer

    from .helpers import loss_node, tiny_policy_node

    node = GeneratorNode(name="gen", model=MODEL, sampling=SamplingConfig(n_samples=2, max_new_tokens=4),
                         env=EnvConfig(env=f"{ENVS}:ResetRaises", max_turns=2))
    mt = MultiTurnGenerator(Generator(node, seed=0), node)
    out, metrics = mt.generate(prompts_of(PROMPTS, start=1) | {"prompt_index": torch.tensor([1, 3])})
    assert out["env_failed"].tolist() == [True, False, True, False] and metrics["env/failed"] == 2.0
    out["env_failed"][:] = True
    out["completion_mask"][:] = False  # as if every sample had failed in reset: no token at all
    out["completion_lens"][:] = 0
    trainer = Trainer(tiny_policy_node(MODEL), loss_node(reward_weights={"env_rewards": 1.0}))
    before = {k: v.clone() for k, v in trainer.weights().items()}
    trainer.train_step(out)
    assert trainer.version == 1
    assert all(torch.equal(before[k], v) for k, v in trainer.weights().items())


def test_each_turn_reads_the_conversation_as_sampled_even_ids_the_built_in_tokenizer_cannot_round_trip():
    """Built-in model with 32 embeddings and the 16-word digit tokenizer: ids 16..31 decode to
    ``<unk:ID>``, which no tokenizer gives back, so a conversation re-tokenised between turns cannot
    hold them. Every model turn's input row is exactly prompt + the completion so far (each earlier
    turn's ids as sampled, then the observation's ids as encoded once), and the trained ids are the
    sampled ones."""
    node = _node("Echo", ModelConfig(vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64))
    gen = Generator(node, seed=0)
    seen: list[list[list[int]]] = []  # per model turn, each active row's input (prompt + completion so far)
    sampled: list[list[list[int]]] = []  # per model turn, each row's sampled ids
    sample = gen._sample

    def spy(prompt_ids, prompt_lens, rng):
        W = prompt_ids.shape[1]
        seen.append([prompt_ids[i, W - int(n) :].tolist() for i, n in enumerate(prompt_lens)])
        tokens, logprobs, mask = sample(prompt_ids, prompt_lens, rng)
        sampled.append([tokens[i, : int(mask[i].sum())].tolist() for i in range(len(tokens))])
        return tokens, logprobs, mask

    gen._sample = spy  # type: ignore[method-assign]
    out, _ = MultiTurnGenerator(gen, node).generate(prompts_of(PROMPTS))
    assert len(seen) == 3
    assert any(i >= 16 for turn in sampled[:2] for row in turn for i in row), "pick a seed that samples an id past the tokenizer's 16"
    obs0, obs = DEFAULT_TOKENIZER.encode("3="), DEFAULT_TOKENIZER.encode("12=")
    for s in range(4):
        prompt = PROMPTS[s // 2]
        want = prompt + obs0
        for t in range(3):
            assert seen[t][s] == want, f"sample {s}, turn {t + 1}: the model read {seen[t][s]}, not the conversation as sampled {want}"
            want = want + sampled[t][s] + (obs if t < 2 else [])
        n = int(out["completion_lens"][s])
        assert out["completion_ids"][s, :n].tolist() == want[len(prompt) :]


def test_metrics_count_environment_seconds_and_tokens_by_role():
    """``SlowEcho`` sleeps 0.2 s per step, two turns (one step each): every sample waits >= 0.4 s, and
    the generator waits less than the 4 x 0.4 s it would if one turn's calls ran one after another
    (``env/seconds`` is the generator's wait, from after it launched a turn's calls: a loaded machine
    can spend part of the 0.2 s launching them, so no lower bound holds for it but > 0).
    Tokens by role: per sample, the model's (mask) and the environment's (the rest)."""
    mt, _ = _spied(_node("SlowEcho", max_turns=2))
    out, metrics = mt.generate(prompts_of(PROMPTS))
    assert metrics["env/seconds_per_sample"] >= 0.4 and 0 < metrics["env/seconds"] < 1.2
    S, mask = 4, out["completion_mask"]
    assert metrics["env/model_tokens"] == pytest.approx(int(mask.sum()) / S)
    assert metrics["env/env_tokens"] == pytest.approx(int(out["completion_lens"].sum() - mask.sum()) / S)
    assert metrics["env/env_tokens"] == len(DEFAULT_TOKENIZER.encode("3=")) + len(DEFAULT_TOKENIZER.encode("12="))
