"""The layers ARCHITECTURE.md draws, checked on the import graph of flowrl's own modules.

Every ``import`` counts, at module level, inside functions and under ``TYPE_CHECKING``: a function-level
import is still a dependency, only a later one.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx

import flowrl

ROOT = Path(flowrl.__file__).parent

#: What graph/ (the IR, the bottom layer) may import besides itself: the shared helpers.
GRAPH_MAY_IMPORT = {"errors", "fileio"}

#: What planners/ (pure: no torch, no processes) may import besides itself: the IR, the placement it
#: emits and the pure shared modules; never the runtime, the operators or the models.
PLANNERS_MAY_IMPORT = {"graph", "placement", "errors", "fileio", "host", "modelspec", "trace", "transport_traits", "backend_traits", "replan", "mesh_support"}

#: What placement/ (between the planner and the runtime) may import besides itself.
PLACEMENT_MAY_IMPORT = {"graph", "errors", "fileio"}


def _module_name(path: Path) -> str:
    parts = ("flowrl", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def import_graph() -> nx.DiGraph:
    """flowrl module -> flowrl module, one edge per import of any kind (parsed once per session; not to be mutated)."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    g = nx.DiGraph()
    for name, path in files.items():
        g.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # `import flowrl.x.y` names module flowrl.x.y; a symbol's module
                    target = target.rpartition(".")[0]
                if target.startswith("flowrl") and target != name:
                    g.add_edge(name, target)
    return g


_REFERENCE = re.compile(r"flowrl(?:\.\w+)+(?=$|:)")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants in ``tree`` (their examples may name any module, as a user would)."""
    bodies = [n.body for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    return {id(b[0].value) for b in bodies if b and isinstance(b[0], ast.Expr) and isinstance(b[0].value, ast.Constant)}


def module_references(source: str, files: set[str]) -> set[str]:
    """The flowrl modules that string constants of ``source`` name (``"flowrl.x.y:qualname"``, ``"flowrl.x.y"``),
    outside docstrings: a reference that code imports later, by ``resolve`` or ``importlib``.

    Example:
        >>> sorted(module_references('X = "flowrl.runtime.programs.nodes:build_source"', {"flowrl.runtime", "flowrl.runtime.programs.nodes"}))
        ['flowrl.runtime.programs.nodes']
    """
    tree, found = ast.parse(source), set()
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            match = _REFERENCE.match(node.value)
            target = match.group(0) if match else ""
            while target and target not in files:  # "flowrl.x.y.Attr": module flowrl.x.y
                target = target.rpartition(".")[0]
            if target.count("."):
                found.add(target)
    return found


@functools.cache
def reference_edges() -> tuple[tuple[str, str], ...]:
    """flowrl module -> the flowrl module a string constant of it names."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return tuple((name, target) for name, path in files.items() for target in sorted(module_references(path.read_text(), set(files))) if target != name)


def _package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_the_import_graph_has_no_circle():
    cycles = sorted(nx.simple_cycles(import_graph()), key=len)
    assert not cycles, "import circles (shortest first):\n" + "\n".join(" -> ".join([*c, c[0]]) for c in cycles[:10])


def test_no_two_packages_import_each_other_through_any_path():
    """Package level (``flowrl.X`` for every module under X/; top-level modules are their own): no
    circle, so each package can be read, tested and moved with only what is below it."""
    packages = nx.DiGraph((_package(a), _package(b)) for a, b in import_graph().edges if _package(a) != _package(b))
    cycles = sorted(nx.simple_cycles(packages), key=len)
    assert not cycles, f"{len(cycles)} package circles (shortest first): {cycles[:5]}; edges behind the first: " + str(
        [(a, b) for a, b in import_graph().edges if (_package(a), _package(b)) in set(zip(cycles[0], [*cycles[0][1:], cycles[0][0]]))][:6]
    )


def test_the_graph_package_is_the_bottom_layer():
    edges = [(a, b) for a, b in import_graph().edges if _package(a) == "graph" and _package(b) not in {"graph", *GRAPH_MAY_IMPORT}]
    assert not edges, f"graph/ imports other flowrl packages: {edges}"


def _edges_out(package: str, allowed: set[str]) -> list[tuple[str, str]]:
    return [(a, b) for a, b in import_graph().edges if _package(a) == package and _package(b) not in {package, *allowed}]


def test_the_runtime_imports_nothing_from_the_planner():
    edges = [(a, b) for a, b in import_graph().edges if _package(a) == "runtime" and _package(b) in {"planners", "calibration", "cli"}]
    assert not edges, f"runtime/ imports the planner (it reads a flowrl.placement.Placement instead): {edges}"


#: Python's and torch's process machinery, which operators/ leaves to the runtime.
PROCESS_MODULES = ("multiprocessing", "subprocess", "concurrent.futures.process", "torch.distributed", "torch.multiprocessing")


