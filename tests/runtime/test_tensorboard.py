"""``flowrl run --tensorboard DIR`` writes the metrics rows' scalars, read back from the event file."""

from __future__ import annotations

import pytest

from flowrl.cli.main import main
from flowrl.runtime.metrics import read_metrics


def test_tensorboard_scalars_equal_the_metrics_rows(tmp_path, capsys):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    board, metrics = tmp_path / "tb", tmp_path / "m.jsonl"
    assert main(["run", "--synthetic", "--steps", "3", "--tensorboard", str(board), "--metrics", str(metrics), "--quiet"]) == 0
    acc = event_accumulator.EventAccumulator(str(board))
    acc.Reload()
    rows = read_metrics(metrics)
    tags = set(acc.Tags()["scalars"])
    assert {"reward_mean", "loss", "staleness", "time_s", "gen_s"} <= tags
    for key in ("reward_mean", "loss", "staleness"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [r["step"] for r in rows]
        assert [e.value for e in events] == pytest.approx([r[key] for r in rows], rel=1e-6)
