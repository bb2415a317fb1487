"""Completion lengths: the distribution, its expected longest, decode steps per batching mode, and
what the generation estimate, the trainer and the schedule make of them (hand-computed cases)."""

from __future__ import annotations

import json

import msgspec
import pytest

from flowrl.cli.plan import lengths_from_metrics  # reads the file, then the planner's pure pooling
from flowrl.errors import PlanError
from flowrl.examples import build_example
from flowrl.planners.estimate.generate import estimate_generate
from flowrl.planners.estimate.train import estimate_train
from flowrl.planners.lengths import (
    LengthDistribution,
    decode_steps,
    fixed_lengths,
    mean_and_tail,
    steady_decode_steps,
)
from flowrl.planners.parallel import ParallelDims
from flowrl.runtime.observe.metrics import length_histogram  # the metrics row writes it
from flowrl.planners.schedule import step_times
from flowrl.planners.workload import Workload, workload_from_graph
from tests.planners.test_estimates import TINY, ctx, device

TWO = LengthDistribution(points=((2, 1.0), (10, 1.0)))  # half the completions 2 tokens long, half 10


@pytest.mark.parametrize(
    "n, expected",
    [(1, 6.0), (2, 2 * 0.25 + 10 * 0.75), (3, 2 * 0.125 + 10 * 0.875)],
    ids=["one", "two", "three"],
)
def test_expected_longest_by_hand(n, expected):
    # P(max <= 2) = 0.5**n, so E[max] = 2 * 0.5**n + 10 * (1 - 0.5**n)
    assert TWO.expected_max(n) == pytest.approx(expected)


@pytest.mark.parametrize(
    "completions, batch, batching, expected",
    [
        (4, 2, "lockstep", 2 * 8.0),  # two waves, each as long as the longer of two
        (4, 2, "continuous", 8.0 + (4 / 2 - 1) * 6.0),  # one drain of the last batch + the mean per refill
        (2, 2, "continuous", 8.0),  # one batch: continuous cannot beat the longest
        (2, 4, "lockstep", 8.0),  # more slots than completions: a batch of 2
    ],
    ids=["lockstep-2-waves", "continuous-refills", "continuous-one-batch", "slots-over-completions"],
)
def test_decode_steps_by_hand(completions, batch, batching, expected):
    assert decode_steps(TWO, completions=completions, batch=batch, batching=batching) == pytest.approx(expected)


def test_steady_state_pays_only_the_mean():
    assert steady_decode_steps(TWO, completions=4, batch=2) == pytest.approx(4 * 6.0 / 2)


def test_fixed_lengths_are_the_old_model():
    d = fixed_lengths(7)
    for mode in ("lockstep", "continuous"):
        assert decode_steps(d, completions=10, batch=4, batching=mode) == pytest.approx(3 * 7 if mode == "lockstep" else 7 + 1.5 * 7)


def test_mean_and_tail_keeps_the_mean():
    d = mean_and_tail(mean=40, max_len=100, tail_frac=0.1)
    assert d.mean == pytest.approx(40) and d.max_len == 100
    assert sum(w for length, w in d.points if length == 100) == pytest.approx(0.1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mean=0.5, max_len=10, tail_frac=0.1), "mean completion length"),
        (dict(mean=5, max_len=10, tail_frac=1.5), "tail fraction"),
        (dict(mean=5, max_len=100, tail_frac=0.5), "lower the tail fraction"),
    ],
    ids=["mean-below-1", "frac-over-1", "tail-too-heavy"],
)
def test_mean_and_tail_refuses_impossible(kwargs, match):
    with pytest.raises(PlanError, match=match):
        mean_and_tail(**kwargs)


@pytest.mark.parametrize(
    "points, match",
    [((), "at least one"), (((3, 1.0), (2, 1.0)), "strictly increasing"), (((3, 0.0),), "weight")],
    ids=["empty", "unsorted", "zero-weight"],
)
def test_distribution_refuses_bad_points(points, match):
    with pytest.raises(PlanError, match=match):
        LengthDistribution(points=points)


