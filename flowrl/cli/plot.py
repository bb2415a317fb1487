"""``flowrl plot METRICS.jsonl [MORE.jsonl ...] -o curves.png``: the curves of one or several runs in one picture.

Rows: reward, loss, staleness, the importance ratio and AIPO's truncated fraction, the
engine/trainer log-prob mismatch (``mismatch/kl``, ``mismatch/abs_logp_max``; steps whose batch held no
token of the trainer's current weights, ``mismatch/tokens`` 0, measured nothing and are left out),
and step time; then, where the rows hold them (``panels``): training health (pi's entropy, the
reward's spread within groups, completion lengths and the share cut at ``max_new_tokens``, the
gradient norm, the learning rate), the critic's (``CRITIC_PANELS``: its value loss and clip
fraction, explained variance, mean value and return, gradient norm), the step's parts (``gen_s``,
``train_s``, ``sync_s``, ``idle_s``), one panel per named reward field
(``reward/NAME``, when a loss combines several), a KL panel (the KL to the reference ``loss/kl_ref``, and
the objective's KL(mu || pi) estimate, ``aipo/kl`` ...), and the evaluations of ``--eval-every`` (greedy
and sampled reward, pass@k; drawn at the evaluated steps only). The left column against the trainer
step, the right against wall time. Each metrics file is one line per panel, labelled by its file name,
so ``k = 0`` and ``k = 2`` runs sit side by side; a metric a run does not record draws no line and
takes no legend entry. ``--smooth N`` draws each curve as its trailing mean over N steps (``smooth``)
over the raw values, faint; the numeric metrics no panel reads are listed on stderr (``unplotted``).
matplotlib is an optional extra (``pip install 'flowrl[plot]'``); it draws with the Agg backend, so
no display is needed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["register", "plot_runs", "draw_runs", "panels", "smooth", "unplotted", "PANELS", "HEALTH_PANELS", "CRITIC_PANELS", "TIMING_PANELS"]

#: (title, what it reads): a key of the metrics rows, or ``"step_time_s"`` (the difference of ``time_s``).
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward (mean)", ("reward_mean",)),
    ("loss", ("loss",)),
    ("staleness (trainer steps, the unit of k; policy versions)", ("staleness_batches", "staleness")),
    ("importance ratio pi/mu (mean) and truncated fraction", ("ratio_mean", "truncated_frac")),
    ("log-prob mismatch mu - pi on current-version tokens (mean, max |.|)", ("mismatch/kl", "mismatch/abs_logp_max")),
    ("step time (s)", ("step_time_s",)),
)

#: Training health (``flowrl.runtime.observe.metrics.HEALTH_KEYS``), a panel each when the rows hold its first key.
HEALTH_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("policy entropy (nats per completion token)", ("policy/entropy",)),
    ("reward std within groups; share of groups with equal rewards", ("rollout/reward_std", "rollout/zero_std_frac")),
    ("completion length (mean, min, max)", ("rollout/length_mean", "rollout/length_min", "rollout/length_max")),
    ("share of completions cut at max_new_tokens", ("rollout/cut_frac",)),
    ("gradient norm (before clipping)", ("policy/grad_norm",)),
    ("learning rate", ("policy/lr",)),
)

#: Where a step's time went (the rows' timings), a panel when the rows hold them.
TIMING_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("step parts (s): generation, training, weight sync, trainer idle", ("gen_s", "train_s", "sync_s", "idle_s")),
)

#: A critic's figures (``flowrl.operators.critic``), a panel each when the rows hold its first key.
CRITIC_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("critic value loss; clipped share", ("critic/value_loss", "critic/clip_frac")),
    ("critic explained variance", ("critic/explained_variance",)),
    ("critic value and return (mean)", ("critic/value_mean", "critic/return_mean")),
    ("critic gradient norm (before clipping)", ("critic/grad_norm",)),
)

#: The objectives' KL(mu || pi) estimates (``flowrl.operators.losses``), as the KL panel reads them.
OBJECTIVE_KL = ("aipo/kl", "pg/kl", "ppo/kl", "gspo/kl", "cispo/kl", "tis/kl", "mis/kl")


def panels(runs: dict[str, list[dict[str, Any]]]) -> list[tuple[str, tuple[str, ...]]]:
    """``PANELS``, then the panels the rows call for: training health's (``HEALTH_PANELS``), a named reward
    field's, the KL's, the evaluations'.

    Example:
        >>> rows = [{"step": 1, "reward/format": 1.0, "reward/answer": 0.0, "loss/kl_ref": 0.1, "eval/greedy_reward_mean": 0.5, "eval/pass@4": 0.9}]
        >>> [title for title, _ in panels({"run": rows})[len(PANELS):]]
        ['reward: answer', 'reward: format', 'KL (loss/kl_ref)', 'eval: reward (greedy, sampled)', 'eval: pass@k']
    """
    keys = {k for rows in runs.values() for row in rows for k in row}
    out = list(PANELS)
    out += [(title, wanted) for title, wanted in (*HEALTH_PANELS, *CRITIC_PANELS, *TIMING_PANELS) if wanted[0] in keys]
    named = sorted(k for k in keys if k.startswith("reward/"))
    if len(named) > 1:  # one field is the reward panel already
        out += [(f"reward: {k.partition('/')[2]}", (k,)) for k in named]
    kl = tuple(k for k in ("loss/kl_ref", *OBJECTIVE_KL) if k in keys)
    if kl:
        out.append((f"KL ({', '.join(kl)})", kl))
    if "eval/greedy_reward_mean" in keys:
        out.append(("eval: reward (greedy, sampled)", ("eval/greedy_reward_mean", "eval/sampled_reward_mean")))
    passes = sorted((k for k in keys if k.startswith("eval/pass@")), key=lambda k: int(k.rpartition("@")[2]))
    if passes:
        out.append(("eval: pass@k", tuple(passes)))
    return out


def smooth(values: list[float], n: int) -> list[float]:
    """The trailing mean of ``values`` over ``n`` points (fewer at the start); ``n <= 1``: the values.

    Example:
        >>> smooth([0.0, 2.0, 4.0, 6.0], 2)
        [0.0, 1.0, 3.0, 5.0]
    """
    if n <= 1:
        return list(values)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= n:
            total -= values[i - n]
        out.append(total / min(i + 1, n))
    return out


#: Row keys that are not curves: bookkeeping, or drawn through another key (``time_s`` is the x axis).
NOT_CURVES = frozenset({"step", "time_s", "policy_version", "rollout_version", "max_staleness", "prompt_index", "layout"})


def unplotted(runs: dict[str, list[dict[str, Any]]], drawn: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    """The numeric metrics of the rows that no drawn panel reads (a ``/``-less panel key reads
    ``objective/key`` too), sorted: what ``flowrl plot`` lists so that no family goes unseen.

    Example:
        >>> unplotted({"r": [{"step": 1, "time_s": 1.0, "loss": 1.0, "aipo/ratio_mean": 1.0, "gen/tokens_per_s": 9.0}]}, list(PANELS))
        ['gen/tokens_per_s']
    """
    read = {k for _, keys in drawn for k in keys}
    numeric = {k for rows in runs.values() for row in rows for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return sorted(k for k in numeric - NOT_CURVES - read if k.rpartition("/")[2] not in read)


PLOT_INSTALL = "pip install 'flowrl[plot]'  (or: pip install matplotlib)"

EPILOG = """\
examples:
  flowrl run --metrics k0.jsonl --max-staleness 0 && flowrl run --metrics k2.jsonl --max-staleness 2
  flowrl plot k0.jsonl k2.jsonl -o curves.png     both runs in one picture, labelled k0 and k2
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plot",
        help="draw the curves of metrics files (reward, loss, staleness, AIPO ratio, log-prob mismatch, step time; "
        "each named reward, KL and evaluations when recorded)",
        description="Draw reward, loss, staleness, importance ratio / truncated fraction, the engine/trainer log-prob "
        "mismatch and step time against step "
        "(and, when the rows hold them, training health, the critic's figures, the step's parts, each named reward, the KL and the "
        "--eval-every evaluations) "
        "and wall time, one line per metrics file (from 'flowrl run --metrics FILE'). Needs matplotlib: " + PLOT_INSTALL,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("metrics", nargs="+", metavar="METRICS.jsonl", help="metrics files written by 'flowrl run --metrics'")
    p.add_argument("-o", "--output", default="curves.png", metavar="FILE", help="the picture (.png, .svg or .pdf; default: curves.png)")
    p.add_argument("--smooth", type=int, default=1, metavar="N",
                   help="draw each curve as its trailing mean over N steps, over the raw values (faint); default 1: raw only")
    p.set_defaults(func=_run)


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float], list[float]]:
    """``(steps, wall times, values)`` of ``key``; a ``/``-less key also matches ``objective/key``."""
    steps, times, values = [], [], []
    previous = 0.0
    for row in rows:
        t = float(row.get("time_s", 0.0))
        if key == "step_time_s":
            value: Any = t - previous
        else:
            value = row.get(key)
            if value is None:
                value = next((v for k, v in row.items() if k.endswith(f"/{key}")), None)
            if key.startswith("mismatch/") and row.get("mismatch/tokens") == 0:
                value = None  # no token of the trainer's weights in this batch: nothing was measured
        previous = t
        if isinstance(value, (int, float)):
            steps.append(float(row["step"]))
            times.append(t)
            values.append(float(value))
    return steps, times, values


