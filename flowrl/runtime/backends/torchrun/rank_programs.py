"""What each rank of a torchrun job runs for a node: its part of the node's program.

``rank_program`` is the ``ProgramEnv.programs`` factory every rank's worker uses (named by
``RANK_PROGRAM``). A node on one rank runs its ordinary program there. A node on several ranks runs
its kind's entry in ``RANK_PROGRAMS``:

- a policy: ``DataParallelPolicy`` (data-parallel replicas, gradients reduced across them), or with
  ``sharding="fsdp"`` ``ShardedPolicy`` (FSDP2 over its dp ranks, ``flowrl.runtime.parallel.fsdp``),
  with a ``tp`` mesh axis > 1 ``tp_policy.TensorParallelPolicy``, or on a mesh with ``pp`` > 1
  ``pp_policy.PipelinePolicy`` (pipeline stages x dp replicas); the first three share ``rank_policy._RankPolicy``'s step;
- a generator: ``ParallelGenerator``, replicas that split each batch of prompts, each replica a
  tensor-parallel group when its mesh has a ``tp`` axis of size > 1 (see ``flowrl.runtime.parallel.tensor_parallel``);
- a reference: tensor-parallel with a ``tp`` mesh axis > 1 (``tp_reference``);
- a critic: tensor-parallel with a ``tp`` mesh axis > 1 (``tp_critic``; any other axis refused);
- anything else (a reward model): one rank only; a mesh of several is refused
  before any work (``flowrl.mesh_support``, ``preflight.check_meshes``); a user or synthetic program
  (``RunConfig.programs``) on several ranks runs on the lead rank while the others idle.

A rank program reports, at its first step, the layout it built (``info["layout"]``,
``flowrl.runtime.observe.layout``), which the run's first row shows.

``RankContext`` (``rank_policy``) is what every rank knows about the job; ``flowrl.runtime.backends.torchrun.backend``
sets it once per process before any program is built.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from flowrl.errors import ConfigError
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import GeneratorNode, Node, PolicyNode
from flowrl.runtime.programs.nodes import (
    Batch,
    GeneratorProgram,
    Info,
    PolicyProgram,
    ProgramBase,
    ProgramEnv,
    SharedTransports,
)
from flowrl.runtime.programs.table import build_program
from flowrl.runtime.backends.torchrun.rank_policy import RankContext, _context, _mesh_axes, _RankPolicy, publish_shards, set_context
from flowrl.runtime.observe.layout import LAYOUT_KEY, record

__all__ = [
    "RANK_PROGRAM",
    "RANK_PROGRAMS",
    "RankContext",
    "set_context",
    "DataParallelPolicy",
    "ShardedPolicy",
    "ParallelGenerator",
    "policy_ranks",
    "rank_program",
]

RANK_PROGRAM = "flowrl.runtime.backends.torchrun.rank_programs:rank_program"


class _Idle(ProgramBase):
    """A non-lead rank of a node whose program is not parallel: takes part in nothing."""

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        return {}, {}


class DataParallelPolicy(_RankPolicy):
    """One data-parallel replica of a policy (see ``flowrl.runtime.parallel.distributed.make_data_parallel``)."""

    runs = "{n} data-parallel replicas"

    def __init__(self, node: PolicyNode, graph: Graph, transports: SharedTransports, *, group: Any, ranks: tuple[int, ...]) -> None:
        from flowrl.runtime.parallel.distributed import make_data_parallel

        ctx = _context()
        loss = graph.loss_of(node.name)
        max_norm = float(node.optimizer.grad_clip or 0.0)
        unclipped = msgspec.structs.replace(node, optimizer=msgspec.structs.replace(node.optimizer, grad_clip=0.0))
        super().__init__(unclipped, loss, graph, transports, device=str(ctx.device))  # type: ignore[arg-type]  # loss_of types it as a Node: the policy's LossNode
        self.group, self.ranks, self.lead = group, ranks, ranks[0]
        self.index = ranks.index(ctx.rank)
        self.device = ctx.device
        with torch.no_grad():
            for p in self.trainer.model.parameters():  # identical initial weights on every replica (on the rank's device)
                torch.distributed.broadcast(p.data, src=self.lead, group=group)
        make_data_parallel(self.trainer, group=group, max_norm=max_norm, device=self.device if self.device.type == "cuda" else None)
        self.collective_bytes = 0  # payload bytes this replica sent on collective weight edges

    def publish(self) -> float:
        """Every replica publishes on a collective edge (the transfer plan picks which replica sends
        what); on a shm / file edge (one writer) only the lead does."""
        from flowrl.runtime.weights.torchrun_edges import channel, opened

        start = time.perf_counter()
        if self.trainer.version > self._published:
            weights = self.trainer.weights()
            for edge in self._edges:
                collective = opened(channel(*edge))
                if collective is not None:
                    before = collective.bytes_sent
                    collective.publish(weights, self.trainer.version)
                    self.collective_bytes += collective.bytes_sent - before
                elif self.index == 0:
                    self._transports.writer(*edge).publish(weights, self.trainer.version)
            self._published = self.trainer.version
        return time.perf_counter() - start

    def _share(self, mine: float, total: float) -> None:
        self.trainer.dp_token_share = mine / total  # make_data_parallel weighs this replica's gradient by it

    def _grad_norm(self, metrics: dict[str, float]) -> float:
        norms = self.trainer.dp_grad_norms  # the global norm of each optimizer step of the batch
        mean = sum(norms) / max(len(norms), 1)
        norms.clear()
        return mean


class ShardedPolicy(_RankPolicy):
    """One dp rank of a policy sharded with FSDP2 (``OptimizerConfig.sharding="fsdp"``; see ``flowrl.runtime.parallel.fsdp``).

    Per optimizer step (``_RankPolicy.step``): each rank trains on its share of the mini-batch's whole
    prompt groups with its loss scaled by ``dp * N_r / N`` (``fsdp.token_scale``), so that FSDP2's
    averaged, reduce-scattered gradients are the mini-batch's; the trainer clips by the
    global norm and steps AdamW on its shards. Weights: on a collective edge every rank publishes
    its own shards (trainer layout ``resharding.fsdp(ranks)``, no gather); on a ``shm``/``file`` edge
    every rank gathers and the lead publishes. ``save`` runs on every rank (the controller sends it
    to all: ``saves_on_every_rank``): each rank writes its own shards of a sharded checkpoint
    (``flowrl.runtime.checkpointing.sharded_state``, torch.distributed.checkpoint; nothing is gathered); ``load``
    reads one on any dp size, or a one-file state, keeping each rank's chunks.
    """

    saves_on_every_rank = True
    holds_shards = True  # its weights are DTensors: on the direct route every rank gathers each bucket
    runs = "FSDP2 shards over {n} data-parallel ranks"

    def __init__(self, node: PolicyNode, graph: Graph, transports: SharedTransports, *, group: Any, ranks: tuple[int, ...], mesh: Any) -> None:
        from flowrl.runtime.parallel.fsdp import shard_trainer_
        from flowrl.runtime.parallel.fsdp_init import meta_build

        ctx = _context()
        loss = graph.loss_of(node.name)
        # parameters on the meta device (LoRA adapters included), each rank materialising only its rows (fsdp_init)
        model, source = meta_build(node.model)
        super().__init__(node, loss, graph, transports, device=str(ctx.device), model=model)  # type: ignore[arg-type]  # loss_of types it as a Node: the policy's LossNode
        self.group, self.ranks, self.lead = group, ranks, ranks[0]
        self.index = ranks.index(ctx.rank)
        self.device = ctx.device
        self.mesh = mesh if mesh.ndim == 1 else mesh["dp"]
        self.ep = ctx.ep.get(node.name, 1)
        ignored = None
        if self.ep > 1:  # the experts split over the dp ranks, tokens exchanged (expert_parallel); FSDP2 shards the rest
            from flowrl.models.registry import family_of
            from flowrl.runtime.parallel.expert_parallel import shard_experts_

            ignored = shard_experts_(self.trainer.model, self.mesh, family_of(node.model, owner=f"policy {node.name!r}").stacked)
            self.runs = "FSDP2 shards over {n} data-parallel ranks, each holding 1/{n} of the experts (expert parallelism, all-to-all)"
        shard_trainer_(self.trainer, self.mesh, source=source, ignored=ignored)
        self.collective_bytes = 0

    def _layout(self) -> dict[str, Any]:
        if self.ep == 1:
            return super()._layout()
        return record(self.ranks, {"dp": len(self.ranks), "ep": self.ep}, [self.ranks], self.runs.format(n=len(self.ranks)))

    def publish(self) -> float:
        return publish_shards(self)

    def _share(self, mine: float, total: float) -> None:
        from flowrl.runtime.parallel.fsdp import token_scale

        self.trainer.loss_scale = token_scale(len(self.ranks), mine, total)

    def _check(self, sizes: list[int]) -> None:
        from flowrl.runtime.parallel.fsdp import check_shards

        check_shards(self.name, sizes, self.trainer.node.optimizer.micro_batch_size)

    def _grad_norm(self, metrics: dict[str, float]) -> float:
        return float(metrics["policy/grad_norm"])  # the global norm already (DTensor gradients), averaged over the steps

    def save(self, path: str) -> None:
        from flowrl.runtime.checkpointing.sharded_state import save_sharded

        save_sharded(self.trainer, path, group=self.group)  # a directory: each rank writes its own shards, nothing is gathered

    def snapshot(self, path: str) -> Any:
        """``save``'s shards staged to CPU memory now; the write returned, to run behind training."""
        from flowrl.runtime.checkpointing.sharded_state import snapshot_sharded

        return snapshot_sharded(self.trainer, path, group=self.group, buffers=self.__dict__.setdefault("_checkpoint_buffers", {}))

    def load(self, path: str) -> None:
        from flowrl.runtime.parallel.fsdp import load_full_state
        from flowrl.runtime.checkpointing.sharded_state import SHARDED_SUFFIX, is_sharded, load_sharded

        if is_sharded(path) or (path.endswith(SHARDED_SUFFIX) and not os.path.isfile(path)):  # any dp size's shards (or a host without them: said)
            load_sharded(self.trainer, path, group=self.group)
        else:  # a one-file state (a replicated policy's, an FSDP one's from one rank, or from before sharded checkpoints)
            load_full_state(self.trainer, torch.load(path, weights_only=True, map_location="cpu", mmap=True))  # each rank reads its rows
        self._published = -1


