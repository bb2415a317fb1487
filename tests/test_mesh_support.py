"""Every entry of ``flowrl.mesh_support.MESH_SUPPORT`` walked: it runs as planned or it is refused.

The cases are the table's keys, ``(variant, backend, axis)``. An entry that says the axis runs is
checked against a real short run whose placement gives each node the axes of size 2 that the table says
its program runs (``_planned``): the run's first row reports what each node's program built
(``flowrl.runtime.observe.layout``), which must be the planned mesh. So a row flipped to ``runs=True``
without a program that runs it fails here (the program reports another mesh, or the run fails). An
entry that says the axis does not run is refused by ``run_graph`` before any work, with the message
naming the node, the axis and its size and what would run instead.

The runs, batched: one graph with every built-in device kind (``every_kind``: a Hugging Face Llama
generator, policy, reference and critic, a classifier reward model), run for one step on the local and
the process backends and in one torchrun job; a teacher, which feeds an ``"opd"`` loss, in a graph of
its own (``teacher_graph``, the built-in model) on the local and process backends; a user's device kind (the ``*`` rows) in a fresh
interpreter (``tests/graph/device_kind_module.py``, as ``tests/graph/test_kinds.py`` adds it); the vLLM
engine's torchrun rows in one torchrun job behind ``--runslow``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.errors import ConfigError
from flowrl.mesh_support import COMBINATIONS, MESH_AXES, MESH_SUPPORT, node_facts, refusal, runnable_axes
from flowrl.placement.layout import AXES, NodeMesh, Placement
from flowrl.runtime.preflight import check_meshes

ROOT = Path(__file__).resolve().parents[1]
CASES = sorted(MESH_SUPPORT)
BUILTIN_KINDS = {"generator": "gen", "policy": "policy", "reference": "ref", "critic": "critic", "reward_model": "rm", "teacher": "teacher"}
USER_KIND = "likelihood"  # tests/graph/device_kind_module.py: the ``*`` rows


def _kind(variant: str) -> tuple[str, str | None]:
    kind, _, engine = variant.partition("/")
    return (USER_KIND if kind == "*" else kind), (engine or None)


def _planned(kind: str, backend: str, engine: str | None = None, axis: str | None = None) -> dict[str, int]:
    """The mesh a run gives a node of ``kind``: size 2 along every axis its program runs on ``backend`` on the
    CPU (``axis``: that one only, when it runs it; a torchrun job per axis, since some axes run only alone:
    ``mesh_support.COMBINATIONS``)."""
    return {a: 2 for a in MESH_AXES if a in runnable_axes(kind, backend, engine=engine, device="cpu") and axis in (None, a)}


def _mesh(devices: list[int], mesh: dict[str, int]) -> NodeMesh:
    """``mesh`` on ``devices``; ``ep`` splits dp, which it takes as its size when ``mesh`` names no dp."""
    ep = mesh.get("ep", 1)
    shape = {a: mesh.get(a, ep if a == "dp" else 1) for a in AXES}
    return NodeMesh(devices=tuple(devices), mesh_shape=tuple(shape.values()), ep=ep)


# -- the graph with every built-in device kind -----------------------------------------------------
def every_kind_graph(root: Path, *, engine: str = "builtin"):
    """gen -> reward (a rule) and rm (a classifier) and ref and critic -> ppo (with a KL penalty) -> policy."""
    from flowrl.examples.hf_copy import ASSETS
    from flowrl.graph.builder import GraphBuilder
    from flowrl.graph.configs import HFModelConfig

    # vLLM on a CPU needs a head size of 32 or more: 2 heads of 32 (``write_assets``) rather than the shipped 4 of 16
    model_dir = root / "two_heads" if engine == "vllm" else ASSETS
    b = GraphBuilder("every_kind", model=HFModelConfig(path=str(model_dir), init="random", seed=0))
    prompts = b.source("prompts", data=str(ASSETS / "prompts.jsonl"), prompt_field="prompt", batch_size=4)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=3, temperature=1.0, engine=engine)
    score = b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text")
    rm = b.reward_model("rm", gen, model=str(root / "classifier"), output="rm_rewards")
    ref = b.reference("ref", gen)
    critic = b.critic("critic", gen, score, rm)
    loss = b.loss("ppo", gen, score, rm, critic, ref, objective="ppo", kl_coef=0.01, reward_weights={"rewards": 1.0, "rm_rewards": 0.1})
    b.weights(b.policy("policy", loss, lr=1e-3), gen, max_staleness=0)
    return b.build()


def teacher_graph():
    """The teacher's rows run on a graph of their own (its loss is ``"opd"``, every_kind's a critic's ``"ppo"``):
    gen -> reward and teacher -> opd -> policy, the built-in tiny model (which axes run does not depend on the family)."""
    from tests.runtime.test_teacher import twin_graph

    return twin_graph()


def _graph_file(root: Path) -> str:
    """A module the torchrun ranks import the graph from (``module:function``)."""
    (root / "every_kind_here.py").write_text(
        "from pathlib import Path\nfrom tests.test_mesh_support import every_kind_graph\n\n"
        f"def graph():\n    return every_kind_graph(Path({str(root)!r}))\n"
    )
    return "every_kind_here:graph"


@pytest.fixture(scope="module")
def kinds_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from tests.operators.test_reward_models import make_classifier_dir

    root = tmp_path_factory.mktemp("every_kind")
    make_classifier_dir(root / "classifier")
    return root


def _every_kind_placement(graph, backend: str, axis: str | None = None) -> tuple[Placement, int]:
    """Every node on ranks from 0 (colocated) with ``_planned``'s mesh, or its own one rank where it runs no axis."""
    nodes, spare = {}, 0
    for node in graph.nodes:
        if node.kind not in BUILTIN_KINDS:
            continue
        mesh = _planned(node.kind, backend, getattr(node, "engine", None), axis)
        size = math.prod(v for a, v in mesh.items() if a != "ep") if set(mesh) - {"ep"} else mesh.get("ep", 1)  # ep takes no devices of its own
        if size > 1:
            nodes[node.name] = _mesh(list(range(size)), mesh)
        else:
            nodes[node.name] = NodeMesh(devices=(spare,))
            spare += 1
    world = max(max(m.devices) for m in nodes.values()) + 1
    return Placement(nodes=nodes, source="test"), world


