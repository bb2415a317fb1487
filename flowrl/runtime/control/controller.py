"""The controller: runs a graph's executors on the version clock and wires the run's parts.

Its parts, each a module tested on its own: ``executors`` (a thread per node, the bounded channels
between them), ``staleness`` (the gate: k per weight edge, U, the minimum version, the check),
``ledger`` (exactly-once prompts), ``row_sink`` (rows, samples, evaluations), ``checkpointer``,
``step_trace`` and ``run_stop`` (the first failure, a stall). State it keeps itself:

- ``clock`` (``VersionClock``): the policy version = completed optimizer steps, ``U`` per trainer
  step; only the policy executor advances it, after publishing (and after a due checkpoint, so a
  node gated on the clock, a critic, has not begun the next batch).
- Each executor takes message ``seq`` from each input, waits for ``gate.min_version`` (a node gated
  on the clock) or ``Node.version_needed`` (a syncing reference) outside its group's runner, runs
  the program's step on that runner and puts the outputs; a continuous generator's prompts come from
  the ledger instead, read ``k`` batches ahead.
- On the first failure (``RunStop.fail``) every channel closes and the clock stops, so every executor
  returns within one step; the run raises it as ``NodeExecutionError``.

Invariant (``StalenessGate.check``, on every batch): ``U * seq - rollout_version <= U * k``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowrl.errors import CheckpointError
from flowrl.graph.fields import OPTIONAL_FIELDS
from flowrl.graph.ir import Graph
from flowrl.graph.kinds import KINDS
from flowrl.placement.layout import Placement
from flowrl.runtime.observe.layout import LAYOUT_KEY, one_process
from flowrl.runtime.control.channels import ChannelClosed, Message
from flowrl.runtime.checkpointing.checkpointer import Checkpointer
from flowrl.runtime.control.clock import ClockStopped, VersionClock
from flowrl.runtime.config import RunConfig
from flowrl.runtime.control.executors import Executor, Executors
from flowrl.runtime.control.ledger import PromptLedger, continuous_feeds
from flowrl.runtime.programs.nodes import NodeProgram
from flowrl.runtime.observe.row_sink import RowSink
from flowrl.runtime.control.run_stop import RunStop
from flowrl.runtime.staleness import StalenessGate, StalenessViolation
from flowrl.runtime.observe.step_trace import SPAN_NAMES, trace_step
from flowrl.trace import Tracer

__all__ = ["Controller", "RunResult", "StalenessViolation", "SPAN_NAMES"]

log = logging.getLogger("flowrl.runtime")


@dataclass
class RunResult:
    """What a finished run reports: its metrics ``rows`` (one per step run here), the final policy
    ``version``, the prompt indices each step ``consumed``, ``wall_s`` from the first step to the
    last, and the newest ``checkpoint`` written (if any)."""

    rows: list[dict[str, Any]]
    version: int
    consumed: list[list[int]]
    wall_s: float
    checkpoint: Path | None = None


class Controller:
    """Executes ``graph`` with ``node_programs`` (node -> program, or a proxy to a worker process, for
    every node but the losses) on ``placement`` (colocated nodes are serialised); ``on_step`` gets
    each metrics row. ``intra_op_threads``: the programs run here, each colocation group's steps on
    one compute thread with that many torch threads; None: they run elsewhere. ``gate``: the run's staleness
    gate (``run_graph`` builds it once; None, outside a run: the gate of ``graph`` and ``config``)."""

    def __init__(
        self, graph: Graph, config: RunConfig, node_programs: dict[str, NodeProgram], placement: Placement, *,
        on_step: Callable[[dict[str, Any]], None] | None = None, intra_op_threads: int | None = None, gate: StalenessGate | None = None,
    ) -> None:  # fmt: skip
        self.graph, self.config, self.placement, self.intra_op_threads = graph, config, placement, intra_op_threads
        self.tracer = Tracer(enabled=bool(config.trace))  # spans are kept in memory only when a trace is asked for
        self.clock = VersionClock(0)
        self.stop, self._t0, self._start = RunStop(stall_timeout_s=config.stall_timeout_s), 0.0, 0
        self.gate = gate if gate is not None else StalenessGate.of(graph, config.max_staleness)  # the run's, handed down by run_graph
        self.ledger = PromptLedger(feeds=continuous_feeds(graph, self.gate))
        self.sink = RowSink(graph, config, on_step=on_step, fail=self._fail)
        for name, mesh in placement.nodes.items():  # a program over several ranks reports its own at its first step
            if name not in graph:
                continue
            node = graph.node(name)
            record = one_process(node.kind, mesh.devices, mesh.mesh_shape, config.backend, engine=getattr(node, "engine", None))
            if record is not None:
                self.sink.note_layout(name, record)
        self.parts = Executors(graph, node_programs, placement, capacity=config.channel_capacity or self.gate.widest() + 1, intra_op_threads=intra_op_threads)
        self.executors, self.channels = self.parts.executors, self.parts.channels
        self.checkpoints = Checkpointer(graph, config, self.parts.programs())

    def run(self) -> RunResult:
        """Run to ``config.steps`` trainer steps (from a checkpoint if ``resume``); raise on failure."""
        try:
            return self._run()
        finally:
            self.parts.close_runners()  # whatever happened, even before the first step

    def _run(self) -> RunResult:
        restored = self.checkpoints.restore(continuous=len(self.ledger.feeds) == len(self.graph.nodes_of_kind("generator"))) if self.config.resume else None
        if restored is not None:
            self.ledger.restore(restored.data_position, restored.delivered_ahead)
        self._start = self.gate.step_of(restored.version) if restored is not None else 0  # restore checks it divides
        self.clock = VersionClock(self.gate.version_at(self._start))
        self.sink.open(self._start)
        self._t0, interrupted = time.perf_counter(), False
        try:
            self.parts.start(self._executor_main)
            self.stop.supervise(self.parts.describe, self._fail)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            self._halt()
            self.parts.join()
        try:  # the final state (also after Ctrl-C); not after a failure: the newest periodic checkpoint is the last good one
            if self.checkpoints.enabled and self.stop.failure is None and self.sink.rows and not self.checkpoints.holds(self.clock.version):
                self._checkpoint(self.clock.version)
        finally:
            try:
                self._wait_for_checkpoint()  # the write in flight is on disk before the programs close
            finally:
                self.parts.close()
            self.sink.close(wait=self.stop.failure is None and not interrupted)  # after a failure: without unfinished evaluations
            if self.config.trace and self.sink.rows:  # a run that failed before its first step leaves no trace file
                self.tracer.save(self.config.trace)
        if interrupted:
            raise KeyboardInterrupt
        self.stop.raise_failure(self.graph)
        return RunResult(self.sink.rows, self.clock.version, self.ledger.consumed, time.perf_counter() - self._t0, self.checkpoints.last)

    def _wait_for_checkpoint(self) -> None:
        """Wait for the checkpoint being written; its failure is raised unless the run failed first
        (that failure is the run's to report; the write's is logged)."""
        try:
            self.checkpoints.wait()
        except CheckpointError as exc:
            if self.stop.failure is None:
                raise
            log.error("%s", exc)

    def _halt(self) -> None:
        self.stop.stop()
        self.clock.stop()
        self.parts.close_channels()

    def _fail(self, node: str, step: int | None, exc: BaseException) -> None:
        self.stop.fail(node, step, exc)
        self._halt()
        self.parts.abort()  # unblock threads waiting on worker processes

    def _executor_main(self, ex: Executor) -> None:
        seq = None
        try:
            for seq in range(self._start, self.ledger.steps_of(ex.name, self.config.steps)):  # a continuous generator's source: more
                if self.stop.stopped():
                    return
                self._step(ex, seq)
        except (ChannelClosed, ClockStopped):
            return
        except BaseException as exc:  # noqa: BLE001 - every failure ends the run, reported once
            self._fail(ex.name, seq, exc)

    def _step(self, ex: Executor, seq: int) -> None:
        t_wait = time.perf_counter()
        if ex.name in self.ledger.feeds:  # a continuous generator's prompts, read k batches ahead (PromptLedger.want)
            inputs = self.ledger.read_ahead(ex.name, self.ledger.want(ex.name, seq - self._start), lambda: ex.inputs[0].get().fields)
        else:
            inputs = ex.take(seq)
        if (idle := time.perf_counter() - t_wait) > 1e-4 and ex.inputs:
            self.tracer.add(ex.name, "wait", t_wait, t_wait + idle, step=seq)
        min_version = self.gate.min_version(ex.name, seq) if self.gate.gates(ex.name) else self.graph.node(ex.name).version_needed(seq, self.gate.updates)
        if min_version >= 0 or self.gate.gates(ex.name):  # outside the runner: the policy may need it to get there
            self.clock.wait_for(min_version)
            if (t := time.perf_counter()) - t_wait - idle > 1e-4:
                self.tracer.add(ex.name, "wait", t_wait + idle, t, step=seq, reason=f"weights {'>= ' if self.gate.gates(ex.name) else 'of '}v{min_version}")

        def run_step() -> tuple[dict[str, torch.Tensor], dict[str, Any], float, float]:
            if self.stop.stopped():
                raise ChannelClosed(ex.name)
            t_step = time.perf_counter()
            outputs, info = ex.program.step(seq, inputs, min_version)
            return outputs, info, t_step, time.perf_counter()

        outputs, info, t_step, t_end = ex.runner.call(run_step) if ex.runner is not None else run_step()
        if LAYOUT_KEY in info:  # a program over several ranks says what it built (observe.layout): for the first row
            self.sink.note_layout(ex.name, info.pop(LAYOUT_KEY))
        self._trace_step(ex, seq, t_step, t_end, info)
        self.stop.progress()
        if KINDS[ex.kind].publishes_weights:
            self._on_train_step(ex, seq, inputs, info, idle)
        else:  # a generator's timings, a source's data/*, a reward model's counts: for the step's row
            self.sink.note(ex.name, seq, info, generator=KINDS[ex.kind].waits_for_weights)
        for ch, fields in ex.outputs:
            ch.put(Message(seq, {f: outputs[f] for f in fields if f in outputs or f not in OPTIONAL_FIELDS}))

    def _trace_step(self, ex: Executor, seq: int, t0: float, t1: float, info: dict[str, Any]) -> None:
        trace_step(self.tracer, ex.name, ex.kind, seq, t0, t1, info)  # a method: tests spy on each step's info here

    def _on_train_step(self, ex: Executor, seq: int, batch: dict[str, torch.Tensor], info: dict[str, Any], idle: float) -> None:
        versions = batch.get("token_versions")
        tokens = (int(versions.min()), int(versions.max())) if versions is not None and versions.numel() else None
        rollout_version = self.gate.check(ex.name, seq, int(batch["rollout_version"]), tokens)
        version = int(info.get("version", self.gate.version_at(seq + 1)))
        checkpoint = self.checkpoints.due(seq)  # every N steps (batches)
        if not checkpoint:
            self.clock.advance(version)
        row = self.sink.add_step(
            ex.name, seq, version=version, generators=self.gate.gated_by(ex.name), program=ex.program, rollout_version=rollout_version,
            batch=batch, info=info, time_s=time.perf_counter() - self._t0, idle_s=idle, updates=self.gate.updates,
            max_staleness=self.gate.policy_k(ex.name),
        )  # fmt: skip
        self.ledger.consume(row["prompt_index"])
        if checkpoint:  # before the clock moves on: a node gated on it (a critic) has not begun the next batch
            self._checkpoint(version)
            self.clock.advance(version)
        if seq + 1 >= self.config.steps:
            self.stop.done()

    def _checkpoint(self, version: int) -> None:
        self.sink.write(wait=True)  # the metrics file covers every step the checkpoint does
        self.checkpoints.save(version, self.ledger)
