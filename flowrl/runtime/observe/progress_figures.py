"""Which figures of a metrics row the progress bar shows: ``flowrl run --progress NAME,NAME,...``.

Each name is one figure read from the row and written as ``name value``. The default is the health
figures that tell at a glance whether a run learns: ``reward``, ``entropy``, ``grad_norm``,
``staleness`` (in batches against k) and ``mismatch``. A figure the row lacks (a synthetic run has
no entropy; no token of the trainer's weights, no mismatch) shows as ``-``.

Example:
    >>> row = {"reward_mean": 0.5, "policy/entropy": 1.2345, "staleness": 1, "staleness_batches": 1, "max_staleness": 1}
    >>> figures_text(row, parse_progress("reward,entropy,staleness"))
    'reward 0.500 entropy 1.23 staleness 1/1 batch'
    >>> figures_text({"reward_mean": 0.5}, ("reward", "mismatch"))
    'reward 0.500 mismatch -'
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from flowrl.errors import ConfigError

__all__ = ["staleness_text", "Figure", "PROGRESS_FIGURES", "DEFAULT_PROGRESS", "parse_progress", "figures_text", "progress_help"]


def _number(key: str, form: str) -> Callable[[Mapping[str, Any]], str | None]:
    def read(row: Mapping[str, Any]) -> str | None:
        value = row.get(key)
        return None if value is None else format(float(value), form)

    return read


def staleness_text(row: Mapping[str, Any]) -> str:
    """A row's staleness in the unit of the bound k (trainer steps: batches), against k, and in policy
    versions too where a batch makes several (``updates`` per batch).

    Example:
        >>> staleness_text({"staleness": 4, "staleness_batches": 2, "max_staleness": 2})
        'staleness 2/2 batches (4 versions)'
        >>> staleness_text({"staleness": 1, "staleness_batches": 1, "max_staleness": 1})
        'staleness 1/1 batch'
        >>> staleness_text({"staleness": 3})  # a row without the batch figures (an older file)
        'staleness 3 versions'
    """
    versions = row["staleness"]
    if "staleness_batches" not in row:
        return f"staleness {versions} version{'s' if versions != 1 else ''}"
    batches, k = row["staleness_batches"], row.get("max_staleness", 0)
    text = f"staleness {batches:g}/{k} batch{'es' if k != 1 else ''}"
    return text + (f" ({versions} version{'s' if versions != 1 else ''})" if versions != batches else "")


def _staleness(row: Mapping[str, Any]) -> str | None:
    return staleness_text(row).removeprefix("staleness ") if "staleness" in row else None


def _mismatch(row: Mapping[str, Any]) -> str | None:
    """``mismatch/kl`` where the step had tokens of the trainer's weights (``mismatch/tokens`` > 0)."""
    if "mismatch/kl" not in row or not row.get("mismatch/tokens", 1):
        return None
    return f"{float(row['mismatch/kl']):.2g}"


class Figure(NamedTuple):
    """One figure the bar can show.

    Attributes:
        key: the metrics-row key it reads (what ``--metrics`` and ``flowrl plot`` call it).
        meaning: what it tells, for ``--help``.
        read: the row -> its text (None: the row lacks it).
    """

    key: str
    meaning: str
    read: Callable[[Mapping[str, Any]], str | None]


#: The figures ``--progress`` can name, in the order ``--help`` lists them.
PROGRESS_FIGURES: dict[str, Figure] = {
    "reward": Figure("reward_mean", "the batch's mean reward", _number("reward_mean", ".3f")),
    "entropy": Figure("policy/entropy", "pi's entropy over the completion tokens, in nats; falling to 0: the policy collapsed", _number("policy/entropy", ".3g")),
    "grad_norm": Figure("policy/grad_norm", "the gradient norm before clipping; spikes: an unstable step", _number("policy/grad_norm", ".3g")),
    "staleness": Figure("staleness_batches", "how old the consumed batch was, in batches against the bound k (and in versions where a batch makes several)", _staleness),
    "mismatch": Figure("mismatch/kl", "mean log mu - log pi on tokens of the trainer's weights; far from 0: the engine samples another distribution than the trainer trains", _mismatch),
    "zero_std": Figure("rollout/zero_std_frac", "the share of prompt groups whose rewards are all equal (no learning signal); near 1: nothing to learn from", _number("rollout/zero_std_frac", ".2f")),
    "reward_std": Figure("rollout/reward_std", "the reward's standard deviation within groups", _number("rollout/reward_std", ".3g")),
    "length": Figure("rollout/length_mean", "the mean completion length in tokens", _number("rollout/length_mean", ".1f")),
    "cut": Figure("rollout/cut_frac", "the share of completions cut at max_new_tokens", _number("rollout/cut_frac", ".2f")),
    "loss": Figure("loss", "the objective's loss", _number("loss", ".4g")),
    "lr": Figure("policy/lr", "the learning rate of the step", _number("policy/lr", ".3g")),
}

#: What the bar shows without ``--progress``: the health figures.
DEFAULT_PROGRESS: tuple[str, ...] = ("reward", "entropy", "grad_norm", "staleness", "mismatch")


def parse_progress(text: str) -> tuple[str, ...]:
    """The figure names of ``--progress``'s value (comma-separated, in the order given).

    Raises:
        ConfigError: naming every unknown or repeated name and the names there are.

    Example:
        >>> parse_progress("reward, zero_std")
        ('reward', 'zero_std')
    """
    names = tuple(n.strip() for n in text.split(","))
    unknown = [n for n in names if n not in PROGRESS_FIGURES]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if unknown or repeated or not text.strip():
        meant = {n: difflib.get_close_matches(n, PROGRESS_FIGURES, n=1) for n in unknown}
        named = ", ".join(f"{n!r}" + (f" (did you mean {m[0]!r}?)" if m else "") for n, m in meant.items())
        what = ("no figure named" if not text.strip() else f"unknown figure{'s' if len(unknown) > 1 else ''} {named}" if unknown
                else f"{', '.join(map(repr, repeated))} named twice")
        raise ConfigError(
            f"--progress {text!r}: {what}; the figures are {', '.join(PROGRESS_FIGURES)} "
            f"(default: {','.join(DEFAULT_PROGRESS)}; no bar at all: --quiet)"
        )
    return names


def figures_text(row: Mapping[str, Any], names: Sequence[str]) -> str:
    """``name value`` for each of ``names``, ``name -`` where ``row`` lacks the figure."""
    return " ".join(f"{name} {PROGRESS_FIGURES[name].read(row) or '-'}" for name in names)


def progress_help() -> str:
    """``--progress``'s help: what it takes, the default, and each name with what it tells."""
    listed = "; ".join(f"{name} ({f.key}): {f.meaning}" for name, f in PROGRESS_FIGURES.items())
    return (
        f"comma-separated figures of each metrics row that the progress bar shows after the step (default: "
        f"{','.join(DEFAULT_PROGRESS)}, the health figures). The names: {listed}. A figure a row lacks shows as '-'; "
        "--metrics FILE keeps every figure of every step"
    )
