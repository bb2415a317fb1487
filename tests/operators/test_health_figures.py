"""Each health figure of a metrics row against a hand computation on a small batch with padding.

The batch: prompts of 2-5 tokens (left padding), completions of 1-6 tokens in 7 columns (right
padding with a garbage id and garbage log-probs), three groups. The trainer runs it padded, in
packed rows, and packed in micro-batches; the hand computation runs each sample alone, unpadded, in
float64 after the model's float32 logits: per real completion token its log pi, the entropy of the
distribution it was evaluated under (temperature, top-k) and whether it lies in pi's kept set.
From those: ``policy/entropy`` (the mean over real tokens: a mean over padding positions fails),
``policy/grad_norm`` (of a hand-written policy-gradient loss's gradient, before clipping), the
``mismatch/*`` figures, and ``rollout_health``'s ``rollout/*`` figures (group reward std, zero-std
share, lengths, cut share). Tolerances: ``tests/tolerances.py``.
"""

from __future__ import annotations

import copy
import math
from fractions import Fraction

import pytest
import torch

from flowrl.operators import logprobs as logprobs_module
from flowrl.operators.trainer import Trainer
from flowrl.runtime.observe.metrics import rollout_health

from tests.tolerances import U32, GradientMagnitudes, entropy_atol, grad_norm_atol, logit_atol, logprob_atol

from .helpers import loss_node, tiny_policy_node

TEMPERATURE = 0.8
C, TP = 7, 5  # completion columns (one beyond the longest), prompt columns
SAMPLES = [  # mu's log-probs are made up; rewards: groups 0 and 1 differ, group 2 is all equal (zero std)
    {"group": 0, "reward": 1.0, "prompt": [1, 4, 5, 13], "completion": [6, 7, 8, 9, 10, 2], "mu": [-2.0, -3.0, -1.0, -2.5, -0.5, -3.5]},
    {"group": 0, "reward": 0.0, "prompt": [1, 4, 5, 13], "completion": [3], "mu": [-2.2]},
    {"group": 1, "reward": 0.5, "prompt": [1, 9], "completion": [11, 12], "mu": [-4.0, -1.5]},
    {"group": 1, "reward": 2.0, "prompt": [1, 9], "completion": [5, 5, 5, 2], "mu": [-2.0, -2.0, -9.0, -0.1]},
    {"group": 2, "reward": 1.0, "prompt": [1, 3, 3, 3, 14], "completion": [4, 2], "mu": [-1.0, -2.0]},
    {"group": 2, "reward": 1.0, "prompt": [1, 3, 3, 3, 14], "completion": [7, 7, 7], "mu": [-3.0, -2.0, -2.5]},
]
TOKENS = sum(len(s["completion"]) for s in SAMPLES)  # 18 real completion tokens of 6 x 7 positions
MISMATCH_TOP_K = 8  # half the vocabulary: some real tokens fall outside, most inside
LAYOUTS = {  # id: (packing, micro_batch_size)
    "padded": (False, 0),
    "packed": (True, 0),
    "packed-micro": (True, 4),
}


