"""The controller's proxy of a node program that runs elsewhere: ``RemoteProgram`` over a ``Link``.

A remote program has the methods of a local one (``start``, ``seek``, ``step``, ``save``, ``snapshot``,
``load``, ``close``; ``snapshot``: the peers take the state now and write it behind their steps, and
the write it returns polls them, between steps, until every file is on disk); each call is one request to the program's *peers* (the workers serving it, answering
``flowrl.runtime.backends.process.worker.serve``) and one reply from each. The proxy owns what every backend shares:
the order (every request goes to every peer before any reply is read, since peers may meet in
collectives inside the request), the lock (one call at a time), which peers a call needs (``seek``
and ``save`` go to the lead only: every peer holds the same state; ``save`` goes to every peer of a
program built with ``save_on_every_peer``, whose peers hold shards and each write their own: ``sharded_state``) and reading the replies (only the
lead gets the input tensors and returns outputs and info). What differs per backend is its ``Link``:
how a message reaches a peer and comes back, and which error names a peer that died or raised.

- ``process``: one peer, a worker process over a socket pair (``backends.process.backend.WorkerLink``);
- ``torchrun``: one peer per rank of the node, lead first (``backends.torchrun.backend.RankLinks``).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from flowrl.errors import FlowrlError
from flowrl.runtime.programs.nodes import Batch, Info
from flowrl.runtime.wire import ConnectionLost

__all__ = ["Link", "RemoteProgram"]

Reply = tuple[dict[str, Any], Batch]

#: How often a checkpoint's write behind training asks the peers whether it is on disk (between steps).
WRITTEN_POLL_S = 0.05


class Link(Protocol):
    """How the controller reaches the peers of one node program, a message at a time.

    ``peers`` lists the peers' ids, lead first. ``send`` and ``recv`` may raise ``OSError`` or
    ``wire.ConnectionLost`` for a peer that is gone; the proxy then raises ``died(peer)``.
    ``closes_with_controller`` says whether the controller's ``close`` ends the program (else the
    backend ends it itself, with ``RemoteProgram.shutdown``).
    """

    peers: tuple[int, ...]
    closes_with_controller: bool

    def send(self, peer: int, header: dict[str, Any], tensors: Batch | None) -> None:
        """Send one request to ``peer``."""
        ...

    def recv(self, peer: int) -> Reply:
        """Read ``peer``'s next reply."""
        ...

    def died(self, peer: int) -> FlowrlError:
        """The error for a peer whose connection closed (it exited or was killed)."""
        ...

    def raised(self, failures: list[tuple[int, dict[str, Any]]], *, starting: bool) -> FlowrlError:
        """The error for the peers that answered ``{"ok": false, ...}`` (peer, reply), ``starting``
        when the request was the program's init (building it)."""
        ...

    def abort(self) -> None:
        """End the peers' side now (after a failure elsewhere), so a call waiting on them returns."""
        ...

    def closing(self) -> bool:
        """Prepare the close request (bound the wait for its reply); False when no peer can answer."""
        ...

    def release(self) -> None:
        """After the close request (or without one): let the peers go and close the connections."""
        ...


