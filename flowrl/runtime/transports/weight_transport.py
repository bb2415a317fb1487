"""The weight-transport protocol: publish a versioned state on one side, fetch the newest on the other.

A *state* is ``dict[str, torch.Tensor]`` (parameter name -> tensor), the same names, shapes and
dtypes at every publish of one transport (its *layout*, fixed by the first publish). Versions are the
policy's version clock (completed optimizer steps): non-negative and strictly increasing.

Contract every transport keeps (checked by ``tests/runtime/transports/conformance.py``):

- ``publish(state, version)`` copies ``state`` before it returns (the trainer may then change its
  tensors) and takes no longer than that copy needs; ``version`` must exceed the last published one,
  and ``state`` must have the transport's layout (``TransportError`` otherwise, naming the tensor).
- ``latest_version()`` is the newest complete version, ``-1`` before the first publish.
- ``fetch_into(target, newer_than=v)`` copies the newest complete state into ``target``'s tensors in
  place (casting dtype if they differ) and returns its version, or returns ``None`` if nothing newer
  than ``v`` is published. ``target`` must have the same names and shapes as the published state
  (``TransportError`` naming the tensor otherwise, raised before any tensor is written). A fetch
  concurrent with publishes never returns a torn state: every tensor comes from the version it
  returns.
- ``close()`` releases what the transport holds (shared memory, files, threads); idempotent. Any
  other call after ``close()`` raises ``TransportError``.
- ``name`` is the transport's registry name (``"inprocess"``, ``"shm"``, ...), not an instance name.
- ``traits`` (a class attribute, ``registry.TransportTraits``) says what it is: whether it crosses
  processes and hosts, which options open it, how the planner costs it. Backends and the planner
  read it instead of the name; a user factory without one gets the defaults.

A transport is opened on each side of a weight edge from plain keyword options (msgspec-encodable:
str, int, float, bool, None), because the process backend sends them to another process.

The helpers below (``StateLayout``, ``layout_of``, ``check_*``, ``copy_tensor``) are shared by every
built-in transport, so that all of them fail the same way with the same messages and copy the same way.

Devices: a state or a target may hold CUDA tensors (a trainer or a generator on a GPU). Every copy
goes through ``copy_tensor``, whose raw memcpy is taken only between CPU tensors
(``memcpy_applies``); a copy into or out of a CUDA tensor is torch's ``copy_`` (a synchronous
device <-> host transfer), so shared memory and files, which hold CPU bytes, stage through the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import msgspec
import numpy as np
import torch

from flowrl.errors import TransportError

__all__ = [
    "WeightTransport",
    "State",
    "TensorSpec",
    "StateLayout",
    "layout_of",
    "dtype_name",
    "dtype_from_name",
    "ALIGN",
    "check_version",
    "check_state",
    "check_target",
    "copy_tensor",
    "memcpy_applies",
]

State = Mapping[str, torch.Tensor]


@runtime_checkable
class WeightTransport(Protocol):
    """What the runtime needs from a way of moving weights; see the module docstring for the contract.

    Example:
        >>> from flowrl.runtime.transports import create_transport
        >>> t = create_transport("inprocess")
        >>> t.publish({"w": torch.ones(2)}, version=0)
        >>> target = {"w": torch.zeros(2)}
        >>> t.fetch_into(target), target["w"].tolist(), t.fetch_into(target, newer_than=0)
        (0, [1.0, 1.0], None)
        >>> t.close()
    """

    name: str

    def publish(self, state: State, version: int) -> None: ...

    def latest_version(self) -> int: ...

    def fetch_into(self, target: Mapping[str, torch.Tensor], *, newer_than: int = -1) -> int | None: ...

    def close(self) -> None: ...


class TensorSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One tensor of a state layout, placed at ``offset`` bytes in a flat buffer.

    Attributes:
        name: the state key (parameter name).
        dtype: torch dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``.
        shape: the tensor's shape; ``()`` for a 0-dim tensor.
        offset: byte offset in the buffer holding the state (a multiple of ``ALIGN``).
        nbytes: bytes the tensor takes (``numel * itemsize``).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class StateLayout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Names, dtypes, shapes and byte offsets of a state, in publish order; ``nbytes`` spans them all."""

    tensors: tuple[TensorSpec, ...]
    nbytes: int


#: Byte alignment of every tensor in a flat layout (a cache line; enough for any dtype view).
ALIGN = 64


def _align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; ``TransportError`` for anything that is not a torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TransportError(f"unknown dtype {name!r} in a weight-state layout; expected a torch dtype name such as 'float32'")
    return dtype