def _labels(paths: list[Path]) -> list[str]:
    """File stems, or whole paths where two stems are the same."""
    stems = [p.stem for p in paths]
    return [str(p) if stems.count(p.stem) > 1 else p.stem for p in paths]


def plot_runs(runs: dict[str, list[dict[str, Any]]], output: str | os.PathLike[str], *, smooth_n: int = 1) -> None:
    """Draw ``panels(runs)`` for every run (label -> metrics rows) into ``output`` (format from its suffix),
    each curve smoothed over ``smooth_n`` steps (``smooth``).

    Raises:
        ConfigError: when matplotlib is missing (with the install command).
    """
    fig = draw_runs(runs, smooth_n=smooth_n)  # checks matplotlib is there
    import matplotlib.pyplot as plt

    fig.savefig(output, dpi=90)
    plt.close(fig)


def draw_runs(runs: dict[str, list[dict[str, Any]]], *, smooth_n: int = 1) -> Any:
    """The matplotlib figure ``plot_runs`` saves: two columns (by trainer step, by wall time) per panel,
    laid out by matplotlib's constrained layout, which keeps the figure's title above the first row's
    titles and legends (``tight_layout`` ignores a ``suptitle`` and let it overlap them). A series a
    run does not record draws nothing (no empty legend entry); with ``smooth_n`` > 1 each curve is its
    trailing mean (labelled), over its raw values drawn faint and unlabelled (evaluations, sparse, stay raw).

    Raises:
        ConfigError: when matplotlib is missing (with the install command).
    """
    from flowrl.errors import ConfigError

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(f"flowrl plot needs matplotlib: {PLOT_INSTALL}") from None
    drawn = panels(runs)
    fig, axes = plt.subplots(len(drawn), 2, figsize=(13, 3.0 * len(drawn)), squeeze=False, layout="constrained")
    for row, (title, keys) in enumerate(drawn):
        for label_i, (label, rows) in enumerate(runs.items()):
            color = f"C{label_i % 10}"
            for key_i, key in enumerate(keys):
                steps, times, values = _series(rows, key)
                if not values:  # this run does not record it: no line, no legend entry
                    continue
                style = ("-", "--", ":", "-.")[key_i % 4] + ("o" if key.startswith("eval/") else "")
                name = label if len(keys) == 1 else f"{label} {key}"
                smoothed = smooth_n > 1 and not key.startswith("eval/")
                shown = smooth(values, smooth_n) if smoothed else values
                for ax, xs in ((axes[row][0], steps), (axes[row][1], times)):
                    if smoothed:
                        ax.plot(xs, values, style, color=color, linewidth=0.8, alpha=0.25)  # the raw values, unlabelled
                    ax.plot(xs, shown, style, color=color, label=name + (f" (mean of {smooth_n})" if smoothed else ""), linewidth=1.2)
        for col, xlabel in enumerate(("trainer step", "wall time (s)")):
            ax = axes[row][col]
            ax.set_title(title, fontsize=10)
            ax.set_xlabel(xlabel)
            ax.grid(True, alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)  # the labelled lines only (matplotlib skips the raw ones, unlabelled)
            else:
                ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.suptitle("flowrl: " + ", ".join(runs), fontsize=12)
    return fig


