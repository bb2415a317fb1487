"""Colocated offloading (``flowrl.runtime.programs.offload``): a trainer's state round trip bit for bit, steps
unchanged, a colocated run with offloading giving the same metrics as without it (k = 0, same seed)
with the moves in its trace, an engine's sleep and wake in order, who offloads, and bad input
refused before any work (also from the CLI)."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.examples import build_example
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.rewrite import with_engine
from flowrl.operators.generation import Generator
from flowrl.operators.trainer import Trainer
from flowrl.placement import NodeMesh, Placement
from flowrl.runtime.config import RunConfig
from flowrl.runtime.programs.offload import HostOffload, SleepingGenerator, offload_roles, trace_spans
from flowrl.runtime.run import run_graph
from tests.operators.helpers import TINY, loss_node, rollout_with_rewards, tiny_policy_node

TOGETHER = Placement(nodes={"gen": NodeMesh(devices=(0,)), "policy": NodeMesh(devices=(0,))})
APART = Placement(nodes={"gen": NodeMesh(devices=(0,)), "policy": NodeMesh(devices=(1,))})


def _snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every number of the trainer's state, copied: parameters, gradients, optimizer state."""
    out = {f"param/{n}": p.detach().clone() for n, p in trainer.model.named_parameters()}
    out.update({f"grad/{n}": p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    for i, state in enumerate(trainer.optimizer.state.values()):
        out.update({f"opt/{i}/{k}": v.clone() for k, v in state.items()})
    return out


def _equal_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose tensors differ in any bit (or in dtype, shape or presence)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or a[k].dtype != b[k].dtype
                  or a[k].shape != b[k].shape or not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)))


def _views_are_the_parameters(trainer: Trainer) -> bool:
    """The published weight views read the parameters' memory (what the transports copy is what trains)."""
    params = {n: p for n, p in trainer.model.named_parameters()}
    return all(v.untyped_storage().data_ptr() == params[n].untyped_storage().data_ptr() for n, v in trainer.weights().items() if n in params)


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    return rollout_with_rewards(seed=1, n_samples=4, batch_size=4)


def test_a_round_trip_keeps_the_state_bit_for_bit_and_moves_every_storage(batch):
    trainer = Trainer(tiny_policy_node(lr=1e-2), loss_node())
    trainer.train_step(batch)  # gradients and AdamW moments exist
    before = _snapshot(trainer)
    ptrs = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    offload = HostOffload(trainer)
    offload.offload()
    assert offload.offloaded and offload.nbytes >= sum(t.numel() * t.element_size() for t in before.values() if t.dim())
    host = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    assert host.isdisjoint(ptrs)  # a real copy: every parameter reads another storage now
    assert _equal_bits(before, _snapshot(trainer)) == []  # readable (a checkpoint's save) and equal while offloaded
    offload.reload()
    assert not offload.offloaded and _equal_bits(before, _snapshot(trainer)) == []
    back = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    assert back.isdisjoint(host)  # back in storages of their own, off the host buffers
    assert _views_are_the_parameters(trainer)
    offload.offload()
    offload.offload()  # twice: a no-op
    assert _equal_bits(before, _snapshot(trainer)) == []


def test_steps_with_the_state_offloaded_between_them_are_the_same_steps(batch):
    """Offloaded before the first step (as a run's start does) and between steps: the same metrics,
    the same state, and the published views still the parameters after every step."""
    plain, moved = Trainer(tiny_policy_node(lr=1e-2), loss_node()), Trainer(tiny_policy_node(lr=1e-2), loss_node())
    offload = HostOffload(moved)
    offload.offload()
    for _ in range(3):
        offload.reload()
        assert moved.train_step(batch) == plain.train_step(batch)
        assert _views_are_the_parameters(moved)
        assert _equal_bits(_snapshot(plain), _snapshot(moved)) == []
        assert all(torch.equal(moved.weights()[n], t) for n, t in plain.weights().items())
        offload.offload()


def _small_graph(max_staleness: int = 0):
    b = GraphBuilder("offload", model=TINY)
    prompts = b.source("prompts", task="copy", batch_size=4)
    gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=4)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    policy = b.policy("policy", b.loss("aipo", gen, reward, objective="aipo"), lr=1e-2)
    b.weights(policy, gen, max_staleness=max_staleness)
    return b.build()


def _timing(key: str) -> bool:
    return key.endswith("_s") or key.startswith("offload/")


