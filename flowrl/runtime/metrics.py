"""Per-step metrics as JSON lines: one object per trainer step, flushed as it is written.

Every line has at least ``step``, ``policy_version``, ``rollout_version``, ``staleness``,
``reward_mean``, ``loss``, ``time_s`` and the timings ``gen_s``, ``train_s``, ``sync_s``, ``idle_s``,
plus the loss's own namespaced metrics (``aipo/ratio_mean`` ...).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

import msgspec

__all__ = ["MetricsWriter", "read_metrics", "REQUIRED_KEYS"]

REQUIRED_KEYS = ("step", "policy_version", "rollout_version", "staleness", "reward_mean", "loss", "time_s",
                 "gen_s", "train_s", "sync_s", "idle_s")


class MetricsWriter:
    """Appends one JSON object per step to ``path`` (None: keeps them in memory only)."""

    def __init__(self, path: str | os.PathLike[str] | None, *, append: bool = False) -> None:
        self.path = Path(path) if path is not None else None
        self.rows: list[dict[str, Any]] = []
        self._file: IO[bytes] | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab" if append else "wb")  # noqa: SIM115 - closed in close()

    def write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self._file is not None:
            self._file.write(msgspec.json.encode(row) + b"\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a metrics file."""
    with open(path, "rb") as f:
        return [msgspec.json.decode(line) for line in f if line.strip()]
