"""Sequence packing (``OptimizerConfig.packing``): the same loss, gradients and metrics as the padded
trainer to float32 rounding, for every loss aggregation, on the built-in model and the HF families."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.graph.configs import OptimizerConfig
from flowrl.models.families import FAMILIES
from flowrl.models.families.builtin.model import packed_attention_mask
from flowrl.operators import packing
from flowrl.operators.packing import pack_rows
from flowrl.operators.trainer import Trainer
from tests.models.helpers import hf_policy_node
from tests.operators.helpers import loss_node, tiny_policy_node
from tests.tolerances import (
    GradientMagnitudes,
    TokenTerms,
    assert_within,
    entropy_atol,
    grad_norm_atol,
    logprob_atol,
    rollout_sequences,
)


@pytest.mark.parametrize(
    "lengths, capacity, rows",
    [
        ([5, 2, 3, 1, 4], 5, [[0], [4, 3], [2, 1]]),  # decreasing: 5 | 4+1 | 3+2
        ([3, 3, 3], 3, [[0], [1], [2]]),  # equal lengths: one per row
        ([2, 0, 2, 2], 6, [[0, 2, 3]]),  # an empty sequence goes nowhere
        ([], 4, []),
    ],
    ids=["long-tail", "equal", "empty-sequence", "nothing"],
)
def test_pack_rows_is_first_fit_decreasing(lengths, capacity, rows):
    assert pack_rows(lengths, capacity=capacity) == rows


def test_pack_rows_refuses_a_sequence_longer_than_a_row():
    with pytest.raises(ConfigError, match="7 tokens does not fit rows of 4"):
        pack_rows([7], capacity=4)


def test_packed_mask_keeps_attention_within_each_sequence():
    mask = packed_attention_mask(torch.tensor([[0, 1, 2, 0, 0, 1]]))[0, 0]  # sequences of 3, 1 and 2 tokens
    want = torch.zeros(6, 6, dtype=torch.bool)
    for lo, hi in [(0, 3), (3, 4), (4, 6)]:
        want[lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
    assert torch.equal(mask, want)


def _batch(prompts: list[list[int]], completions: list[list[int]], vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A rollout of these prompts (left-padded) and completions (right-padded with garbage ids and
    log-probs), two samples a group, rewards and mu's log-probs drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    S, Tp, C = len(prompts), max(map(len, prompts)), max(map(len, completions)) + 1  # one garbage column beyond the longest
    return {
        "sample_prompt_ids": torch.tensor([[0] * (Tp - len(p)) + p for p in prompts]),
        "sample_prompt_lens": torch.tensor([len(p) for p in prompts]),
        "completion_ids": torch.tensor([c + [vocab - 1] * (C - len(c)) for c in completions]),
        "completion_mask": torch.tensor([[t < len(c) for t in range(C)] for c in completions]),
        "behaviour_logprobs": -torch.rand(S, C, generator=g) * 3 - 0.5,
        "sampling_temperature": torch.full((S,), 0.8),
        "group_ids": torch.arange(S) // 2,
        "rewards": torch.randn(S, generator=g),
    }


def _long_tail(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Eight samples whose completions are 1-3 tokens but one of 20 (and one empty): mostly padding when padded."""
    g = torch.Generator().manual_seed(seed)
    lens = [20, 2, 1, 3, 2, 0, 1, 3]
    prompts = [[1] + torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(1, 5, (8,), generator=g)]
    completions = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    return _batch(prompts, completions, vocab, seed)


