"""Completion lengths of one step: a distribution (mean and tail), and what a batch of them costs to decode.

RL completions are not all as long as ``max_new_tokens``: most stop early, a few run to the
limit (the long tail). How much of that a generator pays depends on how it batches:

- **lock-step** (static batching): a batch of ``b`` completions decodes until its longest is done,
  finished slots idle; a replica with ``n`` completions runs ``ceil(n / b)`` such waves::

      steps = ceil(n / b) * E[max of b lengths]

- **continuous** (a finished slot takes the next prompt at once): the slots stay full until the
  queue is empty, then the last batch drains, so the step pays the mean plus one tail::

      steps = E[max of min(n, b) lengths] + max(0, n / b - 1) * mean

  With everything in one batch (``n <= b``) both are the longest completion: batching cannot help.
- **continuous, across steps** (asynchronous, in-flight: the next step's prompts fill the slots the
  tail frees): no drain at all, ``steps = n * mean / b``; ``schedule`` uses it for the async step.

``E[max of b]`` is exact for the distribution: ``sum_l l * (F(l)**b - F(l-)**b)``.

A distribution is a histogram: ``(length, weight)`` points. ``fixed_lengths(L)`` is the old model
(every completion runs to the limit); ``mean_and_tail(mean, max_len, tail_frac)`` a two-point
one: a fraction ``tail_frac`` of completions runs to ``max_len``, the rest share the remaining
mean; ``lengths_from_histograms`` pools the ``completion_len_hist`` of a run's metrics rows (``flowrl plan
--lengths-from``: the CLI reads the file, this module stays pure).

Example:
    >>> d = mean_and_tail(mean=40, max_len=100, tail_frac=0.1)
    >>> round(d.mean, 6), d.max_len
    (40.0, 100)
    >>> round(d.expected_max(1), 6), round(d.expected_max(10), 2)
    (40.0, 76.98)
    >>> [round(decode_steps(d, completions=20, batch=10, batching=m), 2) for m in BATCHING_MODES]
    [153.96, 116.98]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Literal

import msgspec

from flowrl.errors import PlanError

__all__ = [
    "BATCHING_MODES",
    "Batching",
    "LengthDistribution",
    "fixed_lengths",
    "mean_and_tail",
    "lengths_from_histograms",
    "decode_steps",
    "steady_decode_steps",
    "check_batching",
]

Batching = Literal["lockstep", "continuous"]

#: The generator's batching modes (module docstring).
BATCHING_MODES: tuple[str, ...] = ("lockstep", "continuous")



class LengthDistribution(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Completion lengths as a histogram.

    Attributes:
        points: ``(length, weight)`` pairs, lengths >= 1 and strictly increasing, weights > 0
            (normalised by their sum).
    """

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise PlanError("LengthDistribution needs at least one (length, weight) point")
        last = 0
        for length, weight in self.points:
            if length < 1 or length <= last:
                raise PlanError(f"LengthDistribution points {self.points[:4]}...: lengths must be >= 1 and strictly increasing (got {length} after {last})")
            if not weight > 0 or not math.isfinite(weight):
                raise PlanError(f"LengthDistribution: weight {weight} of length {length} must be a finite number > 0")
            last = length

    @property
    def mean(self) -> float:
        """Mean completion length."""
        return _mean(self.points)

    @property
    def max_len(self) -> int:
        """Longest completion."""
        return self.points[-1][0]

    def expected_max(self, n: int) -> float:
        """Expected length of the longest of ``n`` independent completions (``n >= 1``)."""
        return _expected_max(self.points, n)

    def short(self) -> str:
        return f"mean {self.mean:.0f}, max {self.max_len}"


# the search asks the same distribution thousands of times: memoised on its (hashable) points
@functools.lru_cache(maxsize=256)
def _mean(points: tuple[tuple[int, float], ...]) -> float:
    return sum(length * w for length, w in points) / sum(w for _, w in points)


@functools.lru_cache(maxsize=4096)
def _expected_max(points: tuple[tuple[int, float], ...], n: int) -> float:
    total, cdf, prev, out = sum(w for _, w in points), 0.0, 0.0, 0.0
    for length, w in points:
        cdf = min(1.0, cdf + w / total)
        now = cdf**n
        out += length * (now - prev)
        prev = now
    return out


