"""The row sink: where a run's metrics rows go, in step order, with their samples and evaluations.

A row (``metrics.step_row``, one per trainer step) is taken by ``add``, which decodes samples into it
(``RunConfig.log_samples``: ``samples.SampleLogger``) and submits an evaluation of the policy's version
(``RunConfig.eval_every``: a ``Future`` from ``evaluation.Evaluator``). A row is written (the metrics
file, ``metrics.MetricsWriter``; then ``on_step``: the CLI's progress bar, TensorBoard and W&B) once
it and every row before it are complete.

State (the policy executor's thread, then the controller's once the executors are joined):

- ``rows``: every row added, in step order (``RunResult.rows``).
- ``_gen_info`` / ``_source_info`` (``_lock``: the executors' threads write, the policy's reads):
  per step, the generators' info and the other nodes' namespaced metrics (a source's ``data/*``, a
  reward model's ``judge/unparsed/<node>``), for the trainer's row of that step (``noted``).
- ``_unwritten``: rows not yet written, each with the evaluation it waits for (None: none).
- ``_layouts`` (``_lock``): node -> its layout as it runs (``observe.layout``): the controller's
  one-process records, replaced by what a program over several ranks reports at its first step;
  the run's first row carries them (``"layout"``; the row of step 1, so that a resumed run's rows
  are those of a run without the interruption).

Cadences count trainer steps (the row's ``step`` = ``seq + 1``): samples and evaluations fire after
step ``seq`` when ``(seq + 1) % N == 0``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from flowrl.errors import NodeExecutionError
from flowrl.graph.kinds import KINDS
from flowrl.graph.nodes import LossNode
from flowrl.runtime.evaluation.during_run import Evaluator, merge_eval
from flowrl.runtime.observe.layout import LAYOUT_KEY
from flowrl.runtime.observe.metrics import MetricsWriter, step_row
from flowrl.runtime.observe.samples import SampleLogger

if TYPE_CHECKING:
    import torch

    from flowrl.graph.ir import Graph
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.programs.nodes import NodeProgram

__all__ = ["RowSink"]

Row = dict[str, Any]


class RowSink:
    """A run's metrics rows, samples and evaluations (see the module docstring).

    Args:
        graph: the running graph.
        config: the run configuration (``metrics``, ``log_samples``, ``eval_every`` and the eval settings).
        on_step: called with each written row.
        fail: called with ``(node, step, error)`` when an evaluation failed (it fails the run).
    """

    def __init__(
        self, graph: Graph, config: RunConfig, *, on_step: Callable[[Row], None] | None = None,
        fail: Callable[[str, int, BaseException], None] | None = None,
    ) -> None:  # fmt: skip
        self.graph, self.config, self.on_step, self._fail = graph, config, on_step, fail
        self.rows: list[Row] = []
        self._lock = threading.Lock()
        self._gen_info: dict[tuple[str, int], dict[str, Any]] = {}
        self._source_info: dict[int, dict[str, Any]] = {}
        self._unwritten: deque[tuple[Row, Future[dict[str, float]] | None]] = deque()
        self._layouts: dict[str, dict[str, Any]] = {}
        self.reward_weights: dict[str, float] = {}
        for loss in graph.nodes_of(LossNode):
            self.reward_weights.update(loss.loss.reward_weights)
        self._sample_loggers = {  # --log-samples: decoded samples in the rows of the trainers' steps
            node.name: SampleLogger(graph, node.name, every=config.log_samples, reward_weights=self.reward_weights)
            for node in graph.nodes
            if KINDS[node.kind].publishes_weights
        } if config.log_samples else {}
        # --eval-every: the first policy that feeds a generator is the one evaluated
        self.eval_policy = next((e.src for e in graph.weight_edges if KINDS[graph.node(e.dst).kind].waits_for_weights), None)
        self.evaluator: Evaluator | None = None
        self._metrics = MetricsWriter(None)

    def open(self, start: int) -> None:
        """Open the metrics file (a resumed run, ``start`` > 0: kept through step ``start``) and the evaluator."""
        self._metrics = MetricsWriter(self.config.metrics, append=self.config.resume and start > 0, keep_through=start)
        if self.config.eval_every and self.eval_policy is not None:
            assert self.config.eval_data is not None  # RunConfig refuses eval_every without it
            self.evaluator = Evaluator(
                self.graph, self.eval_policy, data=self.config.eval_data, samples=self.config.eval_samples,
                pass_reward=self.config.eval_pass_reward, seed=self.config.seed,
            )

    def note(self, node: str, seq: int, info: dict[str, Any], *, generator: bool) -> None:
        """Keep what ``node``'s step ``seq`` reported for that step's row: a ``generator``'s whole info,
        another node's namespaced keys (``"data/epoch"``, ...)."""
        with self._lock:
            if generator:
                self._gen_info[(node, seq)] = info
            elif any("/" in key for key in info):
                self._source_info.setdefault(seq, {}).update({k: v for k, v in info.items() if "/" in k})

    def note_layout(self, node: str, layout: dict[str, Any]) -> None:
        """Keep ``node``'s layout as it runs (``observe.layout``) for the run's first row."""
        with self._lock:
            self._layouts[node] = layout

    def noted(self, seq: int, *, generators: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Take step ``seq``'s notes: the info of the last of ``generators`` that noted one, and the other nodes' metrics."""
        gen: dict[str, Any] = {}
        with self._lock:
            for g in generators:
                gen = self._gen_info.pop((g, seq), gen)
            return gen, self._source_info.pop(seq, {})

    def add_step(self, policy: str, seq: int, *, version: int, generators: list[str], program: NodeProgram, **measured: Any) -> Row:
        """Build and ``add`` step ``seq``'s row: ``measured`` (the batch, the trainer's info, its
        ``rollout_version``, ``time_s``, ``idle_s``, ``updates``) with what ``generators`` and the
        other nodes noted for it (``metrics.step_row``); the row."""
        gen, source_metrics = self.noted(seq, generators=generators)
        row = step_row(seq=seq, version=version, gen=gen, reward_weights=self.reward_weights, **measured)
        row.update(source_metrics)
        self.add(row, policy=policy, seq=seq, version=version, batch=measured["batch"], program=program)
        return row

    def add(self, row: Row, *, policy: str, seq: int, version: int, batch: dict[str, torch.Tensor], program: NodeProgram) -> None:
        """Take step ``seq``'s row from ``policy`` at ``version`` (its ``batch`` for samples, its ``program`` to evaluate)."""
        logger = self._sample_loggers.get(policy)
        texts = logger(seq + 1, batch) if logger is not None else None  # every N trainer steps, as evaluations and checkpoints
        if texts:
            row["samples_text"] = texts
        if not self.rows and int(row["step"]) == 1:  # a run's first row: each node's devices, sub-mesh and what runs (observe.layout)
            with self._lock:
                row[LAYOUT_KEY] = {n.name: self._layouts[n.name] for n in self.graph.nodes if n.name in self._layouts}  # graph order
        self.rows.append(row)
        evaluation = None
        if self.evaluator is not None and policy == self.eval_policy and (seq + 1) % self.config.eval_every == 0:
            evaluation = self.evaluator.submit(program, version)  # the trainer waits for the save only
        self._unwritten.append((row, evaluation))
        self.write(wait=False)

    def write(self, *, wait: bool, drop: bool = False) -> None:
        """Write the complete rows at the head of the queue: with ``wait``, all of them once their
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
                        f"evaluating policy {self.eval_policy!r} at version {row['policy_version']} (eval_every="
                        f"{self.config.eval_every}, eval_data={self.config.eval_data!r}) failed: {type(exc).__name__}: {exc}",
                        node=str(self.eval_policy), step=step,
                    )
                    error.__cause__ = exc
                    if self._fail is None:
                        raise error from exc
                    self._fail(str(self.eval_policy), step, error)
            elif evaluation is not None and not drop:
                return
            self._unwritten.popleft()
            self._metrics.write(row)
            if self.on_step is not None:
                self.on_step(row)

    def close(self, *, wait: bool) -> None:
        """Write every row (``wait``: with their evaluations; else without those not finished), close the files."""
        try:
            self.write(wait=wait, drop=True)
        finally:
            if self.evaluator is not None:
                self.evaluator.close()
            self._metrics.close()