class _Spy:
    """Counts the policy model's forward calls by layout (packed rows or padded)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.packed = self.padded = 0
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        if kwargs.get("packed_positions") is not None:
            self.packed += 1
        else:
            self.padded += 1


def _equal_steps(node_of, loss, batch, *, micro_batch_size: int) -> None:
    """One train step padded and one packed from the same weights: the same loss and metrics, each
    gradient element within the bound of two float32 sums of its contributions (tests/tolerances.py),
    and the packed one really ran packed rows."""
    padded = Trainer(node_of(grad_clip=0.0, micro_batch_size=micro_batch_size, packing=False), loss)
    packed = Trainer(node_of(grad_clip=0.0, micro_batch_size=micro_batch_size, packing=True), loss)
    packed.model.load_state_dict(padded.model.state_dict())
    spy = _Spy(packed.model)
    terms = _token_terms(padded, loss, batch)  # before the step: the weights both forwards see
    with GradientMagnitudes(padded.model) as mags:
        want = padded.train_step(copy.deepcopy(batch))
    got = packed.train_step(copy.deepcopy(batch))
    assert spy.packed >= 1, (spy.packed, spy.padded)  # a micro-batch that packing cannot shorten runs padded
    S, width = batch["completion_ids"].shape[0], batch["sample_prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
    partials = -(-S // micro_batch_size) if micro_batch_size else 1
    tolerances = mags.tolerances(seq_len=width, positions=S * width, partials=partials, temperature=0.8)
    mine = dict(packed.model.named_parameters())
    for name, param in padded.model.named_parameters():
        assert_within(mine[name].grad, param.grad, tolerances[name], msg=name)
    assert set(got) == set(want)
    _assert_metrics_within_rounding(padded, loss, batch, terms, want, got, grad_norm_tol=grad_norm_atol(tolerances, want["policy/grad_norm"]))


#: Metrics that do not depend on the forward: equal, bit for bit.
EXACT = ("tokens", "lr", "reward")
#: Fractions of tokens past a ratio threshold: change only where a ratio lies within rounding of one.
FRACTIONS = ("clip_frac", "truncated_frac", "outside_kept_frac")


def _token_terms(trainer, loss, batch) -> TokenTerms:
    """``TokenTerms`` of ``loss`` on ``batch`` under ``trainer``'s current weights (tests/tolerances.py)."""
    from flowrl.operators.losses import combined_rewards, loss_advantages

    config = loss.loss
    temperature = float(batch["sampling_temperature"][0])
    return TokenTerms(
        trainer._logprobs(batch, grad=False), batch["behaviour_logprobs"], batch["completion_mask"],
        logprob_tol=logprob_atol(trainer.model, rollout_sequences(batch), temperature=temperature),
        advantages=loss_advantages(config, combined_rewards(config, batch), batch), ref=batch.get("ref_logprobs"), kl_coef=config.kl_coef,
    )  # fmt: skip


def _assert_metrics_within_rounding(padded, loss, batch, terms: TokenTerms, want, got, *, grad_norm_tol: float) -> None:
    """Each metric of the packed step within what float32 rounding allows of the padded step's
    (``tests/tolerances.py``: ``terms`` for the loss and ratio statistics, ``entropy_atol`` for the
    entropy, ``grad_norm_atol`` for the gradient norm), and the forward-free ones equal."""
    config = loss.loss
    low = config.clip_eps_low if config.clip_eps_low is not None else config.clip_eps
    high = config.clip_eps_high if config.clip_eps_high is not None else config.clip_eps
    near = terms.near([1 - low, 1 + high, config.rho])  # the clip range, AIPO's cap
    temperature = float(batch["sampling_temperature"][0])
    entropy_tol = entropy_atol(padded.model, rollout_sequences(batch), n=terms.n, temperature=temperature)
    for key, value in want.items():
        if key.endswith(EXACT) or key.split("/")[-1] in EXACT:
            assert got[key] == value, key
        elif key.split("/")[-1] in FRACTIONS:
            assert abs(got[key] - value) <= near / max(terms.n, 1), (key, near)
        elif key == "policy/entropy":
            assert abs(got[key] - value) <= entropy_tol, (key, got[key] - value, entropy_tol)
        elif key == "policy/grad_norm":
            assert abs(got[key] - value) <= grad_norm_tol, (key, got[key] - value, grad_norm_tol)
        else:  # the loss, ratio and KL statistics
            assert abs(got[key] - value) <= terms.atol(), (key, got[key] - value, terms.atol())