def _batch(*, top_k: int = 0, versions: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
    S = len(SAMPLES)
    batch = {
        "sample_prompt_ids": torch.tensor([[0] * (TP - len(s["prompt"])) + s["prompt"] for s in SAMPLES]),
        "sample_prompt_lens": torch.tensor([len(s["prompt"]) for s in SAMPLES]),
        "completion_ids": torch.tensor([s["completion"] + [15] * (C - len(s["completion"])) for s in SAMPLES]),  # 15: not the pad id
        "completion_mask": torch.tensor([[t < len(s["completion"]) for t in range(C)] for s in SAMPLES]),
        "behaviour_logprobs": torch.tensor([s["mu"] + [-7.0] * (C - len(s["mu"])) for s in SAMPLES]),
        "sampling_temperature": torch.full((S,), TEMPERATURE),
        "group_ids": torch.tensor([s["group"] for s in SAMPLES]),
        "rewards": torch.tensor([s["reward"] for s in SAMPLES]),
    }
    if top_k:
        batch["sampling_top_k"] = torch.full((S,), top_k)
    if versions is not None:
        batch["token_versions"] = torch.tensor([v + [0] * (C - len(v)) for v in versions])
    return batch


def _sequences() -> list[torch.Tensor]:
    return [torch.tensor(s["prompt"] + s["completion"]) for s in SAMPLES]


def _by_hand(model: torch.nn.Module, *, top_k: int) -> list[dict]:
    """Per real completion token, one sample at a time without padding: log pi(y_t) (a tensor with
    gradient), its entropy, whether y_t is in pi's kept set, and the gap of y_t's logit to the edge
    of the top-k set (how far rounding would have to move it to change the kept set)."""
    tokens = []
    for i, s in enumerate(SAMPLES):
        seq = torch.tensor([s["prompt"] + s["completion"]])
        logits = model(seq, valid=torch.ones_like(seq, dtype=torch.bool))[0].double() / TEMPERATURE  # [T, V]
        for t, y in enumerate(s["completion"]):
            z = logits[len(s["prompt"]) - 1 + t]
            keep = torch.ones_like(z, dtype=torch.bool)
            if top_k:
                ordered = z.detach().sort(descending=True).values
                keep = z.detach() >= ordered[top_k - 1]
                edge = (float(ordered[top_k - 1]) + float(ordered[top_k])) / 2
                gap = abs(float(z[y].detach()) - edge)
            else:
                gap = math.inf
            logp = torch.log_softmax(torch.where(keep, z, -math.inf), dim=-1)
            p = logp.detach().exp()
            entropy = -float((p[keep] * logp.detach()[keep]).sum())
            tokens.append({"sample": i, "t": t, "logp": logp[y], "entropy": entropy, "kept": bool(keep[y]), "gap": gap, "mu": s["mu"][t]})
    return tokens


def _advantages() -> list[float]:
    groups: dict[int, list[float]] = {}
    for s in SAMPLES:
        groups.setdefault(s["group"], []).append(s["reward"])
    return [s["reward"] - sum(groups[s["group"]]) / len(groups[s["group"]]) for s in SAMPLES]


def _train(layout: str, *, top_k: int = 0, grad_clip: float = 0.0, batch: dict | None = None, monkeypatch=None):
    """One ``pg`` step of a fresh tiny trainer on the batch; its metrics, the trainer, a copy of its
    starting model, and how many forwards ran on packed rows."""
    packing, micro = LAYOUTS[layout]
    trainer = Trainer(tiny_policy_node(grad_clip=grad_clip, packing=packing, micro_batch_size=micro), loss_node(objective="pg"))
    start = copy.deepcopy(trainer.model)
    packed = []
    if monkeypatch is not None:
        real = logprobs_module.packed_logits

        def counting(*args, **kwargs):
            out = real(*args, **kwargs)
            packed.append(out is not None)
            return out

        monkeypatch.setattr(logprobs_module, "packed_logits", counting)
    metrics = trainer.train_step(batch if batch is not None else _batch(top_k=top_k))
    return metrics, trainer, start, packed


def _assert_entropy(reported: float, tokens: list[dict], model: torch.nn.Module) -> None:
    """``policy/entropy`` is the mean over the real completion tokens of their distributions' entropies."""
    want = math.fsum(tok["entropy"] for tok in tokens) / len(tokens)
    atol = entropy_atol(model, _sequences(), n=len(tokens), temperature=TEMPERATURE)
    assert abs(reported - want) <= atol, f"policy/entropy {reported!r}, by hand over the {len(tokens)} real tokens {want!r} (tolerance {atol:.3g})"


@pytest.mark.parametrize(("layout", "top_k"), [("padded", 0), ("packed", 0), ("padded", 3), ("packed-micro", 3)])
def test_entropy_is_the_mean_over_real_tokens_of_the_distribution_each_was_evaluated_under(layout, top_k, monkeypatch):
    metrics, _, start, packed = _train(layout, top_k=top_k, monkeypatch=monkeypatch)
    assert any(packed) if LAYOUTS[layout][0] else not packed, packed  # the layout the case names ran (packed rows where they shorten a micro-batch)
    with torch.no_grad():
        tokens = _by_hand(start, top_k=top_k)
    assert len(tokens) == TOKENS and metrics["policy/tokens"] == TOKENS
    _assert_entropy(metrics["policy/entropy"], tokens, start)
    # the figures a mean over padding would give are far outside the tolerance: the check can tell them apart
    mean = math.fsum(tok["entropy"] for tok in tokens) / TOKENS
    assert abs(mean * TOKENS / (len(SAMPLES) * C) - mean) > 100 * entropy_atol(start, _sequences(), n=TOKENS, temperature=TEMPERATURE)


def test_an_entropy_averaged_over_padding_positions_fails_the_check(monkeypatch):
    """The same trainer with its entropies taken at every position, padding included (the garbage id
    after each completion): ``_assert_entropy`` refuses the figure it reports."""
    real = logprobs_module.completion_logprobs_and_entropy

    def over_padding(model, prompt_ids, prompt_lens, completion_ids, completion_mask, **kw):
        logp, _ = real(model, prompt_ids, prompt_lens, completion_ids, completion_mask, **kw)
        _, entropy = real(model, prompt_ids, prompt_lens, completion_ids, torch.ones_like(completion_mask), **{**kw, "completion_lens": None})
        return logp, entropy

    from flowrl.operators import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "completion_logprobs_and_entropy", over_padding)
    metrics, _, start, _ = _train("padded")
    with torch.no_grad():
        tokens = _by_hand(start, top_k=0)
    with pytest.raises(AssertionError, match="policy/entropy"):
        _assert_entropy(metrics["policy/entropy"], tokens, start)


