"""Weights into vLLM's workers straight from the policy's ranks: the direct route of the weight-sync group.

The hop route (``vllm_sync.WeightSyncGroup``) has the generator's process in the group, sending from a
full-size staging copy that a transport filled first. Here the group is the policy's *sending rank*
(rank 0) and vLLM's workers (ranks ``1 + worker rank``, ``vllm_worker.FlowrlWorkerExtension``, the
same receiving code); the generator's process is not a member and holds no weights: it coordinates.

Rendezvous, over a ``Channel`` (a torch ``Store``: under torchrun the job's own store, so no
address or port is configured by hand):

1. the generator (``DirectReceiver.connect``) writes ``hello``: its host name, the group's size
   (1 + vLLM's workers), the backend, and the weights' names, shapes and dtypes in *its* dtype;
2. the sending rank (``DirectSender.connect``, the policy's first rank) binds a port on its own host
   (loopback when it shares the generator's host, else its address, or ``FLOWRL_WEIGHT_SYNC_HOST``),
   writes ``address`` and becomes the group's rank 0 and its ``TCPStore`` master with the bound
   socket (vLLM's ``stateless_init_torch_distributed_process_group(listen_socket=...)``): the
   process that listens is the process that chose the port, so no port is picked by one process and
   bound by another, and a policy on another host needs no route into the generator's;
3. the generator reads ``address`` and tells its workers, over vLLM's RPC, to join.

Each sync is one request and one answer (the generator's gate, kept exact): at the point where the
hop route fetches, the generator writes ``want/<n>`` = the version it holds and the oldest it may
sample with (``min_version``); the policy's ranks (``DirectSender.serve``, between their steps) answer
``send/<n>`` with the newest version they published: it is sent only when it is newer than the held
one, and the policy waits to answer until it has published ``min_version``. The generator then tells
its workers the bucket plan (``flowrl_receive_weights``) and the sending rank broadcasts each bucket.

From an FSDP2 policy every rank takes part: per bucket each DTensor is gathered (``full_tensor``,
an all-gather over the policy's mesh) and cast to the generator's dtype, and the sending rank
broadcasts; so no rank holds more than its shards and one bucket of full tensors. From a replicated
policy the first rank sends its tensors (cast where the dtypes differ). The backend is gloo on a CPU
and NCCL where every member has a GPU of its own (the generator chooses it, the sender's tensors go
to its device); a policy rank sharing a GPU with a vLLM worker (colocated) keeps the hop route, as
the file transport does.

Who drives it: ``VLLMGenerator(transport="direct")`` (``connect_direct``, ``take_direct``) on the
generator's side, and on the policy's a caller that runs ``serve`` between its steps: in a torchrun
job ``flowrl.runtime.backends.direct_route`` (which edges, and the policy ranks' order of answers),
elsewhere the bench ``benches/weight_sync.py`` and the tests.

Failures end the sync with ``TransportError`` on both sides: a member that dies closes its gloo
connections (the others' broadcasts fail at once), a silent one runs into the group's timeout (so
may a sender killed in the middle of a tensor: gloo was seen to wait for the timeout then), and a
side that never answers into the channel's.

Example (a generator's process and the policy's first rank, sharing a store)::

    recv = DirectReceiver(llm, Channel(store, "gen"), spec); recv.connect()        # generator
    send = DirectSender(Channel(store, "gen")); send.connect()                      # policy rank(s)
    send.serve(model.state_dict(), version=1)   # answers the generator's next request
    recv.receive(min_version=1, held=0)         # -> 1: loaded into every worker
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import msgspec
import torch
from torch import Tensor

from flowrl.errors import TransportError
from flowrl.operators.engines.vllm_sync import DEFAULT_BUCKET_BYTES, cut_buckets  # one bucket rule and size for both routes

__all__ = ["Channel", "DirectReceiver", "DirectSender", "WeightSpec", "spec_of", "plan_of", "DEFAULT_BUCKET_BYTES", "TIMEOUT_S"]

TIMEOUT_S = 300.0

#: The weights as the generator holds them, in order: ``(name, shape, dtype name)`` (plain data).
WeightSpec = list[tuple[str, list[int], str]]


def spec_of(weights: Mapping[str, Any], dtype: torch.dtype | None = None) -> WeightSpec:
    """The spec of ``weights`` (tensors, DTensors or ``(shape, dtype)`` pairs), in ``dtype`` if given.

    Example:
        >>> spec_of({"w": torch.zeros(2, 3)}, torch.bfloat16)
        [('w', [2, 3], 'bfloat16')]
    """
    out: WeightSpec = []
    for name, t in weights.items():
        shape, dt = (t.shape, t.dtype) if hasattr(t, "shape") else t
        out.append((name, [int(s) for s in shape], str(dtype or dt).removeprefix("torch.")))
    return out


def plan_of(spec: WeightSpec, bucket_bytes: int) -> list[WeightSpec]:
    """``spec`` cut into buckets of at most ``bucket_bytes`` (a larger tensor alone in its bucket),
    the plan both sides compute alike (``vllm_worker.BucketPlan``).

    Example:
        >>> [[n for n, _, _ in b] for b in plan_of([("a", [4], "float32"), ("b", [4], "float32"), ("c", [16], "float32")], 32)]
        [['a', 'b'], ['c']]
    """
    return cut_buckets([(entry, _nbytes(entry)) for entry in spec], bucket_bytes)


def _nbytes(entry: tuple[str, list[int], str]) -> int:
    _, shape, dtype = entry
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=getattr(torch, dtype)).element_size()


class Channel:
    """Plain-data messages (msgspec JSON) under ``flowrl/vllm-direct/<name>/`` in a torch ``Store``."""

    def __init__(self, store: Any, name: str, *, timeout_s: float = TIMEOUT_S) -> None:
        self.store, self.prefix, self.timeout_s = store, f"flowrl/vllm-direct/{name}/", timeout_s

    def put(self, key: str, value: Any) -> None:
        self.store.set(self.prefix + key, msgspec.json.encode(value))

    def has(self, key: str) -> bool:
        return bool(self.store.check([self.prefix + key]))

    def take(self, key: str, *, what: str, timeout_s: float | None = None) -> Any:
        """The value at ``key``, waiting up to ``timeout_s``; ``what`` names it in the error."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        try:
            self.store.wait([self.prefix + key], timedelta(seconds=wait))
            return msgspec.json.decode(self.store.get(self.prefix + key))
        except Exception as exc:
            raise TransportError(f"vLLM weight sync {self.prefix!r}: no {what} within {wait:.0f} s ({type(exc).__name__}: {exc})") from exc


