"""Which mesh axes each device kind's program executes on each backend: one table, ``MESH_SUPPORT``, pure data.

A placement may give any device node a mesh with the axes ``pp``, ``dp``, ``tp``
(``flowrl.placement.layout.AXES``). Whether the node's program *executes* an axis of size > 1 depends on
its kind (a generator also on its engine), on the backend and, for the one-process backends, on the
device type. This module is the one place that says so; preflight refuses every other mesh before
any work (``refusal``; ``flowrl.runtime.preflight.check_meshes``), the runtime's default placements
keep to it (``one_device``) and the planner enumerates only the axes it allows (``runnable_axes``;
``flowrl.planners.runnable``).

The table's key is ``(variant, backend, axis)``:

- ``variant``: a device kind (``generator``, ``policy``, ``reference``, ``critic``, ``reward_model``),
  or ``kind/engine`` where an engine differs (``generator/vllm``, under torchrun); any other device
  kind (a user's) reads the ``*`` rows (a program with no rank program of its own). A policy's
  sharding does not change which axes run (replicas and FSDP2 shards both run ``dp`` only), so the
  policy has one variant; its ``how`` names both;
- ``backend``: ``local``, ``process`` or ``torchrun``; a backend a user registers reads the
  one-process rows (``local``'s), or ``torchrun``'s when it declares itself a job of ranks
  (``flowrl.backend_traits.BackendTraits.ranks``).

Each entry (``AxisRun``) says whether the program runs the axis at size > 1 (on which device types),
and in words how, or what would run instead (for the refusal). Flipping a row (a trainer with tensor
parallelism, say) is one line: ``runs=True`` and its ``how``; preflight, the default placements, the
planner and ``tests/test_mesh_support.py`` (which walks every entry: a real run that reports the layout
it ran, or the refusal) follow. The program that runs it reports the layout it built at its first
step (``flowrl.runtime.observe.layout``), which that test compares with the planned mesh.

What is true today (checked in the code, ``flowrl.runtime.backends``):

- ``torchrun``: a generator on several ranks is ``ParallelGenerator``: ``dp`` replicas, each a ``tp``
  group (the built-in engine's shards, or one vLLM engine with ``tensor_parallel_size`` = tp); it reads
  no ``pp``. A policy is ``DataParallelPolicy`` or ``ShardedPolicy`` (FSDP2) over all its ranks: it
  reads only ``dp``. References, critics, reward models have no rank program: the lead rank runs
  the one-process program, the others idle.
- ``local`` / ``process``: one program per node in one process; its devices are the cores its
  intra-op threads run on (CPU), or on CUDA its first GPU (``executor_placement.node_devices``): a
  ``dp`` mesh on the CPU is that one process over those cores; on GPUs, the other GPUs would idle;
  ``tp`` and ``pp`` are never split.

Example:
    >>> mesh_support("policy", "tp", "torchrun").runs, mesh_support("generator", "tp", "torchrun", engine="vllm").runs
    (False, True)
    >>> sorted(runnable_axes("policy", "torchrun")), sorted(runnable_axes("reference", "mine", device="cpu"))
    (['dp'], ['dp'])
    >>> print(refusal("policy", "policy", {"tp": 2}, "torchrun", devices=(1, 2)))
    policy 'policy' has tp=2 on its mesh {"tp": 2}, but a policy's program on torchrun runs only dp over several ranks: it would run 2 data-parallel replicas (or FSDP2 shards with sharding='fsdp') over ranks [1, 2], without a word; give it the mesh {"dp": 2} (or its ranks without a mesh)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import msgspec

from flowrl.backend_traits import backend_traits

__all__ = [
    "AxisRun",
    "MESH_SUPPORT",
    "MESH_AXES",
    "MESH_BACKENDS",
    "variant_of",
    "table_backend",
    "mesh_support",
    "runnable_axes",
    "refusal",
    "one_device",
]

#: The axes a placement may name (``flowrl.placement.layout.AXES``, pipeline outermost).
MESH_AXES: tuple[str, ...] = ("pp", "dp", "tp")
#: The backends the table has rows for; any other reads ``table_backend``'s answer.
MESH_BACKENDS: tuple[str, ...] = ("local", "process", "torchrun")


class AxisRun(msgspec.Struct, frozen=True, kw_only=True):
    """Whether one variant's program executes one mesh axis at size > 1 on one backend.

    Attributes:
        runs: it executes the axis (on ``devices``).
        how: when it runs, what runs (for the layout a run reports); when not, what would run
            instead, with ``{n}`` the node's device count, ``{size}`` the axis's size, ``{devices}``
            the node's devices, ``{first}`` its first device and ``{idle}`` the others'.
        devices: the torch device types it runs on (``"cpu"``, ``"cuda"``); ``()``: every one.
        elsewhere: what would run instead on another device type (same fields as ``how``).
    """

    runs: bool
    how: str
    devices: tuple[str, ...] = ()
    elsewhere: str = ""


_LEAD_ONLY = "one copy on its lead rank {first} while ranks {idle} idle (this kind has no program over several ranks)"
_ONE_PROCESS_CPU = "one process whose intra-op threads run on the mesh's {n} cores (no replicas)"
_FIRST_GPU = "one copy on its first GPU (device {first}) while devices {idle} idle"
_NO_SPLIT = "one process over the {n} devices, nothing split along {axis}"

#: ``(variant, backend, axis) -> AxisRun``: one line per entry (module docstring).
MESH_SUPPORT: dict[tuple[str, str, str], AxisRun] = {
    # -- torchrun: rank programs (flowrl.runtime.backends.rank_programs.RANK_PROGRAMS) --------------
    ("generator", "torchrun", "dp"): AxisRun(runs=True, how="{size} replicas splitting each batch of prompts (ParallelGenerator)"),
    ("generator", "torchrun", "tp"): AxisRun(runs=True, how="tensor-parallel groups of {size} ranks, each holding its shards (ParallelGenerator, runtime.parallel.tensor_parallel)"),
    ("generator", "torchrun", "pp"): AxisRun(runs=False, how="{n} data-parallel replicas over ranks {devices} (a generator's program reads no pp axis)"),
    ("generator/vllm", "torchrun", "dp"): AxisRun(runs=True, how="{size} vLLM engines splitting each batch of prompts (ParallelGenerator)"),
    ("generator/vllm", "torchrun", "tp"): AxisRun(runs=True, how="one vLLM engine per replica with tensor_parallel_size={size} (runtime.backends.vllm_replicas)"),
    ("generator/vllm", "torchrun", "pp"): AxisRun(runs=False, how="{n} vLLM engines, one per rank of {devices} (a generator's program reads no pp axis)"),
    ("policy", "torchrun", "dp"): AxisRun(runs=True, how="{size} data-parallel replicas (DataParallelPolicy), or FSDP2 shards with sharding='fsdp' (ShardedPolicy)"),
    ("policy", "torchrun", "tp"): AxisRun(runs=False, how="{n} data-parallel replicas (or FSDP2 shards with sharding='fsdp') over ranks {devices}"),
    ("policy", "torchrun", "pp"): AxisRun(runs=False, how="{n} data-parallel replicas (or FSDP2 shards with sharding='fsdp') over ranks {devices}"),
    ("reference", "torchrun", "dp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("reference", "torchrun", "tp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("reference", "torchrun", "pp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("critic", "torchrun", "dp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("critic", "torchrun", "tp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("critic", "torchrun", "pp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("reward_model", "torchrun", "dp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("reward_model", "torchrun", "tp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("reward_model", "torchrun", "pp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("*", "torchrun", "dp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("*", "torchrun", "tp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("*", "torchrun", "pp"): AxisRun(runs=False, how=_LEAD_ONLY),
    # -- local and process: one program per node in one process (runtime.executor_placement) -------
    **{
        (variant, backend, axis): entry
        for variant in ("generator", "policy", "reference", "critic", "reward_model", "*")
        for backend in ("local", "process")
        for axis, entry in (
            ("dp", AxisRun(runs=True, how=_ONE_PROCESS_CPU, devices=("cpu",), elsewhere=_FIRST_GPU)),
            ("tp", AxisRun(runs=False, how=_NO_SPLIT)),
            ("pp", AxisRun(runs=False, how=_NO_SPLIT)),
        )
    },
}


def variant_of(kind: str, engine: str | None = None, backend: str = "torchrun") -> str:
    """The table's variant for a node of ``kind`` (a generator's ``engine``) on ``backend``: ``kind/engine``
    when the table has rows for it there, else ``kind`` when it has those, else ``*``."""
    row = table_backend(backend)
    if engine and (f"{kind}/{engine}", row, "dp") in MESH_SUPPORT:
        return f"{kind}/{engine}"
    return kind if (kind, row, "dp") in MESH_SUPPORT else "*"


def table_backend(backend: str) -> str:
    """The backend whose rows ``backend`` reads: its own (a built-in), else torchrun's for a job of
    ranks (``BackendTraits.ranks``), else the one-process rows (``local``)."""
    if backend in MESH_BACKENDS:
        return backend
    return "torchrun" if backend_traits(backend).ranks else "local"


def mesh_support(kind: str, axis: str, backend: str, *, engine: str | None = None) -> AxisRun:
    """The table's entry for a node of ``kind`` (``engine``) on ``backend`` along ``axis``."""
    return MESH_SUPPORT[(variant_of(kind, engine, backend), table_backend(backend), axis)]


