"""The direct weight route in a torchrun job: the policy's ranks send straight into vLLM's workers.

Which edges (``direct_channels``; the rule is ``flowrl.placement.weight_routes.direct_edges``, the one
place that decides, which the planner prices too): a weight edge into a vLLM generator
whose transport is the default (``inprocess``), not in flight, without LoRA, in lock step, with no
user program at either end, from a policy on other ranks than the generator's. The generator may
have any mesh: ``dp`` replicas, each one vLLM engine of ``tp`` workers (``vllm_replicas``), all join
one weight-sync group of ``1 + dp * tp`` members whose rank 0 is the policy's sending rank, and one
broadcast per tensor reaches every worker of every engine (with ``tp`` > 1 each worker takes the
full tensor and vLLM's ``load_weights`` keeps its shard), as NeMo-RL, verl and OpenRLHF do it.
Such an edge's ``TransportSpec`` has the route ``"direct"`` (``weights.route``); the generator's program
hands its engine the route, whose hop is ``"direct"`` (vLLM starts with no staging copy), and its
sync is ``VLLMGenerator.take_direct`` over the route's channel (``route.DirectEnd``) at the
gate's minimum version (``GeneratorProgram._take_direct``; holding that version already, it asks only
when the lead's ``policy`` key says a newer one exists and the policy is between commands, so
sampling at k >= 1 does not wait for a step in progress). With several replicas the first replica's
engine rank decides and asks on behalf of all, and every other engine rank follows that request at
the same gate call (``vllm_direct.DirectReceiver.gate``): every broadcast reaches every engine, so
the engines hold one version after every gate call and the staleness bound holds for each. Every
other edge takes the hop route (the collective transport into each engine rank's staging copy, then
vLLM's weight-sync group): colocated ranks, LoRA adapters, ``file``/``shm``, continuous batching and
in-flight updates. Naming ``transport="collective"`` on the edge forces the hop.

The rendezvous and the requests go over the job's own store (``vllm_direct.Channel``, under
``<policy>-><generator>``). The policy's side is ``DirectPolicy``, which wraps each policy rank's
program: the requests are answered between the controller's commands (``flowrl.runtime.backends.process.worker.serve``
calls ``between_requests`` while it waits for the next one), so a generator asking while the policy waits for
its next batch (k = 0) is answered. With FSDP2 every rank gathers each bucket, so the ranks must
answer in the same order relative to their other collectives: the lead decides (it alone looks at
the request), writes ``order/<n>`` = the commands it had run before answering request ``n`` and
``cmd/<c>`` = the requests it had answered before command ``c``; the other ranks follow those keys
(a rank that got command ``c`` first answers the requests ordered before it, then runs it).
The lead also answers a due request before each command. A failure while idle is raised with the
policy's next command (the controller names the rank); the generator sees the sender's error or
its channel's timeout.
A replicated policy's lead sends alone.
"""

from __future__ import annotations

import time
from typing import Any

from flowrl.errors import TransportError
from flowrl.graph.ir import Graph
from flowrl.placement.weight_routes import direct_edges

__all__ = ["direct_channels", "store_channel", "DirectPolicy"]

POLL_S = 0.02


def direct_channels(graph: Graph, ranks: dict[str, tuple[int, ...]], programs: dict[str, str], pipelined: frozenset[str] = frozenset()) -> frozenset[str]:
    """The channels (``"<policy>-><generator>"``) of the weight edges that take the direct route: the
    rule is ``flowrl.placement.weight_routes.direct_edges``, which the planner prices too
    (``pipelined``: the policies split into pipeline stages, which take the hop)."""
    from flowrl.runtime.weights.torchrun_edges import channel

    return frozenset(channel(src, dst) for src, dst in direct_edges(graph, ranks, programs, pipelined))


def store_channel(ch: str) -> Any:
    """The edge's ``vllm_direct.Channel`` over the job's default store."""
    import torch.distributed as dist

    from flowrl.operators.engines.vllm_direct import Channel

    return Channel(dist.distributed_c10d._get_default_store(), ch)