def _run(args: argparse.Namespace) -> int:
    from flowrl.errors import ConfigError
    from flowrl.runtime.observe.metrics import read_metrics

    out = Path(args.output)
    if args.smooth < 1:
        raise ConfigError(f"--smooth {args.smooth}: N is the steps each curve's trailing mean takes, >= 1 (1: raw values only)")
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ConfigError(f"-o {out}: write .png, .svg or .pdf")
    if not out.parent.resolve().is_dir():
        raise ConfigError(f"-o {out}: folder {out.parent.resolve()} does not exist; create it first")
    paths = [Path(m) for m in args.metrics]
    runs: dict[str, list[dict[str, Any]]] = {}
    for path, label in zip(paths, _labels(paths)):
        try:
            rows = read_metrics(path)
        except FileNotFoundError:
            raise ConfigError(f"metrics file {str(path)!r} does not exist; write one with 'flowrl run --metrics {path}'") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"metrics file {str(path)!r} is not a flowrl metrics file (one JSON object per line): {exc}") from None
        rows = [r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), int)]
        if not rows:
            raise ConfigError(f"metrics file {str(path)!r} holds no step rows")
        runs[label] = rows
    plot_runs(runs, out, smooth_n=args.smooth)
    print(f"flowrl plot: wrote {out} ({len(runs)} run{'s' if len(runs) > 1 else ''})", file=sys.stderr)
    left = unplotted(runs, panels(runs))
    if left:
        print(f"flowrl plot: not drawn (no panel reads them): {', '.join(left)}", file=sys.stderr)
    return 0
