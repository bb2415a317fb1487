"""pi truncated by its own top-k/top-p kept set, and the engine/trainer mismatch the trainer measures every step.

The generator records mu's log-probs under its truncated, renormalised sampling distribution; the
trainer evaluates pi the same way on pi's own logits (``kept_logprobs``). So at k = 0 the AIPO ratio
is 1 with truncation on, a token outside pi's kept set is left out of the loss without inf or nan,
and ``mismatch/*`` measures what is left: the engine's own error (e.g. an int8 generator's).
"""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.graph.nodes import LossNode
from flowrl.operators.generation import Generator
from flowrl.operators.logprobs import completion_logprobs, completion_logprobs_and_entropy, kept_logprobs, truncation_threshold
from flowrl.operators.mismatch import MISMATCH_KEYS
from flowrl.operators.source import PromptSource
from flowrl.operators.trainer import Trainer

from tests.tolerances import ratio_atol, rollout_logprob_atol

from .helpers import TINY, loss_node, reference_sampling_logprobs, source_node, tiny_generator_node, tiny_policy_node

TINY_V = TINY.vocab_size

# -- the kept-set log-prob by hand -----------------------------------------------------------------

Z = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]  # softmax: [0.561, 0.206, 0.125, 0.076, 0.028, 0.004]
# Every setting below keeps K = {0, 1, 2}: top-3; top-p 0.8 (mass before token 3 is 0.892 >= 0.8);
# top-4 then top-p 0.8 over the renormalised top-4 [0.579, 0.213, 0.129, 0.078] (before token 3: 0.922).
K = (0, 1, 2)
LOG_NORM = math.log(math.exp(2.0) + math.exp(1.0) + math.exp(0.5))
KEEPS_K = [dict(top_k=3), dict(top_p=0.8), dict(top_k=4, top_p=0.8)]
KEEPS_K_IDS = ["top-k-3", "top-p-0.8", "top-k-4-top-p-0.8"]


@pytest.mark.parametrize("settings", KEEPS_K, ids=KEEPS_K_IDS)
def test_kept_logprobs_equal_hand_computed_values(settings):
    got = kept_logprobs(torch.tensor([Z] * len(Z)), torch.arange(len(Z)), **settings).tolist()
    want = [Z[y] - LOG_NORM if y in K else -math.inf for y in range(len(Z))]
    assert [g == -math.inf for g in got] == [w == -math.inf for w in want]
    assert [g for g in got if g != -math.inf] == pytest.approx([w for w in want if w != -math.inf], abs=1e-6)


class LogitModel(torch.nn.Module):
    """A pi whose next-token logits are one trainable vector at every position, whatever the input."""

    def __init__(self, logits: list[float]) -> None:
        super().__init__()
        self.z = torch.nn.Parameter(torch.tensor(logits))
        self.vocab_size, self.max_seq_len = len(logits), 64  # the CausalLM interface

    def forward(self, tokens: torch.Tensor, *, keep: int = 0, **_: object) -> torch.Tensor:
        return self.z.expand(tokens.shape[0], keep or tokens.shape[1], -1)


