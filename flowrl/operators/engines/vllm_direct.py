"""Weights into vLLM's workers straight from the policy's ranks: the direct route of the weight-sync group.

The hop route (``vllm_sync.WeightSyncGroup``) has the generator's process in the group, sending from a
full-size staging copy that a transport filled first. Here the group is the policy's *sending rank*
(rank 0) and every vLLM worker of every engine of the generator (``vllm_worker.FlowrlWorkerExtension``,
the same receiving code): a generator of ``dp`` replicas, each one engine of ``tp`` workers, makes a
group of ``1 + dp * tp``, engine ``i``'s workers at ranks ``first[i] + worker rank`` (``group_ranks``:
engine 0 from 1 on, each next engine after the previous one's workers). The generator's processes
are not members and hold no weights: they coordinate. One broadcast per tensor reaches every worker
of every engine, as NeMo-RL, verl and OpenRLHF do it; with vLLM's tensor parallelism each worker
receives the full tensor and vLLM's own ``load_weights`` keeps its shard.

Rendezvous, over a ``Channel`` (a torch ``Store``: under torchrun the job's own store, so no
address or port is configured by hand):

1. each engine's process (``DirectReceiver.connect``, engine ``i`` of ``engines``) writes ``hello/<i>``:
   its host name, its workers' count, the engines' count, the backend, and the weights' names,
   shapes and dtypes in *its* dtype;
2. the sending rank (``DirectSender.connect``, the policy's first rank) waits for every engine's
   hello (their count from ``hello/0``; spec, backend and bucket size must agree), binds a port on
   its own host (loopback when every engine shares its host, else its address, or
   ``FLOWRL_WEIGHT_SYNC_HOST``), writes ``address`` (with the group's size and each engine's first
   rank, assigned in engine order) and becomes the group's rank 0 and its ``TCPStore`` master with
   the bound socket (vLLM's ``stateless_init_torch_distributed_process_group(listen_socket=...)``):
   the process that listens is the process that chose the port, so no port is picked by one process
   and bound by another, and a policy on another host needs no route into the generator's;
3. each engine reads ``address`` and tells its workers, over vLLM's RPC, to join at its ranks.

Each sync is one request and one answer (the generator's gate, kept exact): at the point where the
hop route fetches, the generator writes ``want/<n>`` = the version it holds and the oldest it may
sample with (``min_version``); the policy's ranks (``DirectSender.serve``, between their steps) answer
``send/<n>`` with the newest version they published: it is sent only when it is newer than the held
one, and the policy waits to answer until it has published ``min_version``. The generator then tells
its workers the bucket plan (``flowrl_receive_weights``) and the sending rank broadcasts each bucket.

With several engines the request is still one, made by the first engine on behalf of all
(``DirectReceiver.gate``): at each of its gate calls ``s`` (one per step, every engine alike) it
writes ``gate/<s>`` = the request it made (or none: it holds what it needs and does not ask) with the
version it holds and the step's ``min_version``; every other engine reads ``gate/<s>`` at its own gate
call ``s``, then that request's answer, and receives alongside. Why one engine asks for all: every
broadcast reaches every engine's workers, so a send is one event that all engines take part in, and
no engine can take a version another does not; one asker makes the decisions that must be common,
whether to ask at all (``GeneratorProgram._take_direct`` asks early only when the policy says it is
idle with a newer version, a key each engine would read at a different moment) and which version
comes, once; and the policy keeps one request counter per edge, as with one engine. So every engine
holds the same version after every gate call, which is the staleness bound's premise; an engine
whose held version or ``min_version`` differs from the first's says so (``TransportError``) rather
than sample with other weights.

From an FSDP2 policy every rank takes part: per bucket each DTensor is gathered (``full_tensor``,
an all-gather over the policy's mesh) and cast to the generator's dtype, and the sending rank
broadcasts; so no rank holds more than its shards and one bucket of full tensors. From a replicated
policy the first rank sends its tensors (cast where the dtypes differ). The backend is gloo on a CPU
and NCCL where every member has a GPU of its own (the generator chooses it, the sender's tensors go
to its device); a policy rank sharing a GPU with a vLLM worker (colocated) keeps the hop route, as
the file transport does.

Who drives it: a ``VLLMGenerator`` handed a route whose hop is ``"direct"`` (``transport="direct"``
outside a run; ``connect_direct``, ``take_direct``) on the generator's side, and on the policy's a caller that runs ``serve`` between its steps: in a torchrun
job ``flowrl.runtime.weights.direct_route`` (which edges, and the policy ranks' order of answers),
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

(several engines: ``DirectReceiver(..., engine=i, engines=E)`` in each engine's process, every one
calling ``connect`` and then ``receive`` or ``gate`` alike; each over a store client of its own, since
a ``TCPStore`` client's ``wait`` holds its socket and would keep another engine's hello from going out.)
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

__all__ = ["Channel", "DirectReceiver", "DirectSender", "WeightSpec", "spec_of", "plan_of", "group_ranks", "DEFAULT_BUCKET_BYTES", "TIMEOUT_S"]

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


def group_ranks(workers: list[int]) -> tuple[int, list[int]]:
    """The weight-sync group's size and each engine's first rank, for engines of ``workers[i]``
    workers each: the sender is rank 0, then the engines' workers in engine order.

    Example:
        >>> group_ranks([1, 2])   # engine 0: rank 1; engine 1 (tp = 2): ranks 2, 3
        (4, [1, 2])
    """
    firsts, nxt = [], 1
    for w in workers:
        firsts.append(nxt)
        nxt += int(w)
    return nxt, firsts


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
    """One engine's side (``engine`` of the generator's ``engines``): rendezvous and requests; it holds
    the spec, never a tensor of the model.

    Attributes:
        syncs: requests answered so far; ``gates``: gate calls so far; ``bytes_moved``: the bytes this
            engine's workers received (each tensor once, the generator's dtype); ``last_s``: the last
            receive's seconds.
    """

    def __init__(
        self, llm: Any, channel: Channel, spec: WeightSpec, *, backend: str = "gloo", bucket_bytes: int = DEFAULT_BUCKET_BYTES, engine: int = 0, engines: int = 1
    ) -> None:
        if not 0 <= engine < engines:
            raise ValueError(f"engine {engine} of {engines}: an engine's index must be in 0..{engines - 1}")
        self.llm, self.channel, self.backend = llm, channel, backend
        self.spec: list[tuple[str, list[int], str]] = [(str(n), [int(s) for s in shape], str(d)) for n, shape, d in spec]
        self.plan = plan_of(spec, bucket_bytes)
        self.bucket_bytes = bucket_bytes
        self.engine, self.engines = int(engine), int(engines)
        self.syncs, self.gates, self.bytes_moved, self.last_s = 0, 0, 0, 0.0
        self.connected = False
        self._asked = 0.0

    def connect(self) -> None:
        """Say hello, wait for the sending rank's address, have every worker join at this engine's
        ranks (blocks until every member of the group, every engine's workers, has joined).

        Raises:
            TransportError: no sender answered, or a worker did not join, within the channel's timeout.
        """
        workers = _worker_count(self.llm)
        timeout = self.channel.timeout_s
        self.channel.put(f"hello/{self.engine}", {"host": socket.gethostname(), "workers": workers, "engines": self.engines,
                                                  "backend": self.backend, "bucket_bytes": self.bucket_bytes, "spec": self.spec})  # fmt: skip
        addr = self.channel.take("address", what="address from the policy's sending rank")
        world, first = int(addr["world"]), int(addr["first"][self.engine])
        try:
            ranks = self.llm.collective_rpc("flowrl_join_weight_group", args=(addr["host"], int(addr["port"]), world, self.backend, timeout, first), timeout=timeout)
        except Exception as exc:
            raise TransportError(f"vLLM's workers (engine {self.engine}) did not join the direct weight-sync group at {addr['host']}:{addr['port']} ({self.backend}): {exc}") from exc
        if sorted(ranks) != list(range(first, first + workers)):
            raise TransportError(f"vLLM's workers (engine {self.engine}) joined the direct weight-sync group as ranks {ranks}, expected {list(range(first, first + workers))}")
        self.connected = True

    def receive(self, min_version: int, held: int) -> int:
        """``gate``, then ``load`` what the answer names when it is newer than ``held``.

        Returns:
            The version vLLM now holds.
        """
        version = self.gate(min_version, held)
        if version > held:
            self.load(version)
        return max(version, held)

    def gate(self, min_version: int, held: int, *, ask: bool = True) -> int:
        """One gate call of this engine (every engine of the generator makes the same calls with the
        same ``min_version`` and ``held``): the version the policy is sending into every engine now,
        or ``held`` when nothing comes. The first engine asks (``ask``: whether to; its decision) on
        behalf of all and says so under ``gate/<s>``; any other engine follows that request's answer.

        Raises:
            TransportError: the policy failed or did not answer; engine 0 did not say its gate call
                within the channel's timeout; this engine holds another version than engine 0.
        """
        s = self.gates
        self.gates += 1
        if self.engine == 0:
            if self.engines > 1:
                self.channel.put(f"gate/{s}", {"request": self.syncs if ask else None, "held": int(held), "min_version": int(min_version)})
            return self.ask(min_version, held) if ask else int(held)
        told = self.channel.take(f"gate/{s}", what=f"the first engine's gate call {s}")
        if (int(told["held"]), int(told["min_version"])) != (int(held), int(min_version)):
            raise TransportError(
                f"vLLM engine {self.engine} holds version {held} at a gate of version >= {min_version}, but engine 0 holds "
                f"{told['held']} at a gate of version >= {told['min_version']} (gate call {s}): every engine of the generator must hold one version"
            )
        if told["request"] is None:
            return int(held)
        n = int(told["request"])
        self.syncs, self._asked = n + 1, time.perf_counter()
        return self._answer(n, min_version)

    def ask(self, min_version: int, held: int) -> int:
        """Ask the policy for its newest version, at least ``min_version`` (``held``: the version vLLM
        holds, -1 for none); the policy sends it at once when it is newer than ``held``, else nothing.
        The first engine's to call (``gate``): the other engines follow its requests.

        Raises:
            TransportError: the policy failed, or did not answer within the channel's timeout.
        """
        if self.engine != 0:
            raise ValueError(f"vLLM engine {self.engine}: only engine 0 asks the policy for weights; the others follow its requests (gate)")
        n = self.syncs
        self.syncs += 1
        self._asked = time.perf_counter()
        self.channel.put(f"want/{n}", {"min_version": int(min_version), "held": int(held)})
        return self._answer(n, min_version)

    def _answer(self, n: int, min_version: int) -> int:
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
        """Tell the policy side the route is closed (the first engine, for all) and leave the group (best effort)."""
        try:
            if self.engine == 0:
                self.channel.put(f"want/{self.syncs}", {"closed": True})
        except Exception:
            pass
        if self.connected:
            self.connected = False
            try:
                self.llm.collective_rpc("flowrl_leave_weight_group", timeout=10)
            except Exception:
                pass


def _own_address(generator_hosts: set[str]) -> tuple[str, str]:
    """(address to bind, address to advertise) for the sending rank's listening socket."""
    fixed = os.environ.get("FLOWRL_WEIGHT_SYNC_HOST")
    if fixed:
        return fixed, fixed
    if generator_hosts == {socket.gethostname()}:
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
        """Read the generator's hello; the sending rank waits for every engine's, binds, answers its
        address and forms the group (blocks until every engine's workers joined)."""
        hello = self.channel.take("hello/0", what="hello from the vLLM generator")
        self.spec = [tuple(e) for e in hello["spec"]]
        self.plan = plan_of(self.spec, int(hello["bucket_bytes"]))
        self.backend = str(hello["backend"])
        if self.backend == "nccl" and self.device.type != "cuda":
            raise TransportError(f"the vLLM generator asked for an NCCL weight-sync group but this policy rank's device is {self.device}; NCCL needs every member on a GPU of its own")
        if not self.sending:
            return
        engines = int(hello["engines"])
        hellos = [hello, *(self.channel.take(f"hello/{i}", what=f"hello from the vLLM generator's engine {i} of {engines}") for i in range(1, engines))]
        _check_alike(hellos)  # before any work: no vLLM import, no port
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        world, firsts = group_ranks([int(h["workers"]) for h in hellos])
        bind, advertise = _own_address({str(h["host"]) for h in hellos})
        listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listen.bind((bind, 0))  # bound before anyone hears the port: no race for it
        listen.listen()
        port = int(listen.getsockname()[1])
        self.channel.put("address", {"host": advertise, "port": port, "world": world, "first": firsts})
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


def _check_alike(hellos: list[dict[str, Any]]) -> None:
    """Every engine's hello names the same weights, backend, bucket size and engine count (they are
    replicas of one generator: one plan and one broadcast serve them all)."""
    first = hellos[0]
    for i, h in enumerate(hellos[1:], start=1):
        if h["spec"] != first["spec"]:
            odd = [e[0] for e, f in zip(h["spec"], first["spec"]) if e != f][:5] or f"{len(h['spec'])} tensors against {len(first['spec'])}"
            raise TransportError(f"the vLLM generator's engine {i} holds other weights than engine 0 ({odd}): every engine of one generator must hold the same model in one dtype")
        for key in ("backend", "bucket_bytes", "engines"):
            if h[key] != first[key]:
                raise TransportError(f"the vLLM generator's engine {i} says {key}={h[key]!r}, engine 0 {key}={first[key]!r}: every engine of one generator must agree")


def _full(t: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``t`` whole (a DTensor gathered over its mesh: a collective every rank of it runs), in ``dtype``
    on ``device``, contiguous; the tensor itself where nothing changes."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to(device=device, dtype=dtype).contiguous()
