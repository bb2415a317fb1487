"""The sampling distribution (temperature, top-k, top-p) against values computed by hand, and the
generator's draws against that distribution."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.graph.configs import ModelConfig, SamplingConfig
from flowrl.operators.generation import Generator, sampling_logprobs

from .helpers import TINY, prompts_of, reference_sampling_logprobs, tiny_generator_node

INF = math.inf
E = math.e

# (logits, sampling settings, log-probs worked out by hand). At temperature 1, softmax([2, 1, 0]) is
# [0.665, 0.245, 0.090]; at temperature 2 (logits [1, 0.5, 0]) it is [0.506, 0.307, 0.186].
HAND = [
    ([2.0, 1.0, 0.0], dict(temperature=0.5), [4 - math.log(E**4 + E**2 + 1), 2 - math.log(E**4 + E**2 + 1), -math.log(E**4 + E**2 + 1)]),
    ([2.0, 1.0, 0.0], dict(temperature=2.0), [1 - math.log(E + E**0.5 + 1), 0.5 - math.log(E + E**0.5 + 1), -math.log(E + E**0.5 + 1)]),
    ([2.0, 1.0, 0.0], dict(top_k=2), [2 - math.log(E**2 + E), 1 - math.log(E**2 + E), -INF]),
    # top-p keeps a token while the mass before it is < top_p: 0.665 >= 0.6 drops the second token
    ([2.0, 1.0, 0.0], dict(top_p=0.6), [0.0, -INF, -INF]),
    ([2.0, 1.0, 0.0], dict(top_p=0.8), [2 - math.log(E**2 + E), 1 - math.log(E**2 + E), -INF]),  # 0.91 >= 0.8
    # the temperature comes first: at temperature 2 the mass before the second token is 0.506 < 0.6
    ([2.0, 1.0, 0.0], dict(temperature=2.0, top_p=0.6), [1 - math.log(E + E**0.5), 0.5 - math.log(E + E**0.5), -INF]),
    # [4, 2, 0, -2] / 2 = [2, 1, 0, -1]; top-3 renormalised is [0.665, 0.245, 0.090]; top-p 0.8 keeps two
    ([4.0, 2.0, 0.0, -2.0], dict(temperature=2.0, top_k=3, top_p=0.8), [2 - math.log(E**2 + E), 1 - math.log(E**2 + E), -INF, -INF]),
]
HAND_IDS = ["temperature-0.5", "temperature-2", "top-k-2", "top-p-0.6", "top-p-0.8", "temperature-then-top-p", "all"]


@pytest.mark.parametrize(("logits", "settings", "want"), HAND, ids=HAND_IDS)
def test_sampling_logprobs_equal_hand_computed_values(logits, settings, want):
    got = sampling_logprobs(torch.tensor([logits]), SamplingConfig(**settings))[0].tolist()
    assert [g == -INF for g in got] == [w == -INF for w in want]
    assert [g for g in got if g != -INF] == pytest.approx([w for w in want if w != -INF], abs=1e-6)
    # the tests' reference implementation (tests/operators/helpers.py) agrees with the hand values too
    assert reference_sampling_logprobs(logits, **settings) == pytest.approx(want, abs=1e-12)


class FixedLogits(torch.nn.Module):
    """A stand-in model whose next-token logits are ``logits`` at every position, whatever the input."""

    def __init__(self, logits: torch.Tensor, config: ModelConfig) -> None:
        super().__init__()
        self.logits, self.config = logits, config
        self.vocab_size, self.max_seq_len = config.vocab_size, config.max_seq_len  # the CausalLM interface

    def forward(self, tokens: torch.Tensor, *, keep: int = 0, **_: object) -> torch.Tensor:
        return self.logits.expand(tokens.shape[0], keep or tokens.shape[1], -1)


SUPPORT = (5, 6, 7)  # the tokens that get the logits of a case; every other token has logit -inf
SAMPLES, STEPS = 256, 16  # 4096 draws per case
SIGMAS = 5  # tolerance per token count: 5 binomial standard deviations (a right sampler fails once in ~3.5e6)


@pytest.mark.parametrize("case", [0, 2, 5], ids=[HAND_IDS[0], HAND_IDS[2], HAND_IDS[5]])
def test_generated_token_frequencies_follow_the_sampling_distribution(case):
    """The generator's draws (Gumbel-max over its recorded log-probs) land on each token as often as the
    hand-computed distribution says, and the log-prob it records for a draw is the hand-computed one."""
    logits, settings, want = HAND[case]
    full = torch.full((TINY.vocab_size,), -INF)
    full[list(SUPPORT)] = torch.tensor(logits)
    gen = Generator(tiny_generator_node(n_samples=SAMPLES, max_new_tokens=STEPS, stop_tokens=(15,), use_kv_cache=False, **settings), seed=0)
    gen.model = FixedLogits(full, TINY)  # every step draws from the same distribution: STEPS draws per sample
    out = gen.generate(prompts_of([[1, 4]]))
    drawn = out["completion_ids"].flatten()
    assert bool(out["completion_mask"].all()) and drawn.numel() == SAMPLES * STEPS
    assert set(drawn.tolist()) <= set(SUPPORT), "a token outside the support was drawn"
    n = drawn.numel()
    for token, logp in zip(SUPPORT, want):
        p = math.exp(logp)
        count = int((drawn == token).sum())
        tolerance = SIGMAS * math.sqrt(n * p * (1 - p))
        assert abs(count - n * p) <= tolerance, f"token {token}: drawn {count} times in {n}, expected {n * p:.0f} +- {tolerance:.0f}"
    recorded = torch.tensor([want[SUPPORT.index(t)] for t in drawn.tolist()]).view_as(out["behaviour_logprobs"])
    torch.testing.assert_close(out["behaviour_logprobs"], recorded.float(), rtol=0, atol=1e-6)