def test_operators_know_nothing_of_processes():
    """operators/ imports neither the runtime nor the process machinery; only the vLLM engine's modules
    (``operators/engines/vllm_*.py``: vLLM's own processes and its weight-sync group) do."""
    flowrl_edges = [(a, b) for a, b in import_graph().edges if _package(a) == "operators" and _package(b) in {"runtime", "serve", "cli"}]
    assert not flowrl_edges, f"operators/ imports a layer above it: {flowrl_edges}"
    found = []
    for path in (ROOT / "operators").rglob("*.py"):
        if path.parent.name == "engines" and path.name.startswith("vllm_"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith(PROCESS_MODULES)]
    assert not found, f"operators/ (but the vLLM engine) knows nothing of processes; these import process machinery: {found}"


def test_the_planner_is_pure():
    edges = _edges_out("planners", PLANNERS_MAY_IMPORT)
    assert not edges, f"planners/ imports beyond the IR, the placement and the pure shared modules: {edges}"


def test_the_placement_sits_between_the_planner_and_the_runtime():
    edges = _edges_out("placement", PLACEMENT_MAY_IMPORT)
    assert not edges, f"placement/ imports more than the IR and the shared helpers: {edges}"


def upward_references(edges, imports: nx.DiGraph) -> list[tuple[str, str]]:
    """String references that point up: from package P to a package X that imports P (so written as an
    import the reference would close a package circle), or out of graph/ (the bottom layer) at all."""
    packages = nx.DiGraph((_package(a), _package(b)) for a, b in imports.edges if _package(a) != _package(b))
    up = []
    for a, b in edges:
        pa, pb = _package(a), _package(b)
        below = pa == "graph" and pb not in {"graph", *GRAPH_MAY_IMPORT}
        if pa != pb and (below or (pa in packages and pb in packages and nx.has_path(packages, pb, pa))):
            up.append((a, b))
    return up


def test_no_string_reference_points_up():
    """A lower layer names no module of a higher one in a string (``"flowrl.runtime.programs.nodes:build_source"``
    in graph/): what it needs from above, that layer registers in a table of its own."""
    up = upward_references(reference_edges(), import_graph())
    assert not up, f"string references into a higher layer (register them in that layer's table instead): {up}"


def test_an_upward_string_reference_is_caught():
    """The check above fails on one: graph/ naming a runtime program, transport_traits a transport class."""
    files = set(import_graph().nodes)
    added = [("flowrl.graph.kinds", t) for t in module_references('P = "flowrl.runtime.programs.nodes:build_source"', files)]
    added += [("flowrl.transport_traits", t) for t in module_references('T = "flowrl.runtime.transports.file:FileTransport"', files)]
    assert added == [("flowrl.graph.kinds", "flowrl.runtime.programs.nodes"), ("flowrl.transport_traits", "flowrl.runtime.transports.file")]
    assert upward_references([*reference_edges(), *added], import_graph()) == added


def test_the_checker_sees_function_level_and_type_checking_imports(tmp_path):
    """The walk above counts every kind of import (or the two tests above could pass by hiding one)."""
    g = import_graph()
    assert g.has_edge("flowrl.runtime.run", "flowrl.runtime.names")  # a function-level import in run_graph
    assert g.has_edge("flowrl.runtime.names", "flowrl.graph.ir")  # a TYPE_CHECKING import
    assert g.has_edge("flowrl.placement.default", "flowrl.graph.ir")  # a TYPE_CHECKING import


def _heavy_modules_after(code: str, heavy: tuple[str, ...] = ("torch", "transformers")) -> str:
    code += f"\nimport sys\nprint(sorted(m for m in sys.modules if m.split('.')[0] in {set(heavy)!r})[:5])\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_planning_and_placing_import_no_torch():
    """A dry-run plan needs no hardware and no torch (numpy: the planner's mesh arithmetic); the placement a run gets from it neither."""
    code = (
        "from flowrl.examples import build_example\n"
        "from flowrl.planners.plan import plan_graph\n"
        "from flowrl.placement import default_placement\n"
        "g = build_example('llamarl')\n"
        "assert str(plan_graph(g, 'cpu:2', strategy='disaggregated').placement()) == 'gen:d1@0 | policy:d1@1'\n"
        "assert str(default_placement(g, 1, 4)) == 'gen:d2@0-1 | policy:d2@2-3'\n"
    )
    assert _heavy_modules_after(code) == "[]"


def test_environments_are_pure_python():
    """envs/ (the protocol, tools, the built-in games) imports no torch: an environment runs anywhere."""
    code = "import flowrl.envs, flowrl.envs.games, flowrl.envs.tools\nflowrl.envs.games.GuessNumberEnv\n"
    assert _heavy_modules_after(code, ("torch", "transformers", "numpy")) == "[]"


