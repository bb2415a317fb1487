"""Weight edges of a torchrun job: which transport, its plain-data options, and one shared instance per rank.

In a torchrun job a weight edge (policy -> generator) uses the collective transport
(``flowrl.runtime.transports.collective``) when its transport is a collective one or cannot cross
processes (``inprocess``, the default); a transport that crosses processes itself (``shm``, ``file``,
a user's) is kept.

- Options are plain data (``collective_options``): the parameters' full shapes and dtypes (from the
  policy's ``ModelConfig``, via a model built on the meta device: no memory, no initialisation
  cost), the trainer layout and the generator layout (``ShardLayout`` in dict form), the channel
  (``"<policy>-><generator>"``) and the timeout. Every rank computes the same options from the graph
  and the placement; rank 0 also ships them in the edge's ``TransportSpec`` (route ``"collective"``),
  and :func:`shared` checks that they agree.
- Layouts: every rank of a data-parallel policy publishes its full replica (``dp_replicas`` over the
  policy's ranks; the transfer plan picks the sender of each block among the replicas, least loaded
  first, so each byte is sent once per destination); every rank of an FSDP policy
  (``sharding="fsdp"``) publishes its own shards (``fsdp`` over its ranks: dim-0 ``torch.chunk``
  pieces, FSDP2's), so each generator rank gets its slices straight from the shards that hold them; every rank
  of a tensor-parallel policy (a ``tp`` axis > 1) publishes its shards, name by name
  (``flowrl.runtime.parallel.tp_train.trainer_layouts``). Generator replicas fetch the full state
  (``dp_replicas``); a tensor-parallel generator (a ``tp`` mesh axis > 1) fetches its shards
  (``flowrl.runtime.parallel.tensor_parallel.tp_param_layouts``). A vLLM generator with a ``tp`` axis fetches
  on each replica's engine rank only, the full state (``vllm_replicas``: vLLM's workers shard it
  themselves). A node run by a user program takes part on its lead rank only (its other ranks idle).
- Process groups: each collective edge gets a group of exactly its participating ranks, created by
  every rank in graph order (``dist.new_group`` is collective), then warmed with one all-reduce so
  that NCCL's first point-to-point batch need not involve every rank.
- One instance per rank and edge: ``open_edges`` constructs the transports on every participating
  rank during job setup, while all ranks are there (construction handshakes over the store), with
  ``background_receive=True`` so that a generator rank receives each version as soon as it is
  published (a trainer never waits for the generator's next step: see the transport's docstring).
  The node programs get them through their edge's route (``route.WeightRoute``, which calls
  :func:`shared`): a rank that hosts both the policy and the generator shares one instance between them.
"""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import torch

from flowrl.errors import ConfigError, TransportError
from flowrl.graph.ir import Graph
from flowrl.placement.resharding import ShardLayout, dp_replicas, fsdp
from flowrl.runtime.parallel.vllm_replicas import engine_ranks, is_vllm_tp, replica_rows
from flowrl.runtime.transports.registry import transport_traits

__all__ = ["COLLECTIVE", "weight_transport", "collective_options", "edge_ranks", "open_edges", "close_edges", "opened", "shared"]

#: The built-in transport that carries a torchrun job's weight edges between ranks (its ``TransportSpec``
#: name on the route ``"collective"``).
COLLECTIVE = "collective"

_LOCK = threading.Lock()
_OPEN: dict[str, Any] = {}  # channel -> CollectiveTransport of this process
_OPTIONS: dict[str, dict[str, Any]] = {}  # channel -> the options it was built with


def weight_transport(name: str) -> str:
    """The transport a weight edge named ``name`` uses across ranks (a registry name): the collective
    one (:data:`COLLECTIVE`, one shared instance per rank) for a collective transport and for one that
    cannot cross processes; the edge's own otherwise."""
    traits = transport_traits(name)
    if traits.collective or not traits.crosses_processes:
        return COLLECTIVE
    return name


def channel(src: str, dst: str) -> str:
    return f"{src}->{dst}"


def _meshes_tp(axes: tuple[tuple[str, ...], tuple[int, ...]] | None) -> int:
    if not axes:
        return 1
    names, shape = axes
    return dict(zip(names, shape)).get("tp", 1)


