"""A Weights & Biases sink for the per-step metrics rows (``flowrl run --wandb PROJECT``).

Each row is logged as it is written (``run.log(scalars, step=row["step"])``): every numeric field,
the ``eval/...`` figures included, and the decoded samples of ``--log-samples`` as a ``wandb.Table``
(prompt, completion, reward) under ``samples``. The run config (what ``RunConfig`` holds, and the
graph) is the W&B run's config. ``mode="offline"`` (or ``WANDB_MODE=offline``) writes the run under
``dir/wandb/offline-run-*`` with no network; ``wandb sync`` uploads it later. ``wandb`` is an
optional extra (``pip install 'flowrl[wandb]'``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from flowrl.errors import ConfigError

__all__ = ["WandbSink", "WANDB_INSTALL", "row_scalars"]

WANDB_INSTALL = "pip install 'flowrl[wandb]'  (or: pip install wandb)"


def row_scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The numeric fields of a metrics row but ``step`` (what the TensorBoard and W&B sinks plot).

    Example:
        >>> row_scalars({"step": 3, "loss": 0.5, "staleness": 1, "prompt_index": [4, 5], "ok": True})
        {'loss': 0.5, 'staleness': 1}
    """
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class WandbSink:
    """Logs every metrics row to a W&B run (see the module docstring).

    Args:
        project: the W&B project.
        config: the run config to record (plain data: ``msgspec.to_builtins`` of a ``RunConfig``, ...).
        mode: ``"online"`` or ``"offline"``; None reads ``WANDB_MODE`` now (else online), not the
            value wandb cached at its first ``init`` in this process.
        dir: the folder that gets ``wandb/`` (None: ``WANDB_DIR``, else the working directory); created.
        name: the run's display name (None: W&B picks one).

    Raises:
        ConfigError: when the wandb package is missing (with the install command).
    """

    def __init__(
        self,
        project: str,
        *,
        config: Mapping[str, Any],
        mode: Literal["online", "offline"] | None = None,
        dir: str | os.PathLike[str] | None = None,
        name: str | None = None,
    ) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(f"--wandb needs the wandb package: {WANDB_INSTALL}") from None
        if dir is not None:
            os.makedirs(dir, exist_ok=True)
        self._wandb = wandb
        chosen: Any = mode or os.environ.get("WANDB_MODE") or None  # any WANDB_MODE: wandb checks the name
        self.run = wandb.init(project=project, config=dict(config), mode=chosen, dir=None if dir is None else str(dir), name=name)

    def __call__(self, row: dict[str, Any]) -> None:
        from flowrl.runtime.observe.samples import SAMPLE_COLUMNS

        data: dict[str, Any] = row_scalars(row)
        if row.get("samples_text"):
            rows = [[s.get(c) for c in SAMPLE_COLUMNS] for s in row["samples_text"]]
            data["samples"] = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows)
        self.run.log(data, step=int(row["step"]))

    def close(self) -> None:
        """Finish the run (an offline run's folder is then complete, ready for ``wandb sync``) and stop
        wandb's service: wandb otherwise keeps the settings of its first ``init`` in a process, so a
        later ``WandbSink`` would ignore a changed ``WANDB_DIR``."""
        self.run.finish()
        self._wandb.teardown()