class ParallelGenerator(GeneratorProgram):
    """A generator on several ranks: ``dp`` replicas, each a group of ``tp`` ranks (``tp`` = 1: plain
    replicas, each rank one; ``tp`` > 1 when its mesh has a ``tp`` axis larger than 1).

    Per step: the node's lead broadcasts the prompts to every rank of the node; replica ``r`` takes
    part ``r`` of them (``split_prompts``), fetches weights and samples; the first rank of every other
    replica sends its rollout to the node's lead, which merges them in replica order. Sampling is
    seeded alike on every rank (by seed and first prompt index). Each replica samples its part through
    ``GeneratorProgram._sample``, as one process does: single-turn, or multi-turn episodes against the
    node's environment (every tp rank of a replica runs them, its environments answering alike); the
    node's lead reports the whole batch's ``env/*`` numbers (``_replicas_env_metrics``).

    With ``tp`` > 1 each rank holds its shards of the model, the built-in transformer or a Hugging
    Face Llama-family one (``flowrl.runtime.parallel.tensor_parallel``: whole attention heads and a slice of
    the SwiGLU units, two all-reduces per layer over its tp group). The tp ranks of a replica agree on
    a weight version (below) and run the same sampling with the same seed, so they draw the same
    tokens (checked after each batch with a checksum all-reduce; a mismatch is an error, never a
    silent divergence).

    A vLLM generator (``engine="vllm"``) with ``tp`` > 1 instead runs one vLLM engine per replica with
    ``tensor_parallel_size`` = tp, started by the replica's first rank; vLLM's own workers hold the
    shards, on the devices of the replica's ranks, and the replica's other ranks are ``idle`` (they
    take part in the node's prompt broadcast and metrics only). On the hop route the engine rank
    fetches the full state and pushes it into every worker (``flowrl.runtime.parallel.vllm_replicas``);
    on the direct route every replica's engine rank has its workers join one group into which the
    policy's rank sends (``direct_route``; the first replica asks for all: ``_engine_of``).

    Weights with ``tp`` > 1 (the built-in engine): a transport that delivers only this rank's slices (``CollectiveTransport``
    whose generator layout is ``tp_param_layouts`` over ``tensor_parallel.tp_rows``: its
    ``local_shapes("generator")`` are the shard shapes) writes straight into ``local_weight_targets()``;
    any other transport delivers the full state into a full-size staging copy, from which each rank
    copies its own slices. Either way the tp ranks first agree on one version (an all-reduce of the
    versions they hold, fetching again until they match), so no replica ever samples with shards of
    two versions. With ``tp`` = 1 each replica fetches as a one-process generator does.

    Continuous batching (``sampling.batching="continuous"``) runs on one replica only (a mesh with
    ``dp`` = 1): every rank of its tp group queues all the prompts the controller reads ahead and runs
    the same ``ContinuousRollouts`` (same seed, same slots, same refills; each rank's KV cache and its
    splices hold its local kv heads), so they draw the same tokens and deliver the same ``P`` groups.
    In-flight weights (``WeightEdge.in_flight``) are taken between decode steps only when every tp
    rank holds the newer version (``_poll``). Several replicas would each deliver groups on their own
    schedule, which the controller's one-stream read-ahead and staleness bookkeeping do not cover:
    they are refused.
    """

    _reported = False  # the lead reported its layout (its first step)

    def __init__(self, node: GeneratorNode, graph: Graph, env: ProgramEnv, transports: SharedTransports, *, group: Any, ranks: tuple[int, ...], mesh: Any) -> None:
        from flowrl.models.quantize import QUANTIZED_PRECISIONS
        from flowrl.runtime.parallel.tensor_parallel import check_tp, tp_rows

        ctx = _context()
        self.rows: list[tuple[int, ...]] = [(r,) for r in ranks]  # [replica] -> its tp ranks
        tp = _mesh_axes(mesh).get("tp", 1)
        self.vllm_tp = node.engine == "vllm" and tp > 1  # each replica one vLLM engine with tensor_parallel_size=tp (``vllm_replicas``)
        if tp > 1:
            try:
                self.rows = tp_rows(mesh.mesh.reshape(-1).tolist(), tuple(mesh.mesh_dim_names or ()), tuple(mesh.mesh.shape))
            except ConfigError as exc:
                raise ConfigError(f"generator {node.name!r}: {exc}") from None
        if tp > 1 and not self.vllm_tp:
            check_tp(node.model, len(self.rows[0]))
            if node.sampling.precision in QUANTIZED_PRECISIONS:
                raise ConfigError(
                    f"generator {node.name!r}: precision={node.sampling.precision!r} does not support tensor parallelism "
                    f"(its mesh has tp={len(self.rows[0])}); give the generator a mesh without a tp axis > 1, or "
                    "sample in float32/bfloat16/float16"
                )
        if node.sampling.batching == "continuous" and len(self.rows) > 1:
            raise ConfigError(
                f"generator {node.name!r}: batching='continuous' runs on one replica (one tp group decoding every "
                f"prompt), but its mesh {_mesh_axes(mesh) or {'dp': len(ranks)}} makes {len(self.rows)} replicas "
                f"{[list(r) for r in self.rows]}; give it a mesh with dp=1 (e.g. plan 'gen:t{len(ranks)}@...', "
                "all its ranks tensor-parallel) or one rank, or set batching='lockstep' to split prompts across replicas"
            )
        self.replica = next(i for i, row in enumerate(self.rows) if ctx.rank in row)
        self.tp_ranks = self.rows[self.replica]
        self.group, self.ranks, self.lead, self.device = group, ranks, ranks[0], ctx.device
        assert self.lead == self.rows[0][0]  # the node's lead runs the first replica (its engine, with vLLM)
        self.idle = self.vllm_tp and ctx.rank != self.tp_ranks[0]  # its device is one of the replica's vLLM workers
        self._env = node.env is not None  # multi-turn episodes (``GeneratorProgram._sample`` runs them)
        if self.idle:
            self.name, self._sampling, self._engine = node.name, node.sampling, node.engine
        else:
            options = self._vllm_options(node.name) if self.vllm_tp else None
            super().__init__(node, graph, env, transports, seed=env.seed, engine_options=options)  # every rank seeds sampling alike
            self._engine_of = (self.replica, len(self.rows))  # on the direct route every replica's engine joins one group
        self.sharded = len(self.tp_ranks) > 1 and not self.vllm_tp  # vLLM shards in its own workers
        if self.sharded:
            self._shard(mesh)

    def _vllm_options(self, name: str) -> dict[str, Any]:
        """The engine rank's ``VLLMGenerator`` options: ``tensor_parallel_size`` = tp, and on GPUs the
        replica's ranks' devices, one per vLLM worker (the replica must sit on one host)."""
        import os

        from flowrl.runtime.parallel.vllm_replicas import replica_devices

        ctx = _context()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        devices = replica_devices(self.tp_ranks, ctx.rank, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", str(ctx.world))), name=name)
        return {"tensor_parallel_size": len(self.tp_ranks), "devices": devices if ctx.device.type == "cuda" else None}

    def close(self) -> None:
        if not self.idle:  # an idle rank holds no engine
            super().close()

    def _shard(self, mesh: Any) -> None:
        """Keep only this rank's shards of the model; the full tensors become the staging copy."""
        import torch.distributed as dist

        from flowrl.runtime.parallel.tensor_parallel import shard_model_

        ctx = _context()
        self.tp_group = mesh.get_group("tp")
        in_group = sorted(dist.get_process_group_ranks(self.tp_group))
        if in_group != sorted(self.tp_ranks):
            raise ConfigError(f"generator {self.name!r}: the mesh's tp group holds ranks {in_group}, expected {list(self.tp_ranks)}")
        self._staging = dict(self.generator.weight_targets())  # the full tensors (version 0) become the staging copy
        comm = ctx.device if ctx.device.type == "cuda" else None
        self._model = shard_model_(self.generator.model, self.tp_ranks, ctx.rank, self.tp_group, comm_device=comm)
        self._local = self.generator.refresh_weight_targets()  # weight_targets() now gives the shards
        self._staged = self.generator.version
        self._direct: bool | None = None  # whether the transport delivers shards (decided at the first fetch)

    def local_weight_targets(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter, by the full model's names (those of ``tp_param_layouts``):
        tensors of shape ``local_shape(layout, full_shape, rank)`` a transport may write into in place
        (with ``tp`` = 1, the whole model's)."""
        return self._local if self.sharded else self.generator.weight_targets()

    def _agree(self, values: list[int]) -> tuple[list[int], list[int]]:
        """Max and min of each value over the tp group (one all-reduce)."""
        import torch.distributed as dist

        t = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.tp_group)
        n = len(values)
        got = t.cpu().tolist()
        return got[:n], [-v for v in got[n:]]

    def _delivers_shards(self, transport: Any) -> bool:
        """True when ``transport`` fetches into shard-shaped targets (its ``local_shapes`` say so)."""
        local_shapes = getattr(transport, "local_shapes", None)
        if not callable(local_shapes):
            return False
        shards = {n: tuple(t.shape) for n, t in self._local.items()}
        return {n: tuple(shape) for n, shape in local_shapes("generator").items()} == shards

    def _sync(self, min_version: int) -> float:
        from flowrl.errors import TransportError
        from flowrl.runtime.parallel.tensor_parallel import copy_local_shards_

        if not self.sharded:
            return super()._sync(min_version)
        transport = self._transports.reader(*self._edge)
        if self._direct is None:
            self._direct = self._delivers_shards(transport)
            (some,), (every,) = self._agree([int(self._direct)])
            if some != every:
                raise ConfigError(f"generator {self.name!r}: tp ranks {list(self.tp_ranks)} disagree on whether the transport delivers shards")
            if self._direct:
                self._staging = {}  # shards arrive in place: free the full-size copy
        target = self._local if self._direct else self._staging
        start = time.perf_counter()
        deadline = start + self._timeout
        while True:  # every tp rank runs the same iterations: each decision comes from the all-reduced values
            got = transport.fetch_into(target, newer_than=self._staged)
            if got is not None:
                self._staged = got
            late = int(time.perf_counter() > deadline)
            (newest, any_late), (oldest, _) = self._agree([self._staged, late])
            if newest == oldest and max(newest, self.generator.version) >= min_version:
                if newest > self.generator.version:
                    if not self._direct:
                        copy_local_shards_(self._local, self._staging, self.tp_ranks, _context().rank, self._model)
                    self.generator.version = newest
                return time.perf_counter() - start
            if any_late:
                raise TransportError(
                    f"generator {self.name!r} (tp ranks {list(self.tp_ranks)}) waited {self._timeout:.0f} s for one weight "
                    f"version >= {min_version} from {self._edge[0]!r} on every tp rank; they hold versions {oldest}..{newest}"
                )
            time.sleep(0.0005)

    def _poll(self) -> None:
        """In-flight weights between decode steps: with tp > 1 a newer version only once every tp rank
        holds it (``_sync`` at the version held now: one fetch and one all-reduce when nothing is newer)."""
        if not self.sharded:
            super()._poll()
            return
        self._sync(self.generator.version)

    def _check_same_tokens(self, rollout: Batch) -> None:
        ids = rollout.get("completion_ids")
        if ids is None or not self.sharded:
            return
        weights = torch.arange(ids.numel(), dtype=torch.int64).remainder_(1009).add_(1).view_as(ids)
        checksum = int((ids.long() * weights).sum()) + int(rollout["completion_mask"].sum()) * 7919
        (hi,), (lo,) = self._agree([checksum])
        if hi != lo:
            raise RuntimeError(
                f"generator {self.name!r}: tp ranks {list(self.tp_ranks)} sampled different tokens (checksums {lo}..{hi}); "
                "their logits differ, e.g. a non-deterministic kernel or different thread counts per rank"
                + (", or its environment answered the ranks differently (each tp rank runs the episodes: an environment "
                   "must answer alike given the same row and actions)" if self._env else "")
            )

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        from flowrl.operators.generation import check_recorded_sampling
        from flowrl.runtime.parallel.distributed import broadcast_batch, merge_rollouts, recv_batch, reduce_metrics, send_batch, split_prompts

        rank = _context().rank
        if self.idle:  # a vLLM worker's rank: the node's collectives only (its timings weigh nothing)
            broadcast_batch(None, src=self.lead, group=self.group, device=self.device)
            reduce_metrics({"fetch_s": 0.0, "gen_s": 0.0}, 0.0, group=self.group, device=self.device)
            if self._env and len(self.rows) > 1:
                self._replicas_env_metrics({}, 0)
            return {}, {}
        prompts = broadcast_batch(inputs if rank == self.lead else None, src=self.lead, group=self.group, device=self.device)
        prompts = {k: v.cpu() for k, v in prompts.items()}
        fetch_s = self._sync(min_version)
        start = time.perf_counter()
        sampled: Info = {}
        if self.generator.sampling.batching == "continuous":  # one replica (checked in __init__) takes every prompt
            rollout, sampled = self._sample(seq, prompts, min_version)
        else:  # ``_sample`` as a one-process generator: single-turn, or episodes against the node's environment
            part = split_prompts(prompts, len(self.rows))[self.replica]
            rollout, sampled = self._sample(seq, part, min_version) if part["prompt_ids"].shape[0] else ({}, {})
        gen_s = time.perf_counter() - start
        if rollout:  # a replica given no prompts samples nothing; mu must be recorded with the truncation it was drawn with
            check_recorded_sampling(rollout, self._sampling, owner=f"generator {self.name!r} (engine {self._engine!r}, rank {rank})")
        self._check_same_tokens(rollout)
        timing = reduce_metrics({"fetch_s": fetch_s, "gen_s": gen_s}, 1.0, group=self.group, device=self.device)
        if self._env and len(self.rows) > 1:
            sampled = self._replicas_env_metrics(sampled, int(rollout["completion_ids"].shape[0]) if rollout else 0)
        if rank != self.lead:
            if rank == self.tp_ranks[0] and self.lead not in self.tp_ranks:
                send_batch(rollout, dst=self.lead, group=self.group, device=self.device)
            return {}, {}
        parts = [
            rollout if i == self.replica else {k: v.cpu() for k, v in recv_batch(src=row[0], group=self.group, device=self.device).items()}
            for i, row in enumerate(self.rows)
        ]
        merged = merge_rollouts(parts)
        slots = {k: v for k, v in sampled.items() if k.startswith(("slots/", "env/"))}  # alike on every tp rank; env/* over every replica
        info: Info = {"fetch_s": timing["fetch_s"], "gen_s": timing["gen_s"], "version": int(merged["rollout_version"]), **slots}
        if not self._reported:  # the layout it built, for the run's first row
            info[LAYOUT_KEY] = self.layout()
            self._reported = True
        return merged, info

    def layout(self) -> dict[str, Any]:
        """The layout these ranks run (``flowrl.runtime.observe.layout``): replicas by ``rows``, each a tp group."""
        dp, tp = len(self.rows), len(self.rows[0])
        if self.vllm_tp:
            runs = f"{dp} vLLM engine(s), each with tensor_parallel_size={tp} over its ranks"
        elif tp > 1:
            runs = f"{dp} replica(s), each {tp} tensor-parallel ranks holding their shards"
        else:
            runs = f"{dp} replicas" + (" (vLLM engines)" if self._engine == "vllm" else "")
        return record(self.ranks, {"dp": dp, "tp": tp}, self.rows, runs)

    def _replicas_env_metrics(self, sampled: Info, samples: int) -> Info:
        """The whole batch's ``env/*`` numbers (``MultiTurnGenerator.metrics``) from each replica's, every
        rank of the node taking part (a replica counts once, through its first rank): the per-sample
        means weighted by each replica's ``samples``, ``env/failed`` and ``env/failed/<cause>`` summed, ``env/seconds`` the longest
        wait (replicas wait in parallel). Numbers an engine adds beyond these are not reported with
        several replicas (a replica given no prompts cannot name them)."""
        import torch.distributed as dist

        from flowrl.operators.multiturn import MultiTurnGenerator

        keys = sorted(MultiTurnGenerator.metrics([], 0.0))
        failed = [k for k in keys if k.startswith("env/failed")]  # env/failed and env/failed/<cause>: counts, summed
        means = [k for k in keys if k not in failed and k != "env/seconds"]
        counts = samples if _context().rank == self.tp_ranks[0] else 0  # idle vLLM ranks and tp copies weigh nothing
        sums = torch.tensor([float(sampled.get(k, 0.0)) * counts for k in means] + [float(sampled.get(k, 0.0)) * bool(counts) for k in failed] + [float(counts)],
                            dtype=torch.float64, device=self.device)  # fmt: skip
        wait = torch.tensor([float(sampled.get("env/seconds", 0.0))], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums, group=self.group)
        dist.all_reduce(wait, op=dist.ReduceOp.MAX, group=self.group)
        *totals, total = sums.tolist()
        env = {k: v / (total or 1.0) for k, v in zip(means, totals)}
        env.update(zip(failed, totals[len(means) :]))
        return {**{k: v for k, v in sampled.items() if not k.startswith("env/")}, **env, "env/seconds": wait.item()}


def rank_program(node: Node, graph: Graph, env: ProgramEnv, transports: SharedTransports) -> Any:
    """``ProgramEnv.programs`` factory on every rank: this rank's part of ``node`` (a policy with
    edges on the direct route wrapped in ``direct_route.DirectPolicy``)."""
    program = _rank_program(node, graph, env, transports)
    ctx = _context()
    from flowrl.runtime.weights.torchrun_edges import channel

    routes = [transports.route(e.src, e.dst) for e in graph.weight_edges_from(node.name)]  # the run's routes, decided at its start
    direct = [channel(r.spec.src, r.spec.dst) for r in routes if r is not None and r.direct]
    if not direct or not isinstance(program, PolicyProgram):
        return program
    from flowrl.runtime.weights.direct_route import DirectPolicy

    ranks = ctx.ranks[node.name]
    sharded = bool(getattr(program, "holds_shards", False))  # FSDP2 or tensor-parallel: every rank gathers
    return DirectPolicy(program, direct, lead=ctx.rank == ranks[0], sharded=sharded, group=ctx.groups.get(node.name), device=ctx.device)


def _rank_program(node: Node, graph: Graph, env: ProgramEnv, transports: SharedTransports) -> Any:
    ctx = _context()
    ranks = ctx.ranks[node.name]
    env = msgspec.structs.replace(env, programs=dict(ctx.programs), devices={**env.devices, node.name: str(ctx.device)})  # the rank's device
    lead = ctx.rank == ranks[0]
    if len(ranks) == 1 or node.name in ctx.programs:
        return build_program(graph, node.name, env, transports) if lead else _Idle()
    builder = RANK_PROGRAMS.get(node.kind)  # a kind not in the table runs on the lead only (a reference)
    if builder is not None:
        return builder(node, graph, env, transports, group=ctx.groups[node.name], ranks=ranks, mesh=ctx.meshes.get(node.name))
    return build_program(graph, node.name, env, transports) if lead else _Idle()


def policy_ranks(node: PolicyNode, graph: Graph, env: ProgramEnv, transports: SharedTransports, *, group: Any, ranks: tuple[int, ...], mesh: Any) -> Any:
    """A policy's entry in ``RANK_PROGRAMS``: pipeline stages for a mesh with ``pp`` > 1
    (``pp_policy.PipelinePolicy``), a tensor-parallel policy for a ``tp`` axis > 1 (``tp_policy``),
    FSDP2 shards for ``sharding="fsdp"``, else data-parallel replicas."""
    axes = _mesh_axes(mesh)
    if axes.get("pp", 1) > 1:
        from flowrl.runtime.backends.torchrun.pp_policy import PipelinePolicy

        ctx = _context()
        return PipelinePolicy(node, graph, transports, group=group, ranks=ranks, mesh=mesh, rank=ctx.rank, device=ctx.device)
    if axes.get("tp", 1) > 1:
        from flowrl.runtime.backends.torchrun.tp_policy import TensorParallelPolicy

        return TensorParallelPolicy(node, graph, transports, group=group, ranks=ranks, mesh=mesh)
    if node.optimizer.sharding == "fsdp":
        return ShardedPolicy(node, graph, transports, group=group, ranks=ranks, mesh=mesh)
    return DataParallelPolicy(node, graph, transports, group=group, ranks=ranks)


def reference_ranks(node: Node, graph: Graph, env: ProgramEnv, transports: SharedTransports, *, group: Any, ranks: tuple[int, ...], mesh: Any) -> Any:
    """A reference's entry in ``RANK_PROGRAMS``: tensor-parallel for a ``tp`` axis > 1 (``tp_reference``),
    else its own program on the lead rank while the others idle."""
    if _mesh_axes(mesh).get("tp", 1) > 1:
        from flowrl.runtime.backends.torchrun.tp_reference import TensorParallelReference

        return TensorParallelReference(node, graph, transports, device=env.device_of(node.name), timeout_s=env.weight_timeout_s,  # type: ignore[arg-type]  # the program table's row for a ReferenceNode
                                       group=group, ranks=ranks, mesh=mesh)
    return build_program(graph, node.name, env, transports) if _context().rank == ranks[0] else _Idle()


def critic_ranks(node: Node, graph: Graph, env: ProgramEnv, transports: SharedTransports, *, group: Any, ranks: tuple[int, ...], mesh: Any) -> Any:
    """A critic's entry in ``RANK_PROGRAMS``: tensor-parallel over its ``tp`` axis (``tp_critic``); a mesh
    with any other axis > 1 is refused there by name (``tp_critic.check_tp_critic``)."""
    from flowrl.runtime.backends.torchrun.tp_critic import TensorParallelCritic

    return TensorParallelCritic(node, graph, device=env.device_of(node.name), group=group, ranks=ranks, mesh=mesh)  # type: ignore[arg-type]  # the program table's row for a CriticNode


#: Kind name -> its program on a mesh of several ranks (torchrun), ``(node, graph, env, transports, *,
#: group, ranks, mesh) -> program``, built on every rank of its mesh; a kind not here runs its own
#: program (``flowrl.runtime.programs.table.PROGRAMS``) on one rank (``flowrl.mesh_support`` says which axes
#: each kind runs; ``tests/test_mesh_support.py`` checks the two agree).
RANK_PROGRAMS: dict[str, Callable[..., Any]] = {
    "generator": ParallelGenerator, "policy": policy_ranks, "reference": reference_ranks, "critic": critic_ranks,
}
