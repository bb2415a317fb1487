"""Strategies: which device splits the search enumerates (the first stage of enumerate -> estimate -> search -> plan).

Nodes play one of two roles: the *generator side* (generator nodes) and the *trainer side*
(policies, with their loss nodes, and reference models). A ``DeviceSplit`` gives each side a
contiguous block of device ids:

- ``colocated``: both sides on the same ``n`` devices, phases in sequence (the synchronous
  DeepSpeed-Chat-like baseline LlamaRL compares against). The ``colocated`` strategy uses every
  device of the cluster.
- ``disaggregated``: generators on devices ``[0, g)``, trainers on ``[g, g + t)``, disjoint, so the
  two overlap under a staleness bound k >= 1. The ``disaggregated`` strategy tries ``g, t`` from
  ``candidate_counts`` and every split that uses all devices (``g + t == N``).
- ``search``: both families over ``candidate_counts`` only. Those counts do not depend on the
  cluster size, so every candidate on N devices is also a candidate on N' > N devices, which is why
  more devices never make the best predicted step slower. The price: on N devices that are not of
  the form ``m * 2**k`` the search may leave some idle (``disaggregated`` and ``colocated`` use them all).

Without a plan, a run places its nodes by one of two fixed strategies (``RUN_STRATEGIES``, chosen by
``run_strategy`` from the staleness bound k, laid out by ``run_devices``; no estimates):

- ``all-colocated`` (k = 0, or one device): every heavy node on every device, the synchronous baseline;
- ``halves`` (k >= 1): generators on the first half of the devices, trainers (policies, references)
  on the second half, so the two overlap.

Example:
    >>> run_devices({"gen": "generator", "policy": "policy"}, "halves", 4)
    {'gen': (0, 1), 'policy': (2, 3)}
    >>> candidate_counts(40, (1, 3))
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 24, 32]
"""

from __future__ import annotations

from typing import Literal

import msgspec

from flowrl.errors import PlanError

__all__ = ["STRATEGIES", "RUN_STRATEGIES", "DeviceSplit", "candidate_counts", "device_splits", "run_strategy", "run_devices"]

STRATEGIES: tuple[str, ...] = ("colocated", "disaggregated", "search")

#: The fixed strategies of a run without a plan (module docstring).
RUN_STRATEGIES: tuple[str, ...] = ("all-colocated", "halves")

#: Node kinds on the trainer side of a ``halves`` split.
TRAINER_SIDE_KINDS = frozenset({"policy", "reference", "reward_model"})

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
    if strategy == "colocated" or (one_sided and strategy != "search"):
        return [DeviceSplit(family="colocated", gen_start=0, gen_count=n_devices, train_start=0, train_count=n_devices)]
    if strategy == "search":
        splits += [DeviceSplit(family="colocated", gen_start=0, gen_count=n, train_start=0, train_count=n) for n in counts]
    if one_sided:
        return splits
    pairs: set[tuple[int, int]] = {(g, t) for g in counts for t in counts if g + t <= n_devices}
    if strategy == "disaggregated":
        pairs |= {(g, n_devices - g) for g in counts if g < n_devices}
        pairs |= {(n_devices - t, t) for t in counts if t < n_devices}
    h = devices_per_host
    for g, t in sorted(pairs):
        splits.append(DeviceSplit(family="disaggregated", gen_start=0, gen_count=g, train_start=g, train_count=t))
        aligned = -(-g // h) * h
        if aligned != g and aligned + t <= n_devices:
            splits.append(DeviceSplit(family="disaggregated", gen_start=0, gen_count=g, train_start=aligned, train_count=t))
    if strategy == "disaggregated" and not splits:
        raise PlanError(f"the disaggregated strategy needs at least 2 devices (one per side); the cluster has {n_devices}")
    return splits


def run_strategy(max_staleness: int, n_devices: int) -> str:
    """The strategy of a run without a plan: ``all-colocated`` for k = 0 or one device, else ``halves``."""
    return "all-colocated" if max_staleness == 0 or n_devices < 2 else "halves"


def run_devices(kinds: dict[str, str], strategy: str, n_devices: int) -> dict[str, tuple[int, ...]]:
    """Devices of each heavy node (name -> kind, in graph order) under a run strategy (``RUN_STRATEGIES``).

    Raises:
        PlanError: for a strategy not in ``RUN_STRATEGIES``.
    """
    if strategy == "all-colocated":
        return {n: tuple(range(n_devices)) for n in kinds}
    if strategy != "halves":
        raise PlanError(f"unknown run strategy {strategy!r}; run strategies: {', '.join(RUN_STRATEGIES)}")
    half = n_devices // 2
    return {n: tuple(range(half, n_devices)) if k in TRAINER_SIDE_KINDS else tuple(range(half)) for n, k in kinds.items()}
