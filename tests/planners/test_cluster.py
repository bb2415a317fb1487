"""Cluster specs: the string forms, the file forms, presets, and the errors that list the forms."""

from __future__ import annotations

import pytest

from flowrl.errors import PlanError
from flowrl.planners.cluster import DEVICE_PRESETS, ClusterSpec, cluster_to_json, cpu_cluster, load_cluster_file, parse_cluster


@pytest.mark.parametrize(
    "text, hosts, per_host, device",
    [
        ("1024xH100", 128, 8, "H100"),
        ("128x8xH100", 128, 8, "H100"),
        ("4xA100", 1, 4, "A100"),
        ("8xh200", 1, 8, "H200"),
        ("16x4xA100", 16, 4, "A100"),
        (" 64xH100 ", 8, 8, "H100"),
    ],
    ids=lambda v: str(v),
)
def test_string_forms(text, hosts, per_host, device):
    c = parse_cluster(text)
    assert (c.hosts, c.devices_per_host, c.device.name) == (hosts, per_host, device)
    assert c.n_devices == hosts * per_host


def test_cpu_forms_are_one_host_of_cores():
    c = parse_cluster("cpu")
    assert c.hosts == 1 and c.device.kind == "cpu" and c.device.compute_dtype == "float32"
    c3 = parse_cluster("cpu:3")
    assert (c3.name, c3.n_devices) == ("cpu:3", 3)
    assert c3.device.memory_bytes == c.device.memory_bytes  # a core's share of RAM, whatever N says


@pytest.mark.parametrize(
    "text, match",
    [
        ("1001xH100", r"do not fill hosts of 8 .*'126x8xH100'"),
        ("8xTPU", r"unknown device 'TPU'; known devices: H100, H200, A100"),
        ("lots of gpus", r"cannot parse cluster .*'NxDEVICE'.*'cpu:N'"),
        ("cpu:0", r"cores=0 must be >= 1"),
        ("0xH100", r"device count 0 must be >= 1"),
        ("0x8xH100", r"hosts=0 .* must both be >= 1"),
        ("missing.json", r"cluster file 'missing.json' does not exist"),
    ],
    ids=lambda v: str(v)[:20],
)
def test_bad_cluster_strings_name_the_forms(text, match):
    with pytest.raises(PlanError, match=match):
        parse_cluster(text)


def test_json_file_round_trip(tmp_path):
    c = parse_cluster("16x4xA100")
    path = tmp_path / "c.json"
    path.write_bytes(cluster_to_json(c))
    assert parse_cluster(str(path)) == c


def test_toml_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        'name = "lab"\nhosts = 2\ndevices_per_host = 4\n[device]\nname = "X"\nmemory_bytes = 1000000000\n'
        "peak_flops = 1e12\nmemory_bandwidth = 1e11\nintra_host_bandwidth = 1e10\ninter_host_bandwidth = 1e9\n"
    )
    c = load_cluster_file(path)
    assert (c.name, c.n_devices, c.device.peak_flops) == ("lab", 8, 1e12)


@pytest.mark.parametrize(
    "content, match",
    [
        (b"{not json", r"is not valid JSON"),
        (b'{"name": "x", "hosts": 1}', r"does not match the ClusterSpec schema"),
        (b'{"name": "x", "hosts": 1, "devices_per_host": 1, "device": {"name": "d", "memory_bytes": 1, "peak_flops": -1, '
         b'"memory_bandwidth": 1, "intra_host_bandwidth": 1, "inter_host_bandwidth": 1}}', r"peak_flops=-1.* must be a finite number > 0"),
        (b'{"name": "x", "hosts": 1, "devices_per_host": 1, "gpus": 3}', r"does not match the ClusterSpec schema"),
        (b'{"name": "x", "hosts": 1, "devices_per_host": 1, "device": {"name": "d", "memory_bytes": 1, "peak_flops": 1, '
         b'"memory_bandwidth": 1, "intra_host_bandwidth": 1, "inter_host_bandwidth": 1, "thread_speedup": 1.5}}',
         r"unknown field `thread_speedup`.*run 'flowrl calibrate -o FILE' again"),
        (b'{"name": "x", "hosts": 1, "devices_per_host": 1, "device": {"name": "d", "memory_bytes": 1, "peak_flops": 1, '
         b'"memory_bandwidth": 1, "intra_host_bandwidth": 1, "inter_host_bandwidth": 1, "cpu": {"shared_slowdown": 0.5}}}',
         r"shared_slowdown=0.5 must be a finite number >= 1"),
    ],
    ids=["not-json", "missing-fields", "negative-flops", "unknown-field", "flat-cpu-terms", "bad-cpu-term"],
)
def test_bad_cluster_files(tmp_path, content, match):
    path = tmp_path / "c.json"
    path.write_bytes(content)
    with pytest.raises(PlanError, match=match):
        parse_cluster(str(path))


def test_presets_have_datasheet_orders_of_magnitude():
    h100 = DEVICE_PRESETS["H100"]
    assert h100.peak_flops == pytest.approx(989e12) and h100.peak_flops_8bit == pytest.approx(2 * 989e12, rel=0.01)
    assert DEVICE_PRESETS["H200"].memory_bytes > h100.memory_bytes
    assert DEVICE_PRESETS["A100"].peak_flops_8bit == 0  # no FP8


def test_cpu_cluster_default_uses_every_core():
    assert cpu_cluster().n_devices >= 1
    with pytest.raises(PlanError, match="hosts=0"):
        ClusterSpec(name="x", hosts=0, devices_per_host=1, device=DEVICE_PRESETS["H100"])


def test_every_device_kind_has_its_traits():
    """``DeviceSpec.kind``'s values are the keys of ``DEVICE_TRAITS``, which the estimates, a plan's placement
    and the machine check read instead of a kind's name; every preset's kind is one."""
    from typing import get_args, get_type_hints

    from flowrl.planners.cluster import DEVICE_PRESETS, DEVICE_TRAITS, DeviceSpec

    assert get_args(get_type_hints(DeviceSpec)["kind"]) == tuple(DEVICE_TRAITS)
    assert {d.kind for d in DEVICE_PRESETS.values()} <= set(DEVICE_TRAITS)
    assert [k for k, t in DEVICE_TRAITS.items() if t.pinned] == ["cpu"] and [k for k, t in DEVICE_TRAITS.items() if t.cuda] == ["gpu"]


def test_a_plan_pins_by_its_device_kind(monkeypatch):
    from flowrl.examples import build_example
    from flowrl.planners import cluster
    from flowrl.planners.plan import plan_graph

    plan = plan_graph(build_example("llamarl"), "cpu:2", strategy="disaggregated")
    assert plan.placement().pin
    monkeypatch.setitem(cluster.DEVICE_TRAITS, "cpu", cluster.DeviceKind(label="CPU", pinned=False))
    assert not plan.placement().pin