def test_a_colocated_run_with_offloading_gives_the_same_metrics_and_traces_the_moves(tmp_path):
    graph = _small_graph()
    rows = {}
    for mode in ("off", "on"):
        config = RunConfig(steps=3, seed=5, offload=mode, trace=str(tmp_path / f"{mode}.json"), threads=1)
        rows[mode] = run_graph(graph, TOGETHER, config).rows
    for off, on in zip(rows["off"], rows["on"], strict=True):
        assert {k: v for k, v in off.items() if not _timing(k)} == {k: v for k, v in on.items() if not _timing(k)}
        assert "offload/reload_s" not in off and on["offload/reload_s"] >= 0 and on["offload/bytes"] > 0
    events = json.loads((tmp_path / "on.json").read_text())["traceEvents"]
    names = [e["name"] for e in events if e.get("ph") == "X"]
    assert names.count("offload") == 3 and names.count("reload") == 3
    assert "offload" not in [e["name"] for e in json.loads((tmp_path / "off.json").read_text())["traceEvents"] if e.get("ph") == "X"]


def test_trace_spans_carve_the_moves_out_of_the_step():
    start, end, spans = trace_spans(0.0, 10.0, {"offload/wake_s": 1.0, "offload/sleep_s": 0.5})
    assert (start, end) == (1.0, 9.5) and spans == [("wake", 0.0, 1.0), ("sleep", 9.5, 10.0)]
    assert trace_spans(2.0, 3.0, {"train_s": 1.0}) == (2.0, 3.0, [])


class _Engine:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def sleep(self) -> None:
        self.log.append("sleep")

    def wake_up(self) -> None:
        self.log.append("wake")


