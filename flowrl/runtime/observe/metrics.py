"""Per-step metrics as JSON lines: one object per trainer step, flushed as it is written.

Every line has at least ``step``, ``policy_version``, ``rollout_version``, ``staleness`` (policy
versions, as the two versions count), ``staleness_batches`` and ``max_staleness`` (the same in trainer
steps, the unit of the bound k, and k: ``staleness 2/2 batches`` on the progress bar), ``reward_mean``, ``loss``, ``time_s`` and the timings ``gen_s``, ``train_s``, ``sync_s``, ``idle_s``,
plus the loss's own namespaced metrics (``aipo/ratio_mean`` ...), the engine/trainer mismatch
(``mismatch/kl``, ``mismatch/abs_logp_max``, ``mismatch/tokens``, ``mismatch/outside_kept_frac``:
``flowrl.operators.mismatch``; 0.0 over 0 tokens when no token is of the trainer's weights, never
NaN, which JSON would write as null) and ``prompt_index``: the indices of
the prompts the step consumed (sorted), so that what a run trained on, across kills and resumes, can
be read back from the file alone.

Training health, in every row of a policy that trains (``HEALTH_KEYS``):

- from the batch the policy consumed (``rollout_health``, so alike under every backend):
  ``rollout/reward_std`` (the combined reward's standard deviation within each prompt group,
  population std as the advantages' ``normalize_std`` takes it, averaged over the groups: the spread
  the group baseline learns from), ``rollout/zero_std_frac`` (the fraction of groups whose rewards
  are all equal: advantage 0, no learning signal), ``rollout/length_mean``, ``rollout/length_min``,
  ``rollout/length_max`` (completion tokens: ``completion_lens``) and ``rollout/cut_frac``
  (the share cut at ``max_new_tokens``: ``shaping.truncated_completions``, the rule
  ``mask_truncated_completions`` applies);
- from the trainer (``flowrl.operators.trainer``): ``policy/entropy`` (pi's entropy over the
  completion tokens, from the logits of its training forward pass), ``policy/grad_norm`` (before
  clipping), ``policy/lr``.

The run's first row (step 1) also has ``layout``: each device node's devices, the sub-mesh its program
runs and what runs there (``flowrl.runtime.observe.layout``), so a run shows the layout it ran.

What a program reports goes into the row when its key is namespaced (has a ``/``); the un-namespaced
keys programs report each have a column of the row or are left out on purpose (``UNNAMESPACED``).
"""

from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Iterable
from typing import IO, Any

import msgspec
import torch

from flowrl.fileio import write_atomic

__all__ = [
    "MetricsWriter",
    "read_metrics",
    "step_row",
    "rollout_health",
    "REQUIRED_KEYS",
    "HEALTH_KEYS",
    "UNNAMESPACED",
    "COMPLETION_LEN_HIST",
    "length_histogram",
]

#: The generator's own figures that reach its step's row: a multi-turn generator's ``env/*``, a
#: continuous one's ``slots/*`` (utilisation, decode steps, carried groups, in-flight weight swaps).
GENERATOR_PREFIXES = ("env/", "slots/")

#: Metrics-row key holding one step's completion-length histogram (``[[length, count], ...]``).
COMPLETION_LEN_HIST = "completion_len_hist"

REQUIRED_KEYS = ("step", "policy_version", "rollout_version", "staleness", "staleness_batches", "max_staleness", "reward_mean",
                 "loss", "time_s", "gen_s", "train_s", "sync_s", "idle_s")

#: The training-health figures of every row of a policy that trains (module docstring).
HEALTH_KEYS = (
    "rollout/reward_std", "rollout/zero_std_frac", "rollout/length_mean", "rollout/length_min", "rollout/length_max",
    "rollout/cut_frac", "policy/entropy", "policy/grad_norm", "policy/lr",
)  # fmt: skip