class DirectPolicy:
    """A policy rank's program, answering the generators' requests on its direct edges between commands.

    ``program``: the rank's ``PolicyProgram`` (one rank), ``DataParallelPolicy`` or ``ShardedPolicy``;
    its direct edges are taken out of its publishing. ``lead``: whether this is the policy's first rank;
    ``sharded``: FSDP2 (every rank gathers); else only the lead takes part.
    """

    def __init__(self, program: Any, channels: list[str], *, lead: bool, sharded: bool, group: Any, device: Any) -> None:
        from flowrl.operators.engines.vllm_direct import DirectSender
        from flowrl.runtime.weights.torchrun_edges import channel

        self.program, self.lead, self.sharded = program, lead, sharded
        program._edges = [e for e in program._edges if channel(*e) not in channels]
        active = lead or sharded
        self._senders = {ch: DirectSender(store_channel(ch), sending=lead, group=group if sharded else None, device=device) for ch in channels} if active else {}
        self._connected: set[str] = set()
        self._closed: set[str] = set()
        self._commands = 0
        self._failed: BaseException | None = None
        self._said: tuple[int, bool] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.program, name)

    # -- the controller's commands, each after the requests the lead answered before it ----------
    def start(self) -> None:
        self._before()
        self.program.start()

    def seek(self, position: int) -> None:
        self._before()
        self.program.seek(position)

    def step(self, seq: int, inputs: Any, min_version: int) -> Any:
        self._before()
        return self.program.step(seq, inputs, min_version)

    def save(self, path: str) -> None:
        self._before()
        self.program.save(path)

    def snapshot(self, path: str) -> Any:
        """The policy's state taken now (``checkpointing.background.snapshot_or_save``); its write returned."""
        from flowrl.runtime.checkpointing.background import snapshot_or_save

        self._before()
        write = snapshot_or_save(self.program, path)
        return write if write is not None else (lambda: None)

    def load(self, path: str) -> None:
        self._before()
        self.program.load(path)

    def close(self) -> None:
        try:
            self.program.close()
        finally:
            for sender in self._senders.values():
                sender.close()

    def _before(self) -> None:
        if self._failed is not None:
            raise TransportError(f"the direct weight route failed while the policy waited for its next command: {self._failed}") from self._failed
        c = self._commands
        if self.lead:
            self._poll()  # a request already due goes before the command (the generator waits on it)
            self._say(busy=True)
        for ch, sender in self._senders.items():
            key = f"cmd/{c}"
            if self.lead:
                sender.channel.put(key, sender.requests)
                continue
            self._follow(ch, sender, key)
        self._commands = c + 1

    def _follow(self, ch: str, sender: Any, key: str) -> None:
        """A non-lead rank before a command: answer the requests the lead answered before it (the lead
        may be gathering one now, before it writes ``key``), then go on."""
        deadline = time.monotonic() + sender.channel.timeout_s
        while True:
            if sender.channel.has(f"order/{sender.requests}"):
                self._serve(ch, sender)
            elif sender.channel.has(key):
                answered = int(sender.channel.take(key, what=f"the policy lead's {key}"))
                while sender.requests < answered:
                    self._serve(ch, sender)
                return
            elif time.monotonic() > deadline:
                raise TransportError(f"direct weight route {ch!r}: the policy's lead wrote no {key!r} within {sender.channel.timeout_s:.0f} s")
            else:
                time.sleep(POLL_S / 4)

    # -- between commands ------------------------------------------------------------------------
    def between_requests(self) -> None:
        """Answer what is due on each direct edge (``worker.serve`` calls it while no command is there)."""
        if self._failed is not None:
            return
        try:
            self._poll()
            if self.lead:
                self._say(busy=False)
        except BaseException as exc:  # reported to the controller with the next command
            self._failed = exc

    def _say(self, *, busy: bool) -> None:
        """The lead's ``policy`` key: its newest version and whether it is between commands (the
        generator asks for a newer version than it needs only then: ``GeneratorProgram._take_direct``)."""
        said = (self.program.trainer.version, not busy)
        if said == self._said:
            return
        self._said = said
        for sender in self._senders.values():
            sender.channel.put("policy", {"version": said[0], "idle": said[1]})

    def _poll(self) -> None:
        for ch, sender in self._senders.items():
            if ch in self._closed:
                continue
            if ch not in self._connected:
                if not sender.channel.has("hello/0"):
                    continue
                sender.connect()  # the sending rank: blocks until vLLM's workers joined
                self._connected.add(ch)
            n = sender.requests
            if self.lead:
                if not sender.channel.has(f"want/{n}"):
                    continue
                want = sender.channel.take(f"want/{n}", what=f"weight request {n}")
                if want.get("closed"):
                    self._closed.add(ch)
                    continue
                if int(want["min_version"]) > self.program.trainer.version:
                    continue  # after the next step
                sender.channel.put(f"order/{n}", self._commands)
                self._serve(ch, sender)
            elif sender.channel.has(f"order/{n}"):
                self._serve(ch, sender)

    def _serve(self, ch: str, sender: Any) -> None:
        n = sender.requests
        at = int(sender.channel.take(f"order/{n}", what=f"the policy lead's order of request {n}"))
        if at != self._commands:
            raise TransportError(f"direct weight route {ch!r}: the lead answered request {n} after {at} commands, this rank is at {self._commands}")
        if ch not in self._connected:
            sender.connect()
            self._connected.add(ch)
        version = self.program.trainer.version
        if not sender.serve(self._state(), version):
            raise TransportError(f"direct weight route {ch!r}: request {n} could not be answered with version {version} on this rank")

    def _state(self) -> dict[str, Any]:
        if self.sharded:
            from flowrl.runtime.parallel.fsdp import _named

            return _named(self.program.trainer.model)  # DTensors: each bucket gathered by every rank
        return self.program.trainer.weights()


def wait_for_command(sock: Any, work: Any) -> None:
    """Block until ``sock`` has data, calling ``work()`` every ``POLL_S`` meanwhile."""
    import select

    while True:
        readable, _, _ = select.select([sock], [], [], POLL_S)
        if readable:
            return
        work()
