"""Which device each node's model runs on: ``RunConfig.device``, ``placement.resolve_device`` and
``node_devices``, carried to the programs by ``ProgramEnv.devices``.

CUDA's availability is monkeypatched where only the decision is checked; the short runs use
``device="cpu"`` explicitly, and one run on CUDA is skipped visibly without a GPU.
"""

from __future__ import annotations

import os

import msgspec
import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.examples import build_example
from flowrl.placement import NodeMesh, Placement
from flowrl.runtime.config import RunConfig
from flowrl.runtime.control.executor_placement import node_devices, resolve_device, run_placement
from flowrl.runtime.programs.table import build_program
from flowrl.runtime.programs.nodes import ProgramEnv, SharedTransports
from flowrl.runtime.run import run_graph
from flowrl.runtime.programs.synthetic import synthetic_program, synthetic_programs
from tests.tolerances import graph_logprob_atol, ratio_atol

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
NO_CUDA = "this machine has no CUDA device; use --device cpu or auto"


@pytest.mark.parametrize(
    "requested, has_cuda, expected",
    [("auto", False, "cpu"), ("auto", True, "cuda"), ("cpu", True, "cpu"), ("cpu", False, "cpu"), ("cuda", True, "cuda")],
    ids=["auto-cpu", "auto-cuda", "cpu-on-gpu-box", "cpu", "cuda"],
)
def test_resolve_device(requested, has_cuda, expected):
    assert resolve_device(requested, cuda_available=has_cuda) == expected


def test_cuda_without_cuda_is_refused():
    with pytest.raises(ConfigError, match=NO_CUDA):
        resolve_device("cuda", cuda_available=False)


@pytest.mark.parametrize(
    "devices, gpus, expected",
    [
        ({"gen": (0,), "policy": (1,)}, 2, {"gen": "cuda:0", "policy": "cuda:1"}),
        ({"gen": (0,), "policy": (1,)}, 1, {"gen": "cuda:0", "policy": "cuda:0"}),
        ({"gen": (0, 1), "policy": (0, 1)}, 8, {"gen": "cuda:0", "policy": "cuda:0"}),
        ({"gen": (0, 1, 2, 3), "policy": (4, 5, 6, 7)}, 8, {"gen": "cuda:0", "policy": "cuda:4"}),
        ({"gen": (0, 1, 2, 3), "policy": (4, 5, 6, 7)}, 3, {"gen": "cuda:0", "policy": "cuda:1"}),
    ],
    ids=["disjoint-2gpus", "one-gpu-colocates", "colocated", "halves-of-8", "modulo"],
)
def test_node_devices_from_the_plan(devices, gpus, expected):
    placement = Placement(nodes={n: NodeMesh(devices=d) for n, d in devices.items()})
    assert node_devices(placement, "cuda", cuda_count=gpus) == expected


def test_node_devices_on_cpu_is_empty():
    placement = Placement(nodes={"gen": NodeMesh(devices=(0,)), "policy": NodeMesh(devices=(1,))})
    assert node_devices(placement, "cpu") == {}


def test_default_plan_on_cuda_spans_the_gpus_not_the_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    graph = build_example("llamarl")
    placement = run_placement(graph, None, RunConfig(steps=1, max_staleness=1, device="auto"))
    assert placement.devices == {"gen": (0,), "policy": (1,)}  # the halves of 2 GPUs
    assert node_devices(placement, "cuda") == {"gen": "cuda:0", "policy": "cuda:1"}
    synchronous = run_placement(graph, None, RunConfig(steps=1, max_staleness=0, device="cuda"))
    assert set(node_devices(synchronous, "cuda").values()) == {"cuda:0"}  # k = 0 colocates
    cores = os.cpu_count() or 1
    assert run_placement(graph, None, RunConfig(steps=1, max_staleness=0, device="cpu")).devices["gen"] == tuple(range(cores))


def test_program_env_carries_devices_across_the_wire():
    env = ProgramEnv(devices={"gen": "cuda:1"})
    back = msgspec.convert(msgspec.to_builtins(env), ProgramEnv)  # what the process backend sends
    assert back.device_of("gen") == "cuda:1" and back.device_of("policy") == "cpu"


@pytest.mark.parametrize("node", ["gen", "policy"])
def test_builders_put_the_operator_on_the_env_device(node):
    """"meta" stands in for an accelerator: the builder must hand the env's device to the operator."""
    graph = build_example("llamarl")
    env = ProgramEnv(devices={node: "meta"}, transports=())
    program = build_program(graph, node, env, SharedTransports(()))
    model = program.generator.model if node == "gen" else program.trainer.model
    assert {p.device.type for p in model.parameters()} == {"meta"}


SEEN: list[dict[str, str]] = []


def recording_program(node, graph, env, transports):
    """A synthetic program that records the devices the driver decided (local backend: same process)."""
    SEEN.append(dict(env.devices))
    return synthetic_program(node, graph, env, transports)


def test_the_driver_decides_devices_once_from_the_placement(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    graph = build_example("llamarl")
    SEEN.clear()
    programs = {n: f"{__name__}:recording_program" for n in synthetic_programs(graph)}
    run_graph(graph, RunConfig(steps=2, progress=False, programs=programs, options={"gen_s": 0.0, "train_s": 0.0}))
    assert SEEN and all(s == {"gen": "cuda:0", "policy": "cuda:0"} for s in SEEN)


def test_run_on_cpu_given_explicitly():
    result = run_graph(build_example("llamarl"), RunConfig(steps=2, progress=False, device="cpu"))
    assert len(result.rows) == 2 and result.version == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the refusal cannot happen")
def test_run_on_cuda_without_cuda_is_refused_before_any_work(tmp_path):
    metrics = tmp_path / "m.jsonl"
    with pytest.raises(ConfigError, match=NO_CUDA):
        run_graph(build_example("llamarl"), RunConfig(steps=2, progress=False, device="cuda", metrics=str(metrics)))
    assert not metrics.exists()


@needs_cuda
@pytest.mark.parametrize("backend", ["local", "process"])
def test_synchronous_run_on_cuda_stays_on_policy(backend):
    graph = build_example("llamarl")
    result = run_graph(graph, RunConfig(steps=3, max_staleness=0, progress=False, device="cuda", backend=backend))
    assert result.version == 3
    atol = ratio_atol(graph_logprob_atol(graph, steps=3))  # mu and pi: two float32 forwards of the same weights
    assert all(row["aipo/ratio_mean"] == pytest.approx(1.0, abs=atol) for row in result.rows)


@pytest.mark.parametrize(("policy_core", "pinned"), [(0, True), (10**6, False)], ids=["cores-here", "core-not-here"])
def test_a_cpu_plans_cores_are_pinned_only_where_this_machine_has_them(policy_core, pinned):
    placement = Placement(nodes={"gen": NodeMesh(devices=(0,)), "policy": NodeMesh(devices=(policy_core,))}, pin=True)
    assert run_placement(build_example("llamarl"), placement, RunConfig(steps=1)).pin is pinned