def _worker_count(llm: Any) -> int:
    return int(llm.llm_engine.vllm_config.parallel_config.world_size)


class DirectReceiver:
    """The generator's side: rendezvous and requests; it holds the spec, never a tensor of the model.

    Attributes:
        syncs: requests answered so far; ``bytes_moved``: the bytes the workers received (each tensor
            once, the generator's dtype); ``last_s``: the last receive's seconds.
    """

    def __init__(self, llm: Any, channel: Channel, spec: WeightSpec, *, backend: str = "gloo", bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.llm, self.channel, self.spec, self.backend = llm, channel, [tuple(e) for e in spec], backend
        self.plan = plan_of(spec, bucket_bytes)
        self.bucket_bytes = bucket_bytes
        self.syncs, self.bytes_moved, self.last_s = 0, 0, 0.0
        self.connected = False
        self._asked = 0.0

    def connect(self) -> None:
        """Say hello, wait for the sending rank's address, have every worker join (blocks until all have).

        Raises:
            TransportError: no sender answered, or a worker did not join, within the channel's timeout.
        """
        world = 1 + _worker_count(self.llm)
        timeout = self.channel.timeout_s
        self.channel.put("hello", {"host": socket.gethostname(), "world": world, "backend": self.backend, "bucket_bytes": self.bucket_bytes, "spec": self.spec})
        addr = self.channel.take("address", what="address from the policy's sending rank")
        try:
            ranks = self.llm.collective_rpc("flowrl_join_weight_group", args=(addr["host"], int(addr["port"]), world, self.backend, timeout), timeout=timeout)
        except Exception as exc:
            raise TransportError(f"vLLM's workers did not join the direct weight-sync group at {addr['host']}:{addr['port']} ({self.backend}): {exc}") from exc
        if sorted(ranks) != list(range(1, world)):
            raise TransportError(f"vLLM's workers joined the direct weight-sync group as ranks {ranks}, expected {list(range(1, world))}")
        self.connected = True

    def receive(self, min_version: int, held: int) -> int:
        """``ask``, then ``load`` what the answer names when it is newer than ``held``.

        Returns:
            The version vLLM now holds.
        """
        version = self.ask(min_version, held)
        if version > held:
            self.load(version)
        return max(version, held)

    def ask(self, min_version: int, held: int) -> int:
        """Ask the policy for its newest version, at least ``min_version`` (``held``: the version vLLM
        holds, -1 for none); the policy sends it at once when it is newer than ``held``, else nothing.

        Raises:
            TransportError: the policy failed, or did not answer within the channel's timeout.
        """
        n = self.syncs
        self.syncs += 1
        self._asked = time.perf_counter()
        self.channel.put(f"want/{n}", {"min_version": int(min_version), "held": int(held)})
        answer = self.channel.take(f"send/{n}", what=f"answer to weight request {n} (version >= {min_version})")
        if "error" in answer:
            raise TransportError(f"the policy's ranks failed to send weights into vLLM: {answer['error']}")
        return int(answer["version"])

    def load(self, version: int) -> None:
        """Have every worker receive the version the policy is sending (``ask`` named it) and load it.

        Raises:
            TransportError: a worker failed to receive or load it (the cause kept).
        """
        try:
            counts = self.llm.collective_rpc("flowrl_receive_weights", args=(self.plan,), timeout=self.channel.timeout_s)
        except Exception as exc:
            raise TransportError(f"vLLM's workers failed to receive version {version} over the direct weight-sync group: {type(exc).__name__}: {exc}") from exc
        loaded = [int(c["loaded"]) for c in counts]
        if any(k != len(self.spec) for k in loaded):
            raise TransportError(f"vLLM's workers loaded {loaded} tensors of {len(self.spec)} (version {version})")
        self.bytes_moved += sum(_nbytes(e) for e in self.spec)
        self.last_s = time.perf_counter() - self._asked

    def close(self) -> None:
        """Tell the policy side the route is closed and leave the group (best effort)."""
        try:
            self.channel.put(f"want/{self.syncs}", {"closed": True})
        except Exception:
            pass
        if self.connected:
            self.connected = False
            try:
                self.llm.collective_rpc("flowrl_leave_weight_group", timeout=10)
            except Exception:
                pass


def _own_address(generator_host: str) -> tuple[str, str]:
    """(address to bind, address to advertise) for the sending rank's listening socket."""
    fixed = os.environ.get("FLOWRL_WEIGHT_SYNC_HOST")
    if fixed:
        return fixed, fixed
    if generator_host == socket.gethostname():
        return "127.0.0.1", "127.0.0.1"
    return "0.0.0.0", socket.gethostbyname(socket.gethostname())


class DirectSender:
    """The policy's side: every policy rank builds one (``group``: the policy's process group, None for
    one rank); the ``sending`` rank (the policy's first) is rank 0 of the weight-sync group.

    Attributes:
        version: the newest version served; ``bytes_sent``: bytes this rank broadcast;
        ``peak_bucket_bytes``: the most bytes of full tensors it held at once for a send.
    """

    def __init__(self, channel: Channel, *, sending: bool = True, group: Any = None, device: torch.device | str = "cpu") -> None:
        self.channel, self.sending, self.group, self.device = channel, sending, group, torch.device(device)
        self.requests, self.version = 0, -1
        self.bytes_sent, self.peak_bucket_bytes = 0, 0
        self.spec: WeightSpec = []  # the generator's, from its hello (``connect``)
        self.plan: list[WeightSpec] = []
        self._pg: Any = None

    def connect(self) -> None:
        """Read the generator's hello; the sending rank binds, answers its address and forms the group
        (blocks until vLLM's workers joined)."""
        hello = self.channel.take("hello", what="hello from the vLLM generator")
        self.spec = [tuple(e) for e in hello["spec"]]
        self.plan = plan_of(self.spec, int(hello["bucket_bytes"]))
        self.backend, world = str(hello["backend"]), int(hello["world"])
        if self.backend == "nccl" and self.device.type != "cuda":
            raise TransportError(f"the vLLM generator asked for an NCCL weight-sync group but this policy rank's device is {self.device}; NCCL needs every member on a GPU of its own")
        if not self.sending:
            return
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        bind, advertise = _own_address(str(hello["host"]))
        listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listen.bind((bind, 0))  # bound before anyone hears the port: no race for it
        listen.listen()
        port = int(listen.getsockname()[1])
        self.channel.put("address", {"host": advertise, "port": port})
        try:
            self._pg = stateless_init_torch_distributed_process_group(
                advertise, port, 0, world, self.backend, listen_socket=listen, timeout=timedelta(seconds=self.channel.timeout_s)
            )
        except Exception as exc:
            listen.close()
            raise TransportError(f"vLLM's workers did not form the direct weight-sync group on {advertise}:{port} ({self.backend}): {exc}") from exc

    def pending(self) -> bool:
        """Whether the generator's next request is there (every policy rank agreeing, over ``group``)."""
        seen = int(self.channel.has(f"want/{self.requests}"))
        if self.group is None:
            return bool(seen)
        import torch.distributed as dist

        flag = torch.tensor([seen], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    @torch.no_grad()
    def serve(self, state: Mapping[str, Tensor], version: int, *, timeout_s: float | None = None) -> bool:
        """Answer the generator's next request with ``state`` (this rank's tensors or DTensor shards,
        the generator's names) at ``version``; every policy rank calls it alike. Blocks until the
        request is there. Returns False when the request asks for a version newer than ``version``
        (not answered: serve again after the next step) or the generator closed the route.

        Raises:
            TransportError: a worker failed or died mid-sync (the cause kept); the generator is told.
        """
        n = self.requests
        want = self.channel.take(f"want/{n}", what=f"weight request {n} from the vLLM generator", timeout_s=timeout_s)
        if want.get("closed"):
            return False
        if int(want["min_version"]) > int(version):
            return False
        self.requests += 1
        send = int(version) > int(want["held"])
        missing = [name for name, _, _ in self.spec if name not in state]
        wrong = [f"{name}: {list(state[name].shape)} != {shape}" for name, shape, _ in self.spec if name in state and list(state[name].shape) != shape]
        if send and (missing or wrong):
            error = (f"the policy's state lacks {missing[:5]} ({len(missing)} names) that the vLLM generator holds" if missing
                     else f"the policy's tensors differ in shape from the vLLM generator's: {wrong[:5]}")  # fmt: skip
            if self.sending:
                self.channel.put(f"send/{n}", {"error": error})
            raise TransportError(error)
        if self.sending:
            self.channel.put(f"send/{n}", {"version": int(version) if send else int(want["held"])})
        if not send:
            return True
        try:
            self._send(state)
        except Exception as exc:
            self.close()  # the workers' receives fail at once rather than at the group's timeout
            raise TransportError(f"weights (version {version}) into vLLM over the direct weight-sync group failed: {type(exc).__name__}: {exc}") from exc
        self.version = int(version)
        return True

    def _send(self, state: Mapping[str, Tensor]) -> None:
        for bucket in self.plan:  # one bucket of full tensors at a time: gathered, cast, broadcast, freed
            full = [_full(state[name], getattr(torch, dtype), self.device) for name, _, dtype in bucket]
            self.peak_bucket_bytes = max(self.peak_bucket_bytes, sum(t.numel() * t.element_size() for t in full))
            if self.sending:
                for work in [self._pg.broadcast(t, 0) for t in full]:
                    work.wait()
                self.bytes_sent += sum(t.numel() * t.element_size() for t in full)
            del full

    def close(self) -> None:
        """Leave the group (best effort)."""
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

                stateless_destroy_torch_distributed_process_group(pg)
            except Exception:
                pass


def _full(t: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``t`` whole (a DTensor gathered over its mesh: a collective every rank of it runs), in ``dtype``
    on ``device``, contiguous; the tensor itself where nothing changes."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to(device=device, dtype=dtype).contiguous()
