"""Which mesh axes each device kind's program executes on each backend: one table, ``MESH_SUPPORT``, pure data.

A placement may give any device node a mesh with the axes ``pp``, ``dp``, ``tp``
(``flowrl.placement.layout.AXES``) and ``ep``, the expert-parallel split of ``dp`` (``NodeMesh.ep``). Whether the node's program *executes* an axis of size > 1 depends on
its kind (a generator also on its engine), on the backend and, for the one-process backends, on the
device type. This module is the one place that says so; preflight refuses every other mesh before
any work (``refusal``; ``flowrl.runtime.preflight.check_meshes``), the runtime's default placements
keep to it (``one_device``) and the planner enumerates only the axes it allows (``runnable_axes``;
``flowrl.planners.runnable``).

The table's key is ``(variant, backend, axis)``:

- ``variant``: a device kind (``generator``, ``policy``, ``reference``, ``critic``, ``reward_model``, ``teacher``),
  or ``kind/engine`` where an engine differs (``generator/vllm``, under torchrun); any other device
  kind (a user's) reads the ``*`` rows (a program with no rank program of its own). A policy's
  sharding does not change which axes run (replicas and FSDP2 shards both run ``dp`` only), so the
  policy has one variant (what depends on its settings is a ``Combination``);
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
  no ``pp``. A policy runs ``dp`` (``DataParallelPolicy`` replicas or ``ShardedPolicy``, FSDP2), ``tp``
  (``TensorParallelPolicy``: DTensor shards, with FSDP2 over ``dp`` on a 2-D mesh) and ``pp``
  (``PipelinePolicy``: stages x ``dp`` replicas) and ``ep`` (a mixture of experts' experts split over groups
  of ``ep`` dp ranks, with FSDP2: ``runtime.parallel.expert_parallel``; preflight also refuses it on a
  dense model or with an ``ep`` not dividing the experts, ``runtime.preflight.check_meshes``). A frozen reference runs ``tp``
  (``TensorParallelReference``), a critic ``tp`` (``TensorParallelCritic``). Reward models and teachers have no rank
  program, nor do critics and references over ``dp`` or ``pp``: the lead rank would run the
  one-process program while the others idle, so those meshes are refused.
- Some axes run only in some combinations or with some node settings (``COMBINATIONS``, keyed by the
  same variant and backend, read with the node's ``node_facts``): a policy's ``pp`` beside ``tp``, its
  ``tp`` beside ``dp`` without FSDP2, ``ep`` without FSDP2, with ``tp``, ``pp`` or LoRA, ``pp`` with FSDP2, LoRA or ``packing=True``, ``tp`` with LoRA
  dropout, a syncing reference's ``tp``, a LoRA critic's ``tp``. ``refusal`` refuses them by name and the planner skips them
  (``allowed``).
- ``local`` / ``process``: one program per node in one process; its devices are the cores its
  intra-op threads run on (CPU), or on CUDA its first GPU (``executor_placement.node_devices``): a
  ``dp`` mesh on the CPU is that one process over those cores; on GPUs, the other GPUs would idle;
  ``tp`` and ``pp`` are never split.

Example:
    >>> mesh_support("critic", "tp", "torchrun").runs, mesh_support("reward_model", "tp", "torchrun").runs
    (True, False)
    >>> sorted(runnable_axes("policy", "torchrun")), sorted(runnable_axes("reference", "mine", device="cpu"))
    (['dp', 'ep', 'pp', 'tp'], ['dp'])
    >>> print(refusal("critic", "critic", {"dp": 2}, "torchrun", devices=(1, 2)))
    critic 'critic' has dp=2 on its mesh {"dp": 2}, but a critic's program on torchrun runs only tp over several ranks: it would run one copy on its lead rank 1 while ranks [2] idle (a critic's program over several ranks splits tp only), without a word; place it on one rank (e.g. [1])
    >>> print(refusal("policy", "policy", {"dp": 2, "tp": 2}, "torchrun", devices=(1, 2, 3, 4)))
    policy 'policy' has dp=2 and tp=2 on its mesh {"dp": 2, "tp": 2}, but dp beside tp runs only as FSDP2 over dp on the 2-D mesh: set sharding='fsdp' on the policy, or give it a mesh of tp only
    >>> allowed("policy", "torchrun", {"dp": 2, "tp": 2}, facts=frozenset({"fsdp"}))
    True
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import msgspec

from flowrl.backend_traits import backend_traits

__all__ = [
    "AxisRun",
    "Combination",
    "COMBINATIONS",
    "node_facts",
    "allowed",
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

#: The axes a placement may name: ``flowrl.placement.layout.AXES`` (pipeline outermost), then ``ep``, the
#: expert-parallel split of ``dp`` (``NodeMesh.ep``: groups of ep dp ranks sharing one copy of the experts).
MESH_AXES: tuple[str, ...] = ("pp", "dp", "tp", "ep")
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
_EVERY_EXPERT = "every expert on each of ranks {devices} (only a policy's program splits experts over ep)"

#: ``(variant, backend, axis) -> AxisRun``: one line per entry (module docstring).
MESH_SUPPORT: dict[tuple[str, str, str], AxisRun] = {
    # -- torchrun: rank programs (flowrl.runtime.backends.torchrun.rank_programs.RANK_PROGRAMS) --------------
    ("generator", "torchrun", "dp"): AxisRun(runs=True, how="{size} replicas splitting each batch of prompts (ParallelGenerator)"),
    ("generator", "torchrun", "tp"): AxisRun(runs=True, how="tensor-parallel groups of {size} ranks, each holding its shards (ParallelGenerator, runtime.parallel.tensor_parallel)"),
    ("generator", "torchrun", "pp"): AxisRun(runs=False, how="{n} data-parallel replicas over ranks {devices} (a generator's program reads no pp axis)"),
    ("generator/vllm", "torchrun", "dp"): AxisRun(runs=True, how="{size} vLLM engines splitting each batch of prompts (ParallelGenerator)"),
    ("generator/vllm", "torchrun", "tp"): AxisRun(runs=True, how="one vLLM engine per replica with tensor_parallel_size={size} (runtime.parallel.vllm_replicas)"),
    ("generator/vllm", "torchrun", "pp"): AxisRun(runs=False, how="{n} vLLM engines, one per rank of {devices} (a generator's program reads no pp axis)"),
    ("policy", "torchrun", "dp"): AxisRun(runs=True, how="{size} data-parallel replicas (DataParallelPolicy), or FSDP2 shards with sharding='fsdp' (ShardedPolicy)"),
    ("policy", "torchrun", "tp"): AxisRun(runs=True, how="tensor-parallel groups of {size} ranks holding DTensor shards of its linears (TensorParallelPolicy, runtime.parallel.tp_train)"),
    ("policy", "torchrun", "pp"): AxisRun(runs=True, how="{size} pipeline stages of contiguous layers, 1F1B (PipelinePolicy, runtime.parallel.pipeline)"),
    ("policy", "torchrun", "ep"): AxisRun(runs=True, how="each mixture-of-experts layer's experts split over groups of {size} dp ranks, tokens exchanged by all-to-all, FSDP2 over the rest (ShardedPolicy, runtime.parallel.expert_parallel)"),
    ("reference", "torchrun", "dp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("reference", "torchrun", "tp"): AxisRun(runs=True, how="one frozen reference split over {size} tensor-parallel ranks (TensorParallelReference)"),
    ("reference", "torchrun", "pp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("critic", "torchrun", "dp"): AxisRun(runs=False, how="one copy on its lead rank {first} while ranks {idle} idle (a critic's program over several ranks splits tp only)"),
    ("critic", "torchrun", "tp"): AxisRun(runs=True, how="one critic split over {size} tensor-parallel ranks, its value head whole (TensorParallelCritic)"),
    ("critic", "torchrun", "pp"): AxisRun(runs=False, how="one copy on its lead rank {first} while ranks {idle} idle (a critic's program over several ranks splits tp only)"),
    ("reward_model", "torchrun", "dp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("reward_model", "torchrun", "tp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("reward_model", "torchrun", "pp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("teacher", "torchrun", "dp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("teacher", "torchrun", "tp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("teacher", "torchrun", "pp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("*", "torchrun", "dp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("*", "torchrun", "tp"): AxisRun(runs=False, how=_LEAD_ONLY),
    ("*", "torchrun", "pp"): AxisRun(runs=False, how=_LEAD_ONLY),
    **{(variant, "torchrun", "ep"): AxisRun(runs=False, how=_EVERY_EXPERT) for variant in ("generator", "generator/vllm", "reference", "critic", "reward_model", "teacher", "*")},
    # -- local and process: one program per node in one process (runtime.control.executor_placement) -------
    **{
        (variant, backend, axis): entry
        for variant in ("generator", "policy", "reference", "critic", "reward_model", "teacher", "*")
        for backend in ("local", "process")
        for axis, entry in (
            ("dp", AxisRun(runs=True, how=_ONE_PROCESS_CPU, devices=("cpu",), elsewhere=_FIRST_GPU)),
            ("tp", AxisRun(runs=False, how=_NO_SPLIT)),
            ("pp", AxisRun(runs=False, how=_NO_SPLIT)),
            ("ep", AxisRun(runs=False, how=_NO_SPLIT)),
        )
    },
}


class Combination(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Axes that each run alone (``MESH_SUPPORT``) but not together, or not with some node setting.

    The rule applies to a mesh whose axes of size > 1 include every one of ``axes``, for a node whose
    facts (``node_facts``) include every one of ``when`` and none of ``unless``; it is then refused,
    saying ``why`` (which names the fix).
    """

    axes: frozenset[str]
    when: frozenset[str] = frozenset()
    unless: frozenset[str] = frozenset()
    why: str


