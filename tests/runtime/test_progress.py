"""The progress bar's rate and the run's summary come from the same numbers (the rows' samples and
time_s): the run's rate, start-up included, and the recent window's, named; the ETA from recent steps."""

from __future__ import annotations

import io
import re

from flowrl.cli.main import main
from flowrl.runtime.observe.progress import ProgressBar, sample_rate


def _rows(n: int, *, start_up: float = 30.0, step_s: float = 0.5, samples: int = 256) -> list[dict]:
    """``n`` rows of ``samples`` each, the first after ``start_up`` seconds, then one every ``step_s``."""
    return [{"step": s, "samples": samples, "reward_mean": 0.5, "staleness": 1, "time_s": start_up + step_s * (s - 1)} for s in range(1, n + 1)]


def test_the_bar_shows_the_runs_rate_and_the_recent_one_named_and_an_eta_from_recent_steps():
    out = io.StringIO()
    bar = ProgressBar(100, stream=out, window=5)
    rows = _rows(50)
    for row in rows:
        bar(row)
    last = out.getvalue().strip().splitlines()[-1]
    run = 50 * 256 / (30.0 + 0.5 * 49)  # 234.9: 30 s of start-up, then a step every 0.5 s
    assert f"{run:.1f} samples/s (last 5 steps: 512.0)" in last, last  # 5 steps of 256 samples in 2.5 s
    assert "ETA   25s" in last, last  # 50 steps left at 0.5 s each
    assert sample_rate(rows, window=5) == (run, 512.0, 5, 0.5)


def test_one_row_has_the_runs_rate_only():
    rate = sample_rate(_rows(1, start_up=2.0))
    assert rate.text() == "128.0 samples/s" and rate.step_s == 2.0


def test_non_terminal_prints_a_line_every_tenth():
    out = io.StringIO()
    bar = ProgressBar(20, stream=out)
    for step in range(1, 21):
        bar({"step": step, "samples": 1, "reward_mean": 0.0, "staleness": 0, "time_s": float(step)})
    lines = out.getvalue().splitlines()
    assert [line.split("/")[0] for line in lines] == [f"step {s:>2}" for s in range(2, 21, 2)]


def test_the_bars_last_rate_is_the_summarys(capsys):
    """A run's bar (the issue: 177.1 samples/s there, 34.2 in the summary) ends on the summary's figures."""
    assert main(["run", "--synthetic", "--steps", "6"]) == 0
    captured = capsys.readouterr()
    bar = [line for line in captured.err.splitlines() if line.startswith("step 6/6")][-1]
    done = next(line for line in captured.out.splitlines() if line.startswith("done: 6 steps"))
    shown = re.search(r"\d+\.\d samples/s \(last 5 steps: \d+\.\d\)", bar)
    assert shown is not None, bar
    assert shown.group(0) in done, (bar, done)


def test_the_bar_shows_the_health_figures_by_default_and_a_dash_for_one_the_row_lacks():
    from flowrl.runtime.observe.progress_figures import DEFAULT_PROGRESS

    row = {"step": 1, "samples": 8, "time_s": 1.0, "reward_mean": 0.25, "policy/entropy": 2.0794, "policy/grad_norm": 0.0123,
           "staleness": 2, "staleness_batches": 1, "max_staleness": 1, "mismatch/kl": 3.2e-6, "mismatch/tokens": 40.0}
    out = io.StringIO()
    ProgressBar(10, stream=out)(row)
    assert DEFAULT_PROGRESS == ("reward", "entropy", "grad_norm", "staleness", "mismatch")
    assert "reward 0.250 entropy 2.08 grad_norm 0.0123 staleness 1/1 batch (2 versions) mismatch 3.2e-06 " in out.getvalue(), out.getvalue()
    out = io.StringIO()
    ProgressBar(10, stream=out)({**row, "mismatch/tokens": 0.0})  # no token of the trainer's weights: no mismatch figure
    assert " mismatch - " in out.getvalue(), out.getvalue()


def test_progress_picks_the_figures_in_the_order_given(capsys):
    assert main(["run", "--synthetic", "--steps", "2", "--progress", "loss,reward,zero_std"]) == 0
    bar = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step 2/2")][-1]
    assert re.search(r"\] loss \S+ reward \S+ zero_std \S+ \d", bar), bar
    assert "entropy" not in bar and "staleness" not in bar, bar


def test_progress_refuses_unknown_names_listing_the_figures_and_with_quiet(capsys):
    from flowrl.runtime.observe.progress_figures import PROGRESS_FIGURES

    assert main(["run", "--synthetic", "--steps", "1", "--progress", "reward,entropyy,foo"]) == 2
    err = " ".join(capsys.readouterr().err.split())  # the message as one line, unwrapped
    assert "unknown figures 'entropyy' (did you mean 'entropy'?), 'foo'" in err, err
    assert ", ".join(PROGRESS_FIGURES) in err, err  # every name there is
    assert main(["run", "--synthetic", "--steps", "1", "--progress", "reward", "--quiet"]) == 2
    assert "--quiet turns off" in capsys.readouterr().err
    assert main(["run", "--synthetic", "--steps", "1", "--progress", "reward,reward"]) == 2
    assert "'reward' named twice" in capsys.readouterr().err


def test_progress_help_names_every_figure_with_its_row_key():
    from flowrl.runtime.observe.progress_figures import PROGRESS_FIGURES, progress_help

    text = progress_help()
    assert all(f"{name} ({figure.key}): {figure.meaning}" in text for name, figure in PROGRESS_FIGURES.items())