AGGREGATIONS = {
    "aipo-token_mean": dict(objective="aipo", loss_agg="token_mean"),
    "aipo-seq_mean": dict(objective="aipo", loss_agg="seq_mean"),
    "grpo-dr_grpo": dict(objective="grpo", loss_agg="dr_grpo"),
    "grpo-seq_mean-kl": dict(objective="grpo", loss_agg="seq_mean", kl_coef=0.1),
}


@pytest.mark.parametrize(
    "case, micro_batch_size",
    [(case, 0) for case in AGGREGATIONS] + [("aipo-token_mean", 3), ("grpo-dr_grpo", 3)],
    ids=[f"{case}-whole" for case in AGGREGATIONS] + ["aipo-token_mean-micro3", "grpo-dr_grpo-micro3"],
)
def test_packed_step_equals_the_padded_one_on_the_builtin_model(case, micro_batch_size):
    options = dict(AGGREGATIONS[case])
    batch = _long_tail(vocab=16)
    if options.get("kl_coef"):
        batch["ref_logprobs"] = batch["behaviour_logprobs"] - 0.1
    _equal_steps(lambda **o: tiny_policy_node(**o), loss_node(**options), batch, micro_batch_size=micro_batch_size)


def test_packed_multi_turn_step_equals_the_padded_one():
    """Multi-turn samples: the environment's tokens inside the extent (``completion_lens``) are attended, not trained."""
    batch = _long_tail(vocab=16)
    lens = batch["completion_mask"].sum(1)
    batch["completion_lens"] = lens
    batch["completion_mask"] = batch["completion_mask"] & (torch.arange(batch["completion_mask"].shape[1])[None, :] % 3 != 1)  # every third an env token
    _equal_steps(lambda **o: tiny_policy_node(**o), loss_node(loss_agg="seq_mean"), batch, micro_batch_size=0)


def test_packed_step_equals_the_padded_one_on_the_hf_families(hf_dir):
    _equal_steps(lambda **o: hf_policy_node(hf_dir, **o), loss_node(loss_agg="seq_mean"), _long_tail(vocab=100), micro_batch_size=0)


def test_packed_log_probs_equal_the_padded_ones_on_the_moe_families(hf_moe_dir):
    """Qwen3-MoE and Qwen2-MoE: packed rows route each token as its padded row does (routing is per
    token), so the trainer's log pi over packed rows equals the padded one's within float32 rounding."""
    batch = _long_tail(vocab=100)
    padded = Trainer(hf_policy_node(hf_moe_dir, packing=False), loss_node(objective="grpo"))
    packed = Trainer(hf_policy_node(hf_moe_dir, packing=True), loss_node(objective="grpo"))
    spy = _Spy(packed.model)
    want, got = padded._logprobs(batch, grad=False), packed._logprobs(batch, grad=False)
    assert (spy.packed, spy.padded) == (1, 0)
    assert_within(got, want, logprob_atol(padded.model, rollout_sequences(batch), temperature=0.8), msg="log pi")


def test_packed_recompute_of_log_pi_old_equals_the_padded_one():
    """Several updates a batch: log pi_old (no gradient, the ``old/*`` metrics, the clipped ratio) packed too."""
    batch = _long_tail(vocab=16)
    padded = Trainer(tiny_policy_node(num_iterations=2, packing=False), loss_node(objective="grpo"))
    packed = Trainer(tiny_policy_node(num_iterations=2, packing=True), loss_node(objective="grpo"))
    spy = _Spy(packed.model)
    want = padded._logprobs(batch, grad=False)
    got = packed._logprobs(batch, grad=False)
    assert spy.packed == 1 and spy.padded == 0
    atol = logprob_atol(padded.model, rollout_sequences(batch), temperature=0.8)
    assert_within(got, want, atol, msg="log pi_old")