#: The un-namespaced keys the built-in programs report (a policy's ``info``, a generator's ``gen``,
#: a source's, scorer's, reference's or reward model's step), which the row does not copy as they
#: are: key -> where its figure is instead. The row takes a policy's namespaced keys, a generator's
#: ``GENERATOR_PREFIXES`` and the other nodes' namespaced keys (``Controller``); any other key is
#: dropped. ``tests/runtime/test_health_metrics.py`` checks that every key the programs of a run
#: report is in its row or here.
UNNAMESPACED: dict[str, str] = {
    "position": "the row's prompt_index (a source's read position)",
    "score_s": "the scorer's span in the trace (--trace)",
    "ref_s": "the reference's span in the trace (--trace)",
    "rm_s": "the reward model's span in the trace (--trace)",
    "teacher_s": "the teacher's span in the trace (--trace)",
    "critic_s": "the critic's span in the trace (--trace)",
    "loss": "the row's loss",
    "reward_mean": "the row's reward_mean, computed from the batch",
    "staleness": "the row's staleness, computed from the batch's versions",
    "updates": "the graph's updates_per_batch, alike every step: policy_version - the previous row's",
    "train_s": "the row's train_s",
    "publish_s": "in the row's sync_s",
    "fetch_s": "in the row's sync_s",
    "gen_s": "the row's gen_s",
    "version": "the row's policy_version (a policy's) or rollout_version (a generator's)",
    "layout": "the run's first row's layout (a program over several ranks, its first step: observe.layout)",
}