def fixed_lengths(length: int) -> LengthDistribution:
    """Every completion ``length`` tokens long (runs to the limit)."""
    return LengthDistribution(points=((length, 1.0),))


def mean_and_tail(*, mean: float, max_len: int, tail_frac: float) -> LengthDistribution:
    """A fraction ``tail_frac`` of completions runs to ``max_len``; the rest are ``head`` long, where
    ``head = (mean - tail_frac * max_len) / (1 - tail_frac)`` keeps the mean.

    Raises:
        PlanError: when no such distribution exists (mean out of ``[1, max_len]``, tail too heavy for the mean).
    """
    if not 1 <= mean <= max_len:
        raise PlanError(f"mean completion length {mean} must be in [1, max_len={max_len}]")
    if not 0 <= tail_frac <= 1:
        raise PlanError(f"tail fraction {tail_frac} must be in [0, 1]")
    if tail_frac in (0.0, 1.0) or mean == max_len:
        return fixed_lengths(max_len) if tail_frac == 1.0 or mean == max_len else fixed_lengths(round(mean))
    head = (mean - tail_frac * max_len) / (1 - tail_frac)
    if head < 1:
        raise PlanError(
            f"tail fraction {tail_frac} of completions at {max_len} tokens already makes the mean "
            f"{tail_frac * max_len:.0f} > {mean}; lower the tail fraction to at most {(mean - 1) / (max_len - 1):.3g}"
        )
    lo = math.floor(head)
    if lo == head or lo + 1 >= max_len:
        return LengthDistribution(points=((round(head), 1 - tail_frac), (max_len, tail_frac)))
    # split the head between its two neighbouring integers so the mean stays exact
    frac = head - lo
    return LengthDistribution(points=((lo, (1 - tail_frac) * (1 - frac)), (lo + 1, (1 - tail_frac) * frac), (max_len, tail_frac)))


def lengths_from_histograms(histograms: Iterable[object], *, source: str) -> LengthDistribution:
    """The completion lengths of a real run, pooled from its metrics rows' ``[[length, count], ...]``
    histograms (``flowrl.runtime.observe.metrics.length_histogram``); entries of another shape are skipped.

    Example:
        >>> lengths_from_histograms([[[1, 2], [5, 2]], [[5, 4]]], source="m.jsonl").points
        ((1, 2.0), (5, 6.0))

    Raises:
        PlanError: no histogram holds a length (``source`` names where they came from).
    """
    pooled: dict[int, float] = {}
    for hist in histograms:
        for pair in hist if isinstance(hist, list) else ():
            if isinstance(pair, list) and len(pair) == 2 and all(isinstance(v, int) for v in pair) and pair[0] >= 1 and pair[1] > 0:
                pooled[pair[0]] = pooled.get(pair[0], 0.0) + pair[1]
    if not pooled:
        raise PlanError(
            f"metrics file {source!r} has no 'completion_len_hist' in any row; it is written by 'flowrl run --metrics FILE' "
            "from this version on (give --gen-len-mean and --tail-frac instead)"
        )
    return LengthDistribution(points=tuple(sorted(pooled.items())))


def decode_steps(dist: LengthDistribution, *, completions: int, batch: int, batching: str) -> float:
    """Decode steps one replica runs for ``completions`` completions in batches of ``batch`` slots
    (module docstring: lock-step waves, or continuous with one drain)."""
    b = max(1, min(batch, completions))
    longest = dist.expected_max(b)
    if batching == "continuous":
        return longest + max(0.0, completions / b - 1) * dist.mean
    return math.ceil(completions / b) * longest


def steady_decode_steps(dist: LengthDistribution, *, completions: int, batch: int) -> float:
    """Decode steps per step of a continuous generator that keeps its slots full across steps."""
    return completions * dist.mean / max(1, min(batch, completions))


def check_batching(value: str, where: str) -> None:
    """Raise ``PlanError`` unless ``value`` is one of ``BATCHING_MODES``."""
    if value not in BATCHING_MODES:
        raise PlanError(f"{where}: batching {value!r} is not one of {', '.join(BATCHING_MODES)}")