def test_packed_reference_log_probs_equal_the_padded_ones(hf_qwen2_dir):
    """A reference with ``packing=True``: its ``ref_logprobs`` over packed rows, the whole batch at once."""
    from flowrl.graph.configs import HFModelConfig, ReferenceConfig
    from flowrl.graph.nodes import ReferenceNode
    from flowrl.operators.reference import Reference

    batch = _long_tail(vocab=100)
    padded, packed = (
        Reference(ReferenceNode(name="ref", model=HFModelConfig(path=str(hf_qwen2_dir)), reference=ReferenceConfig(packing=p))) for p in (False, True)
    )
    spy = _Spy(packed.model)
    want, got = padded.logprobs(batch)["ref_logprobs"], packed.logprobs(batch)["ref_logprobs"]
    assert (spy.packed, spy.padded) == (1, 0)
    assert_within(got, want, logprob_atol(padded.model, rollout_sequences(batch), temperature=0.8), msg="ref_logprobs")


def test_equal_lengths_run_padded():
    """Packing cannot shorten a batch of equal lengths: it runs padded, the same computation."""
    batch = _batch([[1, 4, 5]] * 4, [[6, 7, 8, 9]] * 4, vocab=16)
    trainer = Trainer(tiny_policy_node(packing=True), loss_node())
    spy = _Spy(trainer.model)
    trainer.train_step(batch)
    assert (spy.packed, spy.padded) == (0, 1)


def test_packing_is_refused_for_a_family_whose_attention_cannot_take_packed_rows(hf_llama_dir, monkeypatch):
    monkeypatch.setitem(FAMILIES, "llama", dataclasses.replace(FAMILIES["llama"], packing=False))
    with pytest.raises(ConfigError, match=r"policy 'policy': packing=True .* 'llama' does not \(the families that do: builtin, qwen2, qwen3, qwen3_moe, qwen2_moe\)"):
        Trainer(hf_policy_node(hf_llama_dir, packing=True), loss_node())
    assert not Trainer(hf_policy_node(hf_llama_dir, packing=False), loss_node()).packing  # unpacked: fine
    assert not Trainer(hf_policy_node(hf_llama_dir), loss_node()).packing  # the default pads such a family, silently


def test_packing_is_on_by_default_where_the_family_can_pack(hf_qwen2_dir):
    from flowrl.graph.configs import ReferenceConfig

    assert OptimizerConfig().packing is None and ReferenceConfig().packing is None  # None: where the family can
    assert packing.__all__ == ["pack_rows", "packed_logits", "packed_real_mask", "check_packing", "packs"]
    assert Trainer(tiny_policy_node(), loss_node()).packing and Trainer(hf_policy_node(hf_qwen2_dir), loss_node()).packing
    assert not Trainer(tiny_policy_node(packing=False), loss_node()).packing
    spy = _Spy((trainer := Trainer(tiny_policy_node(), loss_node())).model)
    trainer.train_step(_long_tail(vocab=16))
    assert (spy.packed, spy.padded) == (1, 0)


def test_packed_log_probs_under_mixed_truncations_equal_the_padded_ones():
    """Samples drawn with different top-k / top-p and temperatures: each setting on its own samples' tokens."""
    from flowrl.models.registry import build_model
    from flowrl.operators.logprobs import completion_logprobs_and_entropy
    from tests.operators.helpers import TINY

    batch = _long_tail(vocab=16)
    S = batch["completion_ids"].shape[0]
    model = build_model(TINY)
    spy = _Spy(model)
    settings = dict(temperature=torch.linspace(0.6, 1.2, S), top_k=torch.tensor([0, 4, 0, 4, 8, 0, 4, 8]), top_p=torch.tensor([1.0, 1.0, 0.9, 0.9, 1.0, 0.8, 1.0, 1.0]))
    args = (model, batch["sample_prompt_ids"], batch["sample_prompt_lens"], batch["completion_ids"], batch["completion_mask"])
    want = completion_logprobs_and_entropy(*args, **settings)
    got = completion_logprobs_and_entropy(*args, **settings, packing=True)
    assert (spy.packed, spy.padded) == (1, 1)
    atol = logprob_atol(model, rollout_sequences(batch), temperature=0.6)
    assert torch.equal(torch.isneginf(got[0]), torch.isneginf(want[0]))  # the same kept sets
    finite = ~torch.isneginf(want[0])
    assert_within(got[0][finite], want[0][finite], atol, msg="log-probs")
    # H = -sum p log p: dH = -sum p dlog p (log p + 1), so |dH| <= max |dlog p| (H + 1) <= atol (log V + 1)
    assert_within(got[1], want[1], atol * (math.log(16) + 1), msg="entropy")


