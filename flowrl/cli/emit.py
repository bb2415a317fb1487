"""``flowrl plan ... --emit DIR``: the plan as the files that launch it (the plan file, a torchrun script per host, a README).

What a plan changes against the graph file decides the ``flowrl run`` arguments the scripts hold:

- the graph: ``GRAPH`` as the user gave it to ``flowrl plan``, with ``--engine`` / ``--sharding``
  when ``flowrl plan`` was given them (the planner priced the rewritten graph, the run rewrites it
  the same way), and ``--max-staleness K`` when the plan assumed another k than the graph's;
- the devices: ``--backend torchrun`` (a plan's devices are the job's ranks) and ``--device cuda``
  for a GPU cluster, ``--device cpu`` for a CPU one; ``--plan`` names the emitted plan file;
- ``--model DIR`` (a model directory) plans every model as that directory's shape, and the run
  reads that directory (``flowrl run --model DIR``).

What the run cannot reproduce is refused before any file is written, naming why and the fix:
a plan of another graph's nodes or model shapes (``--model`` with a preset shape the run has no
weights of, say), and a step the graph does not run (``--prompts-per-step``, ``--samples``,
``--gen-len``, ``--batching``, ``--gen-precision`` set otherwise than the graph's; the published-model
defaults of ``--model``): ``flowrl.planners.plan_match``. ``DIR`` must be new or empty: files of the
user's are never overwritten. The text of the scripts is ``flowrl.planners.launch``'s.
"""

from __future__ import annotations

import argparse
import errno
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flowrl.graph.ir import Graph
    from flowrl.planners.plan import Plan

__all__ = ["add_emit_flags", "emit_launch", "planned_graph"]


def add_emit_flags(p: argparse.ArgumentParser) -> None:
    """``flowrl plan``'s ``--emit DIR`` and the graph rewrites ``flowrl run`` also takes (``--engine``, ``--sharding``)."""
    from flowrl.graph.engines import ENGINE_CAPS

    p.add_argument(
        "--emit", metavar="DIR",
        help="write the launch of the plan into DIR (new or empty): the plan file, a torchrun script per host "
        "(host0.sh ...) holding the 'flowrl run' arguments that run it, and a README.txt",
    )  # fmt: skip
    p.add_argument("--engine", choices=tuple(ENGINE_CAPS), help="plan every generator with this engine, as 'flowrl run --engine' runs it (default: the graph's)")
    p.add_argument("--sharding", choices=("replicate", "fsdp"), help="plan every policy's state so held, as 'flowrl run --sharding' runs it (default: the graph's)")


def planned_graph(graph: Graph, args: argparse.Namespace) -> Graph:
    """``graph`` with ``--engine`` / ``--sharding`` applied, as ``flowrl run`` applies them."""
    from flowrl.graph.rewrite import with_engine, with_sharding

    if getattr(args, "engine", None):
        graph = with_engine(graph, args.engine)
    if getattr(args, "sharding", None):
        graph = with_sharding(graph, args.sharding)
    return graph


def _check_directory(directory: Path) -> None:
    from flowrl.errors import ConfigError

    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--emit {directory}: is a file; name a new or empty directory")
    held = sorted(os.listdir(directory)) if directory.is_dir() else []
    if held:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise ConfigError(f"--emit {directory}: holds files ({shown}); emit into a new or empty directory (or remove {directory} first)")
    if not directory.parent.resolve().is_dir():
        raise ConfigError(f"--emit {directory}: folder {directory.parent} does not exist; create it first")


