"""``Batch``: what flows along data edges (field name -> tensor), with helpers to merge, split and size it.

Field names, dtypes and dims are those of ``flowrl.graph.fields.FIELDS``. A batch has two leading dims
in play: ``prompt`` (source fields and ``prompt_index``) and ``sample`` (``prompt * n_samples``, every
rollout and reward field). Scalars (``rollout_version``, ``objective``) have no leading dim.

Example:
    >>> import torch
    >>> b = {"completion_lens": torch.tensor([1, 2, 3, 4]), "rollout_version": torch.tensor(0)}
    >>> [p["completion_lens"].tolist() for p in split(b, 2)]
    [[1, 2], [3, 4]]
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from flowrl.errors import ConfigError
from flowrl.graph.fields import field_type

__all__ = ["Batch", "merge", "split", "nbytes", "num_samples", "leading_dim"]

Batch = dict[str, torch.Tensor]


def leading_dim(name: str) -> str | None:
    """The symbolic leading dim of field ``name`` (``"prompt"``, ``"sample"``) or None for a scalar."""
    dims = field_type(name).dims
    return dims[0] if dims else None


def merge(*batches: Mapping[str, torch.Tensor]) -> Batch:
    """The union of the fields of ``batches`` (e.g. a rollout and its rewards).

    Raises:
        ConfigError: when two batches carry the same field with different values.
    """
    out: Batch = {}
    for batch in batches:
        for name, value in batch.items():
            if name in out and out[name] is not value and not torch.equal(out[name], value):
                raise ConfigError(f"merge: field {name!r} appears in two batches with different values")
            out[name] = value
    return out


def num_samples(batch: Mapping[str, torch.Tensor]) -> int:
    """The size of the ``sample`` dim (from the first sample-major field)."""
    for name, value in batch.items():
        if leading_dim(name) == "sample":
            return int(value.shape[0])
    raise ConfigError(f"batch with fields {sorted(batch)} has no per-sample field")


def split(batch: Mapping[str, torch.Tensor], size: int) -> list[Batch]:
    """Consecutive slices of at most ``size`` samples (micro-batches); views, no copies.

    Per-sample fields are sliced; scalars and per-prompt fields are shared by every slice (a
    micro-batch keeps ``group_ids`` and ``prompt_index`` meaningful against the whole batch).

    Raises:
        ConfigError: when ``size < 1``.
    """
    if size < 1:
        raise ConfigError(f"split: size={size} must be >= 1")
    n = num_samples(batch)
    parts: list[Batch] = []
    for start in range(0, n, size):
        parts.append(
            {
                name: value[start : start + size] if leading_dim(name) == "sample" else value
                for name, value in batch.items()
            }
        )
    return parts


def nbytes(batch: Mapping[str, torch.Tensor]) -> int:
    """Bytes of tensor data the batch holds."""
    return sum(t.element_size() * t.numel() for t in batch.values())