@pytest.mark.parametrize("objective", ["aipo", "pg"])
@pytest.mark.parametrize("settings", KEEPS_K, ids=KEEPS_K_IDS)
def test_a_token_outside_pis_kept_set_is_left_out_of_the_loss_and_counted(settings, objective):
    """Hand-computed step over pi renormalised on K = {0, 1, 2}: tokens 4 and 3 lie outside K (pi = 0,
    AIPO's ratio 0): weight 0, counted in ``mismatch/outside_kept_frac``, and loss and gradient stay
    finite and equal the formula written out here (``pg``, which has no ratio to zero them, too)."""
    trainer = Trainer(tiny_policy_node(grad_clip=0.0), loss_node(objective=objective, rho=4.0))
    trainer.model = LogitModel(Z)
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.0)  # the step leaves z; its .grad stays
    tokens = [[0, 1, 4], [2, 0, 3], [1, 1, 2]]
    rewards = [1.0, 0.0, 0.0]  # group mean 1/3: advantages 2/3, -1/3, -1/3
    S, C = len(tokens), len(tokens[0])
    pi_hand = [[Z[y] - LOG_NORM if y in K else -math.inf for y in row] for row in tokens]
    mu = [[lp if lp != -math.inf else math.log(0.01) for lp in row] for row in pi_hand]  # mu kept 3 and 4
    batch = {
        "sample_prompt_ids": torch.tensor([[1, 2]] * S),
        "sample_prompt_lens": torch.tensor([2] * S),
        "completion_ids": torch.tensor(tokens),
        "completion_mask": torch.ones(S, C, dtype=torch.bool),
        "behaviour_logprobs": torch.tensor(mu),
        "sampling_temperature": torch.ones(S),
        "sampling_top_k": torch.full((S,), settings.get("top_k", 0)),
        "sampling_top_p": torch.full((S,), settings.get("top_p", 1.0)),
        "group_ids": torch.zeros(S, dtype=torch.int64),
        "rollout_version": torch.tensor(0),
        "token_versions": torch.zeros(S, C, dtype=torch.int64),
        "rewards": torch.tensor(rewards),
    }
    metrics = trainer.train_step(batch)
    # The formula: loss = -(1/N) sum_{t in K} A_t log pi(y_t) (ratio 1 on K, 0 off K; N = all 9 tokens),
    # d loss / d z_j = -(1/N) sum_{t in K} A_t (1[j = y_t] - p_j 1[j in K]), p the softmax over K.
    adv = [r - sum(rewards) / S for r in rewards]
    inside = [(s, t) for s in range(S) for t in range(C) if tokens[s][t] in K]
    p = [math.exp(Z[j] - LOG_NORM) if j in K else 0.0 for j in range(len(Z))]
    loss = -sum(adv[s] * pi_hand[s][t] for s, t in inside) / (S * C)
    grad = [-sum(adv[s] * ((j == tokens[s][t]) - p[j]) for s, t in inside) / (S * C) for j in range(len(Z))]
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["loss"] == pytest.approx(loss, abs=1e-6)
    assert trainer.model.z.grad.tolist() == pytest.approx(grad, abs=1e-6)
    assert metrics["mismatch/outside_kept_frac"] == pytest.approx(2 / 9)
    assert metrics["mismatch/tokens"] == 7 and metrics.get("aipo/tokens", 7) == 7
    assert metrics[f"{objective}/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["mismatch/abs_logp_max"] < 1e-6


# -- gradients against an independent formula ------------------------------------------------------

SETTINGS = [dict(top_k=4), dict(top_p=0.7), dict(top_k=6, top_p=0.8), dict(top_k=0, top_p=1.0)]


@pytest.mark.parametrize("temperature", [0.7, 1.3], ids=["T0.7", "T1.3"])
@pytest.mark.parametrize("settings", SETTINGS, ids=["top-k", "top-p", "top-k-top-p", "off"])
def test_kept_logprobs_and_gradients_equal_a_hand_written_formula(settings, temperature):
    """Values and gradients (float64) of ``kept_logprobs`` against ``z_y / T - logsumexp_{v in K}(z_v / T)``
    written out per row, with K from the tests' own reference of the sampling rule (``helpers``)."""
    gen = torch.Generator().manual_seed(0)
    N, V = 24, 12
    logits = torch.randn(N, V, generator=gen, dtype=torch.float64) * 2
    tokens = torch.randint(0, V, (N,), generator=gen)
    weights = torch.randn(N, generator=gen, dtype=torch.float64)
    mine = logits.clone().requires_grad_(True)
    got = kept_logprobs(mine, tokens, temperature=temperature, **settings)
    theirs = logits.clone().requires_grad_(True)
    want, outside = [], 0
    for i in range(N):
        ref = reference_sampling_logprobs(logits[i].tolist(), temperature, **settings)
        kept = [v for v in range(V) if ref[v] != -math.inf]
        y = int(tokens[i])
        if y in kept:
            want.append(theirs[i, y] / temperature - torch.logsumexp(theirs[i, kept] / temperature, dim=0))
        else:
            want.append(torch.tensor(-math.inf, dtype=torch.float64))
            outside += 1
    want_t = torch.stack(want)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want_t))
    if settings.get("top_k") or settings.get("top_p", 1.0) < 1:
        assert outside > 0  # the case exercises tokens outside the kept set
    inside = ~torch.isneginf(want_t)
    torch.testing.assert_close(got[inside], want_t[inside], rtol=0, atol=1e-12)
    zero = torch.zeros((), dtype=torch.float64)
    (torch.where(inside, got, zero) * weights).sum().backward()
    (torch.where(inside, want_t, zero) * weights).sum().backward()
    assert torch.isfinite(mine.grad).all()
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-12)


