"""The order in which an endless prompt stream visits a dataset's rows: epochs of seeded permutations.

Position ``p`` of the stream (the ``prompt_index`` a source writes) falls in epoch ``p // n`` at
offset ``p % n``; with ``shuffle`` the row there is ``permutation(seed, epoch)[offset]``, without it
the offset itself. It is a pure function of ``(seed, n, p)``: a run resumed at position ``p`` sees
exactly the rows an uninterrupted run would, across epoch boundaries too.

The permutation of epoch ``e`` is a ``random.Random`` seeded with the string ``"{seed}:{e}"`` (Python
hashes a str seed with SHA-512, so it is the same on every machine and Python version).

Example:
    >>> order = EpochOrder(n=4, seed=0)
    >>> [order.index(p) for p in range(8)]
    [2, 3, 1, 0, 3, 2, 0, 1]
    >>> order.epoch(5)
    1
    >>> [EpochOrder(n=3, seed=0, shuffle=False).index(p) for p in range(5)]
    [0, 1, 2, 0, 1]
"""

from __future__ import annotations

import random

from flowrl.errors import ConfigError

__all__ = ["EpochOrder", "epoch_permutation"]


def epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    """The order of the ``n`` rows in epoch ``epoch`` of a stream seeded with ``seed``."""
    order = list(range(n))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


class EpochOrder:
    """Position -> (epoch, row index) of an endless stream over ``n`` rows (see the module docstring).

    Args:
        n: rows per epoch (>= 1).
        seed: seed of the per-epoch permutations.
        shuffle: permute each epoch; False visits the rows in order, epoch after epoch.
    """

    def __init__(self, n: int, seed: int, *, shuffle: bool = True) -> None:
        if n < 1:
            raise ConfigError(f"a prompt stream needs at least one row, got n={n}")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._cached: tuple[int, list[int]] | None = None  # (epoch, its permutation): positions come in runs

    def epoch(self, position: int) -> int:
        """The epoch (0-based) that ``position`` falls in."""
        return position // self.n

    def index(self, position: int) -> int:
        """The row index (0 <= index < n) served at stream ``position``.

        Raises:
            ConfigError: for a negative position.
        """
        if position < 0:
            raise ConfigError(f"stream position {position} must be >= 0")
        epoch, offset = divmod(position, self.n)
        if not self.shuffle:
            return offset
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, epoch_permutation(self.n, self.seed, epoch))
        return self._cached[1][offset]
