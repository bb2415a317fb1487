"""Data movement inside one node's process group: batches over collectives, shards, data-parallel steps.

The pieces the ``torchrun`` backend's parallel executors are made of, kept free of sockets and of
the controller so that they can be tested on their own:

- ``broadcast_batch`` / ``send_batch`` / ``recv_batch``: a ``dict[str, Tensor]`` over
  torch.distributed as a msgspec header (names, dtypes, shapes) in a uint8 tensor followed by the
  tensors themselves; never pickle (``broadcast_object_list`` would pickle).
- ``shard_by_groups``: split a training batch into ``parts`` pieces along whole prompt groups, so
  that each piece's group-baseline advantages equal the whole batch's.
- ``split_prompts`` / ``merge_rollouts``: the generator replicas' split of a prompt batch and the
  lead's merge of their rollouts (``group_ids`` re-offset, ``rollout_version`` = the oldest used).
- ``make_data_parallel``: turns a ``Trainer`` into one data-parallel replica: gradients weighted
  by each replica's share of the tokens, summed over the group, clipped with the global norm, then
  the same optimizer step on every replica.

Every collective here runs on the group passed in and under the process group's timeout
(``init_process_group(timeout=...)``): a peer that died makes the others fail within it, never hang.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch import Tensor

from flowrl.runtime.wire import DTYPES

__all__ = [
    "broadcast_batch",
    "send_batch",
    "recv_batch",
    "shard_by_groups",
    "split_prompts",
    "merge_rollouts",
    "make_data_parallel",
    "reduce_metrics",
]

Batch = dict[str, Tensor]
_NAMES = {v: k for k, v in DTYPES.items()}


def _header(batch: Mapping[str, Tensor]) -> Tensor:
    meta = []
    for name, t in batch.items():
        if t.dtype not in _NAMES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which cannot cross ranks; use one of {sorted(DTYPES)}")
        meta.append([name, _NAMES[t.dtype], list(t.shape)])
    return torch.frombuffer(bytearray(msgspec.json.encode(meta)), dtype=torch.uint8)


def _empty_from(raw: Tensor, device: torch.device) -> Batch:
    meta = msgspec.json.decode(bytes(raw.cpu().numpy().tobytes()))
    return {name: torch.empty(shape, dtype=DTYPES[dtype], device=device) for name, dtype, shape in meta}


def broadcast_batch(batch: Mapping[str, Tensor] | None, *, src: int, group: Any, device: torch.device | None = None) -> Batch:
    """``batch`` (given on global rank ``src``, None elsewhere) on every rank of ``group``.

    One broadcast of the header length, one of the header, one per tensor (NCCL needs ``device``
    to be the rank's CUDA device; gloo takes CPU tensors). A tensor travels as its bytes (a uint8
    view): gloo's broadcast has no int16 (``routed_experts`` of a model with more than 255 experts).
    """
    device = device or torch.device("cpu")

    def cast(t: Tensor) -> None:
        dist.broadcast(t.reshape(-1).view(torch.uint8), src=src, group=group)

    if dist.get_rank() == src:
        assert batch is not None
        header = _header(batch)
        cast(torch.tensor([header.numel()], dtype=torch.int64, device=device))
        cast(header.to(device))
        out = {k: v.detach().to(device).contiguous() for k, v in batch.items()}
        for t in out.values():
            if t.numel():
                cast(t)
        return out
    return _take_batch(cast, device)


def send_batch(batch: Mapping[str, Tensor], *, dst: int, group: Any = None, device: torch.device | None = None) -> None:
    """Send ``batch`` to global rank ``dst`` (its ``recv_batch`` takes it): header, then each tensor."""
    device = device or torch.device("cpu")
    header = _header(batch)
    dist.send(torch.tensor([header.numel()], dtype=torch.int64, device=device), dst=dst, group=group)
    dist.send(header.to(device), dst=dst, group=group)
    for t in batch.values():
        if t.numel():
            dist.send(t.detach().to(device).contiguous(), dst=dst, group=group)


def recv_batch(*, src: int, group: Any = None, device: torch.device | None = None) -> Batch:
    """Receive what ``send_batch`` on global rank ``src`` sent."""
    return _take_batch(lambda t: dist.recv(t, src=src, group=group), device or torch.device("cpu"))


def _take_batch(fill: Callable[[Tensor], object], device: torch.device) -> Batch:
    """The receiving side of ``broadcast_batch`` and ``send_batch``: the header's length, the header,
    then each non-empty tensor, each filled in place by ``fill`` (a broadcast or a recv)."""
    length = torch.zeros(1, dtype=torch.int64, device=device)
    fill(length)
    raw = torch.empty(int(length), dtype=torch.uint8, device=device)
    fill(raw)
    out = _empty_from(raw, device)
    for t in out.values():
        if t.numel():
            fill(t)
    return out


def _per_sample(batch: Mapping[str, Tensor], n: int) -> list[str]:
    return [k for k, v in batch.items() if v.dim() >= 1 and v.shape[0] == n]


def shard_by_groups(batch: Mapping[str, Tensor], parts: int) -> list[Batch]:
    """Split a training batch into ``parts`` shards of whole prompt groups (``group_ids``).

    Groups go to shards in order, as evenly as the group count allows; a shard may be empty.
    Per-sample fields (first dim = samples) are sliced; the others (``rollout_version``,
    ``prompt_index``) are copied into every shard. The shards' group ids keep their values.

    Example:
        >>> b = {"group_ids": torch.tensor([0, 0, 1, 1, 2, 2]), "r": torch.arange(6)}
        >>> [s["r"].tolist() for s in shard_by_groups(b, 2)]
        [[0, 1, 2, 3], [4, 5]]
    """
    gid = batch["group_ids"]
    n = int(gid.shape[0])
    keys = _per_sample(batch, n)
    # group boundaries: indices where a new group starts (samples of a group are contiguous)
    starts = [0] + [i for i in range(1, n) if int(gid[i]) != int(gid[i - 1])]
    groups = len(starts) if n else 0
    bounds = [starts[math.ceil(groups * p / parts)] if math.ceil(groups * p / parts) < groups else n for p in range(parts)] + [n]
    out = []
    for p in range(parts):
        lo, hi = bounds[p], bounds[p + 1]
        out.append({k: (v[lo:hi] if k in keys else v) for k, v in batch.items()})
    return out


def split_prompts(prompts: Mapping[str, Tensor], parts: int) -> list[Batch]:
    """Split a prompt batch row-wise into ``parts`` contiguous pieces (sizes differ by at most one)."""
    n = int(prompts["prompt_ids"].shape[0])
    keys = _per_sample(prompts, n)
    bounds = [(n * p) // parts for p in range(parts + 1)]
    return [{k: (v[bounds[p]:bounds[p + 1]] if k in keys else v) for k, v in prompts.items()} for p in range(parts)]


def merge_rollouts(parts: Sequence[Mapping[str, Tensor]]) -> Batch:
    """One rollout from the replicas' rollouts, in order: per-sample fields concatenated,
    ``group_ids`` offset by the prompts before each part, ``rollout_version`` the oldest of the parts
    (every part is at least the version the staleness gate asked for, so the bound still holds)."""
    parts = [p for p in parts if p]
    out: Batch = {}
    offset = 0
    gids = []
    for p in parts:
        gids.append(p["group_ids"] + offset)
        offset += int(p["prompt_index"].shape[0]) if "prompt_index" in p else (int(p["group_ids"].max()) + 1 if p["group_ids"].numel() else 0)
    for key in parts[0]:
        if key == "group_ids":
            out[key] = torch.cat(gids)
        elif key == "rollout_version":
            out[key] = torch.stack([p[key] for p in parts]).min()
        else:
            out[key] = torch.cat([p[key] for p in parts])
    return out


def reduce_metrics(metrics: Mapping[str, float], weight: float, *, group: Any, device: torch.device | None = None) -> dict[str, float]:
    """Every metric over ``group`` (keys must agree on every rank), each reduced as its name says.

    - ``*_max``: the largest value of any rank (``mismatch/abs_logp_max``); ``*_min``: the smallest;
    - ``*/tokens`` and ``shaping/dropped_*``: the sum (how many tokens a figure covers, how many groups
      or samples dynamic sampling dropped, all ranks together);
    - a mean over tokens (``TOKEN_MEANS``: ``mismatch/kl``, ``policy/entropy``): weighted by each
      rank's count of the tokens it covers (``mismatch/tokens``, ``policy/tokens``);
    - anything else: the ``weight``-weighted mean (``weight`` is the rank's samples).

    Example (one process: a group of one):
        >>> import torch.distributed as dist, tempfile, os
        >>> _ = dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
        >>> reduce_metrics({"loss": 2.0, "mismatch/abs_logp_max": 0.5, "mismatch/tokens": 3.0}, 4.0, group=None)
        {'loss': 2.0, 'mismatch/abs_logp_max': 0.5, 'mismatch/tokens': 3.0}
        >>> dist.destroy_process_group()
    """
    from flowrl.operators.trainer import TOKEN_MEANS  # the trainer's metrics say which are means over tokens

    keys = sorted(metrics)
    peaks_of = [k for k in keys if k.endswith(("_max", "_min"))]
    means = [k for k in keys if k not in peaks_of]
    counts = sorted({TOKEN_MEANS[k] for k in means if k in TOKEN_MEANS})  # the token counts the token means are weighted by

    def summed(k: str) -> bool:
        return k.endswith("/tokens") or k.startswith("shaping/dropped_")

    def rank_weight(k: str) -> float:
        return 1.0 if summed(k) else float(metrics.get(TOKEN_MEANS[k], 0.0)) if k in TOKEN_MEANS else weight

    values = torch.tensor(
        [float(metrics[k]) * rank_weight(k) for k in means] + [weight] + [float(metrics.get(c, 0.0)) for c in counts],
        dtype=torch.float64, device=device or "cpu",
    )  # fmt: skip
    dist.all_reduce(values, group=group)
    reduced = values.tolist()
    sums, samples = reduced[: len(means)], reduced[len(means)]
    totals = dict(zip(counts, reduced[len(means) + 1 :]))  # each token count, all ranks together
    out = {}
    for k, v in zip(means, sums):
        total = 1.0 if summed(k) else totals[TOKEN_MEANS[k]] if k in TOKEN_MEANS else samples
        out[k] = v / (total or 1.0)
    for op, suffix in ((dist.ReduceOp.MAX, "_max"), (dist.ReduceOp.MIN, "_min")):
        named = [k for k in peaks_of if k.endswith(suffix)]
        if named:
            peaks = torch.tensor([float(metrics[k]) for k in named], dtype=torch.float64, device=device or "cpu")
            dist.all_reduce(peaks, op=op, group=group)
            out.update(zip(named, peaks.tolist()))
    return {k: out[k] for k in keys}


def make_data_parallel(trainer: Any, *, group: Any, max_norm: float, device: torch.device | None = None) -> None:
    """Make ``trainer`` (a ``flowrl.operators.trainer.Trainer`` built with clipping off) one replica.

    Wraps ``trainer.optimizer.step`` (the only hook the Trainer offers between backward and step):
    before the real step, every gradient is scaled by this replica's token share
    ``max(N_r, 1) / max(N, 1)`` (set ``trainer.dp_token_share`` before ``train_step``), summed over
    ``group``, and the summed gradients are clipped to ``max_norm`` by their global norm. Since the
    loss is a token sum divided by the token count, the result equals one process's step over the
    whole batch, up to float rounding. ``trainer.dp_grad_norm`` holds the global norm afterwards
    (``trainer.dp_grad_norms`` every step's).

    A parameter without a gradient on this replica (an empty shard) gets zeros, so every replica
    takes part in every all-reduce in the same order.
    """
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    step = trainer.optimizer.step
    trainer.dp_token_share = 1.0
    trainer.dp_grad_norm = 0.0
    trainer.dp_grad_norms = []  # every step's global norm (a batch may take several steps)

    def dp_step(*args: Any, **kwargs: Any) -> Any:
        share = float(trainer.dp_token_share)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.mul_(share)
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # one all-reduce instead of one per tensor
        if device is not None:
            flat = flat.to(device)
        dist.all_reduce(flat, group=group)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p))
            offset += n
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        trainer.dp_grad_norm = float(norm)
        trainer.dp_grad_norms.append(float(norm))
        return step(*args, **kwargs)

    trainer.optimizer.step = dp_step
