"""``flowrl plan GRAPH --cluster SPEC``: a dry-run placement with predicted step times; no hardware needed."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowrl.planners.lengths import LengthDistribution

__all__ = ["register", "lengths_from_metrics", "env_seconds_from_metrics"]

EPILOG = """\
examples:
  flowrl plan llamarl --cluster cpu                          the default example on this machine's cores
  flowrl plan llamarl --cluster cpu --strategy disaggregated -o plan.json    then: flowrl run --plan plan.json
  flowrl plan llamarl --cluster 1024xH100 --model llama3-70b              a published model on 1024 H100s
  flowrl plan llamarl --cluster 128x8xH100 --model llama3-405b --gen-precision float8
  flowrl plan llamarl --cluster 16xH100 --model llama3-8b --strategy 'gen:d4t2@0-7 | policy:d2t4@8-15'
  flowrl plan llamarl --cluster cpu.json                     with figures measured by 'flowrl calibrate -o cpu.json'

workload: read from the graph (prompts = the source's batch size, samples = the generator's
n_samples, gen-len = its max_new_tokens; prompt-len = measured on the source's prompt file when it
reads one (each step's longest prompt, tokenised as the source will, averaged over an epoch), else
the source's max_prompt_len when set, else max_seq_len - max_new_tokens: an upper bound either
way). The plan says which prompt length it assumed and where from.
With --model, or a graph whose models name a preset, the defaults are a math-reasoning-sized step:
--prompts-per-step 256 --samples 8 --prompt-len 512 --gen-len 2048 (2048 completions, 5.2M tokens),
and --gen-precision bfloat16. Each flag overrides its field either way. Completion lengths:
every completion runs to --gen-len unless --gen-len-mean (with --tail-frac of them at --gen-len)
or --lengths-from METRICS (a real run's lengths) says otherwise; --batching continuous pays the
mean plus one tail instead of the longest of every batch.

tuning (--set NAME=VALUE, repeatable; the defaults):
"""


def register(sub: argparse._SubParsersAction) -> None:
    from flowrl.cli.emit import add_emit_flags
    from flowrl.cli.graphs import GRAPH_FORMS
    from flowrl.planners.cluster import CLUSTER_FORMS
    from flowrl.planners.tuning import tuning_help

    p = sub.add_parser(
        "plan",
        help="dry-run a placement: devices, parallel dims, predicted step times",
        description=(
            "Place every node of GRAPH (default: the built-in 'llamarl' example) on a cluster and predict "
            "its step time, synchronous and asynchronous, without any hardware. " + GRAPH_FORMS + " " + CLUSTER_FORMS
        ),
        epilog=EPILOG + tuning_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("graph", nargs="?", metavar="GRAPH", help="what to plan (default: the built-in example 'llamarl')")
    p.add_argument("--cluster", default="cpu", metavar="SPEC", help="'1024xH100', '128x8xH100', 'cpu', 'cpu:N' or a .json/.toml file (default: cpu)")
    p.add_argument(
        "--strategy",
        default="search",
        metavar="S",
        help="search (default: the fastest of both), colocated, disaggregated, or a placement 'gen:d4@0-3 | policy:d4@4-7'",
    )
    p.add_argument("--max-staleness", type=int, metavar="K", help="the k the step assumes (default: the graph's weight edges)")
    p.add_argument("--model", metavar="M", help="plan every model as this shape: a preset (llama3-8b/70b/405b, qwen2.5-0.5b ... qwen2.5-72b, qwen3-0.6b ... qwen3-32b, qwen3-30b-a3b, deepseek-v3) or a HF config.json")
    p.add_argument("--prompts-per-step", type=int, metavar="N", help="prompts per trainer step")
    p.add_argument("--samples", type=int, metavar="N", help="completions per prompt")
    p.add_argument("--prompt-len", type=int, metavar="N", help="tokens per prompt")
    p.add_argument("--gen-len", type=int, metavar="N", help="generated tokens per completion")
    p.add_argument("--gen-len-mean", type=float, metavar="N", help="mean generated tokens per completion (default: every completion runs to --gen-len)")
    p.add_argument("--tail-frac", type=float, default=0.05, metavar="F", help="with --gen-len-mean: the fraction of completions that run to --gen-len (default: 0.05)")
    p.add_argument("--lengths-from", metavar="METRICS", help="completion lengths of a real run: its 'flowrl run --metrics' file (and, for a multi-turn run, its env/seconds as --env-s)")
    p.add_argument("--env-s", type=float, metavar="S",
                   help="seconds per step the generator waits on environments (multi-turn rollouts; a run's metrics report env/seconds): a generator-side delay")
    p.add_argument("--batching", choices=("lockstep", "continuous"), help="the generator's batching (default: the graph's, else lockstep)")
    p.add_argument("--gen-precision", choices=("float32", "bfloat16", "float16", "float8"), help="generator weight dtype (LlamaRL: float8)")
    p.add_argument("--backend", choices=("local", "process", "torchrun"),
                   help="the backend the plan runs under, which decides the axes each node runs (default: what the cluster implies; --emit: torchrun)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override a tuning constant (listed below)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    p.add_argument("-o", "--output", metavar="FILE", help="write the plan as JSON to FILE (atomically)")
    p.add_argument("--trace", metavar="FILE", help="write the predicted steady state as a Chrome trace, with the track and span names of 'flowrl run --trace'")
    add_emit_flags(p)  # --emit DIR, and --engine / --sharding as 'flowrl run' takes them
    p.set_defaults(func=_run)


#: ``plan_graph``'s own arguments (all but its ``**tuning``), each with how the command sets it: a
#: ``--set`` of one would collide with the argument the command passes (tests/cli/test_plan_cli.py
#: checks that this names every one of them)
OWN_ARGUMENTS = {
    "graph": "name the graph as the GRAPH argument",
    "cluster": "use --cluster SPEC",
    "strategy": "use --strategy S",
    "max_staleness": "use --max-staleness K",
    "workload": "use --prompts-per-step, --samples, --prompt-len and --gen-len",
    "model": "use --model M",
    "baseline": "the command compares every plan with the synchronous baseline; call plan_graph(baseline=...) for another",
}


def _tuning(pairs: list[str]) -> dict[str, Any]:
    """``--set`` pairs as ``plan_graph``'s tuning keywords (any JSON value; checked by the planner's tuning).

    Raises:
        PlanError: a pair that is no ``NAME=VALUE``, or that names one of ``plan_graph``'s own
            arguments (``OWN_ARGUMENTS``) rather than a tuning constant.
    """
    from flowrl.errors import PlanError

    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name.strip():
            raise PlanError(f"--set {pair!r}: write NAME=VALUE, e.g. --set mfu_train=0.4")
        if name.strip() in OWN_ARGUMENTS:
            raise PlanError(
                f"--set {pair!r}: {name.strip()!r} is an argument of the plan, not a tuning constant (those are listed "
                f"in 'flowrl plan --help'); {OWN_ARGUMENTS[name.strip()]}"
            )
        try:
            value: object = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[name.strip()] = value
    return out


def _run(args: argparse.Namespace) -> int:
    import msgspec

    from flowrl.errors import PlanError
    from flowrl.cli.emit import emit_launch, planned_graph
    from flowrl.cli.graphs import load_graph
    from flowrl.cli.prompt_lengths import prompt_len_from_file
    from flowrl.planners.cluster import parse_cluster
    from flowrl.planners.lengths import mean_and_tail
    from flowrl.modelspec import resolve_model
    from flowrl.planners.plan import plan_graph, plan_to_json, save_plan
    from flowrl.planners.report import format_plan
    from flowrl.planners.workload import default_workload

    graph = planned_graph(load_graph(args.graph), args)  # --engine / --sharding, as 'flowrl run' applies them
    cluster = parse_cluster(args.cluster)
    model = resolve_model(args.model) if args.model else None
    tuning = _tuning(args.set)
    if args.emit and args.backend not in (None, "torchrun"):
        raise PlanError(f"--emit writes a torchrun launch, but --backend {args.backend} plans for another backend; drop --backend (or use --backend torchrun)")
    if args.backend or args.emit:  # --emit's launch is a torchrun job: plan what it runs
        tuning["backend"] = args.backend or "torchrun"
    presets = model is not None or any(getattr(getattr(n, "model", None), "preset", None) for n in graph.nodes)
    if args.gen_precision:
        tuning["gen_precision"] = args.gen_precision
    elif presets:
        tuning.setdefault("gen_precision", "bfloat16")
    prompt_len, prompt_len_from = args.prompt_len, "--prompt-len" if args.prompt_len is not None else None
    if prompt_len is None and not presets:  # the graph's own prompt file, read here: the planner is pure
        measured = prompt_len_from_file(graph)
        if measured is not None and measured[0] is None:
            print(f"note: {measured[1]}", file=sys.stderr)
        elif measured is not None:
            prompt_len, prompt_len_from = measured
    workload = default_workload(
        graph,
        model_override=model is not None,
        prompts_per_step=args.prompts_per_step,
        samples_per_prompt=args.samples,
        prompt_len=prompt_len,
        prompt_len_from=prompt_len_from,
        gen_len=args.gen_len,
        batching=args.batching,
    )
    if args.lengths_from and args.gen_len_mean is not None:
        raise PlanError("give either --lengths-from or --gen-len-mean, not both")
    if args.lengths_from:  # read here: the planner is pure
        workload = msgspec.structs.replace(workload, lengths=lengths_from_metrics(args.lengths_from))
        env_s = env_seconds_from_metrics(args.lengths_from)
        if env_s is not None and args.env_s is None:  # a multi-turn run's wait on its environments, unless --env-s says otherwise
            workload = msgspec.structs.replace(workload, env_s=env_s)
    elif args.gen_len_mean is not None:
        lengths = mean_and_tail(mean=args.gen_len_mean, max_len=workload.gen_len, tail_frac=args.tail_frac)
        workload = msgspec.structs.replace(workload, lengths=lengths)
    if args.env_s is not None:
        workload = msgspec.structs.replace(workload, env_s=args.env_s)
    plan = plan_graph(graph, cluster, strategy=args.strategy, max_staleness=args.max_staleness, workload=workload, model=model, **tuning)
    emit_launch(args, graph, plan)  # --emit DIR: refused before any file is written when the run would not be this plan
    if args.output:
        save_plan(plan, args.output)
    if args.trace:
        from flowrl.planners.timeline import predicted_trace

        predicted_trace(plan).save(args.trace)
    if args.json:
        sys.stdout.write(plan_to_json(plan) + "\n")
    else:
        print(format_plan(plan))
        if args.output:
            print(f"plan written to {args.output}")
    return 0


def _metrics_rows(path: str) -> list[dict[str, object]]:
    import msgspec

    from flowrl.errors import PlanError
    from flowrl.runtime.observe.metrics import read_metrics

    try:
        rows = read_metrics(path)
    except OSError as exc:
        raise PlanError(f"cannot read metrics file {str(path)!r}: {exc.strerror}") from None
    except msgspec.DecodeError as exc:
        raise PlanError(f"metrics file {str(path)!r} is not JSON lines: {exc}") from None
    return [row for row in rows if isinstance(row, dict)]


def lengths_from_metrics(path: str) -> LengthDistribution:
    """The completion lengths recorded in a run's metrics file (``flowrl plan --lengths-from``).

    Raises:
        PlanError: the file is missing, unreadable, not JSON lines, or records no lengths.
    """
    from flowrl.planners.lengths import lengths_from_histograms
    from flowrl.runtime.observe.metrics import COMPLETION_LEN_HIST

    return lengths_from_histograms((row.get(COMPLETION_LEN_HIST) for row in _metrics_rows(path)), source=str(path))


def env_seconds_from_metrics(path: str) -> float | None:
    """The mean ``env/seconds`` per step of a multi-turn run's metrics file (seconds its generator
    waited on environments), or None when no row records it (``flowrl plan --lengths-from``)."""
    seen = [float(v) for row in _metrics_rows(path) if isinstance(v := row.get("env/seconds"), (int, float))]
    return sum(seen) / len(seen) if seen else None