def edge_ranks(graph: Graph, src: str, dst: str, ranks: dict[str, tuple[int, ...]], programs: dict[str, str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(publishing ranks, fetching ranks) of the edge: all of a built-in node's ranks, a user program's lead."""
    def active(node: str) -> tuple[int, ...]:
        rs = ranks[node]
        return rs[:1] if node in programs else rs

    return active(src), active(dst)


def _param_specs(graph: Graph, src: str) -> dict[str, dict[str, Any]]:
    """Full shapes and dtypes of the policy's weights (its ``Trainer.weights()``: a LoRA policy's
    adapters), from its model config."""
    from flowrl.models.lora import adapter_shapes, lora_of
    from flowrl.models.registry import weight_shapes

    node = graph.node(src)
    config = getattr(node, "model", None)
    if config is None:
        raise ConfigError(f"weight edge from {src!r}: node has no model config, so the collective transport cannot know its parameter shapes")
    shapes = adapter_shapes(config) if lora_of(config) is not None else weight_shapes(config)
    return {n: {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")} for n, (shape, dtype) in shapes.items()}


def _generator_layouts(graph: Graph, dst: str, fetchers: tuple[int, ...], axes: Any, params: dict[str, Any]) -> Any:
    """The generator side's layout(s): replicas, or tensor-parallel shards.

    A generator whose mesh has a ``tp`` axis > 1 runs as ``rank_programs.ParallelGenerator``,
    which fetches only its shards: its layout is ``tensor_parallel.tp_param_layouts(config, ranks, dp=...)``
    (the built-in transformer's or, by Hugging Face parameter names, a Llama family's), so each rank
    receives exactly its slices. Replicas fetch the full state (``dp_replicas``).
    """
    tp = _meshes_tp(axes)
    if len(fetchers) > 1 and tp > 1:
        from flowrl.runtime.parallel.tensor_parallel import tp_param_layouts, tp_rows

        try:
            rows = tp_rows(fetchers, *axes)  # the replicas' tp groups, as ParallelGenerator forms them
        except ConfigError as exc:
            raise ConfigError(f"generator {dst!r}: {exc}") from None
        config = graph.node(dst).model  # type: ignore[attr-defined]  # a weight edge's dst is a generator (a model)
        if getattr(config, "lora", None) is not None:
            raise ConfigError(
                f"generator {dst!r} has a tensor-parallel mesh (tp={tp}) and LoRA adapters from {graph.weight_edges_into(dst)[0].src!r}; "
                "a tensor-parallel generator cannot merge adapters yet: give it data-parallel replicas instead "
                f"(e.g. {{\"{dst}\": {{\"ranks\": {list(fetchers)}, \"mesh\": {{\"dp\": {len(fetchers)}}}}}}}), whose each rank merges the whole adapters"
            )
        layouts = tp_param_layouts(config, [r for row in rows for r in row], dp=len(rows))
        missing = sorted(set(params) - set(layouts))
        if missing:
            raise ConfigError(f"tp_param_layouts for generator {dst!r} gives no layout for {missing}")
        return {n: msgspec.to_builtins(layouts[n]) for n in params}
    return msgspec.to_builtins(dp_replicas(fetchers))


def _trainer_layout(graph: Graph, src: str, publishers: tuple[int, ...], programs: dict[str, str], axes: Any = None) -> Any:
    """The policy side's layout: per weight, the ranks of the pipeline stage holding it for a policy
    whose mesh has ``pp`` > 1 (``pipeline.stage_layouts``); a tensor-parallel policy's (a ``tp`` axis >
    1: name -> layout, ``tp_train.trainer_layouts``, each rank its shards); ``fsdp(ranks)`` (dim-0
    chunks, FSDP2's own shards) for a policy with ``sharding="fsdp"`` on several ranks, which
    publishes its local shards;
    else full replicas."""
    node = graph.node(src)
    sizes = dict(zip(axes[0], axes[1])) if axes else {}
    if len(publishers) > 1 and src not in programs and sizes.get("pp", 1) > 1:
        from flowrl.graph.nodes import PolicyNode
        from flowrl.runtime.parallel.pipeline import stage_layouts

        return stage_layouts(graph.node_of(src, PolicyNode).model, publishers, sizes)  # pipelined: a policy
    optimizer = getattr(node, "optimizer", None)
    tp = _meshes_tp(axes)
    if len(publishers) > 1 and src not in programs and tp > 1:
        from flowrl.runtime.parallel.tp_train import trainer_layouts

        dp = len(publishers) // tp
        fsdp_dp = getattr(optimizer, "sharding", "replicate") == "fsdp" and dp > 1
        return trainer_layouts(node.model, publishers, dp=dp, tp=tp, fsdp=fsdp_dp)  # type: ignore[attr-defined]  # a weight edge's src is a node that trains a model
    if len(publishers) > 1 and src not in programs and getattr(optimizer, "sharding", "replicate") == "fsdp":
        return fsdp(publishers)
    return dp_replicas(publishers)


def collective_options(
    graph: Graph,
    src: str,
    dst: str,
    ranks: dict[str, tuple[int, ...]],
    programs: dict[str, str],
    axes: dict[str, Any],
    timeout_s: float,
) -> dict[str, Any]:
    """Plain-data options of the edge's ``CollectiveTransport`` (the same on every rank)."""
    publishers, fetchers = edge_ranks(graph, src, dst, ranks, programs)
    dst_axes = axes.get(dst)
    if dst not in programs and is_vllm_tp(graph.node(dst), dst_axes):  # vLLM shards in its own workers: each replica's engine rank takes the full state
        fetchers, dst_axes = engine_ranks(replica_rows(fetchers, dst_axes)), None
    params = _param_specs(graph, src)
    options = {
        "params": params,
        "trainer_layout": _trainer_layout(graph, src, publishers, programs, axes.get(src)),
        "generator_layout": _generator_layouts(graph, dst, fetchers, dst_axes, params),
        "channel": channel(src, dst),
        "timeout_s": float(timeout_s),
    }
    return msgspec.json.decode(msgspec.json.encode(options))  # JSON types only: what the TransportSpec carries


def participants(options: dict[str, Any]) -> list[int]:
    """Every rank of the edge: publishers and fetchers, sorted."""
    def ranks_of(layout: Any) -> set[int]:
        if isinstance(layout, dict) and "ranks" in layout:
            return set(layout["ranks"])
        return {r for lay in layout.values() for r in lay["ranks"]}

    return sorted(ranks_of(options["trainer_layout"]) | ranks_of(options["generator_layout"]))


def open_edges(specs: dict[str, dict[str, Any]], groups: dict[str, Any], rank: int, device: torch.device) -> None:
    """Construct this rank's transport of every edge it takes part in (every participating rank must call this)."""
    from flowrl.runtime.transports.collective import CollectiveTransport

    for ch, options in specs.items():
        if rank not in participants(options):
            continue
        with _LOCK:
            _OPEN[ch] = CollectiveTransport(
                **options, group=groups[ch], device=str(device), background_receive=True, fetch_wait_s=0.0
            )
            _OPTIONS[ch] = options


def opened(ch: str) -> Any:
    """This rank's transport of edge ``ch`` (None if it has none)."""
    return _OPEN.get(ch)


def close_edges(*, drain_s: float = 0.0) -> None:
    """Close this rank's transports (end of the job)."""
    with _LOCK:
        items = list(_OPEN.values())
        _OPEN.clear()
        _OPTIONS.clear()
    for t in items:
        t.close(drain_s=drain_s)


class _Handle:
    """What a program's route gets: the rank's shared transport. Closing the handle ends this holder's
    use of it (later calls through it are refused, as a closed transport's are); the job closes the
    shared transport itself once every program on this rank is done (``close_edges``)."""

    def __init__(self, transport: Any) -> None:
        self._t = transport
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        if self._closed and name in ("publish", "fetch_into", "latest_version"):
            raise TransportError(f"collective weight edge {self._t.channel!r}: {name}() called after close() (of this route's handle; the job closes the shared transport)")
        return getattr(self._t, name)

    def close(self) -> None:
        """End this holder's use (idempotent); the shared transport stays open for the job."""
        self._closed = True


def shared(options: dict[str, Any]) -> _Handle:
    """This rank's transport of the collective edge that ``options`` (its ``TransportSpec``'s) describe.

    Raises:
        TransportError: this rank has none for it, or opened it with other options.
    """
    ch = str(options.get("channel", ""))
    with _LOCK:
        transport, expected = _OPEN.get(ch), _OPTIONS.get(ch)
    if transport is None:
        raise TransportError(
            f"collective weight edge {ch!r}: this rank has no transport for it; it is opened during torchrun job "
            "setup on the edge's ranks only (is this program running on a rank the placement gave the node?)"
        )
    if msgspec.json.encode(options) != msgspec.json.encode(expected):
        raise TransportError(f"collective weight edge {ch!r}: the controller's options differ from this rank's; every rank must run the same graph and plan")
    return _Handle(transport)