@pytest.mark.parametrize("layout", ["padded", "packed-micro"])
def test_grad_norm_is_the_norm_of_the_hand_written_losss_gradient_before_clipping(layout):
    """``pg`` with token_mean: ``-sum_{kept t} A_s log pi(y_t) / real tokens``, ``A_s`` the reward
    minus its group's mean. The trainer clips to 1e-4 (far below the norm): the row still reports the
    norm before clipping, and its gradients are clipped to 1e-4."""
    max_norm = 1e-4
    metrics, trainer, start, _ = _train(layout, top_k=3, grad_clip=max_norm)
    adv = _advantages()
    with GradientMagnitudes(start) as mags:
        tokens = _by_hand(start, top_k=3)
        loss = -sum(adv[tok["sample"]] * tok["logp"] for tok in tokens if tok["kept"]) / TOKENS
        loss.float().backward()
    named = list(start.named_parameters())
    want = math.sqrt(math.fsum(float(p.grad.double().pow(2).sum()) for _, p in named if p.grad is not None))
    partials = -(-len(SAMPLES) // (LAYOUTS[layout][1] or len(SAMPLES)))  # the trainer's micro-batches
    tolerances = mags.tolerances(seq_len=TP + C, positions=len(SAMPLES) * (TP + C), temperature=TEMPERATURE, partials=partials)
    atol = grad_norm_atol(tolerances, want)
    assert abs(metrics["policy/grad_norm"] - want) <= atol, (metrics["policy/grad_norm"], want, atol)
    assert want > 100 * max_norm
    clipped = math.sqrt(math.fsum(float(p.grad.double().pow(2).sum()) for p in trainer.model.parameters() if p.grad is not None))
    assert clipped == pytest.approx(max_norm, rel=1e-4)  # clip_grad_norm_'s own 1e-6 in the divisor, over a norm ~1e-4


@pytest.mark.parametrize("layout", ["padded", "packed-micro"])
def test_mismatch_figures_are_mu_against_pi_on_the_real_kept_tokens_of_the_current_version(layout):
    """The first tokens of samples 0 and 3 are drawn by an older version (0; the trainer is at 1):
    ``mismatch/kl`` and ``abs_logp_max`` cover the other real tokens inside pi's top-k, ``tokens``
    counts them, ``outside_kept_frac`` is the share of all real tokens outside pi's top-k."""
    versions = [[0, 0, 0, 1, 1, 1]] + [[1] * len(s["completion"]) for s in SAMPLES[1:3]] + [[0, 0, 1, 1]] + [[1] * len(s["completion"]) for s in SAMPLES[4:]]
    packing, micro = LAYOUTS[layout]
    trainer = Trainer(tiny_policy_node(grad_clip=0.0, packing=packing, micro_batch_size=micro), loss_node(objective="pg"))
    trainer.version = 1
    start = copy.deepcopy(trainer.model)
    metrics = trainer.train_step(_batch(top_k=MISMATCH_TOP_K, versions=versions))
    with torch.no_grad():
        tokens = _by_hand(start, top_k=MISMATCH_TOP_K)
    sequences = _sequences()
    edge_atol = logit_atol(start, sequences) / TEMPERATURE
    assert min(tok["gap"] for tok in tokens) > edge_atol  # rounding cannot move a token across the top-k edge
    current = [tok for tok in tokens if tok["kept"] and versions[tok["sample"]][tok["t"]] == 1]
    outside = [tok for tok in tokens if not tok["kept"]]
    assert current and outside and len(current) < TOKENS - len(outside)  # each rule excludes something here
    diffs = [tok["mu"] - float(tok["logp"]) for tok in current]
    atol = logprob_atol(start, sequences, temperature=TEMPERATURE)
    assert metrics["mismatch/tokens"] == len(current)
    assert metrics["mismatch/outside_kept_frac"] == pytest.approx(len(outside) / TOKENS, rel=U32)
    kl = math.fsum(diffs) / len(diffs)
    assert abs(metrics["mismatch/kl"] - kl) <= atol + len(diffs) * U32 * max(map(abs, diffs)), (metrics["mismatch/kl"], kl)
    worst = max(map(abs, diffs))
    assert abs(metrics["mismatch/abs_logp_max"] - worst) <= atol + U32 * worst, (metrics["mismatch/abs_logp_max"], worst)


@pytest.mark.parametrize("width", [7, 6])
def test_rollout_figures_equal_fractions_worked_out_by_hand(width):
    """Groups of rewards (1, 0), (0.5, 2), (1, 1): population stds 1/2, 3/4, 0, so ``reward_std``
    = 5/12 and ``zero_std_frac`` = 1/3; lengths 6, 1, 2, 4, 2, 3 (mean 3); in 6 columns sample 0 reached
    ``max_new_tokens`` without a stop field, so ``cut_frac`` = 1/6 (in 7 columns, 0)."""
    batch = _batch()
    batch = {k: v[:, :width] if k in ("completion_ids", "completion_mask", "behaviour_logprobs") else v for k, v in batch.items()}
    figures = rollout_health(batch, batch["rewards"])
    want = {
        "rollout/reward_std": Fraction(5, 12),
        "rollout/zero_std_frac": Fraction(1, 3),
        "rollout/length_mean": Fraction(3),
        "rollout/length_min": Fraction(1),
        "rollout/length_max": Fraction(6),
        "rollout/cut_frac": Fraction(1, 6) if width == 6 else Fraction(0),
    }
    assert set(figures) == set(want)
    u64 = 2.0**-53
    for key, value in want.items():  # float64 sums and means of at most 6 terms, a square root
        assert abs(figures[key] - float(value)) <= 16 * u64 * max(1.0, float(value)), (key, figures[key], value)