def _run_args(args: argparse.Namespace, graph: Graph, plan: Plan) -> tuple[list[str], Graph, list[tuple[str, str]]]:
    """``flowrl run``'s arguments for ``plan`` (module docstring), the graph they run, and the relative paths among them."""
    from flowrl.errors import ConfigError, PlanError
    from flowrl.planners.cluster import DEVICE_TRAITS

    graph_arg = args.graph or "llamarl"
    gpu = DEVICE_TRAITS[plan.cluster_spec.device.kind if plan.cluster_spec is not None else "cpu"].cuda
    argv = [graph_arg, "--backend", "torchrun", "--device", "cuda" if gpu else "cpu"]
    exists = [("GRAPH", graph_arg)] if os.path.exists(graph_arg) and not os.path.isabs(graph_arg) else []
    for flag in ("engine", "sharding"):
        if getattr(args, flag, None):
            argv += [f"--{flag}", getattr(args, flag)]
    if plan.max_staleness != graph.max_staleness(None):
        argv += ["--max-staleness", str(plan.max_staleness)]
    if args.model and Path(args.model).expanduser().is_dir():  # the run reads the directory the plan measured
        from flowrl.graph.rewrite import with_model_path

        model_dir = os.path.expanduser(args.model)  # the script quotes it: '~' would not expand there
        try:
            graph = with_model_path(graph, model_dir)
        except ConfigError as exc:
            raise PlanError(f"--emit: the run cannot read --model {args.model}: {exc}") from None
        argv += ["--model", model_dir]
        if not os.path.isabs(model_dir):
            exists.append(("--model", model_dir))
    elif args.model:
        what = "a config.json, not a model directory" if Path(args.model).is_file() else "a published shape, not a model directory"
        raise PlanError(
            f"--emit: --model {args.model} is {what}: 'flowrl run' has no weights of it and runs the graph's own models, "
            "so the emitted run would not be the plan; plan without --model, or with --model DIR (a local copy of the model: "
            "its directory, with config.json and weights), which the run then reads"
        )
    return argv, graph, exists


def emit_launch(args: argparse.Namespace, graph: Graph, plan: Plan) -> None:
    """Write ``--emit DIR`` for ``plan`` of ``graph`` (the graph as planned); nothing when ``--emit`` is not given.

    Raises:
        ConfigError: ``DIR`` holds files, is a file, or its folder is missing.
        PlanError: the run could not reproduce the plan (module docstring), naming why and the fix.
    """
    if not getattr(args, "emit", None):
        return
    from flowrl.errors import PlanError
    from flowrl.planners.launch import PLAN_FILE, launch_files, script_name
    from flowrl.planners.plan import plan_to_json
    from flowrl.planners.plan_match import graph_differences, step_differences

    directory = Path(args.emit)
    _check_directory(directory)
    argv, run_graph, exists = _run_args(args, graph, plan)
    why = graph_differences(plan, run_graph)
    if why:
        raise PlanError(f"--emit: the run would not be this plan: {'; '.join(why)}; plan the graph's own models (without --model, or with --model DIR)")
    why = step_differences(plan, run_graph)
    if why:
        graph_arg = shlex.quote(args.graph or "llamarl")
        defaults = " (--model plans a published-model step unless told otherwise)" if args.model else ""
        raise PlanError(
            f"--emit: the plan priced another step than graph {graph_arg} runs{defaults}: {'; '.join(why)}; 'flowrl run' runs the "
            "graph's step, so plan it (the flags in brackets), or change the graph"
        )
    files = launch_files(plan, argv, exists=exists, planned_in=os.getcwd())
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.resolve().name}.emit-", dir=directory.resolve().parent))
    try:
        (staging / PLAN_FILE).write_text(plan_to_json(plan) + "\n", encoding="utf-8")  # the files appear together, below
        umask = os.umask(0)
        os.umask(umask)
        for name, text in {PLAN_FILE: "", **files}.items():
            path = staging / name
            if text:
                path.write_text(text, encoding="utf-8")
            path.chmod((0o777 if name.endswith(".sh") else 0o666) & ~umask)
        staging.chmod(0o777 & ~umask)
        target = directory.resolve()
        if not target.exists():
            os.rename(staging, target)  # the whole directory appears at once
        else:  # an empty directory (perhaps the shell's own): its files moved in, none over one written meanwhile
            for name in sorted(os.listdir(staging)):
                if (target / name).exists():
                    raise FileExistsError(errno.EEXIST, f"{target / name} appeared meanwhile")
                os.replace(staging / name, target / name)
            staging.rmdir()
    except OSError as exc:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
        raise PlanError(f"--emit {directory}: cannot write the launch files: {exc.strerror or exc}") from None
    hosts = sorted(n for n in files if n.endswith(".sh"))
    run = f"bash {shlex.quote(str(directory / script_name(0)))}"
    how = run if len(hosts) == 1 else f"MASTER_ADDR=<host 0 address> bash {shlex.quote(str(directory))}/host<i>.sh on host i"
    print(f"flowrl plan: launch written to {directory}: {PLAN_FILE}, {', '.join(hosts)}, README.txt; start it: {how}", file=sys.stderr)
