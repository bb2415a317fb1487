"""Rollout correction: a layer on any objective for the engine/trainer mismatch (``b.loss(..., correction=...)``).

The generator's log-probs (mu, recorded by the engine) and the trainer's differ even at the same
weights: another precision, other kernels, a stale or quantized copy. A correction turns the ratio
``r_t = pi_prox(y_t) / mu(y_t)`` into a per-token weight ``w_t`` that scales the token's gradient, 0
masking it out; ``pi_prox`` is the policy the objective anchors at, the trainer's weights at the
batch's start: ``proximal_logprobs`` when the trainer computed them (several updates per batch), else
pi's own values (a batch's only update: the same weights). An objective anchored at the old policy
(``ObjectiveRow.anchored_at_old``) then takes its ratio against ``pi_prox``, not mu, so that mu enters
once, through the correction (TRL's and verl's decoupling)::

    tis       w_t = min(r_t, cap)                     (level="token")
              w_t = min(prod_t' r_t', cap)            (level="sequence": every token of the sequence)
    icepop    w_t = r_t 1[low <= r_t <= high]          (IcePop, Ling team 2025: masked, kept tokens reweighted)
    seq_mask  w_t = 1[low <= exp(mean_t' log r_t') <= high]   (geometric-mean sequence ratio; the
              whole sequence masked, kept ones unweighted: SkyRL's / OpenRLHF's geometric masking)

The weight is a constant (no gradient flows through it). A masked token (``w = 0``) leaves the
objective's mask and so its value and its gradient; it still counts in the loss's normalizer and its
sequence's length (the batch's counts do not depend on the mismatch). An objective that already
corrects the mismatch itself (``ObjectiveRow.corrects``: ``aipo``, ``tis``, ``mis``, ``decoupled_ppo``,
``dppo``) refuses a correction.

Metrics (``flowrl.operators.corrections``), under ``correction/``: ``token_frac`` (share of real tokens
masked or truncated), ``seq_frac`` (share of sequences with at least one), ``weight_mean`` and
``weight_max`` (the weights over the real tokens).

Example:
    >>> CorrectionConfig(kind="icepop").band()
    (0.5, 5.0)
    >>> CorrectionConfig(kind="tis", cap=0.5)
    Traceback (most recent call last):
      ...
    flowrl.errors.ConfigError: correction 'tis': cap=0.5 must be >= 1 (it caps pi_prox/mu from above)
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

from flowrl.errors import ConfigError

__all__ = ["CORRECTIONS", "DEFAULTS", "CorrectionConfig", "correction_of", "check_correction"]

#: The corrections by name.
CORRECTIONS: tuple[str, ...] = ("tis", "icepop", "seq_mask")

#: Each correction's options and defaults (the options a correction does not name are refused).
DEFAULTS: dict[str, dict[str, Any]] = {
    "tis": {"level": "token", "cap": 2.0},
    "icepop": {"low": 0.5, "high": 5.0},  # the IcePop post's [alpha, beta]
    "seq_mask": {"low": 0.99, "high": 1.01},
}


class CorrectionConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A rollout correction (module docstring); None options take ``DEFAULTS[kind]``.

    Attributes:
        kind: ``"tis"``, ``"icepop"`` or ``"seq_mask"``.
        level: ``tis``: ``"token"`` or ``"sequence"`` (the product of the sequence's ratios).
        cap: ``tis``'s cap C >= 1.
        low, high: ``icepop``'s band of the token ratio, ``seq_mask``'s of the geometric-mean
            sequence ratio: ``0 <= low <= 1 <= high``, finite.
    """

    kind: Literal["tis", "icepop", "seq_mask"]
    level: Literal["token", "sequence"] | None = None
    cap: float | None = None
    low: float | None = None
    high: float | None = None

    def __post_init__(self) -> None:
        where = f"correction {self.kind!r}"
        if self.kind not in CORRECTIONS:
            raise ConfigError(f"correction {self.kind!r} is not one of {list(CORRECTIONS)}")
        given = [k for k in ("level", "cap", "low", "high") if getattr(self, k) is not None]
        foreign = [k for k in given if k not in DEFAULTS[self.kind]]
        if foreign:
            raise ConfigError(f"{where} takes only {sorted(DEFAULTS[self.kind])}, not {foreign}: drop them")
        for k in ("cap", "low", "high"):
            v = getattr(self, k)
            if v is not None and not math.isfinite(v):
                raise ConfigError(f"{where}: {k}={v} must be finite")
        if self.kind == "tis":
            if self.level is not None and self.level not in ("token", "sequence"):
                raise ConfigError(f"{where}: level={self.level!r} must be 'token' or 'sequence'")
            if self.options()["cap"] < 1:
                raise ConfigError(f"{where}: cap={self.options()['cap']} must be >= 1 (it caps pi_prox/mu from above)")
            return
        low, high = self.band()
        if low > high:
            raise ConfigError(f"{where}: low={low} > high={high}: the kept band is [low, high]")
        if not (0 <= low <= 1 <= high):
            raise ConfigError(f"{where}: low={low}, high={high} must satisfy 0 <= low <= 1 <= high (a ratio of 1, no mismatch, is kept)")

    def options(self) -> dict[str, Any]:
        """The correction's options, defaults filled in."""
        return {k: (d if getattr(self, k) is None else getattr(self, k)) for k, d in DEFAULTS[self.kind].items()}

    def band(self) -> tuple[float, float]:
        """``(low, high)`` of ``icepop`` / ``seq_mask``."""
        o = self.options()
        return float(o["low"]), float(o["high"])

    def describe(self) -> str:
        """``kind(option=value, ...)``."""
        return f"{self.kind}({', '.join(f'{k}={v}' for k, v in self.options().items())})"


def correction_of(value: Any, *, owner: str = "loss") -> CorrectionConfig | None:
    """A ``correction=`` argument as a ``CorrectionConfig``: a name, a dict with ``kind``, a config, or None.

    Raises:
        ConfigError: anything else, or a bad option (naming the owner).
    """
    if value is None or isinstance(value, CorrectionConfig):
        return value
    try:
        if isinstance(value, str):
            return CorrectionConfig(kind=value)  # type: ignore[arg-type]  # any name: __post_init__ refuses an unknown kind
        if isinstance(value, dict):
            return msgspec.convert(value, CorrectionConfig)
    except (msgspec.ValidationError, ConfigError) as exc:
        raise ConfigError(f"{owner}: correction={value!r}: {exc}") from None
    raise ConfigError(f"{owner}: correction={value!r} must be one of {list(CORRECTIONS)}, a dict with 'kind', or a CorrectionConfig")


def check_correction(correction: CorrectionConfig | None, objective: str, corrects: str) -> str | None:
    """What is wrong with ``correction`` on an objective whose row corrects ``corrects`` already; None if nothing."""
    if correction is not None and corrects:
        return (
            f"correction={correction.kind!r} on objective {objective!r}, which already corrects the mismatch "
            f"({corrects}); drop the correction, or use objective='pg' / 'grpo' / another objective with it"
        )
    return None
