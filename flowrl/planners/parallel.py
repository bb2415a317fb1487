"""Parallel dims of one node (dp, tp, pp, and ep within dp) and how they lay out over a list of device ids.

A node on ``n`` devices splits them into a mesh with named axes, outermost first::

    AXES = ("pp", "dp", "tp")        mesh_shape = (pp, dp, tp),  dp * tp * pp == n

``tp`` is innermost, so a tensor-parallel group is ``tp`` consecutive devices (one host when
``tp <= devices_per_host``), data-parallel peers are ``tp`` apart and pipeline stages ``dp * tp``
apart (Megatron's order). ``fsdp`` and ``cp`` would be further axes; none is modelled yet.
``ep`` (expert parallelism, a mixture of experts' policy) is no further axis: it splits ``dp`` into
groups of ``ep`` ranks that share one copy of the routed experts, ``1/ep`` of them each
(``flowrl.placement.layout.NodeMesh.ep``, which the plan's placement carries); it takes no devices of
its own, so the product stays ``dp * tp * pp``.

Rules (``ParallelDims.check``): the product equals the device count; tp divides the attention
heads; pp is at most the layers; ep divides dp (and, for a model, its experts). Stages may be uneven: with ``L`` layers over ``pp`` stages the
first ``L % pp`` stages hold ``ceil(L / pp)`` layers, the rest ``floor(L / pp)``; the largest
stage sets a pipeline's pace and memory (``stage_layers``). Each error states the whole equation
with its values.

Example:
    >>> ParallelDims(dp=2, tp=4, pp=2).short()
    'd2t4p2'
    >>> ParallelDims.parse("d2t4p2") == ParallelDims(dp=2, tp=4, pp=2)
    True
    >>> ParallelDims.parse("d8e4"), ParallelDims(dp=8, ep=4).short()
    (ParallelDims(dp=8, tp=1, pp=1, ep=4), 'd8e4')
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from flowrl.errors import PlanError
from flowrl.placement.layout import AXES

if TYPE_CHECKING:
    from flowrl.modelspec import ModelSpec

__all__ = ["AXES", "DIM_AXES", "ParallelDims", "stage_layers", "stage_fraction", "divisors", "expert_splits", "enumerate_dims", "axis_groups", "spans_hosts", "hosts_per_group"]


#: Every degree a ``ParallelDims`` holds: the mesh's ``AXES``, then ``ep`` (a split of dp, no axis of its own).
DIM_AXES: tuple[str, ...] = (*AXES, "ep")

_DIMS_RE = re.compile(r"^(?:d(\d+))?(?:e(\d+))?(?:t(\d+))?(?:p(\d+))?$")


class ParallelDims(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Data-, tensor- and pipeline-parallel degrees of one node, and the expert-parallel split of dp.

    Attributes:
        dp: data-parallel replicas (each sees a slice of the batch).
        tp: tensor-parallel degree (each layer's matrices split over tp devices).
        pp: pipeline stages (layers split into pp consecutive groups).
        ep: expert parallelism: groups of ``ep`` of the dp ranks each hold ``1/ep`` of a mixture of
            experts' routed experts and send each token to its experts' rank and back (all-to-all);
            divides ``dp``; 1: every rank holds every expert (module docstring).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for axis in ("dp", "tp", "pp", "ep"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"ParallelDims: {axis}={value!r} must be an integer >= 1")
        if self.dp % self.ep:
            raise PlanError(
                f"ParallelDims: ep({self.ep}) must divide dp({self.dp}): expert parallelism splits the data-parallel ranks "
                f"into groups of ep; pick ep among {divisors(self.dp)}"
            )

    @property
    def size(self) -> int:
        """Devices the dims occupy: dp * tp * pp."""
        return self.dp * self.tp * self.pp

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        """Sizes along ``AXES`` (pp, dp, tp)."""
        return (self.pp, self.dp, self.tp)

    def check(self, devices: int, model: ModelSpec | None = None, *, node: str = "node") -> None:
        """Raise ``PlanError`` unless the dims fit ``devices`` devices and ``model``'s heads and layers.

        Example:
            >>> ParallelDims(dp=2, tp=4, pp=2).check(8)
            Traceback (most recent call last):
            ...
            flowrl.errors.PlanError: node 'node': dp(2) * tp(4) * pp(2) = 16 != devices(8); pick dims whose product is 8
        """
        if self.size != devices:
            raise PlanError(
                f"node {node!r}: dp({self.dp}) * tp({self.tp}) * pp({self.pp}) = {self.size} != devices({devices}); "
                f"pick dims whose product is {devices}"
            )
        if model is not None:
            if model.n_heads % self.tp:
                raise PlanError(
                    f"node {node!r}: tp({self.tp}) must divide the attention heads of {model.name} "
                    f"(n_heads={model.n_heads}, {model.n_heads} % {self.tp} = {model.n_heads % self.tp})"
                )
            if self.pp > model.n_layers:
                raise PlanError(
                    f"node {node!r}: pp({self.pp}) is more pipeline stages than {model.name} has layers "
                    f"(n_layers={model.n_layers}); pick pp <= {model.n_layers}"
                )
            if self.ep > 1 and (not model.n_experts or model.n_experts % self.ep):
                what = f"{model.name} is dense (no experts)" if not model.n_experts else f"{model.name} has {model.n_experts} experts"
                raise PlanError(
                    f"node {node!r}: ep({self.ep}) must divide the routed experts, and {what}; "
                    f"pick ep among {expert_splits(model, self.dp)}"
                )

    def short(self) -> str:
        """Compact form: ``"d2t4p2"``, ``"d8e4"`` (``e``: ep, after dp, as ``NodeMesh.short`` writes it); axes
        of size 1 are left out except a lone ``"d1"``."""
        text = "".join(f"{c}{v}" for c, v in (("d", self.dp), ("e", self.ep), ("t", self.tp), ("p", self.pp)) if v > 1)
        return text or "d1"

    @classmethod
    def parse(cls, text: str) -> ParallelDims:
        """Inverse of ``short`` (``"d4t2"``, ``"t8p2"``, ``"d8e4"``, ``"d1"``); missing axes are 1."""
        m = _DIMS_RE.match(text.strip())
        if not m or not text.strip():
            raise PlanError(
                f"cannot parse parallel dims {text!r}; write e.g. 'd4t2p2' (dp=4, tp=2, pp=2) or 'd8e4' (dp=8, experts split over "
                "groups of ep=4 of them), axes of size 1 may be left out"
            )
        if any(g and len(g) > 12 for g in m.groups()):  # int() refuses thousands of digits with a ValueError
            raise PlanError(f"parallel dims {text[:40]!r}{'...' if len(text) > 40 else ''}: an axis of over 12 digits; no cluster has that many devices")
        dp, ep, tp, pp = (int(g) if g else 1 for g in m.groups())
        return cls(dp=dp, tp=tp, pp=pp, ep=ep)


def stage_layers(n_layers: int, pp: int) -> int:
    """Layers of the largest pipeline stage: ``ceil(n_layers / pp)``.

    Example:
        >>> stage_layers(126, 32), stage_layers(80, 16)
        (4, 5)
    """
    return -(-n_layers // pp)


def stage_fraction(n_layers: int, pp: int) -> float:
    """Share of the layers on the largest stage (``1 / pp`` when pp divides the layers)."""
    return stage_layers(n_layers, pp) / n_layers


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


def expert_splits(model: ModelSpec, dp: int) -> list[int]:
    """The ep a mixture of experts' policy on ``dp`` data-parallel ranks may split its experts over: the
    divisors of ``dp`` that divide ``n_experts`` (``[1]`` for a dense model, or a LoRA one: its adapters
    train, not its experts, and the runtime splits no LoRA policy over ep).

    Example:
        >>> from flowrl.modelspec import model_preset
        >>> expert_splits(model_preset("qwen3-30b-a3b"), 8), expert_splits(model_preset("qwen3-30b-a3b"), 6), expert_splits(model_preset("llama3-8b"), 8)
        ([1, 2, 4, 8], [1, 2], [1])
    """
    if not model.n_experts or model.adapter_params:
        return [1]
    return [d for d in divisors(dp) if model.n_experts % d == 0]


def enumerate_dims(
    devices: int, model: ModelSpec, *, max_tp: int | None = None, max_pp: int | None = None, axes: frozenset[str] | None = None
) -> Iterator[ParallelDims]:
    """Every ``ParallelDims`` valid for ``devices`` devices and ``model`` (tp | heads, pp <= layers, ep among
    ``expert_splits``), with size > 1 only along ``axes`` (None: every axis, ``ep`` included; the planner
    passes the axes a node's program runs, ``flowrl.planners.runnable``).

    Example:
        >>> from flowrl.modelspec import model_preset
        >>> [d.short() for d in enumerate_dims(4, model_preset("llama3-8b"), axes=frozenset({"dp", "tp"}))]
        ['d4', 'd2t2', 't4']
        >>> [d.short() for d in enumerate_dims(4, model_preset("qwen3-30b-a3b"), axes=frozenset({"dp", "ep"}))]
        ['d4', 'd4e2', 'd4e4']
    """
    for tp in divisors(devices):
        if model.n_heads % tp or (max_tp and tp > max_tp) or (axes is not None and tp > 1 and "tp" not in axes):
            continue
        for pp in divisors(devices // tp):
            if pp > model.n_layers or (max_pp and pp > max_pp) or (axes is not None and pp > 1 and "pp" not in axes):
                continue
            dp = devices // (tp * pp)
            if axes is not None and dp > 1 and "dp" not in axes:
                continue
            for ep in expert_splits(model, dp) if axes is None or "ep" in axes else [1]:
                yield ParallelDims(dp=dp, tp=tp, pp=pp, ep=ep)


def axis_groups(devices: Sequence[int], dims: ParallelDims, axis: str) -> list[tuple[int, ...]]:
    """The device groups that communicate along ``axis`` (``"tp"``, ``"dp"`` or ``"pp"``).

    Example:
        >>> axis_groups(range(8), ParallelDims(dp=2, tp=2, pp=2), "dp")
        [(0, 2), (1, 3), (4, 6), (5, 7)]
    """
    pp, dp, tp = dims.mesh_shape
    if len(devices) != dims.size:
        raise PlanError(f"dp({dp}) * tp({tp}) * pp({pp}) = {dims.size} != devices({len(devices)})")
    ids = list(devices)
    at = lambda p, d, t: ids[(p * dp + d) * tp + t]  # noqa: E731
    if axis == "tp":
        return [tuple(at(p, d, t) for t in range(tp)) for p in range(pp) for d in range(dp)]
    if axis == "dp":
        return [tuple(at(p, d, t) for d in range(dp)) for p in range(pp) for t in range(tp)]
    if axis == "pp":
        return [tuple(at(p, d, t) for p in range(pp)) for d in range(dp) for t in range(tp)]
    raise PlanError(f"unknown mesh axis {axis!r}; axes: {', '.join(AXES)}")


def spans_hosts(devices: Sequence[int], dims: ParallelDims, axis: str, devices_per_host: int) -> bool:
    """Whether any group along ``axis`` has devices on more than one host (then it uses the NIC).

    A contiguous block (a ``range``, as the search builds) is checked in O(devices_per_host**2)
    without listing its groups: each group is an arithmetic progression, so it straddles hosts iff
    its first and last devices do, and the group starts repeat modulo the host size.
    """
    if axis not in AXES:
        raise PlanError(f"unknown mesh axis {axis!r}; axes: {', '.join(AXES)}")
    if len(devices) != dims.size:
        raise PlanError(f"dp({dims.dp}) * tp({dims.tp}) * pp({dims.pp}) = {dims.size} != devices({len(devices)})")
    if isinstance(devices, range) and devices.step == 1:
        return _block_spans(devices.start % devices_per_host, dims.dp, dims.tp, dims.pp, axis, devices_per_host)
    hosts = (np.asarray(devices, dtype=np.int64) // devices_per_host).reshape(dims.mesh_shape)
    along = AXES.index(axis)
    return bool((hosts.max(axis=along) != hosts.min(axis=along)).any())


def hosts_per_group(devices: Sequence[int], dims: ParallelDims, axis: str, devices_per_host: int) -> int:
    """The most hosts any one group along ``axis`` touches (1: every group stays on one host).

    Example:
        >>> hosts_per_group(range(64), ParallelDims(dp=4, tp=16), "tp", 8)
        2
        >>> hosts_per_group(range(64), ParallelDims(dp=8, tp=8), "tp", 8)
        1
    """
    if axis not in AXES:
        raise PlanError(f"unknown mesh axis {axis!r}; axes: {', '.join(AXES)}")
    if len(devices) != dims.size:
        raise PlanError(f"dp({dims.dp}) * tp({dims.tp}) * pp({dims.pp}) = {dims.size} != devices({len(devices)})")
    hosts = (np.asarray(devices, dtype=np.int64) // devices_per_host).reshape(dims.mesh_shape)
    groups = np.sort(np.moveaxis(hosts, AXES.index(axis), -1), axis=-1)
    return int((np.diff(groups, axis=-1) != 0).sum(axis=-1).max()) + 1


@functools.lru_cache(maxsize=65536)
def _block_spans(offset: int, dp: int, tp: int, pp: int, axis: str, h: int) -> bool:
    """``spans_hosts`` for the block ``range(offset, offset + dp*tp*pp)`` (offset within a host)."""
    if axis == "tp":
        stride, count, firsts = 1, tp, (offset + k * tp for k in range(min(dp * pp, h)))
    elif axis == "dp":
        stride, count = tp, dp
        firsts = (offset + p * dp * tp + t for p in range(min(pp, h)) for t in range(min(tp, h)))
    else:
        stride, count, firsts = dp * tp, pp, (offset + x for x in range(min(dp * tp, h)))
    span = stride * (count - 1)
    return any(a // h != (a + span) // h for a in firsts)
