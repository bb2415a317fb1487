"""Batch helpers: merge refuses conflicts, split slices per-sample fields only, nbytes counts data."""

from __future__ import annotations

import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.operators.batch import leading_dim, merge, nbytes, num_samples, split

BATCH = {
    "completion_ids": torch.arange(10).view(5, 2),
    "rewards": torch.arange(5, dtype=torch.float32),
    "prompt_index": torch.tensor([7]),
    "rollout_version": torch.tensor(3),
}


def test_leading_dims_come_from_the_field_table():
    assert [leading_dim(k) for k in BATCH] == ["sample", "sample", "prompt", None]


def test_split_slices_samples_and_shares_the_rest():
    parts = split(BATCH, 2)
    assert [num_samples(p) for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p["completion_ids"] for p in parts]), BATCH["completion_ids"])
    assert all(p["rollout_version"] is BATCH["rollout_version"] and p["prompt_index"] is BATCH["prompt_index"] for p in parts)
    with pytest.raises(ConfigError, match="size=0 must be >= 1"):
        split(BATCH, 0)


def test_merge_unions_fields_and_refuses_conflicts():
    merged = merge({"a": torch.ones(2)}, {"b": torch.zeros(2)}, {"a": torch.ones(2)})
    assert sorted(merged) == ["a", "b"]
    with pytest.raises(ConfigError, match="field 'a' appears in two batches with different values"):
        merge({"a": torch.ones(2)}, {"a": torch.zeros(2)})


def test_nbytes():
    assert nbytes(BATCH) == 10 * 8 + 5 * 4 + 8 + 8
