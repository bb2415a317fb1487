"""The progress bar's rate and ETA come from recent steps, not from the start of the run."""

from __future__ import annotations

import io

from flowrl.runtime.observe import progress
from flowrl.runtime.observe.progress import ProgressBar


def test_rate_and_eta_ignore_slow_start(monkeypatch):
    clock = {"t": 0.0}
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock["t"])
    out = io.StringIO()
    bar = ProgressBar(100, stream=out, window=5)
    clock["t"] = 30.0  # 30 s of start-up before the first step
    for step in range(1, 51):
        bar({"step": step, "samples": 256, "reward_mean": 0.5, "staleness": 1})
        clock["t"] += 0.5  # then a step every 0.5 s: 512 samples/s
    last = out.getvalue().strip().splitlines()[-1]
    assert "512.0 samples/s" in last, last
    assert "ETA   25s" in last, last  # 50 steps left at 0.5 s each


def test_non_terminal_prints_a_line_every_tenth():
    out = io.StringIO()
    bar = ProgressBar(20, stream=out)
    for step in range(1, 21):
        bar({"step": step, "samples": 1, "reward_mean": 0.0, "staleness": 0})
    lines = out.getvalue().splitlines()
    assert [line.split("/")[0] for line in lines] == [f"step {s:>2}" for s in range(2, 21, 2)]