class _Generator:
    """A generator program that records its calls beside its engine's."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.generator = _Engine(self.log)

    def start(self) -> None:
        self.log.append("start")

    def step(self, seq, inputs, min_version):
        self.log.append(f"step {seq}")
        return {}, {}

    def close(self) -> None:
        self.log.append("close")


def test_the_engine_sleeps_after_each_rollout_and_wakes_before_the_next():
    inner = _Generator()
    program = SleepingGenerator(inner)
    program.start()
    for seq in range(2):
        _, info = program.step(seq, {}, -1)
        assert info["offload/wake_s"] >= 0 and info["offload/sleep_s"] >= 0
    program.close()
    assert inner.log == ["start", "sleep", "wake", "step 0", "sleep", "wake", "step 1", "sleep", "close"]


class SleepyGenerator(Generator):
    """The built-in engine with a sleep and a wake that keep nothing from happening (what vLLM's are on a
    GPU: weights out and back), so a run on this CPU puts its engine to sleep between rollouts."""

    def __init__(self, node, *, sleep_mode: bool = False, **options) -> None:
        super().__init__(node, **options)
        assert sleep_mode  # built asked to be able to sleep (``GeneratorProgram`` passes it for an engine role)
        self.asleep = False

    def sleep(self) -> None:
        self.asleep = True

    def wake_up(self) -> None:
        self.asleep = False

    def generate(self, prompts):
        assert not self.asleep, "generated while asleep"
        return super().generate(prompts)


def test_in_a_run_the_engine_sleeps_while_the_trainer_runs_and_the_trainer_waits_offloaded_while_it_samples(tmp_path, monkeypatch):
    """On one device at k = 0 the trace's moves and steps alternate: wake, sample, sleep, then reload,
    train, publish, offload, every step; the rows are those of a run without offloading."""
    from flowrl.operators import engines
    from flowrl.runtime.programs import offload

    monkeypatch.setitem(engines.ENGINES, "builtin", engines.EngineSpec(generator=f"{__name__}:SleepyGenerator"))
    monkeypatch.setattr(offload, "_can_sleep", lambda graph, name, device: True)
    graph = _small_graph()
    trace = tmp_path / "trace.json"
    assert offload_roles(graph, TOGETHER, "on") == {"policy": "trainer", "gen": "engine"}
    rows = run_graph(graph, TOGETHER, RunConfig(steps=3, seed=5, offload="on", threads=1, trace=str(trace))).rows
    monkeypatch.undo()
    plain = run_graph(graph, TOGETHER, RunConfig(steps=3, seed=5, offload="off", threads=1)).rows
    assert [{k: v for k, v in r.items() if not _timing(k)} for r in rows] == [{k: v for k, v in r.items() if not _timing(k)} for r in plain]
    events = sorted((e["ts"], e["name"]) for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X")
    moves = [name for _ts, name in events if name in ("wake", "generate", "sleep", "reload", "train", "weight publish", "offload")]
    assert moves == ["wake", "generate", "sleep", "reload", "train", "weight publish", "offload"] * 3


# -- who offloads --------------------------------------------------------------------------------
def test_roles_by_mode():
    graph = build_example("llamarl")
    assert offload_roles(graph, TOGETHER, "on") == {"policy": "trainer"}
    assert offload_roles(graph, TOGETHER, "off") == {}
    assert offload_roles(graph, TOGETHER, "auto") == {}  # no plan said so
    planned = msgspec.structs.replace(TOGETHER, offload=("policy",))
    assert offload_roles(graph, planned, "auto") == {"policy": "trainer"}


def test_a_vllm_generator_sleeps_only_where_vllm_can(monkeypatch):
    from flowrl.operators.engines import vllm_engine

    graph = with_engine(build_example("hf_copy"), "vllm")
    with pytest.warns(UserWarning, match="does not sleep: vLLM has no sleep mode"):
        assert offload_roles(graph, TOGETHER, "on", device="cpu") == {"policy": "trainer"}
    monkeypatch.setattr(vllm_engine, "sleep_mode_available", lambda device: True)
    assert offload_roles(graph, TOGETHER, "on", device="cuda") == {"policy": "trainer", "gen": "engine"}
    assert vllm_engine.sleep_mode_available.__module__  # patched back by monkeypatch after the test


def test_vllm_has_no_sleep_mode_on_a_cpu():
    from flowrl.operators.engines.vllm_engine import sleep_mode_available

    assert not sleep_mode_available("cpu") and sleep_mode_available("cuda:0")


# -- bad input -------------------------------------------------------------------------------------
def test_offloading_a_trainer_with_no_generator_beside_it_is_refused_before_any_work(tmp_path):
    metrics = tmp_path / "m.jsonl"
    with pytest.raises(ConfigError, match=r"trainer\(s\) \['policy'\] share no device with a generator"):
        run_graph(build_example("llamarl"), APART, RunConfig(steps=1, offload="on", metrics=str(metrics)))
    assert not metrics.exists()
    with pytest.raises(ConfigError, match="under torchrun run with --offload off"):
        offload_roles(build_example("llamarl"), TOGETHER, "on", backend="torchrun")


def test_the_cli_refuses_it_without_a_traceback(tmp_path, capsys):
    from flowrl.cli.main import main

    plan = tmp_path / "apart.json"
    plan.write_text(json.dumps({"gen": [0], "policy": [1]}))
    metrics = tmp_path / "m.jsonl"
    assert main(["run", "llamarl", "--steps", "1", "--offload", "on", "--plan", str(plan), "--metrics", str(metrics), "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())  # main wraps the paragraph at 100 columns
    assert "share no device with a generator" in err and "--offload off" in err and "Traceback" not in err
    assert not metrics.exists()


def test_the_runtime_moves_the_bytes_the_planner_prices(batch):
    """``HostOffload.nbytes`` is the planner's ``offloadable`` bytes for the same policy (16 per
    parameter in float32 with AdamW), plus AdamW's step counts (4 bytes per parameter tensor), which
    move with the rest on a CPU and stay on the CPU beside a GPU trainer."""
    from flowrl.modelspec import model_from_config
    from flowrl.planners.cluster import parse_cluster
    from flowrl.planners.estimate.common import Context
    from flowrl.planners.parallel import ParallelDims
    from flowrl.planners.search import evaluator, resolve_roles
    from flowrl.planners.tuning import Tuning
    from flowrl.planners.workload import Workload

    trainer = Trainer(tiny_policy_node(), loss_node())
    trainer.train_step(batch)
    offload = HostOffload(trainer)
    offload.offload()
    graph = build_example("llamarl")
    ctx = Context(cluster=parse_cluster("cpu:2"), workload=Workload(prompts_per_step=1, samples_per_prompt=1, prompt_len=4, gen_len=4), tuning=Tuning())
    priced = evaluator(graph, resolve_roles(graph, ctx, model_from_config(TINY)), ctx, 0).offloadable("policy", ParallelDims())
    steps = sum(1 for state in trainer.optimizer.state.values() if "step" in state)
    assert offload.nbytes == priced + 4 * steps


def test_a_plan_that_offloads_under_torchrun_is_said_not_done():
    planned = msgspec.structs.replace(TOGETHER, offload=("policy",))
    with pytest.warns(UserWarning, match="the torchrun backend does not do"):
        assert offload_roles(build_example("llamarl"), planned, "auto", backend="torchrun") == {}


def test_a_run_checkpointed_offloaded_resumes_to_the_same_rows(tmp_path):
    """Saves read the state from host memory, a resume loads it back onto the device: the rows of
    2 + 1 steps with offloading are those of 3 steps without."""
    graph = _small_graph()
    plain = run_graph(graph, TOGETHER, RunConfig(steps=3, seed=5, offload="off", threads=1)).rows
    ck = str(tmp_path / "ck")
    first = run_graph(graph, TOGETHER, RunConfig(steps=2, seed=5, offload="on", threads=1, checkpoint_dir=ck, checkpoint_every=1)).rows
    rest = run_graph(graph, TOGETHER, RunConfig(steps=3, seed=5, offload="on", threads=1, checkpoint_dir=ck, resume=True)).rows
    assert [{k: v for k, v in r.items() if not _timing(k)} for r in [*first, *rest]] == [
        {k: v for k, v in r.items() if not _timing(k)} for r in plain
    ]
