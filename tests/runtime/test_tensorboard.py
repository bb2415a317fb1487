"""``flowrl run --tensorboard DIR`` writes the metrics rows' scalars, read back from the event file."""

from __future__ import annotations

import pytest

from flowrl.cli.main import main
from flowrl.runtime.observe.metrics import read_metrics


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


def test_logged_samples_are_a_markdown_table_in_a_text_summary_at_their_steps(tmp_path):
    """``--log-samples 2``: at steps 2 and 4 the text tag ``samples`` holds one table row per logged sample,
    whose cells are the metrics row's prompt, completion and reward (``|`` escaped)."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    board, metrics = tmp_path / "tb", tmp_path / "m.jsonl"
    assert main(["run", "--steps", "4", "--log-samples", "2", "--tensorboard", str(board), "--metrics", str(metrics), "--quiet"]) == 0
    acc = event_accumulator.EventAccumulator(str(board), size_guidance={"tensors": 0})
    acc.Reload()
    logged = {r["step"]: r["samples_text"] for r in read_metrics(metrics) if "samples_text" in r}
    events = acc.Tensors("samples/text_summary")
    assert sorted(logged) == [e.step for e in events] == [2, 4]
    for event in events:
        lines = event.tensor_proto.string_val[0].decode().splitlines()
        assert lines[:2] == ["| prompt | completion | reward |", "|---|---|---|"]
        cells = [line.strip("| ").split(" | ") for line in lines[2:]]
        assert cells == [[s["prompt"], s["completion"], str(s["reward"])] for s in logged[event.step]]


def test_a_cell_with_pipes_and_line_breaks_stays_one_cell():
    from flowrl.runtime.observe.samples import samples_markdown

    table = samples_markdown([{"prompt": "a|b", "completion": "line 1\nline 2", "reward": 0.5}])
    assert table.splitlines()[2] == r"| a\|b | line 1<br>line 2 | 0.5 |"