def _run_one_process(graph, backend: str) -> dict:
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    placement, _ = _every_kind_placement(graph, backend)
    rows = run_graph(graph, placement, RunConfig(steps=1, progress=False, backend=backend, threads=1, device="cpu")).rows  # the rows on the CPU
    return {"placement": placement, "layout": rows[0]["layout"]}


@pytest.fixture(scope="module")
def one_process_runs(kinds_root: Path) -> dict[str, dict]:
    graph = every_kind_graph(kinds_root)
    return {backend: _run_one_process(graph, backend) for backend in ("local", "process")}


@pytest.fixture(scope="module")
def teacher_runs() -> dict[str, dict]:
    graph = teacher_graph()
    return {backend: _run_one_process(graph, backend) for backend in ("local", "process")}


@pytest.fixture(scope="module")
def torchrun_runs(kinds_root: Path):
    """axis -> one torchrun job where every node that runs ``axis`` has it at size 2 (run once per axis)."""
    from flowrl.placement.forms import placement_to_json
    from tests.runtime.test_torchrun import _torchrun

    done: dict[str, dict] = {}

    def run(axis: str) -> dict:
        if axis not in done:
            graph = every_kind_graph(kinds_root)
            placement, world = _every_kind_placement(graph, "torchrun", axis)
            (kinds_root / f"place-{axis}.json").write_text(placement_to_json(placement))
            proc = _torchrun(world, ["-m", "flowrl", "run", _graph_file(kinds_root), "--backend", "torchrun", "--plan", f"place-{axis}.json",
                                     "--steps", "1", "--quiet", "--metrics", f"m-{axis}.jsonl", "--device", "cpu"], kinds_root,
                             env={"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{kinds_root}"})
            assert proc.returncode == 0, proc.stderr[-4000:]
            rows = [json.loads(line) for line in (kinds_root / f"m-{axis}.jsonl").read_text().splitlines() if line.strip()]
            done[axis] = {"placement": placement, "layout": rows[0]["layout"]}
        return done[axis]

    return run


