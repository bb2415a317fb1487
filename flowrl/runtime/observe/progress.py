"""A progress bar for runs: one redrawn line on a terminal, a line every tenth of the run otherwise.

Samples/s and the ETA come from the last ``window`` steps, so start-up (spawning worker processes,
building models) does not drag the rate down for the rest of the run.
"""

from __future__ import annotations

import collections
import sys
import time
from typing import IO, Any

__all__ = ["ProgressBar"]


class ProgressBar:
    """Shows step, reward, staleness and samples/s; call it with each metrics row."""

    def __init__(self, total: int, *, start: int = 0, stream: IO[str] | None = None, width: int = 24, window: int = 20) -> None:
        self.total = total
        self.start = start
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._t0 = time.perf_counter()
        self._samples = 0
        self._recent: collections.deque[tuple[float, int, int]] = collections.deque(maxlen=window + 1)  # (time, samples so far, step)
        self._every = max(1, (total - start) // 10)

    def __call__(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        self._samples += int(row.get("samples", 0))
        now = time.perf_counter()
        self._recent.append((now, self._samples, step))
        if len(self._recent) > 1:  # the rate over the recent window
            t_old, s_old, step_old = self._recent[0]
            span = max(1e-9, now - t_old)
            rate, step_s = (self._samples - s_old) / span, span / max(1, step - step_old)
        else:
            rate, step_s = self._samples / max(1e-9, now - self._t0), (now - self._t0) / max(1, step - self.start)
        done = (step - self.start) / max(1, self.total - self.start)
        eta = step_s * (self.total - step)
        filled = int(self.width * done)
        bar = "#" * filled + "." * (self.width - filled)
        text = (
            f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] reward {row['reward_mean']:.3f} "
            f"staleness {row['staleness']} {rate:6.1f} samples/s ETA {eta:4.0f}s"
        )
        for sample in row.get("samples_text", ()):  # --log-samples: above the bar, which is redrawn below
            line = f"  sample: {sample['prompt']!r} -> {sample['completion']!r}  reward {sample['reward']:.3f}"
            self.stream.write(("\r\033[K" if self.tty else "") + line + "\n")
        if self.tty:
            self.stream.write("\r" + text)
            if step >= self.total:
                self.stream.write("\n")
        elif (step - self.start) % self._every == 0 or step >= self.total:
            self.stream.write(text + "\n")
        self.stream.flush()