class RemoteProgram:
    """A node program served by peers elsewhere; the controller's executor thread calls it like a local one."""

    def __init__(self, node: str, link: Link, *, save_on_every_peer: bool = False, one_file: bool = False) -> None:
        self.node = node
        self.link = link
        self.save_on_every_peer = save_on_every_peer  # an FSDP policy: every rank writes its shards
        self.one_file = one_file  # with save_on_every_peer: every peer takes part in gathering one file (a tensor-parallel critic)
        self._lock = threading.Lock()

    @property
    def sharded_state(self) -> bool:
        """Whether ``save`` writes a sharded state (a directory of every peer's shards,
        ``flowrl.runtime.checkpointing.sharded_state``) rather than one file: a program whose peers hold
        shards, unless they gather them into one file (``one_file``)."""
        return self.save_on_every_peer and not self.one_file

    def _send(self, header: dict[str, Any], tensors: Batch | None, peers: tuple[int, ...]) -> None:
        lead = self.link.peers[0]
        for p in peers:
            try:
                self.link.send(p, header, tensors if p == lead else None)
            except (ConnectionLost, OSError):
                raise self.link.died(p) from None

    def _receive(self, peers: tuple[int, ...], *, starting: bool = False) -> Reply:
        """Every peer's reply; the lead's is returned. Raises the link's error for a peer that died
        (at once) or for the peers that raised (after every reply is in)."""
        lead = self.link.peers[0]
        lead_reply: Reply = ({}, {})
        failures = []
        for p in peers:
            try:
                reply, out = self.link.recv(p)
            except (ConnectionLost, OSError):
                raise self.link.died(p) from None
            if not reply.get("ok"):
                failures.append((p, reply))
            elif p == lead:
                lead_reply = (reply, out)
        if failures:
            raise self.link.raised(failures, starting=starting)
        return lead_reply

    def _call(self, header: dict[str, Any], tensors: Batch | None = None, *, lead_only: bool = False) -> Reply:
        peers = self.link.peers[:1] if lead_only else self.link.peers
        with self._lock:
            self._send(header, tensors, peers)
            return self._receive(peers)

    def open(self, init: dict[str, Any]) -> None:
        """Send every peer the init message (its reply is read by ``ready``, so several programs can build at once)."""
        with self._lock:
            self._send(init, None, self.link.peers)

    def ready(self) -> None:
        """Wait for every peer's answer to its init message."""
        with self._lock:
            self._receive(self.link.peers, starting=True)

    def start(self) -> None:
        self._call({"op": "start"})

    def seek(self, position: int) -> None:
        self._call({"op": "seek", "position": position}, lead_only=True)

    def step(self, seq: int, inputs: Batch, min_version: int) -> tuple[Batch, Info]:
        reply, outputs = self._call({"op": "step", "seq": seq, "min_version": min_version}, inputs)
        return outputs, reply.get("info", {})

    def save(self, path: str) -> None:
        self._call({"op": "save", "path": path}, lead_only=not self.save_on_every_peer)  # else peers hold the same state

    def snapshot(self, path: str) -> Any:
        """The state taken on the peers now (``save``'s peers; each writes behind its steps); returns the
        wait for their writes, which asks them between steps (``written``) until every one is done."""
        lead_only = not self.save_on_every_peer
        self._call({"op": "snapshot", "path": path}, lead_only=lead_only)

        def write() -> None:
            peers = self.link.peers[:1] if lead_only else self.link.peers
            while True:
                with self._lock:
                    self._send({"op": "written"}, None, peers)
                    answers = []
                    for p in peers:  # every peer's answer: the lead's alone does not say the others' files are written
                        try:
                            answers.append((p, self.link.recv(p)[0]))
                        except (ConnectionLost, OSError):
                            raise self.link.died(p) from None
                failed = [(p, r) for p, r in answers if not r.get("ok")]
                if failed:
                    raise self.link.raised(failed, starting=False)
                if all(r.get("done") for _, r in answers):
                    return
                time.sleep(WRITTEN_POLL_S)

        return write

    def load(self, path: str) -> None:
        self._call({"op": "load", "path": path})

    def abort(self) -> None:
        """After a failure elsewhere: end the peers' side, which unblocks a thread waiting on them."""
        self.link.abort()

    def close(self) -> None:
        """The controller is done with the program: end it now, or leave it to the backend's ``shutdown``."""
        if self.link.closes_with_controller:
            self.shutdown()

    def shutdown(self) -> None:
        """Close the program on every peer (errors ignored: the run is ending), then release the link."""
        try:
            if self.link.closing():
                self._call({"op": "close"})
        except (FlowrlError, OSError):
            pass
        self.link.release()
