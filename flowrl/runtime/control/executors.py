"""A run's executors: one thread per node (a loss runs inside its policy's), wired by bounded channels.

- ``executors``: node name -> ``Executor`` (its program, its input channels, its output channels
  with the fields each carries, its colocation group's step runner, its pinned cores, its thread).
- ``channels``: one bounded FIFO per executor-level data edge; an edge into a loss goes to the
  loss's policy, and a loss -> policy edge is no channel. A full channel blocks its producer:
  nothing is dropped.
- ``runners``: one step runner per colocation group of the placement (``compute_threads``): the
  group's steps run one at a time, so executors that share devices never run at the same time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flowrl.graph.ir import Graph
from flowrl.graph.kinds import KINDS
from flowrl.placement.layout import Placement
from flowrl.runtime.control.channels import Channel
from flowrl.runtime.control.compute_threads import StepRunner, group_runners, set_thread_cores
from flowrl.runtime.parallel.threads import set_intra_op_threads
from flowrl.runtime.programs.nodes import NodeProgram

__all__ = ["Executor", "Executors"]


@dataclass
class Executor:
    """One node's executor (see the module docstring)."""

    name: str
    kind: str
    program: NodeProgram
    inputs: list[Channel] = field(default_factory=list)
    outputs: list[tuple[Channel, tuple[str, ...]]] = field(default_factory=list)
    runner: StepRunner | None = None
    cores: tuple[int, ...] = ()
    thread: threading.Thread | None = None

    def take(self, seq: int) -> dict[str, torch.Tensor]:
        """Message ``seq`` from each input channel, its fields merged (the channels are FIFOs: another seq is a bug)."""
        inputs: dict[str, torch.Tensor] = {}
        for ch in self.inputs:
            if (message := ch.get()).seq != seq:
                raise RuntimeError(f"executor {self.name!r} expected step {seq} on {ch.name}, got {message.seq}")
            inputs.update(message.fields)
        return inputs


class Executors:
    """The executors of ``graph``'s nodes with ``programs`` on ``placement``, channels of ``capacity``
    messages; ``intra_op_threads`` sizes each colocation group's compute thread (None: a lock)."""

    def __init__(
        self, graph: Graph, programs: dict[str, NodeProgram], placement: Placement, *, capacity: int, intra_op_threads: int | None,
    ) -> None:  # fmt: skip
        cores, self.intra_op_threads = (placement.devices if placement.pin else {}), intra_op_threads
        self.runners = group_runners(placement.groups(), intra_op_threads=intra_op_threads, cores=cores)
        runs_in = {n.name: graph.users(n.name)[0].name for n in graph.nodes if KINDS[n.kind].runs_on == "policy"}  # loss -> policy
        self.executors = {
            n.name: Executor(n.name, n.kind, programs[n.name], runner=self.runners.get(n.name), cores=tuple(cores.get(n.name, ())))
            for n in graph.nodes if n.name not in runs_in
        }
        self.channels: list[Channel] = []
        for edge in graph.edges:
            src, dst = runs_in.get(edge.src, edge.src), runs_in.get(edge.dst, edge.dst)
            if src != dst:  # loss -> its policy: the same executor
                self.channels.append(ch := Channel(f"{edge.src}->{edge.dst}", capacity))
                self.executors[src].outputs.append((ch, tuple(edge.fields)))
                self.executors[dst].inputs.append(ch)

    def programs(self) -> dict[str, NodeProgram]:
        """Node name -> program, for every executor."""
        return {name: ex.program for name, ex in self.executors.items()}

    def start(self, main: Callable[[Executor], None]) -> None:
        """Start every program, then run ``main(executor)`` on one daemon thread per executor, pinned to its cores."""
        for ex in self.executors.values():
            ex.program.start()
        for ex in self.executors.values():
            ex.thread = threading.Thread(target=self._thread, args=(ex, main), name=f"flowrl-{ex.name}", daemon=True)
            ex.thread.start()

    def _thread(self, ex: Executor, main: Callable[[Executor], None]) -> None:
        set_thread_cores(ex.cores)
        if self.intra_op_threads is not None:  # no OpenMP team of its own (compute_threads): its group's compute thread has it
            set_intra_op_threads(1)
        main(ex)

    def close_channels(self) -> None:
        """Close every channel: a blocked ``get`` or ``put`` raises ``ChannelClosed``."""
        for ch in self.channels:
            ch.close()

    def abort(self) -> None:
        """Unblock threads waiting on worker processes (programs that have an ``abort``)."""
        for ex in self.executors.values():
            if (abort := getattr(ex.program, "abort", None)) is not None:
                abort()

    def join(self, timeout: float = 30.0) -> None:
        """Wait for the executor threads (each returns within one program step once halted)."""
        deadline = time.monotonic() + timeout
        for ex in self.executors.values():
            if ex.thread is not None:
                ex.thread.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Close every program (errors ignored: closing after a failure must not hide the failure)."""
        for ex in self.executors.values():
            try:
                ex.program.close()
            except Exception:  # noqa: BLE001 - closing after a failure must not hide the failure
                pass

    def close_runners(self) -> None:
        """Stop the colocation groups' compute threads."""
        for runner in self.runners.values():
            runner.close()

    def describe(self) -> str:
        """Each channel with the messages it holds, for a stall's error."""
        return ", ".join(f"{c.name}({len(c)})" for c in self.channels)