def test_nothing_is_truncated_or_sorted_when_both_are_off_and_the_old_path_is_unchanged():
    logits = torch.randn(5, 7, 11, generator=torch.Generator().manual_seed(1))
    assert truncation_threshold(logits, top_k=0, top_p=1.0) is None
    assert truncation_threshold(logits, top_k=11, top_p=1.0) is None  # k >= V keeps everything
    tokens = torch.randint(0, 11, (5, 7), generator=torch.Generator().manual_seed(2))
    old = torch.log_softmax(logits / 0.8, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)  # the computation before truncation
    assert torch.equal(kept_logprobs(logits, tokens, temperature=0.8), old)


@pytest.mark.parametrize("scale", [[0.05], [1.0], [8.0], [8.0, 0.05, 1.0, 8.0, 3.0, 0.05]], ids=["flat", "normal", "peaked", "mixed"])
def test_top_p_windows_find_the_threshold_a_full_sort_finds(scale):
    """Top-p without top-k looks at growing windows of each row's largest logits, and sorts only rows
    whose nucleus is a large share of V; its thresholds are those of a full sort, row by row."""
    V, top_p = 3000, 0.9
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3)) * torch.tensor(scale * (6 // len(scale)))[:, None]
    got = truncation_threshold(logits, top_p=top_p)
    ordered = logits.sort(dim=-1, descending=True).values
    probs = torch.softmax(ordered.double(), dim=-1)
    before = probs.cumsum(-1) - probs
    want = ordered.gather(-1, (before < top_p).sum(-1, keepdim=True) - 1)
    assert torch.equal(got, want)


# -- the built-in engine at k = 0 ------------------------------------------------------------------


def _on_policy(trainer: Trainer, *, seed: int = 0, **sampling: object) -> dict[str, torch.Tensor]:
    gen = Generator(tiny_generator_node(n_samples=8, max_new_tokens=8, **sampling), seed=seed)
    gen.load_weights(trainer.weights(), trainer.version)  # k = 0: the generator holds the policy's weights
    rollout = gen.generate(PromptSource(source_node("copy", 4)).next_batch())
    return {**rollout, "rewards": torch.linspace(0, 1, rollout["completion_ids"].shape[0])}


@pytest.mark.parametrize("sampling", [dict(top_p=0.95), dict(top_k=5), dict(top_k=5, top_p=0.9, temperature=0.8)], ids=["top-p", "top-k", "both"])
def test_on_policy_aipo_ratio_and_mismatch_with_truncation(sampling):
    """At k = 0 with top-k/top-p on, pi truncated by its own kept set is mu: ratio 1, mismatch 0, within
    float32 rounding (``tests/tolerances.py``); pi left untruncated (the trainer before this change) gives
    ratio mean 0.973 (top-p 0.95) and 0.381 (top-k 5 of 16)."""
    trainer = Trainer(tiny_policy_node(), LossNode(name="aipo"))
    batch = _on_policy(trainer, **sampling)
    assert batch["sampling_top_k"].tolist() == [sampling.get("top_k", 0)] * len(batch["sampling_top_k"])
    atol = rollout_logprob_atol(trainer.model, batch, temperature=sampling.get("temperature", 1.0))
    metrics = trainer.train_step(batch)
    assert metrics["aipo/ratio_mean"] == pytest.approx(1.0, abs=ratio_atol(atol))
    assert metrics["aipo/ratio_max"] == pytest.approx(1.0, abs=ratio_atol(atol))
    assert abs(metrics["mismatch/kl"]) < atol and metrics["mismatch/abs_logp_max"] < atol
    assert metrics["mismatch/tokens"] == int(batch["completion_mask"].sum()) and metrics["mismatch/outside_kept_frac"] == 0.0
    untruncated = {k: v for k, v in batch.items() if k not in ("sampling_top_k", "sampling_top_p")}
    before = Trainer(tiny_policy_node(), LossNode(name="aipo")).train_step(untruncated)  # a rollout without the fields
    assert abs(before["aipo/ratio_mean"] - 1.0) > 1e-2


def test_mismatch_covers_only_the_tokens_of_the_trainers_current_weights():
    """A stale batch (versions set by hand): the trainer at version 1 gets tokens of versions 0 and 1;
    those of version 0 carry a mu off by 0.25 (older weights), those of version 1 are pi's own. The
    mismatch covers only the version-1 tokens (0 within float32 rounding); a batch with no such token reads 0 over 0 tokens."""
    trainer = Trainer(tiny_policy_node(), LossNode(name="aipo"))
    trainer.train_step(_on_policy(trainer, seed=1, top_p=0.95))
    assert trainer.version == 1
    batch = _on_policy(trainer, top_p=0.95)
    mask = batch["completion_mask"]
    stale = torch.zeros_like(mask)
    stale[::2] = True  # every other sample, all its tokens
    stale[1::2, 3:] = True  # and the tail of the others (continuous batching mixes versions within a sample)
    batch["token_versions"] = torch.where(stale, 0, 1)
    batch["rollout_version"] = torch.tensor(0)
    batch["behaviour_logprobs"] = torch.where(stale & mask, batch["behaviour_logprobs"] + 0.25, batch["behaviour_logprobs"])
    atol = rollout_logprob_atol(trainer.model, batch)
    metrics = trainer.train_step(dict(batch))
    assert metrics["mismatch/tokens"] == int((mask & ~stale).sum()) > 0
    assert abs(metrics["mismatch/kl"]) < atol and metrics["mismatch/abs_logp_max"] < atol
    assert metrics["aipo/ratio_mean"] < 0.95  # the stale tokens' ratio exp(-0.25) is AIPO's business, not the engine's
    del batch["token_versions"]  # every token of rollout_version 0, the trainer at version 2: nothing to measure
    empty = trainer.train_step(batch)
    assert {k: empty[k] for k in MISMATCH_KEYS[:3]} == {"mismatch/kl": 0.0, "mismatch/abs_logp_max": 0.0, "mismatch/tokens": 0.0}


def test_an_int8_generator_shows_a_nonzero_mismatch_that_the_aipo_ratio_reflects():
    """An engine that really differs from the trainer (int8 weights, as vLLM's kernels will): the mismatch
    is not trivially 0, and it is the log-ratio AIPO corrects. Measured on this tiny model: float32
    max |mu - pi| 2e-7; int8 3.95e-4 (kl 5e-6), ratio max 1.00038: the lower bounds below leave ~4x
    margin under int8's quantization error (a bound from float32 rounding cannot give those)."""
    trainer = Trainer(tiny_policy_node(), LossNode(name="aipo"))
    on_policy = _on_policy(trainer, top_p=0.95)
    exact = Trainer(tiny_policy_node(), LossNode(name="aipo")).train_step(on_policy)
    metrics = trainer.train_step(_on_policy(trainer, top_p=0.95, precision="int8"))
    assert exact["mismatch/abs_logp_max"] < rollout_logprob_atol(trainer.model, on_policy)
    assert metrics["mismatch/abs_logp_max"] > 1e-4 and metrics["mismatch/tokens"] > 0
    # AIPO's per-token ratio is exp(pi - mu): its largest log lies within the mismatch's largest |mu - pi|,
    # and its mean is 1 - mismatch/kl to first order (the second-order term is < max^2 / 2 ~ 1e-7).
    assert metrics["aipo/ratio_max"] > 1 + 1e-5
    assert math.log(metrics["aipo/ratio_max"]) <= metrics["mismatch/abs_logp_max"] + 1e-6
    assert metrics["aipo/ratio_mean"] - 1 == pytest.approx(-metrics["mismatch/kl"], abs=2e-7)


def test_the_reference_truncates_by_its_own_kept_set():
    """The reference evaluates the same truncated distribution: at version 0 it equals pi (KL 0)."""
    from flowrl.graph.nodes import ReferenceNode
    from flowrl.operators.reference import Reference

    trainer = Trainer(tiny_policy_node(), LossNode(name="aipo"))
    batch = _on_policy(trainer, top_k=5)
    ref = Reference(ReferenceNode(name="ref", model=trainer.node.model)).logprobs(batch)["ref_logprobs"]
    pi = completion_logprobs(trainer.model, batch["sample_prompt_ids"], batch["sample_prompt_lens"], batch["completion_ids"],
                             batch["completion_mask"], top_k=batch["sampling_top_k"], top_p=batch["sampling_top_p"])  # fmt: skip
    atol = rollout_logprob_atol(trainer.model, batch)  # float32 rounding of two evaluations (tests/tolerances.py)
    torch.testing.assert_close(ref, pi.detach(), rtol=0, atol=atol)
    torch.testing.assert_close(ref, batch["behaviour_logprobs"], rtol=0, atol=atol)


def test_samples_drawn_with_different_truncations_are_each_evaluated_with_their_own():
    """A batch whose samples carry different top-k/top-p (rollouts of two generators merged): each row's
    log-probs are those of its own setting, as if evaluated alone."""
    trainer = Trainer(tiny_policy_node(), LossNode(name="aipo"))
    batch = _on_policy(trainer, top_k=5)
    S = batch["completion_ids"].shape[0]
    top_k = torch.tensor([5, 0, 3, 5] * (S // 4))
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.8] * (S // 4))
    fields = [batch[f] for f in ("sample_prompt_ids", "sample_prompt_lens", "completion_ids", "completion_mask")]
    atol = rollout_logprob_atol(trainer.model, batch)  # a padded batch against each row alone: float32 rounding
    with torch.no_grad():
        got = completion_logprobs(trainer.model, *fields, top_k=top_k, top_p=top_p)
        for i in range(S):
            alone = completion_logprobs(trainer.model, *(f[i : i + 1] for f in fields), top_k=int(top_k[i]), top_p=float(top_p[i]))
            torch.testing.assert_close(got[i : i + 1], alone, rtol=0, atol=atol)
    assert bool(torch.isneginf(got).any())  # top-k 3 drops some of the tokens top-k 5 drew


@pytest.mark.parametrize("settings", [dict(), dict(top_k=4, temperature=0.7), dict(top_p=0.8)], ids=["plain", "top-k-4-T0.7", "top-p-0.8"])
def test_the_entropy_of_each_completion_token_equals_a_sum_over_the_vocabulary(settings):
    """``completion_logprobs_and_entropy``'s entropy at position t is ``-sum_v p(v) log p(v)`` over every
    token v put at t (each one a separate ``completion_logprobs`` call, so the kept set and its
    renormalisation come from the one truncation rule; p(v) = 0 outside it); its log-probs are
    ``completion_logprobs``'s. Tolerance: per-token log-probs of ~2.8 nats from forwards of other
    batch shapes differ by a few float32 ulps (~1e-6 relative), summed over 16 tokens: 1e-5 relative."""
    trainer = Trainer(tiny_policy_node(), LossNode(name="aipo"))
    settings = dict(settings)
    temperature = settings.pop("temperature", 1.0)
    batch = _on_policy(trainer, temperature=temperature, **settings)
    fields = [batch[f][:2] for f in ("sample_prompt_ids", "sample_prompt_lens", "completion_ids", "completion_mask")]
    prompt_ids, prompt_lens, ids, mask = fields
    with torch.no_grad():
        logp, entropy = completion_logprobs_and_entropy(trainer.model, *fields, temperature=temperature, **settings)
        torch.testing.assert_close(logp, completion_logprobs(trainer.model, *fields, temperature=temperature, **settings), rtol=0, atol=0)
        assert bool((entropy[~mask] == 0).all())
        V = TINY_V
        for i in range(2):
            for t in range(int(mask[i].sum())):
                each = ids[i : i + 1].repeat(V, 1)
                each[:, t] = torch.arange(V)  # every token at position t, after the sample's own y_<t
                upto = (torch.arange(ids.shape[1]) <= t)[None, :].expand(V, -1)
                lp = completion_logprobs(trainer.model, prompt_ids[i : i + 1].repeat(V, 1), prompt_lens[i : i + 1].repeat(V), each, upto,
                                         temperature=temperature, **settings)[:, t]  # fmt: skip
                p = lp.double().exp()
                want = float(-(torch.where(p > 0, p * lp.double(), 0.0)).sum())
                assert float(entropy[i, t]) == pytest.approx(want, rel=1e-5), (i, t)
    if settings:
        assert float(entropy[mask].max()) < math.log(V)  # truncation keeps fewer tokens than the vocabulary