def test_histogram_bins_keep_counts_and_bound_lengths():
    lengths = list(range(1, 201))
    hist = length_histogram(lengths, max_bins=10)
    assert len(hist) <= 10 and sum(c for _, c in hist) == 200
    assert hist[-1][0] == 200  # a bin stands at its longest length: never shorter than what it holds


def test_lengths_from_metrics_pools_rows(tmp_path):
    path = tmp_path / "m.jsonl"
    rows = [{"step": 1, "completion_len_hist": [[1, 2], [5, 2]]}, {"step": 2, "completion_len_hist": [[5, 4]]}, {"step": 3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = lengths_from_metrics(path)
    assert d.points == ((1, 2.0), (5, 6.0)) and d.mean == pytest.approx((2 + 30) / 8)


def test_lengths_from_metrics_without_lengths(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text('{"step": 1}\n')
    with pytest.raises(PlanError, match="no 'completion_len_hist'"):
        lengths_from_metrics(path)
    with pytest.raises(PlanError, match="cannot read"):
        lengths_from_metrics(tmp_path / "missing.jsonl")


# -- the workload ------------------------------------------------------------------------------------
def test_workload_refuses_lengths_past_gen_len_and_unknown_batching():
    with pytest.raises(PlanError, match="raise --gen-len to at least 10"):
        Workload(prompts_per_step=1, samples_per_prompt=1, prompt_len=1, gen_len=5, lengths=TWO)
    with pytest.raises(PlanError, match="batching 'paged' is not one of"):
        Workload(prompts_per_step=1, samples_per_prompt=1, prompt_len=1, gen_len=5, batching="paged")


def test_workload_reads_a_graphs_batching_mode_when_it_has_one():
    graph = build_example("llamarl")
    assert workload_from_graph(graph).batching == "lockstep"
    assert workload_from_graph(graph, batching="continuous").batching == "continuous"


# -- what the estimates make of them -----------------------------------------------------------------
LONGTAIL = Workload(prompts_per_step=2, samples_per_prompt=2, prompt_len=3, gen_len=10, lengths=TWO)


@pytest.mark.parametrize("batching", ["lockstep", "continuous"])
def test_generation_time_follows_decode_steps(batching):
    """Compute free, so a decode step costs its bytes read (weights + KV at the mean context + logits)."""
    dev = device(peak_flops=1e18)
    work = msgspec.structs.replace(LONGTAIL, batching=batching)
    est = estimate_generate(TINY, ParallelDims(), range(1), ctx(dev=dev, work=work), precision="bfloat16")
    kv_token = 2 * 2 * 1 * 4 * 2
    b = 4  # every completion in one batch
    longest = TWO.expected_max(b)  # 2 * 0.5**4 + 10 * (1 - 0.5**4) = 9.5
    ctx_len = 3 + (6.0 if batching == "continuous" else longest) / 2
    read = 1352 * 2 + b * ctx_len * kv_token + b * 10 * 4
    assert est.time_s == pytest.approx(longest * read / 1e11, rel=1e-6)  # one batch: both pay the longest
    if batching == "continuous":  # across steps only the mean: 4 completions * 6 tokens / 4 slots
        assert est.steady_s == pytest.approx(6.0 * read / 1e11, rel=1e-6)
    else:
        assert est.steady_s is None


def test_trainer_compute_follows_the_mean_sequence():
    fixed = estimate_train(TINY, ParallelDims(), range(1), ctx(work=Workload(prompts_per_step=2, samples_per_prompt=2, prompt_len=3, gen_len=6)))
    tail = estimate_train(TINY, ParallelDims(), range(1), ctx(work=LONGTAIL))  # mean 3 + 6 = 9 tokens, the same as fixed
    assert tail.breakdown["compute"] == pytest.approx(fixed.breakdown["compute"])
    assert tail.memory.activations > fixed.memory.activations  # memory is sized for the longest (13 tokens)


def test_async_step_uses_the_steady_time():
    graph = build_example("llamarl")
    devices = {"prompts": (), "reward": (), "gen": (0,), "policy": (1,), "aipo": (1,)}
    times = {"gen": 3.0, "policy": 2.0}
    s = step_times(graph, devices, times, [], steady={"gen": 1.5})
    assert (s.sync_step_s, s.async_step_s) == (pytest.approx(5.0), pytest.approx(2.0))
