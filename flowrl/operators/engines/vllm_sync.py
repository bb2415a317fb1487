"""Weights into vLLM's workers over a process group: the sender side of the weight-sync group.

``WeightSyncGroup`` forms, once per engine, a process group between the generator's process (rank
0) and each of vLLM's workers (rank ``1 + worker rank``; ``flowrl.operators.engines.vllm_worker``
is the receiving side), outside torch's default world: vLLM's
``stateless_init_torch_distributed_process_group`` on both sides, on loopback (vLLM's workers run
on the generator's host). The group is gloo, over host memory, on a CPU and on GPUs alike: the
generator's process and vLLM's worker use the same GPU, and NCCL refuses two ranks of one
communicator on one device; NCCL straight from the policy's ranks (on GPUs of their own) to vLLM's
workers is the direct route (``flowrl.operators.engines.vllm_direct``), which leaves this process out
of the group. The call takes ``"nccl"`` unchanged.

``send(weights)`` cuts the weights into buckets of at most ``bucket_bytes`` (a tensor larger than
that is a bucket of its own), tells every worker the plan (names, shapes, dtypes: plain data over
vLLM's RPC) and broadcasts each tensor of each bucket, as it lies in the staging copy (no packing),
with the group's own ``broadcast`` (the group is not in torch's world map, so
``torch.distributed.broadcast`` cannot name it). Each worker receives a bucket's tensors into views
of one buffer it keeps from update to update and hands each to vLLM's ``reload_weights`` (which
consumes an iterator) as soon as it arrives, so vLLM loads one layer while the next ones arrive and
at most ``_AHEAD + 1`` buckets are in memory beyond the model (``vllm_worker``). Every tensor goes once to every worker, in the generator's
dtype: ``bytes`` is the model's bytes in that dtype. With vLLM's tensor parallelism every worker
is a member and receives the full tensors; its model's own ``load_weights`` keeps its shard (as verl
and TRL do), so every shard is the policy's bits (``expected_digests`` with a ``TPShard`` checks it).

Why a group of its own rather than a transport of the policy's: vLLM's workers are processes vLLM
spawns, outside torchrun's world, so they cannot join the job's groups; the generator's process is
the one process that both belongs to the job and starts vLLM (the same layout as vLLM's own RLHF
examples, where the trainer joins a stateless group with the workers).

Example (needs vLLM, so not run as a doctest)::

    group = WeightSyncGroup.join(llm)
    group.send({"model.embed_tokens.weight": emb, ...})   # -> tensors loaded per worker
    group.close()
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch import Tensor

from flowrl.errors import TransportError

__all__ = ["WeightSyncGroup", "bucket_plan", "cut_buckets", "expected_digests", "tp_part", "TPShard", "DEFAULT_BUCKET_BYTES"]

K = TypeVar("K")

#: Bytes per bucket: large enough that a broadcast's fixed cost is small, small enough that a few
#: buckets in flight are little next to the model (a 0.5B model in float32 is 1.4 GB: 12 buckets).
DEFAULT_BUCKET_BYTES = 128 << 20

#: Seconds to wait for the workers to join or receive before the sync is an error.
JOIN_TIMEOUT_S = 300.0


def bucket_plan(weights: Mapping[str, Tensor], bucket_bytes: int) -> list[list[str]]:
    """Names of ``weights`` in order, cut into buckets of at most ``bucket_bytes`` (a larger tensor
    alone in its bucket).

    Example:
        >>> w = {"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(16)}
        >>> bucket_plan(w, bucket_bytes=32)
        [['a', 'b'], ['c']]
    """
    return cut_buckets([(name, t.numel() * t.element_size()) for name, t in weights.items()], bucket_bytes)


def cut_buckets(sized: Sequence[tuple[K, int]], bucket_bytes: int) -> list[list[K]]:
    """``(item, bytes)`` pairs in order, cut into buckets of at most ``bucket_bytes`` (a larger item
    alone in its bucket): the one rule both weight routes into vLLM (this hop and ``vllm_direct``) cut by.

    Example:
        >>> cut_buckets([("a", 16), ("b", 16), ("c", 64)], 32)
        [['a', 'b'], ['c']]
    """
    plan: list[list[K]] = []
    size = 0
    for item, n in sized:
        if plan and size + n <= bucket_bytes:
            plan[-1].append(item)
            size += n
        else:
            plan.append([item])
            size = n
    return plan


def _digest(t: Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class TPShard:
    """Which tensor-parallel shard a vLLM worker holds: ``rank`` of ``size``, for a model with
    ``heads`` query heads and ``kv_heads`` key/value heads (``size`` = 1: the whole model)."""

    rank: int = 0
    size: int = 1
    heads: int = 1
    kv_heads: int = 1


#: Projections vLLM splits by their input columns (``RowParallelLinear``); the other projections of a
#: Llama-family layer are split by output rows (``ColumnParallelLinear`` and its fused kinds), the
#: embedding and the head by vocabulary rows, norms are whole on every worker.
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")
#: vLLM pads a vocabulary-parallel layer's rows to a multiple of this before splitting them
#: (``DEFAULT_VOCAB_PADDING_SIZE`` in ``vllm/model_executor/layers/vocab_parallel_embedding.py``).
VOCAB_PADDING = 64


def tp_part(name: str, t: Tensor, shard: TPShard) -> Tensor:
    """The part of checkpoint tensor ``name`` that worker ``shard.rank`` holds under vLLM's tensor
    parallelism (its own rules, restated: ``q_proj`` by heads; ``k_proj``/``v_proj`` by key/value
    heads, one head on several workers when there are fewer heads than workers; other column-parallel
    projections by rows; ``o_proj``/``down_proj`` by input columns, their bias whole; the embedding
    and head by rows of the vocabulary padded to ``VOCAB_PADDING``, the checkpoint's rows only).

    Example:
        >>> t = torch.arange(8.0).reshape(4, 2)
        >>> tp_part("l.gate_proj.weight", t, TPShard(rank=1, size=2)).tolist()
        [[4.0, 5.0], [6.0, 7.0]]
        >>> tp_part("l.o_proj.weight", t, TPShard(rank=1, size=2)).tolist()
        [[1.0], [3.0], [5.0], [7.0]]
    """
    r, n = shard.rank, shard.size
    if n == 1:
        return t
    module, _, leaf = name.rpartition(".")
    proj = module.rpartition(".")[2]
    if proj in ROW_PARALLEL:
        return t if leaf == "bias" else t.tensor_split(n, dim=1)[r]
    if proj in VOCAB_PARALLEL:
        padded = -(-t.shape[0] // VOCAB_PADDING) * VOCAB_PADDING
        per = padded // n
        return t[min(r * per, t.shape[0]) : min((r + 1) * per, t.shape[0])]
    if proj in ("k_proj", "v_proj"):
        if shard.kv_heads >= n:
            return t.tensor_split(n, dim=0)[r]
        per_head = t.shape[0] // shard.kv_heads
        head = r // (n // shard.kv_heads)  # vLLM's num_kv_head_replicas workers share one head
        return t[head * per_head : (head + 1) * per_head]
    if t.dim() == 1 and "norm" in proj:
        return t
    return t.tensor_split(n, dim=0)[r]


def expected_digests(
    weights: Mapping[str, Tensor], packed: Mapping[str, list[str]], *, tied: bool, shard: TPShard = TPShard(), rename: Callable[[str], str] = str
) -> dict[str, str]:
    """What ``FlowrlWorkerExtension.flowrl_weight_digests`` must report for a vLLM model holding
    ``weights`` (Hugging Face names, the generator's dtype): fused projections are their parts
    concatenated along the output rows in ``packed``'s order (``qkv_proj`` = q, k, v), a tied
    ``lm_head`` is the embedding. With tensor parallelism (``shard``) each tensor is first cut to the
    worker's part (``tp_part``), so a fused shard is its parts' shards concatenated. ``rename``: the
    name vLLM holds a tensor under when it is not the Hugging Face one (``ModelFamily.vllm_name``: a
    mixture of experts' stacked experts are vLLM's ``w13_weight`` / ``w2_weight``).

    Example:
        >>> w = {"l.q_proj.weight": torch.ones(2, 2), "l.k_proj.weight": torch.zeros(1, 2), "l.v_proj.weight": torch.zeros(1, 2)}
        >>> list(expected_digests(w, {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}, tied=False))
        ['l.qkv_proj.weight']
    """
    out: dict[str, str] = {}
    fused = {part: (whole, parts) for whole, parts in packed.items() for part in parts}
    done: set[str] = set()
    for name in weights:
        module, _, leaf = name.rpartition(".")
        prefix, _, proj = module.rpartition(".")
        if proj in fused:
            whole, parts = fused[proj]
            key = f"{prefix}.{whole}.{leaf}"
            if key not in done:
                done.add(key)
                names = [f"{prefix}.{p}.{leaf}" for p in parts]
                out[key] = _digest(torch.cat([tp_part(n, weights[n], shard) for n in names]))
            continue
        out[rename(name)] = _digest(tp_part(name, weights[name], shard))
    if tied and "lm_head.weight" not in weights:
        out["lm_head.weight"] = _digest(tp_part("lm_head.weight", weights["model.embed_tokens.weight"], shard))
    return out


def _dtype_name(t: Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


class WeightSyncGroup:
    """A process group between this process (rank 0) and a ``vllm.LLM``'s workers (see the module docstring).

    Attributes:
        world: members: this process and vLLM's workers.
        backend: the group's backend: ``"gloo"`` (host memory, also on GPUs; see the module docstring).
        bytes_sent: payload bytes broadcast so far (each tensor once; the group fans it out).
    """

    def __init__(self, llm: Any, group: Any, *, world: int, backend: str, bucket_bytes: int) -> None:
        self._llm, self._group = llm, group
        self.world, self.backend, self.bucket_bytes = world, backend, bucket_bytes
        self.bytes_sent = 0
        self.last_workers: list[dict[str, float]] = []
        self.last_split: dict[str, float] = {}
        self._rpc = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowrl-vllm-rpc")

    @classmethod
    def join(cls, llm: Any, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = JOIN_TIMEOUT_S) -> WeightSyncGroup:
        """Form the group with every worker of ``llm`` (blocks until all have joined).

        Raises:
            TransportError: a worker did not join within ``timeout_s``.
        """
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        backend = "gloo"  # on host memory, also on GPUs: see the module docstring (NCCL cannot join two processes on one GPU)
        workers = int(llm.llm_engine.vllm_config.parallel_config.world_size)
        world = 1 + workers
        host = "127.0.0.1"
        listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listen.bind((host, 0))  # bound before the workers hear the port: no race for it
        listen.listen()
        port = int(listen.getsockname()[1])
        rpc = ThreadPoolExecutor(max_workers=1)
        try:
            joined = rpc.submit(llm.collective_rpc, "flowrl_join_weight_group", args=(host, port, world, backend, timeout_s))
            group = stateless_init_torch_distributed_process_group(
                host, port, 0, world, backend, listen_socket=listen, timeout=timedelta(seconds=timeout_s)
            )
            ranks = joined.result(timeout=timeout_s)
        except Exception as exc:
            listen.close()
            raise TransportError(f"vLLM's {workers} worker(s) did not form the weight-sync group on {host}:{port} ({backend}): {exc}") from exc
        finally:
            rpc.shutdown(wait=False)
        if sorted(ranks) != list(range(1, world)):
            raise TransportError(f"vLLM's workers joined the weight-sync group as ranks {ranks}, expected {list(range(1, world))}")
        return cls(llm, group, world=world, backend=backend, bucket_bytes=bucket_bytes)

    @torch.no_grad()
    def send(self, weights: Mapping[str, Tensor], *, timeout_s: float = JOIN_TIMEOUT_S) -> list[int]:
        """Broadcast ``weights`` (Hugging Face names, the generator's dtype) to every worker, which
        loads them in place. Returns the number of tensors each worker loaded; ``last_workers`` keeps
        each worker's report (``loaded``, ``seconds``, ``waited_s``: see ``flowrl_receive_weights``) and
        ``last_split`` this side's: ``wire_s`` until the last bucket was out, ``after_wire_s`` waiting
        for the workers to finish loading after that.

        Raises:
            TransportError: a worker failed to receive or load them (its error is the cause).
        """
        start = time.perf_counter()
        plan = bucket_plan(weights, self.bucket_bytes)
        wire = [[(n, list(weights[n].shape), _dtype_name(weights[n])) for n in bucket] for bucket in plan]
        loaded: Future[Any] = self._rpc.submit(self._llm.collective_rpc, "flowrl_receive_weights", args=(wire,))
        try:
            for bucket in plan:  # the staging tensors go on the wire as they are: no packing copy
                works = [self._group.broadcast(weights[n].detach().contiguous(), 0) for n in bucket]
                for work in works:
                    work.wait()
                self.bytes_sent += sum(weights[n].numel() * weights[n].element_size() for n in bucket)
            sent = time.perf_counter()
            counts = loaded.result(timeout=timeout_s)
            self.last_split = {"wire_s": sent - start, "after_wire_s": time.perf_counter() - sent}
        except Exception as exc:
            raise TransportError(f"weights into vLLM over the weight-sync group failed: {type(exc).__name__}: {exc}") from exc
        self.last_workers = [dict(c) for c in counts]
        return [int(c["loaded"]) for c in counts]

    def close(self) -> None:
        """Leave the group on both sides (best effort: vLLM may be shutting down)."""
        from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

        group, self._group = self._group, None
        if group is None:
            return
        try:
            done = self._rpc.submit(self._llm.collective_rpc, "flowrl_leave_weight_group")
            stateless_destroy_torch_distributed_process_group(group)
            done.result(timeout=10)
        except Exception:
            pass
        self._rpc.shutdown(wait=False)
