"""``flowrl run --wandb PROJECT`` offline: the run folder W&B leaves holds the metrics rows and the run
config, read back from its transaction log (no network, no W&B account)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from flowrl.cli.main import main
from flowrl.runtime.observe.metrics import read_metrics

wandb = pytest.importorskip("wandb")


def read_wandb_log(path: Path) -> list:
    """The records of a W&B run file (``run-*.wandb``): a 7-byte W&B header, then LevelDB's log format
    (32 KiB blocks of records: crc32c, length, type FULL/FIRST/MIDDLE/LAST), each a ``Record`` protobuf."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, out, part = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            part = payload
        elif kind in (3, 4):
            part += payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            out.append(record)
    return out


@pytest.mark.parametrize("how", ["flag", pytest.param("env", marks=pytest.mark.slow)])
def test_an_offline_run_folder_holds_every_metrics_row_and_the_run_config(tmp_path, monkeypatch, capsys, how):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    mode = ["--wandb-mode", "offline"] if how == "flag" else []
    if how == "env":
        monkeypatch.setenv("WANDB_MODE", "offline")
    metrics = tmp_path / "m.jsonl"
    argv = ["run", "--synthetic", "--steps", "3", "--log-samples", "0", "--metrics", str(metrics), "--quiet", "--wandb", "proj", *mode]
    assert main(argv) == 0
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert f"wandb: {run_file.parent}" in capsys.readouterr().out
    records = read_wandb_log(run_file)
    history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    rows = read_metrics(metrics)
    assert [h.step.num for h in history] == [r["step"] for r in rows] == [1, 2, 3]
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in h.item} for h in history]
    for logged, row in zip(history, rows):
        for key in ("reward_mean", "loss", "staleness", "time_s", "train_s"):
            assert logged[key] == pytest.approx(row[key], rel=1e-9), key
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in run.config.update}
    assert config["run"]["steps"] == 3 and config["run"]["metrics"] == str(metrics)
    assert config["graph"]["name"] == "llamarl"


def test_without_wandb_the_flag_names_the_extra(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(["run", "--synthetic", "--steps", "1", "--quiet", "--wandb", "proj"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'flowrl[wandb]'" in err and "Traceback" not in err
