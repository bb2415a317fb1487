"""``flowrl calibrate``: measure this machine (the built-in model's pass rates, thread speedup, overheads) into a cluster spec."""

from __future__ import annotations

import argparse
import os
import sys

from typing import TYPE_CHECKING

from flowrl.fileio import write_atomic

if TYPE_CHECKING:
    from flowrl.calibration.needs import CalibrationNeeds

__all__ = ["register"]

EPILOG = """\
examples:
  flowrl calibrate                        print the measured figures
  flowrl calibrate -o cpu.json            write a calibrated cluster spec ...
  flowrl plan llamarl --cluster cpu.json  ... and plan with it
  flowrl calibrate --graph g.py -o cpu.json   also at g.py's model widths (and vLLM's figures if it has a vLLM generator)
  flowrl calibrate --widths 896 --vllm    the pass rates at width 896 too; vLLM's decode and sync rates (~1 min more)
  flowrl calibrate --gloo                 also gloo's rates between two processes and how split passes run there (CPU ranks)
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure this CPU into a cluster spec for 'flowrl plan --cluster FILE'",
        description=(
            "Run micro-benchmarks (float32 matmul FLOP/s, memory-copy bandwidth, operator overhead; the "
            "built-in model's forward, decode and training passes by width; the speedup of a mesh of every "
            "core, the slowdown of two meshes side by side, the generators' per-step overheads; under a "
            "minute) and write a 'cpu-calibrated' cluster spec: one device per core. The pass rates are "
            "measured at widths 32-256; a wider model takes width 256's rate unless its width is measured "
            "too (--graph, --widths). vLLM's decode speed-up and weight-sync rate are measured with --vllm "
            "or --graph of a graph with a vLLM generator (starts vLLM: about a minute more); the rate of gloo's "
            "all-gather, reduce-scatter, all-reduce and send between two processes (what an FSDP2, tp or pp "
            "policy's collectives run at on CPU ranks), and how well the two run a tensor- or pipeline-parallel "
            "pass against the planner's terms, with --gloo or --graph of a graph with an FSDP2 policy (two "
            "processes: about a minute at width 896)."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-o", "--output", metavar="FILE", help="write the cluster spec as JSON (atomically)")
    p.add_argument("--cores", type=int, metavar="N", help="devices (cores) the spec offers (default: all usable cores)")
    p.add_argument("--matmul-size", type=int, default=256, metavar="N", help="n of the n x n matmul (default: 256)")
    p.add_argument("--repeats", type=int, default=5, metavar="N", help="timings per figure, of which the median is kept (default: 5; 1 is a quick, noisier look)")
    p.add_argument("--graph", metavar="GRAPH", help="also measure what GRAPH needs: its models' widths, and vLLM's figures at its vLLM generator's shape")
    p.add_argument("--widths", metavar="W,W", help="more model widths to measure the pass rates at (comma-separated hidden sizes, e.g. 896)")
    p.add_argument("--vllm", action="store_true", help="measure vLLM's decode speed-up and weight-sync rate (needs vLLM; default shape: --graph's vLLM model, else qwen2.5-0.5b's)")
    p.add_argument("--gloo", action="store_true", help="measure gloo's collective rates between two processes and the split passes' efficiency there (FSDP2, tp and pp policies on CPU ranks)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from flowrl.errors import PlanError
    from flowrl.calibration.measure import calibrated_cluster, measure
    from flowrl.planners.cluster import cluster_to_json

    if args.cores is not None and args.cores < 1:
        raise PlanError(f"--cores {args.cores}: must be >= 1")
    if args.matmul_size < 8:
        raise PlanError(f"--matmul-size {args.matmul_size}: must be >= 8")
    if args.repeats < 1:
        raise PlanError(f"--repeats {args.repeats}: must be >= 1")
    needs = _needs(args)  # a bad --graph or --widths fails here, before any measurement
    widths, vllm_model = needs.widths, needs.vllm_model
    if args.output:
        folder = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(folder):
            raise PlanError(f"cannot write {args.output!r}: folder {folder!r} does not exist")
    m = measure(matmul_size=args.matmul_size, repeats=args.repeats, widths=widths)
    if needs.gloo or args.gloo:  # before vLLM, whose processes take a while to leave
        from flowrl.calibration.gloo_rate import measure_gloo, with_gloo

        gloo = measure_gloo(repeats=min(args.repeats, 3))
        m = with_gloo(m, gloo)
        rates = ", ".join(f"{n / 2**20:g} MiB {r / 1e9:.2f}" for n, r in m.cpu.gloo_by_bytes)
        print(f"gloo between two processes (GB/s, the slower of all-gather and reduce-scatter): {rates}", file=sys.stderr)
        acts = "; ".join(f"{n / 2**20:g} MiB all-reduce {a / 1e9:.2f}, send {p / 1e9:.2f}, all-to-all {x / 1e9:.2f}"
                         for (n, a), (_, p), (_, x) in zip(m.cpu.gloo_all_reduce_by_bytes, m.cpu.gloo_send_by_bytes, m.cpu.gloo_all_to_all_by_bytes))
        print(f"gloo at activations' sizes (GB/s): {acts}", file=sys.stderr)
        from flowrl.calibration.rank_passes import RankShape, default_shape, measure_rank_passes, with_rank_passes

        shape = default_shape(max(32, m.cpu.train_flops_by_width[-1][0] // 32 * 32))  # the widest width measured
        p = needs.policy_model
        if p is not None and not (p.n_heads % 2 or p.n_kv_heads % 2 or p.ffn_dim % 2) and needs.policy_rows >= 4:  # the graph's policy, if it splits
            shape = RankShape(width=p.dim, heads=p.n_heads, kv_heads=p.n_kv_heads, ffn=p.ffn_dim, rows=needs.policy_rows,
                              tokens=max(1, needs.policy_tokens), decode_rows=needs.policy_rows)  # fmt: skip
        m = with_rank_passes(m, measure_rank_passes(shape, repeats=min(args.repeats, 3)))
        print(
            f"split passes on two ranks at {shape}, against the planner's terms: tp training {m.cpu.tp_train_efficiency:.2f}, "
            f"tp decoding {m.cpu.tp_decode_efficiency:.2f}, pp training (1F1B) {m.cpu.pp_train_efficiency:.2f}",
            file=sys.stderr,
        )
    if vllm_model is not None:
        from flowrl.calibration.vllm_rates import measure_vllm, with_vllm

        print(f"measuring vLLM at {vllm_model.name}'s shape (width {vllm_model.dim}, 2 layers): starting it takes a minute", file=sys.stderr, flush=True)
        if needs.vllm_rows:
            figures = measure_vllm(vllm_model, repeats=min(args.repeats, 3), rows=needs.vllm_rows, new_tokens=needs.vllm_new_tokens)
        else:  # measure_vllm's default shape
            figures = measure_vllm(vllm_model, repeats=min(args.repeats, 3))
        m = with_vllm(m, figures)
        print(
            f"vLLM: decode {figures.decode_speedup:.2f}x the built-in engine's on one core, weight sync "
            f"{figures.sync_bandwidth / 1e9:.2f} GB/s ({figures.sync_bytes / 1e6:.0f} MB, broadcast + reload)",
            file=sys.stderr,
        )
    cluster = calibrated_cluster(m, cores=args.cores)
    print(
        f"matmul {m.matmul_flops / 1e9:.1f} GFLOP/s per core ({m.matmul_size}^3 float32), memory copy "
        f"{m.copy_bandwidth / 1e9:.2f} GB/s, operator overhead {m.op_overhead_s * 1e6:.2f} us, "
        f"{m.cores} cores, {m.memory_bytes / 2**30:.1f} GiB RAM",
        file=sys.stderr,
    )
    rates = ", ".join(
        f"{kind} {' '.join(f'{w}:{f / 1e9:.1f}' for w, f in table)}"
        for kind, table in (("forward", m.cpu.flops_by_width), ("decode", m.cpu.decode_flops_by_width), ("train", m.cpu.train_flops_by_width))
    )
    print(
        f"model passes, GFLOP/s by width: {rates}; thread speedup {m.cpu.thread_speedup:.2f} (generating {m.cpu.gen_thread_speedup:.2f}), shared slowdown "
        f"{m.cpu.shared_slowdown:.2f}, decode step overhead {m.cpu.decode_step_overhead_s * 1e6:.0f} us, slot row "
        f"overhead {m.cpu.slot_row_overhead_s * 1e6:.1f} us, AdamW step {m.cpu.adamw_s_per_param * 1e9:.2f} ns a parameter, "
        f"decode on 1/4/16 rows at {'/'.join(f'{f:.2f}' for _, f in m.cpu.decode_rows_fraction)} of the table's rate",
        file=sys.stderr,
    )
    data = cluster_to_json(cluster)
    if not args.output:
        sys.stdout.write(data.decode())
        return 0
    write_atomic(args.output, data, what="calibrated cluster ")
    print(f"calibrated cluster written to {args.output}; use it with: flowrl plan GRAPH --cluster {args.output}")
    return 0


def _needs(args: argparse.Namespace) -> CalibrationNeeds:
    """The widths to measure beside the defaults and the model shape (and call) to measure vLLM at
    (None: not asked), from ``--graph``, ``--widths`` and ``--vllm``; ``PlanError`` for a bad one."""
    import msgspec

    from flowrl.calibration.needs import CalibrationNeeds
    from flowrl.errors import PlanError
    from flowrl.modelspec import model_preset

    widths: set[int] = set()
    vllm_model = None
    graph_needs = CalibrationNeeds()
    if args.widths:
        try:
            widths.update(int(w) for w in args.widths.split(",") if w.strip())
        except ValueError:
            raise PlanError(f"--widths {args.widths!r}: expected comma-separated integers (hidden sizes), e.g. --widths 896,1024") from None
        if any(w < 16 for w in widths):
            raise PlanError(f"--widths {args.widths!r}: each width must be >= 16")
    if args.graph:
        from flowrl.calibration.needs import calibration_needs
        from flowrl.cli.graphs import load_graph

        graph_needs = calibration_needs(load_graph(args.graph))
        widths.update(graph_needs.widths)
        vllm_model = graph_needs.vllm_model
    if args.vllm and vllm_model is None:
        vllm_model = model_preset("qwen2.5-0.5b")
    if vllm_model is not None:
        from flowrl.operators.engines.vllm_engine import VLLM_INSTALL_HINT, vllm_distribution

        if vllm_distribution() is None:
            why = "--vllm" if args.vllm else f"--graph {args.graph}: a vLLM generator"
            raise PlanError(f"measuring vLLM's figures ({why}) needs vLLM installed: {VLLM_INSTALL_HINT}")
    return msgspec.structs.replace(graph_needs, widths=tuple(sorted(widths)), vllm_model=vllm_model)
