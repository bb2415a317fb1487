"""What every rank of a torchrun job knows (``RankContext``) and what a policy's rank programs share (``_RankPolicy``).

``RankContext`` is set once per process by ``flowrl.runtime.backends.torchrun.backend`` before any program is
built (``set_context``). ``_RankPolicy`` is the step every policy program on several ranks runs
(``rank_programs.DataParallelPolicy`` and ``ShardedPolicy``, ``tp_policy.TensorParallelPolicy``): a
module of its own so that each of them can subclass it without importing ``rank_programs``, which
dispatches to them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import torch

from flowrl.errors import ConfigError
from flowrl.runtime.observe.layout import LAYOUT_KEY, record
from flowrl.runtime.programs.nodes import Batch, Info, PolicyProgram

__all__ = ["RankContext", "set_context", "publish_shards", "finish_step", "collective_bytes", "split_whole_model", "lead_forward_step"]


# -- this rank's view of the job --------------------------------------------------------------------
@dataclass
class RankContext:
    """What every rank knows about the job (set once per process by ``run_torchrun``)."""

    rank: int
    world: int
    ranks: dict[str, tuple[int, ...]]
    programs: dict[str, str]
    groups: dict[str, Any] = field(default_factory=dict)
    meshes: dict[str, Any] = field(default_factory=dict)
    device: torch.device = torch.device("cpu")
    direct: frozenset[str] = frozenset()  # channels of the weight edges on the direct route (``direct_route``)
    ep: dict[str, int] = field(default_factory=dict)  # node -> its expert-parallel size, where > 1 (``NodeMesh.ep``)


_CONTEXT: RankContext | None = None


def set_context(ctx: RankContext | None) -> None:
    """Set (or, with None, clear) this process's view of the job."""
    global _CONTEXT
    _CONTEXT = ctx


def _context() -> RankContext:
    if _CONTEXT is None:
        raise ConfigError("rank programs exist only inside a torchrun job (flowrl run --backend torchrun under torchrun)")
    return _CONTEXT


class _RankPolicy(PolicyProgram):
    """What a policy's replicas and its FSDP shards share: the step.

    The lead broadcasts the batch; every rank runs the trainer on the whole batch with
    ``trainer.part_of`` set to ``_part``: each optimizer step's mini-batch (whole prompt groups, the
    same on every rank) is split into whole groups across the ranks (``shard_by_groups``) and this
    rank's share of the mini-batch's loss divisor (``shaping.loss_normalizer``: tokens or sequences, as
    ``loss_agg`` normalises) is set before the trainer uses its part, so the summed (replicas) or
    averaged (FSDP) gradient is the mini-batch's. Metrics are reduced over the group, weighted by each
    rank's samples of the batch; then weights are published. Subclasses say how the share is applied
    (``_share``), what a rank's shards must satisfy (``_check``) and where the global gradient norm is.
    """

    group: Any
    ranks: tuple[int, ...]
    lead: int
    index: int
    device: torch.device  # this rank's (``RankContext.device``)
    collective_bytes: int
    runs: str = "{n} ranks"  # what runs, for the layout the lead reports (``{n}``: its ranks)
    _reported: bool = False  # the lead reported its layout (its first step)

    def _share(self, mine: float, total: float) -> None:
        raise NotImplementedError

    def _layout(self) -> dict[str, Any]:
        """The layout this program built (``observe.layout.record``), which the lead reports at its
        first step: data-parallel over every rank by default; a tensor-parallel policy says its groups."""
        return record(self.ranks, {"dp": len(self.ranks)}, [self.ranks], self.runs.format(n=len(self.ranks)))

    def _shares(self) -> tuple[int, int]:
        """(how many parts a mini-batch splits into, this rank's part): one per rank by default; a
        tensor-parallel group's ranks share one part (``tp_policy``)."""
        return len(self.ranks), self.index

    def _check(self, sizes: list[int]) -> None:
        """Refuse shards the ranks cannot train together (nothing by default)."""

    def _grad_norm(self, metrics: dict[str, float]) -> float:
        raise NotImplementedError

    def _reduce(self, metrics: dict[str, float], samples: float) -> dict[str, float]:
        """The batch's metrics from this rank's (``reduce_metrics`` over the policy's ranks, each
        weighted by its ``samples``); a tensor-parallel group's ranks count once (``tp_policy``)."""
        from flowrl.runtime.parallel.distributed import reduce_metrics

        return reduce_metrics(metrics, samples, group=self.group, device=self.device)

    def _part(self, mini: Batch) -> Batch:
        from flowrl.operators.shaping import loss_normalizer
        from flowrl.runtime.parallel.distributed import shard_by_groups

        parts, index = self._shares()
        shards = shard_by_groups(mini, parts)
        self._check([int(s["completion_mask"].shape[0]) for s in shards])
        part = shards[index]
        config = self.trainer.loss.loss
        self._share(loss_normalizer(config, part), loss_normalizer(config, mini))
        return part

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        from flowrl.runtime.parallel.distributed import broadcast_batch, shard_by_groups

        start = time.perf_counter()
        batch = broadcast_batch(inputs if self.index == 0 else None, src=self.lead, group=self.group, device=self.device)
        batch = {k: v.cpu() for k, v in batch.items()}
        self.trainer.part_of = self._part
        metrics = self.trainer.train_step(batch)
        grad_norm = self._grad_norm(metrics)
        parts, index = self._shares()
        samples = float(shard_by_groups(batch, parts)[index]["completion_mask"].shape[0])
        metrics = self._reduce({k: float(v) for k, v in metrics.items()}, samples)
        metrics["policy/grad_norm"] = grad_norm
        return finish_step(self, metrics, start, lead=self.index == 0, layout=self._layout)