#: (variant, backend) -> the combinations its program refuses (checked by each program again at launch:
#: ``runtime.parallel.tp_train.check_tp_policy`` / ``check_tp_reference`` / ``check_tp_critic``, ``runtime.parallel.pipeline.check_pipeline``).
COMBINATIONS: dict[tuple[str, str], tuple[Combination, ...]] = {
    ("policy", "torchrun"): (
        Combination(axes=frozenset({"pp", "tp"}), why="a policy's pipeline stages do not split their layers over tp (pp x tp is not built): give it pp or tp, not both"),
        Combination(axes=frozenset({"dp", "tp"}), unless=frozenset({"fsdp"}), why="dp beside tp runs only as FSDP2 over dp on the 2-D mesh: set sharding='fsdp' on the policy, or give it a mesh of tp only"),
        Combination(axes=frozenset({"pp"}), when=frozenset({"fsdp"}), why="pipeline stages are not sharded with FSDP2: set sharding='replicate' (the default), or give it a mesh without pp"),
        Combination(axes=frozenset({"pp"}), when=frozenset({"lora"}), why="a LoRA policy is not split into pipeline stages: give it a mesh of dp or tp"),
        Combination(axes=frozenset({"pp"}), when=frozenset({"packing"}), why="pipeline stages exchange fixed-shape activations, so packed rows are refused: leave OptimizerConfig.packing unset (padded rows), or give it a mesh without pp"),
        Combination(axes=frozenset({"tp"}), when=frozenset({"lora_dropout"}), why="LoRA dropout would draw another mask on each tp rank for the same input: set LoraConfig(dropout=0.0), or give it a mesh without tp"),
        Combination(axes=frozenset({"ep", "tp"}), why="expert-parallel groups are not split over tp (ep x tp is not built): give it ep or tp, not both"),
        Combination(axes=frozenset({"ep", "pp"}), why="pipeline stages are not split over ep (ep x pp is not built): give it ep or pp, not both"),
        Combination(axes=frozenset({"ep"}), when=frozenset({"lora"}), why="a LoRA policy is not split over ep: give it a model without lora, or a mesh without ep"),
        Combination(axes=frozenset({"ep"}), unless=frozenset({"fsdp"}), why="expert parallelism runs with FSDP2 over the other parameters: set sharding='fsdp' on the policy, or give it a mesh without ep"),
    ),
    ("reference", "torchrun"): (
        Combination(axes=frozenset({"tp"}), when=frozenset({"syncing"}), why="a reference mixed with the policy every sync_steps is not split over tp: leave sync_steps unset (a frozen reference), or place it on one rank"),
    ),
    ("critic", "torchrun"): (
        Combination(axes=frozenset({"tp"}), when=frozenset({"lora"}), why="a LoRA critic is not split over tp: give it a model without lora, or place it on one rank"),
    ),
}


