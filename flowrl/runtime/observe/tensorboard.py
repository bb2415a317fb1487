"""A TensorBoard sink for the per-step metrics rows: the same scalars, written with torch's ``SummaryWriter``,
and the decoded samples of ``--log-samples`` as a table (a text summary, tag ``samples``, holding a
markdown table: prompt, completion, reward) at the steps that logged them.

``flowrl run --tensorboard DIR`` passes it each row; ``tensorboard --logdir DIR`` shows them. The
``tensorboard`` package is an optional extra (``pip install 'flowrl[tensorboard]'``).
"""

from __future__ import annotations

import os
from typing import Any

from flowrl.errors import ConfigError

__all__ = ["TensorBoardSink", "TENSORBOARD_INSTALL", "SAMPLES_TAG"]

#: The text tag of the samples table.
SAMPLES_TAG = "samples"

TENSORBOARD_INSTALL = "pip install 'flowrl[tensorboard]'  (or: pip install tensorboard)"


class TensorBoardSink:
    """Writes every numeric field of a metrics row (but ``step``) as a scalar at that step, and its
    ``samples_text`` as a markdown table (text tag ``SAMPLES_TAG``).

    Args:
        log_dir: the event-file directory (created).

    Raises:
        ConfigError: when the tensorboard package is missing (with the install command).
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(f"--tensorboard needs the tensorboard package: {TENSORBOARD_INSTALL}") from None
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def __call__(self, row: dict[str, Any]) -> None:
        from flowrl.runtime.observe.wandb_log import row_scalars

        step = int(row["step"])
        for key, value in row_scalars(row).items():
            self.writer.add_scalar(key, value, step)
        if row.get("samples_text"):
            from flowrl.runtime.observe.samples import samples_markdown

            self.writer.add_text(SAMPLES_TAG, samples_markdown(row["samples_text"]), step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