def publish_shards(program: Any) -> float:
    """Publish a sharded policy's new weights (its ``trainer.model`` holds DTensors: FSDP2 or tp shards):
    on a collective edge every rank sends its own shards (no gather); on a ``shm``/``file`` edge every
    rank gathers (a collective) and the lead writes. Seconds taken."""
    from flowrl.runtime.weights.torchrun_edges import channel, opened
    from flowrl.runtime.parallel.fsdp import full_weights, local_weights

    start = time.perf_counter()
    trainer = program.trainer
    if trainer.version > program._published:
        full = None
        for edge in program._edges:
            collective = opened(channel(*edge))
            if collective is not None:
                before = collective.bytes_sent
                collective.publish(local_weights(trainer.model), trainer.version)
                program.collective_bytes += collective.bytes_sent - before
                continue
            full = full_weights(trainer.model) if full is None else full  # every rank gathers
            if program.index == 0:
                program._transports.writer(*edge).publish(full, trainer.version)
        program._published = trainer.version
    return time.perf_counter() - start


def finish_step(program: Any, metrics: dict[str, float], start: float, *, lead: bool, layout: Callable[[], Any]) -> tuple[Batch, Info]:
    """A policy rank's step after its optimizer steps, on every kind of policy rank (``_RankPolicy``,
    ``pp_policy.PipelinePolicy``): on a CPU the step's freed memory back to the system before the sync
    (activations, FSDP's gathered layers), the new weights published, the step's info (on the ``lead``
    rank, the layout it built once, for the run's first row; the collective's bytes)."""
    from flowrl.host import release_freed_memory

    if program.device.type == "cpu":
        release_freed_memory()
    train_s = time.perf_counter() - start
    sent = program.collective_bytes
    publish_s = program.publish()
    info: Info = dict(metrics)
    info.update(train_s=train_s, publish_s=publish_s, version=program.trainer.version)
    if lead and not program._reported:
        info[LAYOUT_KEY] = layout()
        program._reported = True
    info.update(collective_bytes(program, sent))
    return {}, info


def collective_bytes(program: Any, sent: int) -> dict[str, float]:
    """``{"weights/collective_bytes": ...}``: the payload bytes every rank of ``program``'s group put on
    collective weight edges since ``sent`` (this rank's ``collective_bytes`` before publishing), summed
    over the group (every rank calls it); empty without a collective edge."""
    from flowrl.runtime.weights.torchrun_edges import channel, opened

    if not any(opened(channel(*e)) is not None for e in program._edges):
        return {}
    total = torch.tensor([float(program.collective_bytes - sent)], dtype=torch.float64, device=program.device)
    torch.distributed.all_reduce(total, group=program.group)
    return {"weights/collective_bytes": float(total)}


def _mesh_axes(mesh: Any) -> dict[str, int]:
    """Axis name -> size of a ``DeviceMesh`` (empty without a mesh)."""
    if mesh is None:
        return {}
    return dict(zip(mesh.mesh_dim_names or (), (int(s) for s in mesh.mesh.shape)))


def split_whole_model(model: Any, mesh: Any, split: Callable[[Any, Any], Any], *, lead: int, group: Any) -> None:
    """Broadcast ``model``'s whole weights from rank ``lead`` (equal starts on every rank), then
    ``split(model, tp_mesh)`` it over ``mesh``'s ``tp`` axis (the mesh itself when it has one axis):
    the start every tensor-parallel forward program (a reference's, a critic's) shares."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            torch.distributed.broadcast(p.data, src=lead, group=group)
    names = tuple(mesh.mesh_dim_names or ())
    split(model, mesh["tp"] if len(names) > 1 else mesh)


def lead_forward_step(program: Any, step: Callable[..., tuple[Any, Any]], seq: int, inputs: Any, min_version: int, runs: str) -> tuple[Any, Any]:
    """One step of a tensor-parallel forward program (``program``: ``group``, ``ranks``, ``lead``,
    ``is_lead``, ``device``, ``_reported``): the lead broadcasts its inputs, every rank runs ``step``
    (its base class's) on them, and only the lead answers, its first answer with the layout ``runs``
    describes (the run's first row)."""
    from flowrl.runtime.observe.layout import LAYOUT_KEY, record
    from flowrl.runtime.parallel.distributed import broadcast_batch

    batch = broadcast_batch(inputs if program.is_lead else None, src=program.lead, group=program.group, device=program.device)
    out, info = step(seq, {k: v.cpu() for k, v in batch.items()}, min_version)
    if not program.is_lead:
        return {}, {}
    if not program._reported:
        info = {**info, LAYOUT_KEY: record(program.ranks, {"tp": len(program.ranks)}, [program.ranks], runs)}
        program._reported = True
    return out, info
