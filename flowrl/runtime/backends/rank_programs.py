"""What each rank of a torchrun job runs for a node: its part of the node's program.

``rank_program`` is the ``ProgramEnv.programs`` factory every rank's worker uses (named by
``RANK_PROGRAM``). A node on one rank runs its ordinary program there. A node on several ranks runs:

- a policy: ``DataParallelPolicy`` (data-parallel replicas, gradients reduced across them);
- a generator: ``ReplicaGenerator`` (replicas that split each batch of prompts);
- anything else (a reference, a user or synthetic program): on the lead rank only; the others idle.

``RankContext`` is what every rank knows about the job; ``flowrl.runtime.backends.torchrun`` sets it
once per process before any program is built.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from flowrl.errors import ConfigError
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import GeneratorNode, Node, PolicyNode
from flowrl.runtime.programs import (
    Batch,
    GeneratorProgram,
    Info,
    PolicyProgram,
    ProgramBase,
    ProgramEnv,
    SharedTransports,
    build_program,
)

__all__ = ["RANK_PROGRAM", "RankContext", "set_context", "DataParallelPolicy", "ReplicaGenerator", "rank_program"]

RANK_PROGRAM = "flowrl.runtime.backends.rank_programs:rank_program"


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


_CONTEXT: RankContext | None = None


def set_context(ctx: RankContext | None) -> None:
    """Set (or, with None, clear) this process's view of the job."""
    global _CONTEXT
    _CONTEXT = ctx


def _context() -> RankContext:
    if _CONTEXT is None:
        raise ConfigError("rank programs exist only inside a torchrun job (flowrl run --backend torchrun under torchrun)")
    return _CONTEXT


class _Idle(ProgramBase):
    """A non-lead rank of a node whose program is not parallel: takes part in nothing."""

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        return {}, {}


class DataParallelPolicy(PolicyProgram):
    """One data-parallel replica of a policy (see ``flowrl.runtime.distributed.make_data_parallel``)."""

    def __init__(self, node: PolicyNode, graph: Graph, transports: SharedTransports, *, group: Any, ranks: tuple[int, ...]) -> None:
        from flowrl.runtime.distributed import make_data_parallel

        ctx = _context()
        loss = graph.loss_of(node.name)
        max_norm = float(node.optimizer.grad_clip or 0.0)
        unclipped = msgspec.structs.replace(node, optimizer=msgspec.structs.replace(node.optimizer, grad_clip=0.0))
        super().__init__(unclipped, loss, graph, transports)  # type: ignore[arg-type]
        self.group, self.ranks, self.lead = group, ranks, ranks[0]
        self.index = ranks.index(ctx.rank)
        self.device = ctx.device
        for p in self.trainer.model.parameters():  # identical initial weights on every replica
            t = p.data.to(self.device)  # NCCL moves CUDA tensors only; the models live on CPU for now
            torch.distributed.broadcast(t, src=self.lead, group=group)
            p.data.copy_(t)
        make_data_parallel(self.trainer, group=group, max_norm=max_norm, device=self.device if self.device.type == "cuda" else None)

    def publish(self) -> float:
        return super().publish() if self.index == 0 else 0.0

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        from flowrl.runtime.distributed import broadcast_batch, reduce_metrics, shard_by_groups

        start = time.perf_counter()
        batch = broadcast_batch(inputs if self.index == 0 else None, src=self.lead, group=self.group, device=self.device)
        batch = {k: v.cpu() for k, v in batch.items()}
        shard = shard_by_groups(batch, len(self.ranks))[self.index]
        total = float(batch["completion_mask"].sum().clamp(min=1))
        mine = float(shard["completion_mask"].sum())
        self.trainer.dp_token_share = max(mine, 1.0) / total
        metrics = self.trainer.train_step(shard)
        samples = float(shard["completion_mask"].shape[0])
        metrics = reduce_metrics({k: float(v) for k, v in metrics.items()}, samples, group=self.group, device=self.device)
        metrics["grad_norm"] = self.trainer.dp_grad_norm
        train_s = time.perf_counter() - start
        publish_s = self.publish()
        info: Info = dict(metrics)
        info.update(train_s=train_s, publish_s=publish_s, version=self.trainer.version)
        return {}, info


class ReplicaGenerator(GeneratorProgram):
    """One generator replica: samples its contiguous part of the prompts; the lead gathers the parts."""

    def __init__(self, node: GeneratorNode, graph: Graph, env: ProgramEnv, transports: SharedTransports, *, group: Any, ranks: tuple[int, ...]) -> None:
        super().__init__(node, graph, env, transports, seed=env.seed)  # sampling is seeded by (seed, first prompt index)
        self.group, self.ranks, self.lead = group, ranks, ranks[0]
        self.index = ranks.index(_context().rank)
        self.device = _context().device

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        from flowrl.runtime.distributed import broadcast_batch, merge_rollouts, recv_batch, reduce_metrics, send_batch, split_prompts

        prompts = broadcast_batch(inputs if self.index == 0 else None, src=self.lead, group=self.group, device=self.device)
        prompts = {k: v.cpu() for k, v in prompts.items()}
        part = split_prompts(prompts, len(self.ranks))[self.index]
        fetch_s = self._sync(min_version)
        start = time.perf_counter()
        rollout = self.generator.generate(part) if part["prompt_ids"].shape[0] else {}
        gen_s = time.perf_counter() - start
        timing = reduce_metrics({"fetch_s": fetch_s, "gen_s": gen_s}, 1.0, group=self.group, device=self.device)
        if self.index != 0:
            send_batch(rollout, dst=self.lead, group=self.group, device=self.device)
            return {}, {}
        parts = [rollout] + [{k: v.cpu() for k, v in recv_batch(src=r, group=self.group, device=self.device).items()} for r in self.ranks[1:]]
        merged = merge_rollouts(parts)
        return merged, {"fetch_s": timing["fetch_s"], "gen_s": timing["gen_s"], "version": int(merged["rollout_version"])}


def rank_program(node: Node, graph: Graph, env: ProgramEnv, transports: SharedTransports) -> Any:
    """``ProgramEnv.programs`` factory on every rank: this rank's part of ``node``."""
    ctx = _context()
    ranks = ctx.ranks[node.name]
    env = msgspec.structs.replace(env, programs=dict(ctx.programs))
    lead = ctx.rank == ranks[0]
    if len(ranks) == 1 or node.name in ctx.programs:
        return build_program(graph, node.name, env, transports) if lead else _Idle()
    group = ctx.groups[node.name]
    if isinstance(node, PolicyNode):
        return DataParallelPolicy(node, graph, transports, group=group, ranks=ranks)
    if isinstance(node, GeneratorNode):
        return ReplicaGenerator(node, graph, env, transports, group=group, ranks=ranks)
    return build_program(graph, node.name, env, transports) if lead else _Idle()  # reference: on the lead only
