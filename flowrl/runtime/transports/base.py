"""The weight-transport protocol: publish a versioned state on one side, fetch the newest on the other.

A *state* is ``dict[str, torch.Tensor]`` (parameter name -> tensor), the same names, shapes and
dtypes at every publish of one transport. Versions are the policy's version clock (completed
optimizer steps) and only grow.

Contract every transport keeps (checked by ``tests/runtime/transports/conformance.py``):

- ``publish(state, version)`` copies ``state`` before it returns (the trainer may then change its
  tensors) and takes no longer than that copy needs; ``version`` must exceed the last published one.
- ``latest_version()`` is the newest complete version, ``-1`` before the first publish.
- ``fetch_into(target, newer_than=v)`` copies the newest complete state into ``target``'s tensors in
  place (casting dtype if they differ) and returns its version, or returns ``None`` if nothing newer
  than ``v`` is published. A fetch concurrent with publishes never returns a torn state: every tensor
  comes from the version it returns.
- ``close()`` releases what the transport holds (shared memory, files, threads); idempotent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch

__all__ = ["WeightTransport", "State"]

State = Mapping[str, torch.Tensor]


@runtime_checkable
class WeightTransport(Protocol):
    """What the runtime needs from a way of moving weights; see the module docstring for the contract."""

    name: str

    def publish(self, state: State, version: int) -> None: ...

    def latest_version(self) -> int: ...

    def fetch_into(self, target: Mapping[str, torch.Tensor], *, newer_than: int = -1) -> int | None: ...

    def close(self) -> None: ...