def layout_of(state: State, *, transport: str = "transport") -> StateLayout:
    """The layout of ``state``: each tensor at an ``ALIGN``-aligned offset, in the state's order.

    Raises:
        TransportError: if a key is not a string or a value is not a tensor.
    """
    specs, offset = [], 0
    for name, tensor in state.items():
        if not isinstance(name, str):
            raise TransportError(f"{transport}: state key {name!r} is not a string; a state maps parameter names to tensors")
        if not isinstance(tensor, torch.Tensor):
            raise TransportError(
                f"{transport}: state entry {name!r} is a {type(tensor).__name__}, not a torch.Tensor; publish tensors only"
            )
        nbytes = tensor.numel() * tensor.element_size()
        specs.append(TensorSpec(name=name, dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape), offset=offset, nbytes=nbytes))
        offset = _align(offset + nbytes)
    return StateLayout(tensors=tuple(specs), nbytes=offset)


def check_version(transport: str, version: int, last: int) -> None:
    """Versions are non-negative ints and strictly increase from one publish to the next."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise TransportError(f"{transport}: version {version!r} is a {type(version).__name__}; versions are ints (the policy's step count)")
    if version < 0:
        raise TransportError(f"{transport}: version {version} is negative; versions count optimizer steps from 0 (-1 means 'nothing published')")
    if version <= last:
        raise TransportError(
            f"{transport}: version {version} published after version {last}; versions must strictly increase "
            f"(publish once per optimizer step with the policy's version clock)"
        )


def check_state(transport: str, layout: StateLayout, state: State, version: int) -> None:
    """``state`` has exactly the names, shapes and dtypes of ``layout`` (fixed by the first publish)."""
    _check_names(transport, layout, state, what="state", at=f" at version {version}",
                 fix="a transport carries one layout; open a new transport for a different model")
    for spec in layout.tensors:
        tensor = state[spec.name]
        if not isinstance(tensor, torch.Tensor):
            raise TransportError(f"{transport}: state entry {spec.name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tuple(tensor.shape) != spec.shape or dtype_name(tensor.dtype) != spec.dtype:
            raise TransportError(
                f"{transport}: tensor {spec.name!r} is {dtype_name(tensor.dtype)}{list(tensor.shape)} at version {version}, "
                f"but the transport's layout (fixed by its first publish) has {spec.dtype}{list(spec.shape)}; "
                f"a transport carries one layout, open a new transport for a different model"
            )


def check_target(transport: str, layout: StateLayout, target: Mapping[str, torch.Tensor]) -> None:
    """``target`` has exactly the names and shapes of the published ``layout`` (dtypes may differ: they are cast)."""
    _check_names(transport, layout, target, what="target", at="",
                 fix="fetch into a model with the same parameters as the publisher's")
    for spec in layout.tensors:
        tensor = target[spec.name]
        if not isinstance(tensor, torch.Tensor):
            raise TransportError(f"{transport}: target entry {spec.name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tuple(tensor.shape) != spec.shape:
            raise TransportError(
                f"{transport}: target tensor {spec.name!r} has shape {list(tensor.shape)} but the published one has "
                f"{list(spec.shape)}; fetch into a model with the same parameters as the publisher's"
            )


def _check_names(transport: str, layout: StateLayout, given: Mapping[str, object], *, what: str, at: str, fix: str) -> None:
    expected = [t.name for t in layout.tensors]
    missing = [n for n in expected if n not in given]
    if not missing and len(given) == len(expected):
        return
    known = set(expected)
    extra = [n for n in given if n not in known]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"lacks tensor(s) {_names(missing)}")
        if extra:
            parts.append(f"has tensor(s) {_names(extra)} that the published state does not")
        raise TransportError(f"{transport}: the {what}{at} {' and '.join(parts)}; {fix}")


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def memcpy_applies(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``copy_tensor`` may copy ``src`` into ``dst`` with a raw memcpy: both strided,
    contiguous, on the CPU (never a CUDA pointer), of one dtype and size.

    Example:
        >>> memcpy_applies(torch.zeros(3), torch.ones(3)), memcpy_applies(torch.zeros(3), torch.ones(3, dtype=torch.float16))
        (True, False)
    """
    return (
        dst.layout == torch.strided
        and src.layout == torch.strided
        and dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.numel() == src.numel()
        and dst.is_contiguous()
        and src.is_contiguous()
    )


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` without autograd; a single-threaded memcpy when ``memcpy_applies`` (both
    contiguous CPU tensors of one dtype and size), ``torch``'s ``copy_`` (casts, devices, strides) otherwise.

    Why not always ``copy_``: it splits every copy across torch's intra-op threads and joins them
    at a barrier. On a busy machine (the runtime's executors share few cores) a descheduled thread
    stalls each barrier, once per tensor: on the 2-core dev box under load, ``copy_`` over a
    43-tensor, 96 MB state ran at 0.15 GB/s where a memcpy of the same tensors ran at 1.1-1.9 GB/s
    (``benches/transports.py`` prints both). Unloaded many-core machines lose a little peak.
    """
    if memcpy_applies(dst, src):
        if dst.numel() == 0:
            return
        try:
            np.copyto(_as_bytes(dst), _as_bytes(src))
            return
        except (RuntimeError, TypeError):  # conjugate/negative views and other exotica: torch handles them
            pass
    with torch.no_grad():
        dst.copy_(src)


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().reshape(-1).view(torch.uint8).numpy()
