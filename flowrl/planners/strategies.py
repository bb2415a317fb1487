"""Strategies: which device splits the search enumerates (the first stage of enumerate -> estimate -> search -> plan).

Nodes play one of two roles: the *generator side* (generator nodes) and the *trainer side*
(policies, with their loss nodes, and reference models). A ``DeviceSplit`` gives each side a
contiguous block of device ids:

- ``colocated``: both sides on the same ``n`` devices, phases in sequence (the synchronous
  DeepSpeed-Chat-like baseline LlamaRL compares against), for ``n`` from ``candidate_counts``.
- ``disaggregated``: generators on devices ``[0, g)``, trainers on ``[g, g + t)``, disjoint, so the
  two overlap under a staleness bound k >= 1, for ``g, t`` from ``candidate_counts`` with
  ``g + t <= N``.
- ``search``: both families.

Every strategy searches sub-clusters: the counts it tries do not depend on the cluster size, so
every candidate on N devices is also a candidate on N' > N devices, which is why more devices
never make a strategy's best predicted step slower (``tests/planners/test_monotone.py``). The
price: on N devices that are not of the form ``m * 2**k`` (or at most ``EXHAUSTIVE_UP_TO``) the
plan may leave some idle, e.g. a colocated placement on 1008 H100s uses at most 896 (7 * 128); a multiplier of
``Tuning.split_multipliers`` (``--set 'split_multipliers=[1,3,5,7,63]'``) adds sizes. Using every
device instead would not be monotone: Llama-3 405B's synchronous baseline is predicted faster on
1008 H100s (d18t8p7) than on all of 1024 (d16t8p8), whose dims cannot hold 18 replicas.
Tensor-parallel groups across hosts follow the same rule: a split searches them for a side that
fits on it no other way, and every side of a split on which nothing fits otherwise, whatever the
cluster (``search.search_placements``; the baseline, count by count).

A run without a plan places its nodes by a fixed *run strategy* instead (no search, no
estimates): ``flowrl.placement.default``.

Example:
    >>> candidate_counts(40, (1, 3))
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 24, 32]
"""

from __future__ import annotations

from typing import Literal

import msgspec

from flowrl.errors import PlanError

__all__ = ["STRATEGIES", "DeviceSplit", "candidate_counts", "device_splits"]

STRATEGIES: tuple[str, ...] = ("colocated", "disaggregated", "search")

#: Every count up to this one is a candidate (small clusters, e.g. CPU cores, are searched exhaustively).
EXHAUSTIVE_UP_TO = 16


class DeviceSplit(msgspec.Struct, frozen=True, kw_only=True):
    """Devices of each side: ``range(gen_start, gen_start + gen_count)`` and the trainer's likewise."""

    family: Literal["colocated", "disaggregated"]
    gen_start: int
    gen_count: int
    train_start: int
    train_count: int

    @property
    def gen_devices(self) -> range:
        return range(self.gen_start, self.gen_start + self.gen_count)

    @property
    def train_devices(self) -> range:
        return range(self.train_start, self.train_start + self.train_count)

    def short(self) -> str:
        if self.family == "colocated":
            return f"colocated on {self.gen_count}"
        return f"split {self.gen_count} gen + {self.train_count} train"


def candidate_counts(n_devices: int, multipliers: tuple[int, ...] = (1, 3, 5, 7)) -> list[int]:
    """Device counts the search tries: all of 1..16, and ``m * 2**k`` for each multiplier ``m``, up to ``n_devices``."""
    counts = set(range(1, min(n_devices, EXHAUSTIVE_UP_TO) + 1))
    for m in multipliers:
        c = m
        while c <= n_devices:
            counts.add(c)
            c *= 2
    return sorted(counts)


def device_splits(
    strategy: str,
    n_devices: int,
    multipliers: tuple[int, ...] = (1, 3, 5, 7),
    *,
    devices_per_host: int = 1,
    has_generator: bool = True,
    has_trainer: bool = True,
) -> list[DeviceSplit]:
    """The device splits a strategy enumerates on ``n_devices`` devices (see the module docstring).

    Every split uses counts from ``candidate_counts`` only (sub-clusters; see the module docstring).
    A disaggregated split puts the trainer right after the generator (``train_start = g``) and,
    when ``g`` does not end on a host boundary and there is room, also at the next boundary, so
    the trainer's tensor-parallel groups need not straddle hosts. A graph with only one side (no
    generator, or no trainer) has only colocated splits.

    Raises:
        PlanError: for an unknown strategy, listing the known ones.
    """
    if strategy not in STRATEGIES:
        raise PlanError(f"unknown strategy {strategy!r}; strategies: {', '.join(STRATEGIES)}, or a placement like 'gen:d4@0-3 | policy:d4@4-7'")
    counts = candidate_counts(n_devices, multipliers)
    splits: list[DeviceSplit] = []
    one_sided = not (has_generator and has_trainer)
    if strategy in ("colocated", "search") or one_sided:
        splits += [DeviceSplit(family="colocated", gen_start=0, gen_count=n, train_start=0, train_count=n) for n in counts]
    if one_sided or strategy == "colocated":
        return splits
    pairs: set[tuple[int, int]] = {(g, t) for g in counts for t in counts if g + t <= n_devices}
    h = devices_per_host
    for g, t in sorted(pairs):
        splits.append(DeviceSplit(family="disaggregated", gen_start=0, gen_count=g, train_start=g, train_count=t))
        aligned = -(-g // h) * h
        if aligned != g and aligned + t <= n_devices:
            splits.append(DeviceSplit(family="disaggregated", gen_start=0, gen_count=g, train_start=aligned, train_count=t))
    if strategy == "disaggregated" and not splits:
        raise PlanError(f"the disaggregated strategy needs at least 2 devices (one per side); the cluster has {n_devices}")
    return splits