def runnable_axes(kind: str, backend: str, *, engine: str | None = None, device: str | None = None, table: Mapping[tuple[str, str, str], AxisRun] | None = None) -> frozenset[str]:
    """The axes a node of ``kind`` executes at size > 1 on ``backend`` (on ``device``; None: any device
    type the entry names), read from ``table`` (default ``MESH_SUPPORT``)."""
    table = MESH_SUPPORT if table is None else table
    variant, row = variant_of(kind, engine, backend), table_backend(backend)
    out = set()
    for axis in MESH_AXES:
        entry = table[(variant, row, axis)]
        if entry.runs and (device is None or not entry.devices or device in entry.devices):
            out.add(axis)
    return frozenset(out)


def _words(text: str, devices: Sequence[int], size: int, axis: str) -> str:
    ids = list(devices)
    return text.format(n=len(ids), size=size, devices=ids, first=ids[0] if ids else "?", idle=ids[1:], axis=axis)


def refusal(
    kind: str, node: str, mesh: Mapping[str, int], backend: str, *, devices: Sequence[int], engine: str | None = None, device: str = "cpu"
) -> str | None:
    """Why node ``node`` (of ``kind``) cannot run on ``mesh`` (axis -> size) under ``backend`` on ``device``
    type: the message naming the node, the axis and its size, what would run instead and the fix; None
    when every axis of size > 1 runs."""
    sizes = {a: int(s) for a, s in mesh.items() if int(s) > 1}
    where = "ranks" if table_backend(backend) == "torchrun" else "devices"
    for axis in MESH_AXES:
        if axis not in sizes:
            continue
        entry = mesh_support(kind, axis, backend, engine=engine)
        if entry.runs and (not entry.devices or device in entry.devices):
            continue
        label = f"{kind} (engine {engine!r})" if "/" in variant_of(kind, engine, backend) else kind
        instead = _words(entry.how if not entry.runs else entry.elsewhere, devices, sizes[axis], axis)
        ok = runnable_axes(kind, backend, engine=engine, device=device)
        runs = f"runs only {' and '.join(a for a in MESH_AXES if a in ok)} over several {where}" if ok else f"runs on one {where[:-1]} only"
        on = f"{backend} on {device}" if entry.runs else backend
        n = len(devices)
        if "dp" in ok and n > 1:
            fix = f"give it the mesh {{\"dp\": {n}}} (or its {where} without a mesh)"
        else:
            fix = f"place it on one {where[:-1]} (e.g. [{devices[0] if devices else 0}])"
        if table_backend(backend) != "torchrun" and axis in runnable_axes(kind, "torchrun", engine=engine, device=device):
            fix += ", or run it under torchrun (--backend torchrun), whose program runs it"
        return (
            f"{kind} {node!r} has {axis}={sizes[axis]} on its mesh {json.dumps(dict(mesh))}, but a {label}'s program on {on} {runs}: "
            f"it would run {instead}, without a word; {fix}"
        )
    return None


def one_device(kind: str, backend: str, *, engine: str | None = None, device: str | None = None) -> bool:
    """Whether a node of ``kind`` runs no axis over several devices on ``backend`` (``device``): a default
    placement gives it one device (its first) rather than a mesh it would not run."""
    return not runnable_axes(kind, backend, engine=engine, device=device)
