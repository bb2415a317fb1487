"""The controller: runs a graph's executors, keeps the version clock, and enforces the staleness bound.

State it keeps (each guarded as noted):

- ``clock`` (``VersionClock``, its own condition): the policy version = completed optimizer steps.
  Only the policy executor advances it, after a step's weights are published. A trainer step (one
  batch, ``seq``) takes ``U = graph.updates_per_batch()`` optimizer steps (``num_iterations *
  num_mini_batches``), so the version at the start of step ``seq`` is ``U * seq``.
- ``channels`` (``Channel``, each its own condition): one bounded FIFO per executor-level data
  edge. Edges into a loss node are redirected to its policy (the loss runs inside the policy's
  step). Capacity ``max_staleness + 1`` unless configured.
- ``executors``: one thread per non-loss node. Executor ``e`` processes steps ``start .. steps-1``
  in order: it takes message ``seq`` from each input channel, runs its program, and puts the
  outputs on each output channel.
- ``runners``: one step runner per colocation group of the placement (``compute_threads``); an
  executor hands each program step to its group's runner, which runs the group's steps one at a
  time, so executors that share devices never run at the same time. With ``intra_op_threads`` > 1
  (programs in this process) the runner is the group's one compute thread, which alone runs torch
  with that many intra-op threads (one OpenMP team per group: see ``compute_threads`` for why);
  the executor threads themselves (and the steps of executors in no group) then use one intra-op
  thread. Otherwise it is a lock.
- A node may need the policy's weights of one step besides the version clock's gate of a kind that
  ``waits_for_weights`` (``Node.version_needed``: a syncing reference needs version ``U * seq``
  at its sync steps): its executor waits on the clock for it before handing the step to its runner,
  so the wait never holds a colocation group's runner, which the policy may need to get there.
- ``_gen_info`` (``_lock``): per (generator, seq) timings and the version the rollout used.
- ``_source_info`` (``_lock``): per seq, the namespaced metrics of the nodes besides generators and
  policies (a source's ``data/epoch``, ``data/prompts_dropped``, ...; a reward model's
  ``judge/unparsed/<node>``), merged into that step's metrics row.
- ``_failure`` (``_lock``): the first error, with its node and step; set once, then ``_stop``.
- ``_unwritten`` (the policy executor's thread, then the controller's once the executors are
  joined): metrics rows not yet written, in step order, each with the evaluation its row waits
  for (``RunConfig.eval_every``: a ``Future`` from ``evaluation.Evaluator``, else None). A row is
  written (file, ``on_step``) once it and every row before it are complete; a checkpoint first
  waits for all of them, so the metrics file covers every step a resume will not repeat.
- Cadences count trainer steps (the row's ``step`` = ``seq + 1``), whatever the updates per batch:
  ``eval_every``, ``log_samples`` and ``checkpoint_every`` fire after step ``seq`` when
  ``(seq + 1) % N == 0``. A checkpoint is written before the clock advances past the step, so a
  node gated on the clock (``Node.version_needed``: a critic) has not begun the next batch.

Invariants:

- ``max_staleness`` k counts trainer steps (batches), not versions: the generator samples batch
  ``seq`` only after ``clock >= U * (seq - k)`` and with weights of version ``>= U * (seq - k)`` (it
  fetches the newest). The policy consumes batch ``seq`` at version ``U * seq``. Hence, for every
  consumed batch: ``policy_version_at_consumption - rollout_version <= U * k`` (``<= k`` with one
  update per batch). The policy checks it on every batch; a violation is a flowrl bug and fails the run.
  (Only versions ``U * seq`` are ever published, so a bound in versions below ``U`` would be k = 0.)
- Nothing is dropped: a full channel blocks its producer (backpressure).
- On any failure every channel is closed and the clock stopped, so every executor returns within
  one program step; the run raises ``NodeExecutionError`` naming the node and the step.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flowrl.errors import NodeExecutionError
from flowrl.graph.fields import OPTIONAL_FIELDS
from flowrl.graph.ir import Graph
from flowrl.graph.kinds import KINDS
from flowrl.runtime.channels import Channel, ChannelClosed, Message
from flowrl.runtime.clock import ClockStopped, VersionClock
from flowrl.runtime.compute_threads import StepRunner, group_runners, set_intra_op_threads, set_thread_cores
from flowrl.runtime.config import RunConfig
from flowrl.runtime.evaluation import Evaluator, merge_eval
from flowrl.runtime.ledger import PromptLedger
from flowrl.runtime.metrics import MetricsWriter, step_row
from flowrl.runtime.offload import trace_spans
from flowrl.runtime.samples import SampleLogger
from flowrl.runtime.staleness import StalenessGate, StalenessViolation
from flowrl.placement.data import Placement
from flowrl.runtime.programs import NodeProgram
from flowrl.runtime.resume import restore_run_checkpoint, save_run_checkpoint
from flowrl.trace import Tracer

__all__ = ["Controller", "RunResult", "StalenessViolation", "SPAN_NAMES"]

#: The span each node kind's program step is recorded as in the trace (``flowrl.graph.kinds``: the
#: planner's predicted timeline uses the same names).
SPAN_NAMES = {kind: spec.span for kind, spec in KINDS.items() if spec.program}


@dataclass
class RunResult:
    """What a finished run reports.

    Attributes:
        rows: the metrics rows, one per trainer step run in this process.
        version: the policy version at the end.
        consumed: for each step, the prompt indices the trainer consumed (exactly-once checks).
        wall_s: seconds from the first step to the last.
        checkpoint: the newest checkpoint written, if any.
    """

    rows: list[dict[str, Any]]
    version: int
    consumed: list[list[int]]
    wall_s: float
    checkpoint: Path | None = None


@dataclass
class _Executor:
    name: str
    kind: str
    program: NodeProgram
    inputs: list[Channel] = field(default_factory=list)
    outputs: list[tuple[Channel, tuple[str, ...]]] = field(default_factory=list)
    runner: StepRunner | None = None
    cores: tuple[int, ...] = ()
    thread: threading.Thread | None = None


class Controller:
    """Executes ``graph`` with the programs in ``node_programs`` (built by a backend).

    Args:
        graph: a validated graph.
        config: the run configuration.
        node_programs: node name -> program (in this process, or a proxy to a worker process), for every
            node but the loss nodes.
        placement: devices per node; colocated nodes are serialised.
        on_step: called with each metrics row (the CLI's progress bar).
        intra_op_threads: the programs run in this process: each colocation group's steps run on one
            compute thread with this many torch intra-op threads (under a lock on their executors'
            threads when it is 1); the executor threads use one.
            ``None``: the programs run elsewhere (proxies); torch's threads here are left as they are.
    """

    def __init__(
        self,
        graph: Graph,
        config: RunConfig,
        node_programs: dict[str, NodeProgram],
        placement: Placement,
        *,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        intra_op_threads: int | None = None,
    ) -> None:
        self.graph = graph
        self.intra_op_threads = intra_op_threads
        self.config = config
        self.placement = placement
        self.on_step = on_step
        self.tracer = Tracer(enabled=bool(config.trace))  # spans are kept in memory only when a trace is asked for
        self.clock = VersionClock(0)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._done = threading.Event()
        self._failure: tuple[str, int | None, BaseException] | None = None
        self._gen_info: dict[tuple[str, int], dict[str, Any]] = {}
        self._source_info: dict[int, dict[str, Any]] = {}
        self._idle: dict[int, float] = {}
        self._progress_at = time.monotonic()
        self._t0 = 0.0
        self.rows: list[dict[str, Any]] = []
        self.last_checkpoint: Path | None = None
        self._checkpoint_version = -1

        self.gate = StalenessGate.of(graph, config.max_staleness)  # k per gated edge (generators), U, the check
        self.updates = self.gate.updates  # U: versions per trainer step
        #: a node that runs inside its policy's step (a loss) -> that policy: one executor for both
        self.loss_policy = {n.name: graph.users(n.name)[0].name for n in graph.nodes if KINDS[n.kind].runs_on == "policy"}
        self.reward_weights: dict[str, float] = {}
        for loss in graph.nodes_of_kind("loss"):
            self.reward_weights.update(loss.loss.reward_weights)  # type: ignore[union-attr]
        self._sample_loggers = {  # --log-samples: decoded samples in the metrics rows
            node.name: SampleLogger(graph, node.name, every=config.log_samples, reward_weights=self.reward_weights)
            for node in graph.nodes
            if KINDS[node.kind].publishes_weights  # the trainer's step writes the row
        } if config.log_samples else {}
        # Continuous-batching generators read prompts ahead (``_read_ahead``): name -> (source, P, k).
        self._continuous: dict[str, tuple[str, int, int]] = {}
        for gen in graph.nodes_of_kind("generator"):
            if gen.sampling.batching == "continuous":  # type: ignore[attr-defined]
                (feed,) = (e.src for e in graph.edges if e.dst == gen.name)
                self._continuous[gen.name] = (feed, graph.node(feed).source.batch_size, self.gate.bound(gen.name).k)  # type: ignore[attr-defined]
        self.ledger = PromptLedger()  # exactly once: the watermark, the prompts consumed ahead of it, those a resume skips
        self._unwritten: deque[tuple[dict[str, Any], Future[dict[str, float]] | None]] = deque()
        self._evaluator: Evaluator | None = None
        # --eval-every: the first policy that feeds a generator is the one evaluated
        self._eval_policy = next((e.src for e in graph.weight_edges if KINDS[graph.node(e.dst).kind].waits_for_weights), None)
        self._build_executors(node_programs)

    # -- wiring -------------------------------------------------------------------------------------
    def _build_executors(self, node_programs: dict[str, NodeProgram]) -> None:
        cores = self.placement.devices if self.placement.pin else {}
        self.runners = group_runners(self.placement.groups(), intra_op_threads=self.intra_op_threads, cores=cores)
        self.executors: dict[str, _Executor] = {}
        for node in self.graph.nodes:
            if KINDS[node.kind].runs_on == "policy":  # a loss runs inside its policy's step
                continue
            self.executors[node.name] = _Executor(
                name=node.name,
                kind=node.kind,
                program=node_programs[node.name],
                runner=self.runners.get(node.name),
                cores=cores.get(node.name, ()),
            )
        capacity = self.config.channel_capacity or self.gate.widest() + 1
        self.channels: list[Channel] = []
        for edge in self.graph.edges:
            src = self.loss_policy.get(edge.src, edge.src)
            dst = self.loss_policy.get(edge.dst, edge.dst)
            if src == dst:  # loss -> its policy: the same executor
                continue
            ch = Channel(f"{edge.src}->{edge.dst}", capacity)
            self.channels.append(ch)
            self.executors[src].outputs.append((ch, tuple(edge.fields)))
            self.executors[dst].inputs.append(ch)

    # -- the run ------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Run to ``config.steps`` trainer steps (from a checkpoint if ``resume``); raise on failure."""
        try:
            return self._run()
        finally:
            for runner in self.runners.values():  # whatever happened, even before the first step
                runner.close()

    def _run(self) -> RunResult:
        start = (self._restore() if self.config.resume else 0) // self.updates  # restore checks it divides
        self.clock = VersionClock(start * self.updates)
        self._start_version = start  # the first step (seq) this run takes
        metrics = MetricsWriter(self.config.metrics, append=self.config.resume and start > 0, keep_through=start)
        self._metrics = metrics
        self._t0 = time.perf_counter()
        interrupted = False
        try:
            if self.config.eval_every and self._eval_policy is not None:
                assert self.config.eval_data is not None  # RunConfig refuses eval_every without it
                self._evaluator = Evaluator(
                    self.graph, self._eval_policy, data=self.config.eval_data, samples=self.config.eval_samples,
                    pass_reward=self.config.eval_pass_reward, seed=self.config.seed,
                )
            for ex in self.executors.values():
                ex.program.start()
            for ex in self.executors.values():
                ex.thread = threading.Thread(target=self._executor_main, args=(ex, start), name=f"flowrl-{ex.name}", daemon=True)
                ex.thread.start()
            self._supervise()
        except KeyboardInterrupt:
            interrupted = True
        finally:
            self._halt()
            self._join()
        try:
            # The final state (also after Ctrl-C), unless the last periodic checkpoint is it. Not after
            # a failure: the newest periodic checkpoint is the last state known to be good.
            if self.config.checkpoint_dir and self._failure is None and self.rows and self._checkpoint_version != self.clock.version:
                self._checkpoint_now()
        finally:
            self._close_programs()
            self._write_rows(wait=self._failure is None and not interrupted, drop=True)  # after a failure: without unfinished evaluations
            if self._evaluator is not None:
                self._evaluator.close()
            metrics.close()
            if self.config.trace and self.rows:  # a run that failed before its first step leaves no trace file
                self.tracer.save(self.config.trace)
        if interrupted:
            raise KeyboardInterrupt
        if self._failure is not None:
            node, step, exc = self._failure
            if isinstance(exc, NodeExecutionError):
                raise exc
            kind = self.graph.node(node).kind
            where = f" at step {step}" if step is not None else ""
            raise NodeExecutionError(f"node {node!r} ({kind}) failed{where}: {type(exc).__name__}: {exc}", node=node, step=step) from exc
        return RunResult(
            rows=self.rows,
            version=self.clock.version,
            consumed=self.ledger.consumed,
            wall_s=time.perf_counter() - self._t0,
            checkpoint=self.last_checkpoint,
        )

    def _supervise(self) -> None:
        """Wait for the policy to finish, a failure, or a stall."""
        while not self._done.wait(0.05):
            if self._stop.is_set():
                return
            if time.monotonic() - self._progress_at > self.config.stall_timeout_s:
                waiting = ", ".join(f"{c.name}({len(c)})" for c in self.channels)
                self._fail("controller", None, TimeoutError(
                    f"no executor finished a step in {self.config.stall_timeout_s:.0f} s (channels: {waiting}); "
                    "a program is hung or far slower than stall_timeout_s allows"
                ))
                return

    def _halt(self) -> None:
        self._stop.set()
        self.clock.stop()
        for ch in self.channels:
            ch.close()

    def _join(self, timeout: float = 30.0) -> None:
        """Wait for the executor threads (each returns within one program step once halted)."""
        deadline = time.monotonic() + timeout
        for ex in self.executors.values():
            if ex.thread is not None:
                ex.thread.join(max(0.0, deadline - time.monotonic()))

    def _close_programs(self) -> None:
        for ex in self.executors.values():
            try:
                ex.program.close()
            except Exception:  # noqa: BLE001 - closing after a failure must not hide the failure
                pass

    def _fail(self, node: str, step: int | None, exc: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = (node, step, exc)
        self._halt()
        for ex in self.executors.values():  # unblock threads waiting on worker processes
            abort = getattr(ex.program, "abort", None)
            if abort is not None:
                abort()

    # -- one executor -------------------------------------------------------------------------------
    def _executor_main(self, ex: _Executor, start: int) -> None:
        set_thread_cores(ex.cores)
        if self.intra_op_threads is not None:  # no OpenMP team of its own (compute_threads): its group's compute thread has it
            set_intra_op_threads(1)
        seq: int | None = None
        end = self.config.steps
        for _gen, (feed, P, k) in self._continuous.items():
            if ex.name == feed:  # the generator reads k batches ahead, more after a resume skipped some
                end += k + 1 + self.ledger.extra_steps(P)
        try:
            for seq in range(start, end):
                if self._stop.is_set():
                    return
                self._step(ex, seq)
        except (ChannelClosed, ClockStopped):
            return
        except BaseException as exc:  # noqa: BLE001 - every failure ends the run, reported once
            self._fail(ex.name, seq, exc)

    def _step(self, ex: _Executor, seq: int) -> None:
        t_wait = time.perf_counter()
        inputs: dict[str, torch.Tensor] = {}
        if ex.name in self._continuous:
            inputs = self._read_ahead(ex, seq)
        for ch in ex.inputs if ex.name not in self._continuous else ():
            message = ch.get()
            if message.seq != seq:
                raise RuntimeError(f"executor {ex.name!r} expected step {seq} on {ch.name}, got {message.seq}")
            inputs.update(message.fields)
        idle = time.perf_counter() - t_wait
        if ex.inputs and idle > 1e-4:
            self.tracer.add(ex.name, "wait", t_wait, t_wait + idle, step=seq)
        min_version = -1
        if KINDS[ex.kind].waits_for_weights:
            min_version = self.gate.min_version(ex.name, seq)
            t = time.perf_counter()
            self.clock.wait_for(min_version)
            if time.perf_counter() - t > 1e-4:
                self.tracer.add(ex.name, "wait", t, time.perf_counter(), step=seq, reason=f"weights >= v{min_version}")
        elif (needed := self.graph.node(ex.name).version_needed(seq, self.updates)) >= 0:
            min_version = needed
            t = time.perf_counter()
            self.clock.wait_for(min_version)
            if time.perf_counter() - t > 1e-4:
                self.tracer.add(ex.name, "wait", t, time.perf_counter(), step=seq, reason=f"weights of v{min_version}")

        def run_step() -> tuple[dict[str, torch.Tensor], dict[str, Any], float, float]:
            if self._stop.is_set():
                raise ChannelClosed(ex.name)
            t_step = time.perf_counter()
            outputs, info = ex.program.step(seq, inputs, min_version)
            return outputs, info, t_step, time.perf_counter()

        outputs, info, t_step, t_end = ex.runner.call(run_step) if ex.runner is not None else run_step()
        self._trace_step(ex, seq, t_step, t_end, info)
        self._progress_at = time.monotonic()
        if KINDS[ex.kind].waits_for_weights:
            with self._lock:
                self._gen_info[(ex.name, seq)] = info
        elif not KINDS[ex.kind].publishes_weights and any("/" in key for key in info):  # a source's data/*, a reward model's counts
            with self._lock:
                self._source_info.setdefault(seq, {}).update({k: v for k, v in info.items() if "/" in k})
        elif KINDS[ex.kind].publishes_weights:
            self._on_train_step(ex, seq, inputs, info, idle)
        for ch, fields in ex.outputs:
            ch.put(Message(seq, {f: outputs[f] for f in fields if f in outputs or f not in OPTIONAL_FIELDS}))

    def _read_ahead(self, ex: _Executor, seq: int) -> dict[str, torch.Tensor]:
        """The prompts a continuous generator gets at ``seq``: enough that ``(1 + k) * P`` are
        undelivered (it may start groups up to ``k`` steps ahead), without those a resumed run
        delivered already (``PromptLedger.read_ahead``)."""
        _feed, P, k = self._continuous[ex.name]
        (ch,) = ex.inputs
        return self.ledger.read_ahead(ex.name, (seq - self._start_version + 1 + k) * P, lambda: ch.get().fields)

    def _trace_step(self, ex: _Executor, seq: int, t0: float, t1: float, info: dict[str, Any]) -> None:
        name = SPAN_NAMES.get(ex.kind, ex.kind)
        t0, t1, moves = trace_spans(t0, t1, info)  # colocated offloading: the state's moves, at the step's ends
        for move, start, end in moves:
            self.tracer.add(ex.name, move, start, end, step=seq)
        if KINDS[ex.kind].waits_for_weights and info.get("fetch_s", 0) > 0:
            fetch_end = t0 + info["fetch_s"]
            self.tracer.add(ex.name, "weight fetch", t0, fetch_end, step=seq, version=info.get("version"))
            self.tracer.add(ex.name, name, fetch_end, t1, step=seq, version=info.get("version"))
            if "slots/utilisation" in info:
                self.tracer.counter(ex.name, "slot occupancy", fetch_end, info["slots/utilisation"])
        elif KINDS[ex.kind].publishes_weights and "publish_s" in info:
            pub_start = t1 - info["publish_s"]
            self.tracer.add(ex.name, name, t0, pub_start, step=seq, version=info.get("version"))
            self.tracer.add(ex.name, "weight publish", pub_start, t1, step=seq, version=info.get("version"))
        else:
            self.tracer.add(ex.name, name, t0, t1, step=seq)

    # -- the trainer's side ---------------------------------------------------------------------------
    def _on_train_step(self, ex: _Executor, seq: int, batch: dict[str, torch.Tensor], info: dict[str, Any], idle: float) -> None:
        U = self.updates
        versions = batch.get("token_versions")
        tokens = (int(versions.min()), int(versions.max())) if versions is not None and versions.numel() else None
        rollout_version = self.gate.check(ex.name, seq, int(batch["rollout_version"]), tokens)
        gens = self.gate.gated_by(ex.name)
        version = int(info.get("version", U * (seq + 1)))
        every = self.config.checkpoint_every
        checkpoint = bool(self.config.checkpoint_dir and every and (seq + 1) % every == 0)  # every N steps (batches)
        if not checkpoint:
            self.clock.advance(version)
        gen = {}
        with self._lock:
            for g in gens:
                gen = self._gen_info.pop((g, seq), gen)
            source_metrics = self._source_info.pop(seq, {})
        row = step_row(
            seq=seq, version=version, rollout_version=rollout_version, batch=batch, info=info, gen=gen,
            reward_weights=self.reward_weights, time_s=time.perf_counter() - self._t0, idle_s=idle, updates=U,
        )
        row.update(source_metrics)
        logger = self._sample_loggers.get(ex.name)
        texts = logger(seq + 1, batch) if logger is not None else None  # every N trainer steps, as evaluations and checkpoints
        if texts:
            row["samples_text"] = texts
        consumed = row["prompt_index"]
        self.rows.append(row)
        evaluation = None
        if self._evaluator is not None and ex.name == self._eval_policy and (seq + 1) % self.config.eval_every == 0:  # every N steps
            evaluation = self._evaluator.submit(ex.program, version)  # the trainer waits for the save only
        self._unwritten.append((row, evaluation))
        self._write_rows(wait=False)
        self.ledger.consume(consumed)
        if checkpoint:  # before the clock moves on: a node gated on it (a critic) has not begun the next batch
            self._checkpoint_now(version)
            self.clock.advance(version)
        if seq + 1 >= self.config.steps:
            self._done.set()

    def _write_rows(self, *, wait: bool, drop: bool = False) -> None:
        """Write the complete rows at the head of ``_unwritten``: with ``wait``, all of them once their
        evaluations finish; with ``drop`` (after a failure), all of them, without the evaluations not
        finished. An evaluation that failed fails the run (its row is written without it)."""
        while self._unwritten:
            row, evaluation = self._unwritten[0]
            if evaluation is not None and (wait or evaluation.done()):
                try:
                    merge_eval(row, evaluation.result())
                except BaseException as exc:  # noqa: BLE001 - the evaluation's failure fails the run, reported once
                    step = int(row["step"])
                    error = NodeExecutionError(
                        f"evaluating policy {self._eval_policy!r} at version {row['policy_version']} (eval_every="
                        f"{self.config.eval_every}, eval_data={self.config.eval_data!r}) failed: {type(exc).__name__}: {exc}",
                        node=str(self._eval_policy), step=step,
                    )
                    error.__cause__ = exc
                    self._fail(str(self._eval_policy), step, error)
            elif evaluation is not None and not drop:
                return
            self._unwritten.popleft()
            self._metrics.write(row)
            if self.on_step is not None:
                self.on_step(row)

    # -- checkpoints ---------------------------------------------------------------------------------
    def _checkpoint_now(self, version: int | None = None) -> None:
        """Checkpoint the nodes that keep state at ``version`` (default: the clock's; ``resume.save_run_checkpoint``)."""
        assert self.config.checkpoint_dir is not None
        self._write_rows(wait=True)  # the metrics file covers every step the checkpoint does
        version = self.clock.version if version is None else version
        node_programs = {name: ex.program for name, ex in self.executors.items()}
        self.last_checkpoint = save_run_checkpoint(
            self.config.checkpoint_dir, self.graph, node_programs, version=version,
            data_position=self.ledger.watermark, previous=self.last_checkpoint,
            delivered_ahead=self.ledger.delivered_ahead(), keep=self.config.keep_checkpoints,
        )
        self._checkpoint_version = version

    def _restore(self) -> int:
        """Load the newest checkpoint into the programs (``resume.restore_run_checkpoint``); the version to start at."""
        assert self.config.checkpoint_dir is not None
        node_programs = {name: ex.program for name, ex in self.executors.items()}
        restored = restore_run_checkpoint(self.config.checkpoint_dir, self.graph, node_programs, steps=self.config.steps)
        if restored is None:
            return 0  # nothing to resume from: a fresh run (the CLI says so)
        self.ledger = PromptLedger(restored.data_position, restored.delivered_ahead)
        if self.ledger.skip and len(self._continuous) != len(self.graph.nodes_of_kind("generator")):
            from flowrl.errors import CheckpointError

            raise CheckpointError(
                f"checkpoint {restored.path} was written by a continuous-batching run ({len(self.ledger.skip)} prompts delivered "
                "out of order); resume it with the generator's batching='continuous'"
            )
        self.last_checkpoint = restored.path
        self._checkpoint_version = restored.version
        return restored.version
