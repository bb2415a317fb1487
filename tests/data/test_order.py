"""Epoch order: every epoch visits every row once, epochs differ, and a position maps to one row forever."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowrl.data.order import EpochOrder, epoch_permutation
from flowrl.errors import ConfigError


@given(n=st.integers(1, 40), seed=st.integers(0, 2**31), epoch=st.integers(0, 50))
def test_each_epoch_is_a_permutation_of_the_rows(n, seed, epoch):
    order = EpochOrder(n, seed)
    assert sorted(order.index(epoch * n + i) for i in range(n)) == list(range(n))
    assert [order.index(epoch * n + i) for i in range(n)] == epoch_permutation(n, seed, epoch)


@given(n=st.integers(1, 30), seed=st.integers(0, 1000), positions=st.lists(st.integers(0, 500), max_size=30))
def test_a_position_maps_to_the_same_row_whatever_was_asked_before(n, seed, positions):
    """Exactly-once resume rests on this: a fresh order (a resumed run) agrees with a used one."""
    used = EpochOrder(n, seed)
    for p in positions:
        used.index(p)
    for p in [*positions, 0, n, 3 * n + 1]:
        assert used.index(p) == EpochOrder(n, seed).index(p)
        assert used.epoch(p) == p // n


def test_epochs_and_seeds_shuffle_differently_and_shuffle_false_keeps_file_order():
    n = 20
    order = EpochOrder(n, 0)
    epochs = [[order.index(e * n + i) for i in range(n)] for e in range(3)]
    assert len({tuple(e) for e in epochs}) == 3
    assert epochs[0] != [EpochOrder(n, 1).index(i) for i in range(n)]
    assert [EpochOrder(n, 0, shuffle=False).index(p) for p in range(2 * n)] == list(range(n)) * 2


@pytest.mark.parametrize(("n", "position", "match"), [(0, 0, "at least one row"), (3, -1, "must be >= 0")], ids=["empty", "negative"])
def test_bad_orders(n, position, match):
    with pytest.raises(ConfigError, match=match):
        EpochOrder(n, 0).index(position)
