"""How well this CPU's ranks run a split model, measured: the tensor- and pipeline-parallel passes
against one process's.

A tp or pp mesh on CPU ranks (a torchrun job, one process with one intra-op thread per rank, gloo
between them) is priced by ``planners.estimate.cpu_ranks``: each rank's share of the FLOPs at the
one-core rate, plus its all-reduces and sends at gloo's calibrated rates. On this project's 2-core
CPU the runtime's split passes ran well below those terms (a tp2 rank's training pass 0.66 s
where they said 0.38; a pp2 stage's 1F1B schedule 0.72-0.86 s against 0.46; ``benches/RESULTS.md``,
issue 42): a rank's matmuls are half as wide, which a core runs at a lower rate; DTensor dispatches
every sharded operator in Python; the ranks wait for each other at every collective; the
pipeline's schedule has work of its own. None of that is a FLOP or a byte, so this module measures
it as the runtime runs it and hands the planner one efficiency per pass:

- ``tp_train``: a 2-layer built-in transformer of the graph's policy's shape (``RankShape``: width,
  heads, kv heads, MLP width, its batch's rows and tokens; without a graph the calibration model's,
  ``default_shape``) split over 2 ranks by the trainer's own tensor parallelism
  (``runtime.parallel.tp_train.shard_tp_model_``: DTensor, the family's split table), one forward +
  backward of the shape's rows on both ranks at once;
- ``tp_decode``: the same model split by the built-in generator's tensor parallelism
  (``runtime.parallel.tensor_parallel.shard_model_``), one decode-shaped forward (one token) of
  the shape's ``decode_rows``;
- ``pp_train``: the same model in two stages (``runtime.parallel.pipeline.split_model``, one layer
  each) under ``torch.distributed.pipelining``'s ``Schedule1F1B`` over ``MICRO_BATCHES`` micro-batches
  of those rows, as ``PipelineTrainer`` runs it;
- ``whole_train`` / ``whole_decode``: the whole model's same passes on rank 0 alone (rank 1 waits),
  what the one-core rate prices.

``efficiencies`` turns the seconds into ``CpuTerms.tp_train_efficiency``, ``tp_decode_efficiency`` and
``pp_train_efficiency``: the planner's compute term for the same pass (the whole pass split evenly
over the ranks; for the pipeline its ``m + pp - 1`` slots) over what the measured pass leaves once its
collectives are taken out at the gloo rates measured beside it (``CpuTerms.gloo_all_reduce_rate``,
``gloo_send_rate``), so that a rank's compute term divided by it, plus the collectives priced as
before, gives what the runtime takes. 1 would be a perfect split; it is clamped to [0.05, 1.5].

``measure_rank_passes(width)`` starts the two processes (``gloo_rate.run_pair``); ``flowrl calibrate``
runs it beside the gloo rates (``--gloo``, or ``--graph`` of a graph with CPU ranks).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import msgspec

from flowrl.calibration.measure import Measurements, pass_rows
from flowrl.errors import PlanError

__all__ = ["RankShape", "default_shape", "RankPassSeconds", "measure_rank_passes", "efficiencies", "with_rank_passes", "DECODE_ROWS", "MICRO_BATCHES"]

#: Rows of the decode-shaped passes (a CPU generator's batch).
DECODE_ROWS = 8
#: Micro-batches of the pipeline's schedule.
MICRO_BATCHES = 4
#: All-reduces of one layer on a tp rank: forward and backward (``cpu_ranks.TP_FORWARD_ALL_REDUCES``,
#: ``TP_BACKWARD_ALL_REDUCES``); a decode forward has the forward's only.
_LAYERS = 2
_TOKENS = 8


class RankShape(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The model and batch the split passes run at: the graph's policy's when ``flowrl calibrate --graph``
    knows it (``needs.CalibrationNeeds.rank_shape``), else the calibration model's (``default_shape``).

    Attributes:
        width: hidden size; heads / kv_heads / ffn: its attention heads, key-value heads and MLP width.
        rows / tokens: the training pass's sequences and tokens each; decode_rows: the decode step's rows.
    """

    width: int
    heads: int
    kv_heads: int
    ffn: int
    rows: int
    tokens: int = _TOKENS
    decode_rows: int = DECODE_ROWS