def node_facts(node: object) -> frozenset[str]:
    """The settings of ``node`` that ``COMBINATIONS`` read: ``fsdp`` (``OptimizerConfig.sharding``),
    ``packing`` (``packing=True``), ``lora`` / ``lora_dropout`` (its model's adapters), ``syncing`` (a
    reference with ``sync_steps``). Read by attribute, so that this module imports no graph types.

    Example:
        >>> from flowrl.examples import build_example
        >>> node_facts(build_example("llamarl").node("policy"))
        frozenset()
    """
    facts = set()
    optimizer = getattr(node, "optimizer", None)
    if getattr(optimizer, "sharding", None) == "fsdp":
        facts.add("fsdp")
    if getattr(optimizer, "packing", None) is True:
        facts.add("packing")
    lora = getattr(getattr(node, "model", None), "lora", None)
    if lora is not None:
        facts.add("lora")
        if float(getattr(lora, "dropout", 0.0) or 0.0) > 0:
            facts.add("lora_dropout")
    if int(getattr(getattr(node, "reference", None), "sync_steps", 0) or 0) > 0:
        facts.add("syncing")
    return frozenset(facts)


def combination_refused(kind: str, backend: str, mesh: Mapping[str, int], *, facts: frozenset[str] = frozenset(), engine: str | None = None) -> Combination | None:
    """The first ``COMBINATIONS`` rule that refuses ``mesh`` (axis -> size) for a node of ``kind`` with ``facts``; None if none."""
    active = {a for a, s in mesh.items() if int(s) > 1}
    for rule in COMBINATIONS.get((variant_of(kind, engine, backend), table_backend(backend)), ()):
        if rule.axes <= active and rule.when <= facts and not (rule.unless & facts):
            return rule
    return None


