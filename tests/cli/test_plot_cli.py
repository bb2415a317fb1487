"""``flowrl plot``: a real PNG of several runs, and clear errors (missing matplotlib, bad files)."""

from __future__ import annotations

import builtins
import json

import pytest

from flowrl.cli.main import main


def _metrics(path, n, k):
    rows = [
        {"step": s, "time_s": 0.1 * s, "reward_mean": s / n, "loss": 1.0 / s, "staleness": min(k, s - 1),
         "aipo/ratio_mean": 1.0, "aipo/truncated_frac": 0.01 * k, "prompt_index": [s]}
        for s in range(1, n + 1)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_plot_renders_a_png_of_several_runs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "curves.png"
    assert main(["plot", str(_metrics(tmp_path / "k0.jsonl", 20, 0)), str(_metrics(tmp_path / "k2.jsonl", 20, 2)), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 20_000
    assert "wrote" in capsys.readouterr().err


def test_plot_without_matplotlib_names_the_extra(tmp_path, capsys, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert main(["plot", str(_metrics(tmp_path / "m.jsonl", 3, 0)), "-o", str(tmp_path / "c.png")]) == 2
    assert "pip install 'flowrl[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "c.png").exists()


@pytest.mark.parametrize(
    "content, output, message",
    [
        (None, "c.png", "does not exist; write one with 'flowrl run --metrics"),
        ("not json\n", "c.png", "is not a flowrl metrics file"),
        ('{"a": 1}\n', "c.png", "holds no step rows"),
        ('{"step": 1}\n', "c.txt", "write .png, .svg or .pdf"),
    ],
    ids=["missing", "not-json", "no-rows", "bad-suffix"],
)
def test_plot_user_mistakes(tmp_path, capsys, content, output, message):
    path = tmp_path / "m.jsonl"
    if content is not None:
        path.write_text(content)
    assert main(["plot", str(path), "-o", str(tmp_path / output)]) == 2
    err = capsys.readouterr().err
    assert message in " ".join(err.split()) and "Traceback" not in err


@pytest.mark.parametrize("objective", ["aipo", "pg"])
def test_the_ratio_panel_reads_the_objectives_ratio_and_truncated_fraction(objective):
    """The ratio panel's keys match any objective's namespaced metrics (``pg`` logs the mismatch it ignores)."""
    from flowrl.cli.plot import PANELS, _series

    rows = [{"step": s, "time_s": s, f"{objective}/ratio_mean": 1 + s / 10, f"{objective}/truncated_frac": s / 100} for s in (1, 2)]
    (keys,) = [keys for title, keys in PANELS if title.startswith("importance ratio")]
    assert [_series(rows, key)[2] for key in keys] == [[1.1, 1.2], [0.01, 0.02]]


def test_the_mismatch_panel_leaves_out_steps_that_measured_nothing():
    """``mismatch/tokens`` 0 (no token of the trainer's weights in the batch) writes kl 0.0 by convention;
    the panel leaves those steps out instead of drawing a perfect match."""
    from flowrl.cli.plot import PANELS, _series

    rows = [
        {"step": 1, "time_s": 1.0, "mismatch/kl": 1e-3, "mismatch/abs_logp_max": 0.01, "mismatch/tokens": 50.0},
        {"step": 2, "time_s": 2.0, "mismatch/kl": 0.0, "mismatch/abs_logp_max": 0.0, "mismatch/tokens": 0.0},
        {"step": 3, "time_s": 3.0, "mismatch/kl": 2e-3, "mismatch/abs_logp_max": 0.02, "mismatch/tokens": 40.0},
    ]
    (keys,) = [keys for title, keys in PANELS if title.startswith("log-prob mismatch")]
    assert [_series(rows, key)[:1] + _series(rows, key)[2:] for key in keys] == [([1.0, 3.0], [1e-3, 2e-3]), ([1.0, 3.0], [0.01, 0.02])]


def _rich_metrics(path):
    """Two named rewards, a KL to the reference, the objective's KL, training health, and evaluations at steps 2 and 4."""
    from flowrl.runtime.observe.metrics import HEALTH_KEYS

    rows = []
    for s in range(1, 5):
        row = {"step": s, "time_s": 0.5 * s, "reward_mean": 0.1 * s, "loss": 1.0, "staleness": 0, "prompt_index": [s],
               "reward/answer": 0.1 * s, "reward/format": 1.0, "loss/kl_ref": 0.01 * s, "aipo/kl": 0.002 * s,
               "aipo/truncated_frac": 0.01 * s, **{k: i + 0.5 * s for i, k in enumerate(HEALTH_KEYS)}}
        if s % 2 == 0:
            row.update({"eval/greedy_reward_mean": 0.2 * s, "eval/sampled_reward_mean": 0.1 * s, "eval/pass@1": 0.1 * s,
                        "eval/pass@2": 0.15 * s, "eval/pass@4": 0.2 * s})
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_panels_per_named_reward_kl_and_evaluations_when_the_rows_hold_them(tmp_path):
    """Each named reward field, the KL (to the reference, and the objective's) and the evaluations get a
    panel drawn from their rows; a run without them gets none of these panels."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flowrl.cli.plot import PANELS, panels, plot_runs
    from flowrl.runtime.observe.metrics import read_metrics

    drawn = {}

    def keep(fig, *args, **kwargs):  # what each panel drew, title -> {legend label: (x, y)}; the PNG is another test's
        for ax in fig.axes[::2]:
            drawn[ax.get_title()] = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}

    rows = read_metrics(_rich_metrics(tmp_path / "m.jsonl"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plt.Figure, "savefig", keep)
        mp.setattr(plt.Figure, "tight_layout", lambda fig: None)  # layout is slow and checked by the PNG test
        plot_runs({"m": rows}, tmp_path / "c.png")
    assert list(drawn)[len(PANELS):] == [
        "policy entropy (nats per completion token)", "reward std within groups; share of groups with equal rewards",
        "completion length (mean, min, max)", "share of completions cut at max_new_tokens", "gradient norm (before clipping)",
        "learning rate", "reward: answer", "reward: format", "KL (loss/kl_ref, aipo/kl)", "eval: reward (greedy, sampled)", "eval: pass@k",
    ]
    assert drawn["reward: answer"]["m"] == ([1, 2, 3, 4], [r["reward/answer"] for r in rows])
    assert drawn["policy entropy (nats per completion token)"]["m"] == ([1, 2, 3, 4], [r["policy/entropy"] for r in rows])
    assert drawn["completion length (mean, min, max)"]["m rollout/length_max"][1] == [r["rollout/length_max"] for r in rows]
    (ratio_panel,) = [t for t in drawn if t.startswith("importance ratio")]
    assert drawn[ratio_panel]["m truncated_frac"][1] == [r["aipo/truncated_frac"] for r in rows]  # AIPO's, not rollout/cut_frac
    assert drawn["KL (loss/kl_ref, aipo/kl)"]["m loss/kl_ref"][1] == [r["loss/kl_ref"] for r in rows]
    assert drawn["eval: pass@k"]["m eval/pass@4"] == ([2, 4], [rows[1]["eval/pass@4"], rows[3]["eval/pass@4"]])
    assert sorted(drawn["eval: pass@k"]) == ["m eval/pass@1", "m eval/pass@2", "m eval/pass@4"]
    assert drawn["eval: reward (greedy, sampled)"]["m eval/greedy_reward_mean"][0] == [2, 4]

    assert panels({"plain": read_metrics(_metrics(tmp_path / "p.jsonl", 4, 0))}) == list(PANELS)


def test_the_figure_title_overlaps_no_panel_title_or_legend(tmp_path):
    """The suptitle's box lies above every first-row panel's title and legend, as drawn (a long title of
    two runs; boxes in display pixels from matplotlib's renderer)."""
    pytest.importorskip("matplotlib")
    from flowrl.cli.plot import draw_runs
    from flowrl.runtime.observe.metrics import read_metrics

    runs = {name: read_metrics(_metrics(tmp_path / f"{name}.jsonl", 20, k)) for name, k in (("k0-baseline", 0), ("k2-async", 2))}
    fig = draw_runs(runs)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    title = fig._suptitle.get_window_extent(renderer)
    first_row = fig.axes[:2]
    for ax in first_row:
        for artist in (ax.title, ax.get_legend()):
            box = artist.get_window_extent(renderer)
            assert not title.overlaps(box), (title, box)
            assert title.y0 >= box.y1  # above it, not beside it
    fig.savefig(tmp_path / "curves.png", dpi=90)


def _drawn_by_panel(runs, tmp_path, **kwargs):
    """title -> {legend label: (x, y)} of the step column, and the figure's legend labels per panel, as drawn."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from flowrl.cli.plot import draw_runs

    fig = draw_runs(runs, **kwargs)
    lines = {ax.get_title(): {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines} for ax in fig.axes[::2]}
    legends = {ax.get_title(): [t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend() else [] for ax in fig.axes[::2]}
    import matplotlib.pyplot as plt

    plt.close(fig)
    return lines, legends


def _grpo_critic_rows():
    """A GRPO-like run (a ratio, no truncated fraction) with a critic's figures and the step's timings."""
    return [
        {"step": s, "time_s": float(s), "reward_mean": float(s % 2), "loss": 1.0, "staleness": 2 * (s > 1), "staleness_batches": int(s > 1),
         "max_staleness": 1, "grpo/ratio_mean": 1.0, "critic/value_loss": 1.0 / s, "critic/clip_frac": 0.1, "critic/explained_variance": 0.1 * s,
         "critic/value_mean": 0.2, "critic/return_mean": 0.3, "critic/grad_norm": 2.0, "gen_s": 0.5, "train_s": 0.4, "sync_s": 0.05,
         "idle_s": 0.0, "samples": 16, "gen/tokens_per_s": 100.0 + s}
        for s in range(1, 7)
    ]


def test_a_metric_a_run_lacks_takes_no_legend_entry_and_the_critic_is_plotted(tmp_path):
    lines, legends = _drawn_by_panel({"m": _grpo_critic_rows()}, tmp_path)
    (ratio,) = [t for t in legends if t.startswith("importance ratio")]
    assert legends[ratio] == ["m ratio_mean"]  # no 'm truncated_frac' entry: GRPO records none
    assert lines["critic value loss; clipped share"]["m critic/value_loss"][1] == [1.0 / s for s in range(1, 7)]
    assert lines["critic explained variance"]["m"][1] == pytest.approx([0.1 * s for s in range(1, 7)], rel=0, abs=1e-12)
    assert set(legends["critic value and return (mean)"]) == {"m critic/value_mean", "m critic/return_mean"}
    assert "critic gradient norm (before clipping)" in lines
    (staleness,) = [t for t in legends if t.startswith("staleness")]
    assert lines[staleness]["m staleness_batches"][1] == [0, 1, 1, 1, 1, 1] and lines[staleness]["m staleness"][1] == [0, 2, 2, 2, 2, 2]
    assert lines["step parts (s): generation, training, weight sync, trainer idle"]["m gen_s"][1] == [0.5] * 6


def test_smooth_draws_the_trailing_mean_over_the_raw_values(tmp_path):
    from flowrl.cli.plot import smooth

    assert smooth([1.0, 0.0, 1.0, 0.0, 1.0], 3) == pytest.approx([1.0, 0.5, 2 / 3, 1 / 3, 2 / 3], rel=1e-15)
    assert smooth([3.0, 4.0], 1) == [3.0, 4.0]
    lines, legends = _drawn_by_panel({"m": _grpo_critic_rows()}, tmp_path, smooth_n=2)
    reward = lines["reward (mean)"]
    assert reward["m (mean of 2)"][1] == [1.0, 0.5, 0.5, 0.5, 0.5, 0.5]  # rewards 1, 0, 1, 0, 1, 0
    raw = [v for label, v in reward.items() if label.startswith("_")]  # the faint raw line is unlabelled
    assert [y for _, y in raw] == [[1.0, 0.0, 1.0, 0.0, 1.0, 0.0]]
    assert legends["reward (mean)"] == ["m (mean of 2)"]


def test_plot_smooth_on_the_command_line_and_the_metrics_no_panel_reads_are_listed(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _grpo_critic_rows()))
    assert main(["plot", str(path), "--smooth", "3", "-o", str(tmp_path / "c.png")]) == 0
    err = capsys.readouterr().err
    assert "not drawn (no panel reads them): gen/tokens_per_s, samples" in err
    assert main(["plot", str(path), "--smooth", "0", "-o", str(tmp_path / "c.png")]) == 2
    assert "--smooth 0: N is the steps each curve's trailing mean takes, >= 1" in capsys.readouterr().err