def default_shape(width: int) -> RankShape:
    """The calibration model's shape at ``width`` (``measure._pass_model``: heads 16 wide, MHA, the
    built-in MLP width) on ``pass_rows(width)`` rows of 8 tokens.

    Example:
        >>> default_shape(896)
        RankShape(width=896, heads=56, kv_heads=56, ffn=2392, rows=73, tokens=8, decode_rows=8)
    """
    heads = max(1, width // 16)
    return RankShape(width=width, heads=heads, kv_heads=heads, ffn=-(-8 * width // 3 // 8) * 8, rows=pass_rows(width))


class RankPassSeconds(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Seconds of each pass (module docstring), the ``statistic`` over the repeats, and the shape they ran at."""

    width: int
    rows: int
    tokens: int = _TOKENS
    decode_rows: int = DECODE_ROWS
    whole_train: float
    tp_train: float
    pp_train: float
    whole_decode: float
    tp_decode: float


def _clamp(x: float) -> float:
    return min(1.5, max(0.05, x))


def efficiencies(s: RankPassSeconds, m: Measurements) -> dict[str, float]:
    """``CpuTerms``' ``tp_train_efficiency``, ``tp_decode_efficiency`` and ``pp_train_efficiency`` of
    ``s`` (module docstring), its collectives priced at ``m``'s gloo rates (none: free).

    Example:
        >>> s = RankPassSeconds(width=64, rows=4, whole_train=1.0, tp_train=1.0, pp_train=1.0, whole_decode=0.1, tp_decode=0.1)
        >>> m = Measurements(matmul_flops=1e9, copy_bandwidth=1e9, op_overhead_s=1e-6, cores=2, memory_bytes=2**30)
        >>> efficiencies(s, m)  # no gloo rates (free collectives): tp 0.5 / 1.0; pp (4 + 1) x 0.5 / 4 / 1.0
        {'tp_train_efficiency': 0.5, 'tp_decode_efficiency': 0.5, 'pp_train_efficiency': 0.625}
    """
    from flowrl.planners.estimate.cpu_ranks import TP_BACKWARD_ALL_REDUCES, TP_FORWARD_ALL_REDUCES

    terms = m.cpu

    def all_reduce(nbytes: float) -> float:  # all_reduce_s with n = 2: bytes / rate
        rate = terms.gloo_all_reduce_rate(nbytes) or terms.gloo_rate(nbytes)
        return nbytes / rate if rate else 0.0

    def send(nbytes: float) -> float:
        rate = terms.gloo_send_rate(nbytes) or terms.gloo_rate(nbytes)
        return nbytes / rate if rate else 0.0

    act = s.rows * s.tokens * s.width * 4
    tp_comm = _LAYERS * (TP_FORWARD_ALL_REDUCES + TP_BACKWARD_ALL_REDUCES) * all_reduce(act)
    dec_comm = _LAYERS * TP_FORWARD_ALL_REDUCES * all_reduce(s.decode_rows * s.width * 4)
    mb = s.whole_train / 2 / MICRO_BATCHES  # one stage's share of one micro-batch
    sends = (MICRO_BATCHES + 1) * 2 * send(act / MICRO_BATCHES)  # 1F1B: m + pp - 1 slots, a send each way

    def eff(compute: float, measured: float, comm: float) -> float:  # the compute term over what the pass left for it
        return _clamp(compute / max(measured - comm, 1e-9))

    return {
        "tp_train_efficiency": eff(s.whole_train / 2, s.tp_train, tp_comm),
        "tp_decode_efficiency": eff(s.whole_decode / 2, s.tp_decode, dec_comm),
        "pp_train_efficiency": eff((MICRO_BATCHES + 1) * mb, s.pp_train, sends),
    }


def with_rank_passes(m: Measurements, s: RankPassSeconds) -> Measurements:
    """``m`` with ``efficiencies(s, m)`` in its ``CpuTerms`` (pure; measure the gloo rates first)."""
    return msgspec.structs.replace(m, cpu=msgspec.structs.replace(m.cpu, **efficiencies(s, m)))


def measure_rank_passes(shape: RankShape | int, *, repeats: int = 3, statistic: str = "median") -> RankPassSeconds:
    """Time the passes of the module docstring at ``shape`` (a width: ``default_shape``'s) on two
    processes of this host.

    Raises:
        PlanError: a shape that does not split in two (odd heads, kv heads or MLP width; 4 rows at
            least for the pipeline's micro-batches), fewer than one repeat, an unknown ``statistic``,
            or a process that failed or took too long.
    """
    if isinstance(shape, int):
        if shape < 32 or shape % 32:
            raise PlanError(f"measure_rank_passes: width={shape} must be a multiple of 32 (an even number of 16-wide heads)")
        shape = default_shape(shape)
    odd = [k for k in ("heads", "kv_heads", "ffn") if getattr(shape, k) % 2]
    if odd or shape.width % shape.heads or shape.heads % shape.kv_heads or shape.rows < MICRO_BATCHES or min(shape.tokens, shape.decode_rows) < 1 or repeats < 1:
        raise PlanError(
            f"measure_rank_passes: {shape} must split over 2 ranks (even {odd or 'heads, kv_heads, ffn'}; heads dividing the width, "
            f"kv heads the heads), with at least {MICRO_BATCHES} rows, and repeats={repeats} >= 1"
        )
    if statistic not in ("median", "best"):
        raise PlanError(f"calibration statistic {statistic!r} is not one of median, best")
    from flowrl.calibration.gloo_rate import run_pair

    seconds = run_pair("flowrl.calibration.rank_passes", ["--shape", msgspec.json.encode(shape).decode(), "--repeats", str(repeats)], what="the split passes")
    pick = min if statistic == "best" else statistics.median
    return RankPassSeconds(width=shape.width, rows=shape.rows, tokens=shape.tokens, decode_rows=shape.decode_rows, **{k: pick(v) for k, v in seconds.items()})


def _rank(rank: int, port: int, shape: RankShape, repeats: int) -> None:
    """One of the two processes: the passes of the module docstring; rank 0 prints their seconds."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from flowrl.calibration.gloo_rate import TIMEOUT_S
    from flowrl.graph.configs import ModelConfig
    from flowrl.models import build_model
    from flowrl.models.causal_lm import as_module
    from flowrl.runtime.parallel.pipeline import split_model
    from flowrl.runtime.parallel.tensor_parallel import shard_model_
    from flowrl.runtime.parallel.tp_train import shard_tp_model_

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        width, rows, tokens = shape.width, shape.rows, shape.tokens
        config = ModelConfig(vocab_size=16, dim=width, n_layers=_LAYERS, n_heads=shape.heads, n_kv_heads=shape.kv_heads, ffn_dim=shape.ffn, max_seq_len=2 * tokens)
        whole = as_module(build_model(config))
        x = torch.randint(0, 16, (rows, tokens))
        valid = torch.ones_like(x, dtype=torch.bool)
        xd = torch.randint(0, 16, (shape.decode_rows, 1))
        vd = torch.ones_like(xd, dtype=torch.bool)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        tp_train = copy.deepcopy(whole)
        shard_tp_model_(tp_train, mesh, config)
        tp_decode = shard_model_(copy.deepcopy(whole), (0, 1), rank, dist.group.WORLD)
        stage = split_model(copy.deepcopy(whole), rank, 2, _LAYERS)
        mb = rows // MICRO_BATCHES
        hidden = torch.empty(mb, tokens, width, device="meta", requires_grad=True)
        given = torch.empty(mb, tokens, dtype=torch.int64, device="meta") if stage.first else hidden
        stage.keep = tokens
        out = torch.empty(mb, tokens, stage.vocab_rows(), device="meta") if stage.last else hidden

        def train(model: torch.nn.Module) -> None:
            model(x, valid=valid).float().sum().backward()

        def decode(model: torch.nn.Module) -> None:
            with torch.no_grad():
                model(xd, valid=vd)

        def pipeline() -> None:
            pipe = PipelineStage(stage, rank, 2, torch.device("cpu"), input_args=given, output_args=out)
            schedule = Schedule1F1B(pipe, MICRO_BATCHES, loss_fn=lambda logits, target: logits.float().mean(), scale_grads=False)
            target = torch.zeros(rows)
            if stage.first:
                schedule.step(x[: mb * MICRO_BATCHES], target=target, valid=valid[: mb * MICRO_BATCHES])
            else:
                schedule.step(target=target, valid=valid[: mb * MICRO_BATCHES])

        passes = {
            "whole_train": lambda: train(whole) if rank == 0 else None,
            "whole_decode": lambda: decode(whole) if rank == 0 else None,
            "tp_train": lambda: train(tp_train),
            "tp_decode": lambda: decode(tp_decode),
            "pp_train": pipeline,
        }
        seconds: dict[str, list[float]] = {k: [] for k in passes}
        for r in range(repeats + 1):  # the first round warms up; the passes take turns
            for name, call in passes.items():
                dist.barrier()
                t0 = time.perf_counter()
                call()
                spent = time.perf_counter() - t0
                dist.barrier()
                if r:
                    seconds[name].append(spent)
        if rank == 0:
            print(json.dumps(seconds), flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one of measure_rank_passes' two processes")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--shape", required=True, help="a RankShape as JSON")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    _rank(args.rank, args.port, msgspec.json.decode(args.shape, type=RankShape), args.repeats)


if __name__ == "__main__":  # a member of a gloo group: ends without interpreter teardown (flowrl.runtime.backends.torchrun.rank_exit)
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process

    main()
    end_rank_process(0)
