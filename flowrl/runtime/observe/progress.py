"""A progress bar for runs: one redrawn line on a terminal, a line every tenth of the run otherwise.

Its rate and the run's summary (``flowrl run``'s ``done:`` line) come from the same numbers, the
metrics rows' ``samples`` and ``time_s`` (seconds since the run started), through ``sample_rate``:
the run's rate (its samples over the last row's ``time_s``, start-up included) and the rate over the
last ``window`` steps (start-up left out), both named. The ETA comes from the recent steps, so
start-up (spawning worker processes, building models) does not drag it for the rest of the run.

Example:
    >>> rows = [{"step": s, "samples": 8, "time_s": 10.0 + s} for s in range(1, 5)]
    >>> rate = sample_rate(rows, window=2)
    >>> rate.text()
    '2.3 samples/s (last 2 steps: 8.0)'
    >>> rate.step_s
    1.0
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any, NamedTuple

from flowrl.runtime.observe.progress_figures import DEFAULT_PROGRESS, figures_text, staleness_text

__all__ = ["ProgressBar", "SampleRate", "sample_rate", "staleness_text"]


class SampleRate(NamedTuple):
    """Samples per second of a run so far.

    Attributes:
        run: all its samples over the last row's ``time_s`` (start-up included).
        recent: over the last ``steps`` steps (the rows' ``time_s`` differences); ``run`` with one row.
        steps: steps in the recent window (0: one row, no window).
        step_s: seconds per step over the recent window (the whole run's with one row).
    """

    run: float
    recent: float
    steps: int
    step_s: float

    def text(self) -> str:
        """The rate as the bar and the summary print it: the run's, then the recent window's, named."""
        if not self.steps:
            return f"{self.run:.1f} samples/s"
        return f"{self.run:.1f} samples/s (last {self.steps} step{'s' if self.steps > 1 else ''}: {self.recent:.1f})"


def sample_rate(rows: Sequence[Mapping[str, Any]], *, window: int = 20, start: int = 0) -> SampleRate:
    """The run's and the recent rate from metrics rows (each with ``step``, ``samples``, ``time_s``).

    Args:
        rows: the run's rows so far, in order (at least one).
        window: steps in the recent window.
        start: the step the run started after (a resumed run's first row is ``start + 1``).
    """
    last = rows[-1]
    elapsed = max(1e-9, float(last["time_s"]))
    total = sum(int(r.get("samples", 0)) for r in rows)
    run = total / elapsed
    if len(rows) < 2:
        return SampleRate(run, run, 0, elapsed / max(1, int(last["step"]) - start))
    first = rows[max(0, len(rows) - 1 - window)]
    span = max(1e-9, float(last["time_s"]) - float(first["time_s"]))
    steps = int(last["step"]) - int(first["step"])
    recent = sum(int(r.get("samples", 0)) for r in rows[max(0, len(rows) - window):]) / span
    return SampleRate(run, recent, steps, span / max(1, steps))


class ProgressBar:
    """Shows step, the row's ``figures`` (``flowrl.runtime.observe.progress_figures``: by default reward,
    entropy, grad norm, staleness in batches against k and the mismatch) and samples/s (``sample_rate``);
    call it with each metrics row."""

    def __init__(
        self, total: int, *, start: int = 0, stream: IO[str] | None = None, width: int = 24, window: int = 20,
        figures: Sequence[str] = DEFAULT_PROGRESS,
    ) -> None:  # fmt: skip
        self.total = total
        self.figures = tuple(figures)
        self.start = start
        self.stream = stream or sys.stderr
        self.width = width
        self.window = window
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._t0 = time.perf_counter()
        self._rows: list[dict[str, Any]] = []  # each row's step, samples and time_s: what sample_rate reads
        self._every = max(1, (total - start) // 10)

    def __call__(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        when = float(row["time_s"]) if "time_s" in row else time.perf_counter() - self._t0  # the rows' clock, else ours
        self._rows.append({"step": step, "samples": int(row.get("samples", 0)), "time_s": when})
        rate = sample_rate(self._rows, window=self.window, start=self.start)
        done = (step - self.start) / max(1, self.total - self.start)
        eta = rate.step_s * (self.total - step)
        filled = int(self.width * done)
        bar = "#" * filled + "." * (self.width - filled)
        text = (
            f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] {figures_text(row, self.figures)} "
            f"{rate.text()} ETA {eta:4.0f}s"
        )
        for sample in row.get("samples_text", ()):  # --log-samples: above the bar, which is redrawn below
            line = f"  sample: {sample['prompt']!r} -> {sample['completion']!r}  reward {sample['reward']:.3f}"
            self.stream.write(("\r\033[K" if self.tty else "") + line + "\n")
        if self.tty:
            self.stream.write("\r\033[K" + text)
            if step >= self.total:
                self.stream.write("\n")
        elif (step - self.start) % self._every == 0 or step >= self.total:
            self.stream.write(text + "\n")
        self.stream.flush()