def test_building_and_validating_a_graph_imports_no_torch():
    code = (
        "import sys\n"
        "from flowrl import GraphBuilder\n"
        "from flowrl.graph.serialize import from_json, to_json\n"
        "b = GraphBuilder('g')\n"
        "gen = b.generator('gen', b.source('prompts', task='copy'))\n"
        "reward = b.scorer('reward', gen, fn='flowrl.operators.tasks:copy_reward')\n"
        "policy = b.policy('policy', b.loss('aipo', gen, reward))\n"
        "b.weights(policy, gen)\n"
        "assert from_json(to_json(b.build())).name == 'g'\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'transformers', 'numpy'})\n"
        "print(heavy[:5])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"building a graph imported {out.strip()}"


#: The runtime's rooms, bottom to top (ARCHITECTURE.md draws them): an import between two rooms points
#: down this list or stays on its floor. A top-level module of runtime/ is a room of its own.
RUNTIME_FLOORS: tuple[frozenset[str], ...] = tuple(
    frozenset(floor.split())
    for floor in (
        "wire config names staleness transports parallel",
        "checkpointing",
        "weights",
        "programs",
        "evaluation",
        "observe",
        "control",
        "preflight",
        "backends",
        "backends.process",
        "backends.torchrun",
        "run",
    )
)


def runtime_room(module: str) -> str | None:
    """The room of a runtime module (``flowrl.runtime.control.clock`` -> ``control``; the backends'
    two subpackages are rooms of their own); None outside runtime/."""
    parts = module.split(".")
    if len(parts) < 3 or parts[:2] != ["flowrl", "runtime"]:
        return None
    if parts[2] == "backends" and len(parts) > 3 and parts[3] in ("process", "torchrun"):
        return f"backends.{parts[3]}"
    return parts[2]


def runtime_floor(room: str) -> int:
    return next(i for i, floor in enumerate(RUNTIME_FLOORS) if room in floor)


def runtime_imports(source: str) -> list[tuple[str, str]]:
    """(``"module"``, ``"function"`` or ``"annotations"``, the imported flowrl.runtime module path) of every
    ``from flowrl.runtime... import`` in ``source``; ``annotations`` for one under ``if TYPE_CHECKING:``.

    Example:
        >>> runtime_imports("def f():\\n    from flowrl.runtime.run import run_graph\\n")
        [('function', 'flowrl.runtime.run.run_graph')]
    """
    tree = ast.parse(source)
    where: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where.update({id(n): "function" for n in ast.walk(node) if n is not node})
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            where.update({id(n): "annotations" for stmt in node.body for n in ast.walk(stmt)})
    return [
        (where.get(id(node), "module"), f"{node.module}.{alias.name}")
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flowrl.runtime")
        for alias in node.names
    ]


def test_every_runtime_import_between_rooms_points_down():
    """Module-level and function-level imports between the runtime's rooms point down ``RUNTIME_FLOORS``
    (a function-level import is a dependency too, only a later one); an import under ``TYPE_CHECKING``
    names a type for an annotation and is never executed, so it may name a room above."""
    files = {_module_name(p): p for p in (ROOT / "runtime").rglob("*.py")}
    up = []
    for name, path in sorted(files.items()):
        for kind, target in runtime_imports(path.read_text()):
            while target not in files:
                target = target.rpartition(".")[0]
            a, b = runtime_room(name), runtime_room(target)
            if kind != "annotations" and a and b and a != b and runtime_floor(a) < runtime_floor(b):
                up.append(f"{name} -> {target} ({kind} import; {a} is below {b})")
    assert not up, "runtime imports that point up a room:\n" + "\n".join(up)


def test_every_runtime_room_is_on_a_floor():
    rooms = {runtime_room(_module_name(p)) for p in (ROOT / "runtime").rglob("*.py")} - {None, "__init__"}
    placed = set().union(*RUNTIME_FLOORS)
    assert rooms <= placed, f"runtime rooms on no floor of RUNTIME_FLOORS: {sorted(rooms - placed)}"


def test_an_upward_runtime_import_is_caught():
    kind, target = runtime_imports("def f():\n    from flowrl.runtime.backends.torchrun.backend import x\n")[0]
    assert kind == "function" and runtime_floor(runtime_room("flowrl.runtime.programs.nodes")) < runtime_floor(runtime_room(target))
    assert runtime_imports("if TYPE_CHECKING:\n    from flowrl.runtime.run import r\n") == [("annotations", "flowrl.runtime.run.r")]


def test_the_runtime_top_level_holds_at_most_eight_modules():
    top = sorted(p.name for p in (ROOT / "runtime").glob("*.py"))
    assert len(top) <= 8, f"runtime/ holds {len(top)} modules at its top level (at most 8; put the others in a room): {top}"