def allowed(kind: str, backend: str, mesh: Mapping[str, int], *, facts: frozenset[str] = frozenset(), engine: str | None = None, device: str | None = None) -> bool:
    """Whether a node of ``kind`` with ``facts`` runs ``mesh`` (axis -> size) on ``backend`` as planned:
    every axis of size > 1 runs there (``runnable_axes``) and no combination rule refuses them."""
    ok = runnable_axes(kind, backend, engine=engine, device=device)
    if any(int(s) > 1 and a not in ok for a, s in mesh.items()):
        return False
    return combination_refused(kind, backend, mesh, facts=facts, engine=engine) is None


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
    kind: str,
    node: str,
    mesh: Mapping[str, int],
    backend: str,
    *,
    devices: Sequence[int],
    engine: str | None = None,
    device: str = "cpu",
    facts: frozenset[str] = frozenset(),
) -> str | None:
    """Why node ``node`` (of ``kind``, with ``facts``: ``node_facts``) cannot run on ``mesh`` (axis -> size)
    under ``backend`` on ``device`` type: the message naming the node, the axis and its size, what
    would run instead and the fix, or the combination rule that refuses its axes; None when it runs
    as planned."""
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
    rule = combination_refused(kind, backend, sizes, facts=facts, engine=engine)
    if rule is not None:
        named = " and ".join(f"{a}={sizes[a]}" for a in MESH_AXES if a in sizes)
        return f"{kind} {node!r} has {named} on its mesh {json.dumps(dict(mesh))}, but {rule.why}"
    return None


def one_device(kind: str, backend: str, *, engine: str | None = None, device: str | None = None) -> bool:
    """Whether a node of ``kind`` does not run ``dp`` over several devices on ``backend`` (``device``): a
    default placement (a ``dp`` mesh over the node's devices) gives it one device (its first) rather than
    a mesh it would not run. A kind that runs only ``tp`` (a reference, a critic under torchrun) runs
    on several ranks when a placement names its ``tp`` axis.

    Example:
        >>> one_device("critic", "torchrun"), one_device("policy", "torchrun")
        (True, False)
    """
    return "dp" not in runnable_axes(kind, backend, engine=engine, device=device)
