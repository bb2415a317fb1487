"""A progress bar for runs: one redrawn line on a terminal, a line every tenth of the run otherwise."""

from __future__ import annotations

import sys
import time
from typing import IO, Any

__all__ = ["ProgressBar"]


class ProgressBar:
    """Shows step, reward, staleness and samples/s; call it with each metrics row."""

    def __init__(self, total: int, *, start: int = 0, stream: IO[str] | None = None, width: int = 24) -> None:
        self.total = total
        self.start = start
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._t0 = time.perf_counter()
        self._samples = 0
        self._every = max(1, (total - start) // 10)

    def __call__(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        self._samples += int(row.get("samples", 0))
        elapsed = max(1e-9, time.perf_counter() - self._t0)
        done = (step - self.start) / max(1, self.total - self.start)
        eta = elapsed / max(done, 1e-9) * (1 - done)
        filled = int(self.width * done)
        bar = "#" * filled + "." * (self.width - filled)
        text = (
            f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] reward {row['reward_mean']:.3f} "
            f"staleness {row['staleness']} {self._samples / elapsed:6.1f} samples/s ETA {eta:4.0f}s"
        )
        if self.tty:
            self.stream.write("\r" + text)
            if step >= self.total:
                self.stream.write("\n")
        elif (step - self.start) % self._every == 0 or step >= self.total:
            self.stream.write(text + "\n")
        self.stream.flush()
