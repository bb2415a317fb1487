"""``flowrl plan`` on a cluster with no devices: one clear error (exit 2, no traceback) before any planning."""

from __future__ import annotations

import re

import msgspec
import pytest

from flowrl.cli.main import main
from flowrl.planners.cluster import parse_cluster


@pytest.mark.parametrize(("field", "message"), [("hosts", r"hosts=0 and devices_per_host=8 must both be >= 1"), ("devices_per_host", r"hosts=2 and devices_per_host=0")])
def test_a_cluster_file_without_devices_is_refused_by_the_cli(tmp_path, capsys, field, message):
    spec = msgspec.to_builtins(parse_cluster("16xH100"))
    spec[field] = 0
    path = tmp_path / "cluster.json"
    path.write_bytes(msgspec.json.encode(spec))
    assert main(["plan", "llamarl", "--cluster", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(message, err), err


@pytest.mark.parametrize("text", ["0xH100", "cpu:0", "0x8xH100"])
def test_a_cluster_string_without_devices_is_refused_by_the_cli(capsys, text):
    assert main(["plan", "llamarl", "--cluster", text]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("flowrl plan: error: cluster") and "be >= 1" in err, err