class MetricsWriter:
    """Appends one JSON object per step to ``path`` (None: keeps them in memory only).

    The file is created at the first row, so a run that fails before its first step leaves none.
    With ``append`` (a resumed run), rows of steps after ``keep_through`` (the checkpoint resumed
    from) are removed first, with a torn last line a kill may have left: they belong to the part of
    the interrupted run that the resume repeats, so the file keeps exactly one row per step.
    """

    def __init__(self, path: str | os.PathLike[str] | None, *, append: bool = False, keep_through: int | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.rows: list[dict[str, Any]] = []
        self._file: IO[bytes] | None = None
        self._mode = "ab" if append else "wb"
        if self.path is not None and append and keep_through is not None and self.path.is_file():
            _truncate_after(self.path, keep_through)

    def write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self.path is not None:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, self._mode)  # noqa: SIM115 - closed in close()
            self._file.write(msgspec.json.encode(row) + b"\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _truncate_after(path: Path, step: int) -> None:
    """Keep the complete rows of ``path`` with ``step <= step``; replace the file atomically."""
    kept = []
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # torn by a kill mid-write
            try:
                row = msgspec.json.decode(line)
            except msgspec.DecodeError:
                break
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                kept.append(line)
    write_atomic(path, b"".join(kept))


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a metrics file."""
    with open(path, "rb") as f:
        return [msgspec.json.decode(line) for line in f if line.strip()]


def step_row(
    *,
    seq: int,
    version: int,
    rollout_version: int,
    batch: dict[str, torch.Tensor],
    info: dict[str, Any],
    gen: dict[str, Any],
    reward_weights: dict[str, float],
    time_s: float,
    idle_s: float,
    updates: int = 1,
    max_staleness: int = 0,
) -> dict[str, Any]:
    """The metrics row of trainer step ``seq`` (0-based; the row's ``step`` is ``seq + 1``).

    Args:
        seq: the step's sequence number; version: the policy's version after it.
        rollout_version: the weights' version that generated the batch.
        batch: the batch the policy consumed (rewards by scorer name, completions, prompt indices).
        info: what the policy's program reported (loss, train and publish times, namespaced metrics).
        gen: what the generator reported for this batch (``gen_s``, ``fetch_s``).
        reward_weights: scorer name -> weight in the combined reward.
        time_s: seconds since the run started; idle_s: seconds the policy waited for this batch.
        updates: policy versions per step (``Graph.updates_per_batch``): the row's ``staleness`` is the
            policy's version at the step's start (``updates * seq``) minus ``rollout_version``, in versions;
            ``staleness_batches`` is that over ``updates``, in trainer steps (batches), the unit of the bound.
        max_staleness: the bound k the batch was checked against, in batches (``StalenessGate.policy_k``).
    """
    rewards = {name: batch[name].float() for name in reward_weights if name in batch}
    combined = sum(w * rewards[name] for name, w in reward_weights.items() if name in rewards)
    row: dict[str, Any] = {
        "step": seq + 1,
        "policy_version": version,
        "rollout_version": rollout_version,
        "staleness": updates * seq - rollout_version,
        "staleness_batches": _in_batches(updates * seq - rollout_version, updates),
        "max_staleness": max_staleness,
        "reward_mean": float(combined.mean()) if isinstance(combined, torch.Tensor) else 0.0,
        "loss": float(info.get("loss", float("nan"))),
        "time_s": time_s,
        "gen_s": float(gen.get("gen_s", 0.0)),
        "train_s": float(info.get("train_s", 0.0)),
        "sync_s": float(info.get("publish_s", 0.0)) + float(gen.get("fetch_s", 0.0)),
        "idle_s": idle_s,
        "samples": int(batch["completion_ids"].shape[0]) if "completion_ids" in batch else 0,
    }
    if "completion_lens" in batch:  # the planner reads a run's lengths back (flowrl plan --lengths-from)
        row[COMPLETION_LEN_HIST] = length_histogram(batch["completion_lens"].tolist())
    row.update(rollout_health(batch, combined if isinstance(combined, torch.Tensor) else None))
    if len(rewards) > 1:
        row.update({f"reward/{name}": float(r.mean()) for name, r in rewards.items()})
    row.update({key: value for key, value in info.items() if "/" in key})
    row.update({key: float(value) for key, value in gen.items() if key.startswith(GENERATOR_PREFIXES)})
    prompts = batch.get("prompt_index")
    row["prompt_index"] = sorted(set(prompts.tolist())) if prompts is not None else []  # exactly-once is checkable from the file
    return row


def _in_batches(versions: int, updates: int) -> int | float:
    """``versions`` policy versions in trainer steps of ``updates`` versions each: an int when whole
    (published versions are multiples of ``updates``), else a float."""
    whole, rest = divmod(versions, max(1, updates))
    return whole if rest == 0 else versions / max(1, updates)


def rollout_health(batch: dict[str, torch.Tensor], rewards: torch.Tensor | None) -> dict[str, float]:
    """The ``rollout/*`` health figures of a consumed batch (module docstring); none without completions.

    Args:
        batch: the rollout (``completion_mask``, ``group_ids``, ``completion_lens`` when it has them,
            ``completion_stopped`` when the engine says which stopped).
        rewards: ``[S]`` the combined reward of each sample (None: no reward figures).

    Example:
        >>> b = {"completion_mask": torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0]]).bool(),
        ...      "group_ids": torch.tensor([0, 0, 1, 1])}
        >>> rollout_health(b, torch.tensor([1.0, 0.0, 0.5, 0.5]))
        {'rollout/length_mean': 2.0, 'rollout/length_min': 1.0, 'rollout/length_max': 3.0, 'rollout/cut_frac': 0.25, 'rollout/reward_std': 0.25, 'rollout/zero_std_frac': 0.5}
    """
    from flowrl.operators.shaping import truncated_completions

    mask = batch.get("completion_mask")
    if mask is None or mask.shape[0] == 0:
        return {}
    lengths = batch["completion_lens"] if "completion_lens" in batch else mask.sum(1)  # [S]
    lengths = lengths.to(torch.float64)
    cut = truncated_completions(mask, batch.get("completion_stopped"))  # [S] bool
    out = {
        "rollout/length_mean": float(lengths.mean()),
        "rollout/length_min": float(lengths.min()),
        "rollout/length_max": float(lengths.max()),
        "rollout/cut_frac": float(cut.to(torch.float64).mean()),
    }
    if rewards is not None and "group_ids" in batch:
        _, inverse = torch.unique(batch["group_ids"].cpu(), return_inverse=True)  # [S] -> group 0..G-1
        n = int(inverse.max()) + 1
        r = rewards.to("cpu", torch.float64)
        count = torch.zeros(n, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))  # [G]
        mean = torch.zeros(n, dtype=torch.float64).index_add_(0, inverse, r) / count  # [G]
        var = torch.zeros(n, dtype=torch.float64).index_add_(0, inverse, (r - mean[inverse]) ** 2) / count  # [G]
        hi = torch.full((n,), -torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, r, "amax")
        lo = torch.full((n,), torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, r, "amin")
        out["rollout/reward_std"] = float(var.sqrt().mean())
        out["rollout/zero_std_frac"] = float((hi == lo).to(torch.float64).mean())
    return out


def length_histogram(lengths: Iterable[int], *, max_bins: int = 64) -> list[list[int]]:
    """``[[length, count], ...]`` of one batch (a metrics row's ``completion_len_hist``, read back by
    ``flowrl plan --lengths-from``), at most ``max_bins`` bins (each bin at its longest length).

    Example:
        >>> length_histogram([3, 1, 3, 5])
        [[1, 1], [3, 2], [5, 1]]
    """
    counts: dict[int, int] = {}
    for n in lengths:
        counts[int(n)] = counts.get(int(n), 0) + 1
    items = sorted(counts.items())
    if len(items) > max_bins:
        lo, hi = items[0][0], items[-1][0]
        width = -(-(hi - lo + 1) // max_bins)
        binned: dict[int, int] = {}
        for length, c in items:
            top = min(hi, lo + ((length - lo) // width + 1) * width - 1)
            binned[top] = binned.get(top, 0) + c
        items = sorted(binned.items())
    return [[length, c] for length, c in items]