# -- a user's device kind (the ``*`` rows), in a fresh interpreter -----------------------------------
USER_SCRIPT = r'''
kinds.KINDS["likelihood"] = kinds.KindSpec(
    node="tests.graph.device_kind_module:LikelihoodNode", runs_on="devices", side="trainer", span="likelihood",
    style=kinds.KINDS["reference"].style,
)
from flowrl.runtime.programs.table import PROGRAMS
from tests.graph.device_kind_module import LikelihoodNode, build_likelihood
PROGRAMS["likelihood"] = build_likelihood
from flowrl.examples.llamarl import DEFAULT_MODEL
from flowrl.errors import ConfigError
from flowrl.graph.builder import GraphBuilder
from flowrl.placement.layout import NodeMesh, Placement
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph

b = GraphBuilder("likelihood", model=DEFAULT_MODEL)
prompts = b.source("prompts", task="copy", batch_size=4)
gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=3)
reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
lik = b.add(LikelihoodNode(name="lik", model=DEFAULT_MODEL), (gen,))
b.weights(b.policy("policy", b.loss("aipo", gen, reward, lik, reward_weights={"rewards": 1.0, "reward_likelihood": 0.1})), gen)
g = b.build()
out = {}
for backend, axis, runs in json.loads(sys.argv[1]):
    shape = tuple(2 if a == axis or (axis == "ep" and a == "dp") else 1 for a in ("pp", "dp", "tp"))  # ep splits dp
    lik = NodeMesh(devices=(0, 1), mesh_shape=shape, ep=2 if axis == "ep" else 1)
    placement = Placement(nodes={"gen": NodeMesh(devices=(0,)), "policy": NodeMesh(devices=(0,)), "lik": lik})
    try:
        rows = run_graph(g, placement, RunConfig(steps=1, progress=False, backend=backend, threads=1, device="cpu")).rows
        out[f"{backend}/{axis}"] = {"layout": rows[0]["layout"]["lik"]}
    except ConfigError as exc:
        out[f"{backend}/{axis}"] = {"refused": str(exc)}
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def user_kind_runs() -> dict[str, dict]:
    cases = [(b, a, MESH_SUPPORT[(v, b, a)].runs) for v, b, a in CASES if v == "*" and b != "process"]  # see the test
    from tests.graph.test_kinds import _LOAD_THE_TABLE  # the kinds table loaded first, so the entry is as if in the file

    proc = subprocess.run([sys.executable, "-c", _LOAD_THE_TABLE + USER_SCRIPT, json.dumps(cases)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the walk ----------------------------------------------------------------------------------------
def _check_ran(layout: dict, placement: Placement, name: str, axis: str) -> None:
    """The node's program built the planned mesh, over its devices."""
    planned = placement.nodes[name]
    want = planned.sizes()
    got = layout[name]
    assert got["mesh"].get(axis) == 2, (name, axis, got)
    assert got["mesh"] == want and got["devices"] == list(planned.devices), (name, want, got)
    assert sorted(d for g in got["groups"] for d in g) == sorted(planned.devices), got  # every device in one copy


def _refused(graph, name: str, kind: str, backend: str, axis: str, engine: str | None) -> None:
    """``run_graph`` refuses the node's mesh with ``axis`` = 2 on ``backend`` before any work."""
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    nodes = {n.name: NodeMesh(devices=(0,)) for n in graph.nodes if n.kind in BUILTIN_KINDS or n.kind == USER_KIND}
    nodes[name] = _mesh([0, 1], {axis: 2})
    entry = MESH_SUPPORT[(f"{kind}/{engine}" if engine and (f"{kind}/{engine}", backend, axis) in MESH_SUPPORT else kind, backend, axis)]
    with pytest.raises(ConfigError) as info:
        run_graph(graph, Placement(nodes=nodes), RunConfig(steps=1, progress=False, backend=backend, device="cpu"))
    text = str(info.value)
    assert text.startswith(f"{kind} {name!r} has {axis}=2 on its mesh"), text
    instead = entry.how.format(n=2, size=2, devices=[0, 1], first=0, idle=[1], axis=axis)
    assert f"it would run {instead}, without a word" in text, text


@pytest.mark.parametrize(("variant", "backend", "axis"), CASES, ids=["-".join(c) for c in CASES])
def test_every_entry_runs_as_planned_or_is_refused(variant, backend, axis, request):
    entry = MESH_SUPPORT[(variant, backend, axis)]
    kind, engine = _kind(variant)
    if kind == USER_KIND:
        if backend == "process":
            # A kind added at run time is not in the process backend's workers (they import flowrl afresh),
            # so it cannot run there from a script; the backend treats a node's mesh as local does
            # (one driver, ``drive.run_with_controller``; the same rows), which is checked on local.
            assert entry == MESH_SUPPORT[(variant, "local", axis)], entry
            backend = "local"
        got = request.getfixturevalue("user_kind_runs")[f"{backend}/{axis}"]
        if entry.runs:
            assert "layout" in got, got
            assert got["layout"]["mesh"] == {axis: 2} and got["layout"]["devices"] == [0, 1], got
        else:
            assert got.get("refused", "").startswith(f"{USER_KIND} 'lik' has {axis}=2 on its mesh"), got
            assert entry.how.format(n=2, size=2, devices=[0, 1], first=0, idle=[1], axis=axis) in got["refused"], got
        return
    if engine == "vllm" and entry.runs:
        run = request.getfixturevalue("vllm_torchrun_run")  # --runslow
        _check_ran(run["layout"], run["placement"], "gen", axis)
        return
    root = request.getfixturevalue("kinds_root")
    graph = teacher_graph() if kind == "teacher" else every_kind_graph(root, engine=engine or "builtin")
    name = BUILTIN_KINDS[kind]
    if not entry.runs:
        _refused(graph, name, kind, backend, axis, engine)
        return
    if (kind, backend, axis) == ("policy", "torchrun", "ep"):  # experts to split: a mixture of experts' run (tests/runtime/ep_fixtures.py)
        run = request.getfixturevalue("moe_ep_run")
        _check_ran(run["rows"][0]["layout"], run["placement"], name, axis)
        return
    if kind == "teacher":  # no teacher row runs over several torchrun ranks (the test below)
        run = request.getfixturevalue("teacher_runs")[backend]
    else:
        run = request.getfixturevalue("torchrun_runs")(axis) if backend == "torchrun" else request.getfixturevalue("one_process_runs")[backend]
    _check_ran(run["layout"], run["placement"], name, axis)
    if entry.devices:  # on another device type, refused by preflight with what would run there
        other = next(d for d in ("cpu", "cuda") if d not in entry.devices)
        with pytest.raises(ConfigError, match=rf"has {axis}=2 on its mesh .* on {backend} on {other} .*it would run "):
            check_meshes(graph, Placement(nodes={**run["placement"].nodes, name: _mesh([0, 1], {axis: 2})}), backend=backend, device=other)


@pytest.fixture(scope="module")
def vllm_torchrun_run(kinds_root: Path, request) -> dict:
    if not request.config.getoption("--runslow"):
        pytest.skip("the vLLM engine's torchrun rows run a torchrun job with vLLM engines (--runslow)")
    pytest.importorskip("vllm")
    from flowrl.placement.forms import placement_to_json
    from tests.runtime.test_torchrun import _torchrun

    from flowrl.examples.hf_copy import write_assets

    write_assets(kinds_root / "two_heads", heads=2)
    graph = every_kind_graph(kinds_root, engine="vllm")
    placement, world = _every_kind_placement(graph, "torchrun")
    (kinds_root / "vplace.json").write_text(placement_to_json(placement))
    (kinds_root / "every_kind_vllm.py").write_text(
        "from pathlib import Path\nfrom tests.test_mesh_support import every_kind_graph\n\n"
        f"def graph():\n    return every_kind_graph(Path({str(kinds_root)!r}), engine='vllm')\n"
    )
    proc = _torchrun(world, ["-m", "flowrl", "run", "every_kind_vllm:graph", "--backend", "torchrun", "--plan", "vplace.json",
                             "--steps", "1", "--quiet", "--metrics", "v.jsonl", "--device", "cpu"], kinds_root, env={"PYTHONPATH": f"{ROOT}:{kinds_root}"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (kinds_root / "v.jsonl").read_text().splitlines() if line.strip()]
    return {"placement": placement, "layout": rows[0]["layout"]}


def test_the_kinds_the_table_runs_over_several_ranks_are_those_with_a_rank_program():
    from flowrl.runtime.backends.torchrun.rank_programs import RANK_PROGRAMS

    spanning = {variant.partition("/")[0] for (variant, backend, _), entry in MESH_SUPPORT.items() if backend == "torchrun" and entry.runs}
    assert spanning == set(RANK_PROGRAMS)


# -- the CLI: exit 2 with the message, on every backend and on every torchrun rank ----------------------
REFUSED = {"gen": [0], "policy": {"ranks": [0, 1], "mesh": {"tp": 2}}}
MESSAGE = (
    "policy 'policy' has tp=2 on its mesh {{\"tp\": 2}}, but a policy's program on {backend} runs only dp over several {where}: "
    "it would run {instead}, without a word"
)


@pytest.mark.parametrize("backend", ["local", "process"])
def test_flowrl_run_refuses_a_mesh_its_programs_do_not_run(tmp_path, backend):
    (tmp_path / "place.json").write_text(json.dumps(REFUSED))
    proc = subprocess.run([sys.executable, "-m", "flowrl", "run", "llamarl", "--backend", backend, "--plan", "place.json", "--steps", "1", "--quiet", "--device", "cpu",
                           "--metrics", "m.jsonl"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    instead = MESH_SUPPORT[("policy", backend, "tp")].how.format(n=2, size=2, devices=[0, 1], first=0, idle=[1], axis="tp")
    assert MESSAGE.format(backend=backend, where="devices", instead=instead) in " ".join(proc.stderr.split()), proc.stderr  # the CLI wraps lines
    assert "Traceback" not in proc.stderr and not (tmp_path / "m.jsonl").exists()


#: under torchrun a policy runs tp; a generator does not run pp
REFUSED_RANKS = {"policy": [0], "gen": {"ranks": [0, 1], "mesh": {"pp": 2}}}


def test_every_torchrun_rank_refuses_the_same_way_and_nothing_is_left_running(tmp_path):
    from tests.runtime.test_torchrun import _torchrun

    (tmp_path / "place.json").write_text(json.dumps(REFUSED_RANKS))
    proc = _torchrun(2, ["-m", "flowrl", "run", "llamarl", "--backend", "torchrun", "--plan", "place.json", "--steps", "1", "--quiet", "--device", "cpu",
                         "--metrics", "m.jsonl"], tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0 and not (tmp_path / "m.jsonl").exists()
    instead = MESH_SUPPORT[("generator", "torchrun", "pp")].how.format(n=2, size=2, devices=[0, 1], first=0, idle=[1], axis="pp")
    line = ("flowrl run: error: generator 'gen' has pp=2 on its mesh {\"pp\": 2}, but a generator's program on torchrun runs only dp and tp over "
            f"several ranks: it would run {instead}, without a word")
    said = " ".join(proc.stderr.split())
    # each rank refuses before any process group (torchrun stops a rank still refusing once one has exited: at least one says it)
    assert said.count(line) >= 1 and said.count("flowrl run: error: ") == said.count(line), proc.stderr[-4000:]
    assert "/flowrl/" not in proc.stderr, proc.stderr[-4000:]  # no traceback through flowrl (torchrun prints its own summary)


@pytest.mark.parametrize("key", sorted(COMBINATIONS), ids=["-".join(k) for k in sorted(COMBINATIONS)])
def test_every_combination_rule_is_refused_by_name_and_only_where_it_applies(key):
    """Each ``COMBINATIONS`` rule: a mesh of its axes, for a node with its ``when`` settings, is refused
    naming the axes and the rule's fix; without them (or with an ``unless``) the same mesh runs."""
    variant, backend = key
    kind, engine = _kind(variant)
    for rule in COMBINATIONS[key]:
        mesh = {a: 2 for a in rule.axes}
        devices = list(range(2 ** len(mesh)))
        text = refusal(kind, "n", mesh, backend, devices=devices, engine=engine, facts=rule.when)
        assert text is not None and text.startswith(f"{kind} 'n' has ") and text.endswith(rule.why), text
        if rule.when or rule.unless:  # the settings make the difference: without the rule's, it runs (or another rule says why not)
            other = (frozenset() if rule.when else rule.unless)
            later = refusal(kind, "n", mesh, backend, devices=devices, engine=engine, facts=other)
            assert later is None or not later.endswith(rule.why), later


def test_the_runtime_refuses_each_combination_at_launch_as_the_table_does(tmp_path):
    """The programs' own launch checks agree with ``COMBINATIONS`` on the policy rules (no run needed: they
    raise before any process group)."""
    from flowrl.examples.hf_copy import build_hf_copy
    from flowrl.runtime.parallel.pipeline import check_pipeline
    from flowrl.runtime.parallel.tp_train import check_tp_meshes
    import msgspec

    graph = build_hf_copy()
    policy = graph.node("policy")
    cases = {
        frozenset(): graph,
        frozenset({"fsdp"}): _with_policy(graph, msgspec.structs.replace(policy, optimizer=msgspec.structs.replace(policy.optimizer, sharding="fsdp"))),
        frozenset({"packing"}): _with_policy(graph, msgspec.structs.replace(policy, optimizer=msgspec.structs.replace(policy.optimizer, packing=True))),
        frozenset({"lora"}): build_hf_copy(lora={"r": 4, "target_modules": ("q_proj",)}),
        frozenset({"lora", "lora_dropout"}): build_hf_copy(lora={"r": 4, "target_modules": ("q_proj",), "dropout": 0.1}),
    }
    for facts, g in cases.items():
        assert node_facts(g.node("policy")) == facts, (facts, node_facts(g.node("policy")))
        for mesh in ({"dp": 2, "tp": 2}, {"pp": 2, "tp": 2}, {"pp": 2}, {"tp": 2}, {"pp": 2, "dp": 2}):
            table = refusal("policy", "policy", mesh, "torchrun", devices=list(range(math.prod(mesh.values()))), facts=facts)
            names = tuple(a for a in AXES if a in mesh)
            axes = {"policy": (names, tuple(mesh[a] for a in names))}
            try:
                check_pipeline(g, axes, skip={})
                check_tp_meshes(g, axes, skip={})
                runtime = None
            except ConfigError as exc:
                runtime = str(exc)
            assert (table is None) == (runtime is None), (facts, mesh, table, runtime)


def _with_policy(graph, node):
    import msgspec

    from flowrl.graph.ir import Graph

    return Graph(msgspec.structs.replace(graph.spec, nodes=tuple(node if n.name == node.name else n for n in graph.nodes)))