def test_a_run_refuses_packing_for_such_a_family_before_it_starts(hf_llama_dir, monkeypatch):
    from flowrl.graph.builder import GraphBuilder
    from flowrl.graph.configs import HFModelConfig
    from flowrl.runtime import preflight
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    monkeypatch.setitem(FAMILIES, "llama", dataclasses.replace(FAMILIES["llama"], packing=False))
    b = GraphBuilder("g", model=HFModelConfig(path=str(hf_llama_dir)))
    gen = b.generator("gen", b.source("prompts", task="copy", batch_size=2), n_samples=2, max_new_tokens=4)
    aipo = b.loss("aipo", gen, b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward"))
    b.weights(b.policy("policy", aipo, packing=True), gen)
    graph = b.build()
    message = r"policy 'policy': packing=True .* 'llama' does not \(the families that do: builtin, qwen2, qwen3, qwen3_moe, qwen2_moe\)"
    with pytest.raises(ConfigError, match=message):
        preflight.check_packing_families(graph)
    monkeypatch.setattr(Trainer, "__init__", lambda *a, **k: pytest.fail("a trainer was built"))
    with pytest.raises(ConfigError, match=message):
        run_graph(graph, RunConfig(steps=1))


@pytest.mark.slow  # two runs: ~30 s on the loaded 2-core machine
def test_a_run_with_packing_trains_as_the_padded_run_does():
    """The long-tail example with and without packing, k = 0, one step: the batch is the same, and so
    are its loss, entropy and gradient norm."""
    from flowrl.examples.longtail import LONGTAIL_MODEL
    from flowrl.graph.builder import GraphBuilder
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    def graph(packing: bool):
        b = GraphBuilder("longtail", model=LONGTAIL_MODEL)
        gen = b.generator("gen", b.source("prompts", task="longtail", batch_size=2), n_samples=4, max_new_tokens=32)
        aipo = b.loss("aipo", gen, b.scorer("reward", gen, fn="flowrl.operators.tasks:longtail_reward"), objective="aipo")
        b.weights(b.policy("policy", aipo, packing=packing, micro_batch_size=4), gen, max_staleness=0)
        return b.build()

    padded, packed = (run_graph(graph(p), RunConfig(steps=1, progress=False)).rows[0] for p in (False, True))
    assert packed["reward_mean"] == padded["reward_mean"] and packed["policy/tokens"] == padded["policy/tokens"]
    # Bounds from the initial weights (the step's forward runs on them), as tests/tolerances.py derives them:
    # rewards in [0, 1] give |A| <= 1 against the group mean; the gradient norm is bounded element-wise by
    # the one-step tests above, not here (its magnitudes need the reference backward).
    from flowrl.models.registry import build_model
    from tests.tolerances import U32, bound_entropy_atol, graph_logprob_atol, reductions, weights_magnitude

    model, n = build_model(LONGTAIL_MODEL), int(padded["policy/tokens"])
    logp_tol = graph_logprob_atol(graph(False), steps=0)
    scale = 3 * math.exp(padded["mismatch/abs_logp_max"] + logp_tol)  # (|A|max + 2) R, TokenTerms' scale
    loss_tol = scale * math.expm1(logp_tol) + 2 * n * U32 / (1 - n * U32) * scale
    assert abs(packed["loss"] - padded["loss"]) <= loss_tol, (packed["loss"] - padded["loss"], loss_tol)
    magnitude = weights_magnitude(model)
    logit_tol = 2 * U32 * sum(reductions(model, LONGTAIL_MODEL.max_seq_len)) * magnitude
    temperature = graph(False).node("gen").sampling.temperature
    entropy_tol = bound_entropy_atol(magnitude, logit_tol, vocab=LONGTAIL_MODEL.vocab_size, n=n, temperature=temperature)
    assert abs(packed["policy/entropy"] - padded["policy/entropy"]) <= entropy_tol, (packed["policy/entropy"] - padded["policy/entropy"], entropy_tol)
