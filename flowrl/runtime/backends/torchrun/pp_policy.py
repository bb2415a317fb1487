"""A pipeline-parallel policy under torchrun: its mesh's ``pp`` axis splits the model into stages.

``PipelinePolicy`` is a policy's rank program when its mesh has ``pp`` > 1 (``rank_programs.policy_ranks``
dispatches to it). The mesh is ``pp x dp`` (``tp`` > 1 beside ``pp`` is refused before any work,
``flowrl.runtime.parallel.pipeline.check_pipeline``): each rank holds stage ``i`` of the model
(``pipeline.split_model``: contiguous layers, the planner's rule) for dp replica ``j``; the ranks of
one dp replica form a pipeline (the mesh's ``pp`` group), the ranks of one stage its dp group.

Per step (``step``): the lead broadcasts the batch to every rank of the policy; every rank runs the
trainer (``flowrl.runtime.parallel.pipeline_trainer.PipelineTrainer``) on it with ``part_of`` set to
its dp replica's share of each mini-batch (whole prompt groups, ``shard_by_groups``, and its share of
the loss divisor), so a step's gradients, clipped by the global norm over every stage, and its AdamW
step equal one process's on the whole batch up to float rounding. The RL loss and so the step's
metrics live on the last stage: its dp ranks reduce them (``reduce_metrics``, as data-parallel
replicas do) and its first dp rank sends them to the policy's lead (``send_batch``: a msgspec header
and tensors, no pickle), so the run's rows are those of one process.

Initialisation: the model is built on the meta device and each rank materialises only its stage's
tensors, read from the weight files or drawn as a whole build draws them
(``flowrl.runtime.parallel.fsdp_init``: ``meta_build``, ``materialise_``), bit for bit the whole
model's, with no broadcast.

Weights out (``publish``): each stage holds its own layers. On a collective edge each stage sends its
own: the transport's trainer layout gives each weight the ranks of the stage that holds it, replicated
over its dp ranks (``pipeline.stage_layouts``; a tied head's matrix is the first stage's), so no rank
gathers the model. On a ``shm`` / ``file`` edge (one writer) each stage's first dp rank sends its
tensors (the whole model's names) to the lead, which publishes the whole model.

Checkpoints (``save`` / ``load``, sent to every rank): each stage writes its own parameters and AdamW
state keyed by the whole model's names (``flowrl.runtime.checkpointing.stage_state``), a
``policy-<node>.dcp`` that resumes on any pp x dp layout, in one process, or on FSDP2 ranks, and that
``flowrl export`` writes as one Hugging Face directory.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from flowrl.errors import ConfigError
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import LossNode, PolicyNode
from flowrl.runtime.backends.torchrun.rank_policy import finish_step
from flowrl.runtime.programs.nodes import Batch, Info, PolicyProgram, SharedTransports

__all__ = ["PipelinePolicy"]


class PipelinePolicy(PolicyProgram):
    """One rank of a pipeline-parallel policy: a stage of one dp replica (see the module docstring).

    Args:
        node, graph, transports: as every policy program's.
        group: the process group of all the policy's ranks; ranks: them, the lead first.
        mesh: the policy's ``DeviceMesh`` (dims ``pp``, ``dp``, ``tp``); rank, device: this rank's.
    """

    saves_on_every_rank = True
    _reported = False  # the lead reported its layout (its first step)

    def __init__(
        self, node: PolicyNode, graph: Graph, transports: SharedTransports, *, group: Any, ranks: tuple[int, ...], mesh: Any, rank: int, device: torch.device
    ) -> None:
        from flowrl.models.causal_lm import weight_dict
        from flowrl.runtime.parallel.fsdp_init import materialise_, meta_build
        from flowrl.runtime.parallel.pipeline import model_layers, split_model
        from flowrl.runtime.parallel.pipeline_trainer import PipelineTrainer

        names = list(mesh.mesh_dim_names)
        sizes = dict(zip(names, (int(n) for n in mesh.mesh.shape)))
        self.pp, self.dp = sizes["pp"], sizes.get("dp", 1)
        coordinate = mesh.get_coordinate()
        self.stage_index = coordinate[names.index("pp")]
        self.dp_index = coordinate[names.index("dp")] if "dp" in names else 0
        grid = mesh.mesh.reshape(self.pp, self.dp)  # (pp, dp) -> global rank (tp is 1: check_pipeline)
        self._grid = grid
        self.stage_leads = [int(grid[s, 0]) for s in range(self.pp)]  # each stage's first dp rank
        self.reporter = self.stage_leads[-1]  # the last stage's first dp rank: sends the step's metrics
        pipeline = [int(grid[s, self.dp_index]) for s in range(self.pp)]
        if pipeline != sorted(pipeline):  # a PipelineStage's peers are its group's ranks in order: stage i = group rank i
            raise ConfigError(
                f"policy {node.name!r}: its pipeline stages 0..{self.pp - 1} sit on ranks {pipeline}; torch's pipelining numbers "
                f"stages by rank, so list the policy's ranks in increasing order (e.g. {{\"ranks\": {sorted(ranks)}, \"mesh\": ...}})"
            )
        whole, source = meta_build(node.model)  # on the meta device: no rank holds the whole model
        self.whole = [n for n, p in whole.named_parameters() if p.requires_grad]  # param_groups' order (checkpoints)
        self.whole_names = list(weight_dict(whole))  # what is published, in this order
        stage = split_model(whole, self.stage_index, self.pp, model_layers(node.model))
        del whole
        materialise_(stage, _by_whole_names(source, stage.names), device)  # this stage's tensors, read or drawn as a whole build's
        self.name = node.name
        loss = graph.loss_of(node.name)
        if not isinstance(loss, LossNode):
            raise ConfigError(f"policy {node.name!r} has no loss node")
        self.trainer: PipelineTrainer = PipelineTrainer(
            node, loss, stage=stage, pp_group=mesh.get_group("pp"),
            dp_group=mesh.get_group("dp") if self.dp > 1 else None, device=device,
        )  # fmt: skip
        self._edges = [(e.src, e.dst) for e in graph.weight_edges_from(node.name)]
        self._transports = transports
        self._published = -1
        self.group, self.ranks, self.lead = group, ranks, ranks[0]
        self.rank, self.device = rank, device
        self.collective_bytes = 0

    # -- the step ----------------------------------------------------------------------------------
    def _part(self, mini: Batch) -> Batch:
        from flowrl.operators.shaping import loss_normalizer
        from flowrl.runtime.parallel.distributed import shard_by_groups

        part = shard_by_groups(mini, self.dp)[self.dp_index]
        config = self.trainer.loss.loss
        total = loss_normalizer(config, mini)
        self.trainer.dp_token_share = loss_normalizer(config, part) / total if total else 0.0
        return part

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        from flowrl.runtime.parallel.distributed import broadcast_batch, reduce_metrics, shard_by_groups

        start = time.perf_counter()
        batch = broadcast_batch(inputs if self.rank == self.lead else None, src=self.lead, group=self.group, device=self.device)
        batch = {k: v.cpu() for k, v in batch.items()}
        self.trainer.part_of = self._part
        metrics = {k: float(v) for k, v in self.trainer.train_step(batch).items()}
        norms = self.trainer.grad_norms  # the global norm of each optimizer step, alike on every rank
        grad_norm = sum(norms) / max(len(norms), 1)
        norms.clear()
        if self.stage_index == self.pp - 1 and self.dp > 1:  # the loss lives on the last stage: its dp ranks reduce it
            samples = float(shard_by_groups(batch, self.dp)[self.dp_index]["completion_mask"].shape[0])
            metrics = reduce_metrics(metrics, samples, group=self.trainer.dp_group, device=self.device)
        metrics = self._share_metrics(metrics)
        metrics["policy/grad_norm"] = grad_norm
        return finish_step(self, metrics, start, lead=self.rank == self.lead, layout=self._layout)

    def _layout(self) -> dict[str, Any]:
        """The layout it built, for the run's first row: each replica's stages, first to last."""
        from flowrl.runtime.observe.layout import record

        groups = [[int(r) for r in self._grid[:, d].tolist()] for d in range(self.dp)]
        runs = f"{self.dp} data-parallel replica(s), each {self.pp} pipeline stages (1F1B; GPipe with fewer micro-batches than stages)"
        return record(self.ranks, {"pp": self.pp, "dp": self.dp}, groups, runs)

    def _share_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The last stage's metrics on the lead (the other ranks keep their own: nobody reads them)."""
        from flowrl.runtime.parallel.distributed import recv_batch, send_batch

        if self.reporter == self.lead:
            return metrics
        if self.rank == self.reporter:
            send_batch({k: torch.tensor([v], dtype=torch.float64) for k, v in metrics.items()}, dst=self.lead, group=self.group, device=self.device)
        elif self.rank == self.lead:
            got = recv_batch(src=self.reporter, group=self.group, device=self.device)
            return {k: float(v) for k, v in got.items()}
        return metrics

    # -- weights out -------------------------------------------------------------------------------
    def _whole_weights(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on the lead, gathered from the stages' first dp ranks (None elsewhere)."""
        from flowrl.runtime.parallel.distributed import recv_batch, send_batch

        mine = self.trainer.weights()
        parts: list[dict[str, torch.Tensor]] = []
        for src in self.stage_leads:
            if src == self.lead:
                parts.append(dict(mine) if self.rank == self.lead else {})
            elif self.rank == src:
                send_batch(mine, dst=self.lead, group=self.group, device=self.device)
            elif self.rank == self.lead:
                parts.append(recv_batch(src=src, group=self.group, device=self.device))
        if self.rank != self.lead:
            return None
        whole: dict[str, torch.Tensor] = {}
        for part in parts:
            for k, v in part.items():
                whole.setdefault(k, v)  # a tied head's copy on the last stage: the first stage's is the same
        return {k: whole[k] for k in self.whole_names}

    def publish(self) -> float:
        """Each stage its own tensors on a collective edge; the whole model, gathered, from the lead on
        another (see the module docstring)."""
        from flowrl.runtime.weights.torchrun_edges import channel, opened

        start = time.perf_counter()
        if self.trainer.version > self._published:
            edges = [(e, opened(channel(*e))) for e in self._edges]
            mine = self.trainer.weights()
            for _, collective in edges:
                if collective is not None:  # this stage's own tensors (a tied head's copy: the first stage sends it)
                    before = collective.bytes_sent
                    collective.publish({n: mine[n] for n in collective.local_shapes("trainer")}, self.trainer.version)
                    self.collective_bytes += collective.bytes_sent - before
            if any(c is None for _, c in edges):
                whole = self._whole_weights()
                for edge, collective in edges:
                    if collective is None and whole is not None:
                        self._transports.writer(*edge).publish(whole, self.trainer.version)
            self._published = self.trainer.version
        return time.perf_counter() - start

    # -- checkpoints -------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        from flowrl.runtime.checkpointing.stage_state import save_stages

        save_stages(self.trainer, self.whole, path, group=self.group)

    def snapshot(self, path: str) -> Any:
        """``save``'s stages staged to CPU memory now; the write returned, to run behind training."""
        from flowrl.runtime.checkpointing.stage_state import snapshot_stages

        return snapshot_stages(self.trainer, self.whole, path, group=self.group, buffers=self.__dict__.setdefault("_checkpoint_buffers", {}))

    def load(self, path: str) -> None:
        from flowrl.runtime.checkpointing.stage_state import load_stages

        load_stages(self.trainer, self.whole, path, group=self.group)
        self._published = -1


def _by_whole_names(source: Any, names: dict[str, str]) -> Any:
    """``source`` (an ``fsdp_init.RowSource`` of the whole model) asked for a stage's parameters by the
    whole model's names: a tied head on the last stage (``lm_head.weight``) is its embedding's rows."""

    def renamed(wanted: Any) -> Any:
        back = {names[k]: k for k in wanted}
        for name, rows in source({names[k]: span for k, span in wanted.items()}):
            yield back[name], rows

    return renamed
