"""The rate of gloo collectives between two processes of this host, measured: what an FSDP2 policy's
gathers and reduce-scatters run at on CPU ranks.

An FSDP2 policy on CPU ranks (a torchrun job: one process per rank, a gloo group) gathers every
block's parameters for each forward and again for the backward, and reduce-scatters the gradients,
over loopback TCP between the ranks' processes: a rate of its own, well below a memory copy's, and
one that falls with the tensor's size (caches). The planner prices those collectives at it
(``estimate.train``, ``estimate.direct``: ``CpuTerms.gloo_by_bytes``, at a block's or a tensor's bytes).

``measure_gloo()`` binds a ``TCPStore`` (it picks the port: no race) and starts two processes
(``python -m flowrl.calibration.gloo_rate``) at once, which form a gloo group over it and, for
each size of ``sizes``, time ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` of a tensor
of that many bytes (each rank's shard is half of it), ``repeats`` times after one warm-up each, the
two taking turns. The rate is in the planner's terms (``estimate.common.all_gather_s``: ``(n - 1) /
n * bytes / bandwidth`` with n = 2), the median (or ``statistic="best"``) of each collective's
seconds: ``bandwidth = nbytes / 2 / seconds``; ``CpuTerms.gloo_by_bytes`` takes the slower of the
two at each size. ``GLOO_SIZES`` (4, 16 and 64 MiB: a 0.5B model's tensors and blocks) take about
a second on this project's 2-core CPU, plus the two processes' start.

At each of ``activation_sizes`` (``ACTIVATION_SIZES``: 256 KiB to 4 MiB, a micro-batch's ``[tokens,
hidden]`` activations, and 16 KiB, a tp generator's decode step ``[rows, hidden]``, where the rate is
gloo's latency) the same processes also time an ``all_reduce`` (a tensor-parallel policy's,
``bandwidth = nbytes / seconds``: ``all_reduce_s``' terms with n = 2) and a ``send`` there and back
(a pipeline stage's activations and their gradient: ``bandwidth = nbytes / (seconds / 2)``) and an
``all_to_all_single`` of that many bytes per rank, half of it to the peer (an expert-parallel
policy's tokens going to their experts' ranks and back: ``bandwidth = nbytes / 2 / seconds``,
``estimate.common.all_to_all_s``' terms with n = 2): ``CpuTerms.gloo_all_reduce_by_bytes``,
``gloo_send_by_bytes`` and ``gloo_all_to_all_by_bytes``. On this project's CPU the all-reduce and send
ran 2-9 times faster than the gather / reduce-scatter rate at those sizes (``benches/tp_pp_parts.py``).

Example:
    >>> m = Measurements(matmul_flops=40e9, copy_bandwidth=6e9, op_overhead_s=4e-6, cores=2, memory_bytes=2**30)
    >>> figures = GlooFigures(sizes=(2**24, 2**26), gather_bandwidth=(0.5e9, 0.1e9), reduce_scatter_bandwidth=(0.4e9, 0.2e9))
    >>> with_gloo(m, figures).cpu.gloo_by_bytes
    ((16777216, 400000000.0), (67108864, 100000000.0))
    >>> acts = GlooFigures(sizes=(2**24,), gather_bandwidth=(0.5e9,), reduce_scatter_bandwidth=(0.4e9,), activation_sizes=(2**20,),
    ...                    all_reduce_bandwidth=(1.5e9,), send_bandwidth=(3e9,), all_to_all_bandwidth=(1e9,))
    >>> terms = with_gloo(m, acts).cpu
    >>> terms.gloo_all_reduce_by_bytes, terms.gloo_send_by_bytes, terms.gloo_all_to_all_by_bytes
    (((1048576, 1500000000.0),), ((1048576, 3000000000.0),), ((1048576, 1000000000.0),))
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import msgspec

from flowrl.calibration.measure import Measurements
from flowrl.errors import PlanError

__all__ = ["GlooFigures", "measure_gloo", "with_gloo", "run_pair", "GLOO_SIZES", "ACTIVATION_SIZES"]

#: Bytes of the tensors the collectives gather (or reduce-scatter) by default, ascending.
GLOO_SIZES = (4 * 2**20, 16 * 2**20, 64 * 2**20)
#: Bytes of the activations whose all-reduce and send are timed by default, ascending.
ACTIVATION_SIZES = (2**14, 2**18, 2**20, 4 * 2**20)
#: How many times the repeats an activation size up to 1 MiB is timed (each takes milliseconds).
SMALL_REPEATS = 5
#: Seconds the two processes may take, start-up included, before they are killed.
TIMEOUT_S = 300.0


class GlooFigures(msgspec.Struct, frozen=True, kw_only=True):
    """What ``measure_gloo`` found (module docstring): per size of ``sizes``, bytes/s in the planner's terms."""

    sizes: tuple[int, ...]
    gather_bandwidth: tuple[float, ...]
    reduce_scatter_bandwidth: tuple[float, ...]
    activation_sizes: tuple[int, ...] = ()
    all_reduce_bandwidth: tuple[float, ...] = ()
    send_bandwidth: tuple[float, ...] = ()
    all_to_all_bandwidth: tuple[float, ...] = ()


def with_gloo(m: Measurements, figures: GlooFigures) -> Measurements:
    """``m`` with the slower of the two gloo rates at each size as ``CpuTerms.gloo_by_bytes``, and the
    all-reduce, send and all-to-all rates at activations' sizes as ``gloo_all_reduce_by_bytes``,
    ``gloo_send_by_bytes`` and ``gloo_all_to_all_by_bytes`` (pure)."""
    table = tuple((n, min(g, r)) for n, g, r in zip(figures.sizes, figures.gather_bandwidth, figures.reduce_scatter_bandwidth))
    all_reduce = tuple(zip(figures.activation_sizes, figures.all_reduce_bandwidth))
    send = tuple(zip(figures.activation_sizes, figures.send_bandwidth))
    all_to_all = tuple(zip(figures.activation_sizes, figures.all_to_all_bandwidth))
    cpu = msgspec.structs.replace(
        m.cpu, gloo_by_bytes=table, gloo_all_reduce_by_bytes=all_reduce, gloo_send_by_bytes=send, gloo_all_to_all_by_bytes=all_to_all
    )
    return msgspec.structs.replace(m, cpu=cpu)


def measure_gloo(
    *, sizes: tuple[int, ...] = GLOO_SIZES, activation_sizes: tuple[int, ...] = ACTIVATION_SIZES, repeats: int = 3, statistic: str = "median"
) -> GlooFigures:
    """Time gloo's all-gather and reduce-scatter, and at ``activation_sizes`` its all-reduce, send and all-to-all,
    between two processes of this host (module docstring; ``activation_sizes=()``: none of the latter).

    Raises:
        PlanError: a count below 1, an unknown ``statistic``, or a process that failed or took longer
            than ``TIMEOUT_S`` (its error kept).
    """
    if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 8 or repeats < 1:
        raise PlanError(f"measure_gloo: sizes={list(sizes)} must be ascending byte counts >= 8 and repeats={repeats} >= 1")
    if list(activation_sizes) != sorted(set(activation_sizes)) or (activation_sizes and activation_sizes[0] < 8):
        raise PlanError(f"measure_gloo: activation_sizes={list(activation_sizes)} must be ascending byte counts >= 8 (or none)")
    if statistic not in ("median", "best"):
        raise PlanError(f"calibration statistic {statistic!r} is not one of median, best")
    cmd = ["--bytes", ",".join(map(str, sizes)), "--activation-bytes", ",".join(map(str, activation_sizes)), "--repeats", str(repeats)]
    seconds = run_pair("flowrl.calibration.gloo_rate", cmd, what="gloo's rate")
    pick = min if statistic == "best" else statistics.median
    rate = {name: tuple(n / 2 / pick(seconds[f"{name}/{n}"]) for n in sizes) for name in ("all_gather", "reduce_scatter")}
    return GlooFigures(
        sizes=tuple(sizes), gather_bandwidth=rate["all_gather"], reduce_scatter_bandwidth=rate["reduce_scatter"],
        activation_sizes=tuple(activation_sizes),
        all_reduce_bandwidth=tuple(n / pick(seconds[f"all_reduce/{n}"]) for n in activation_sizes),
        send_bandwidth=tuple(n / (pick(seconds[f"send/{n}"]) / 2) for n in activation_sizes),  # there and back: two sends
        all_to_all_bandwidth=tuple(n / 2 / pick(seconds[f"all_to_all/{n}"]) for n in activation_sizes),  # half of it leaves
    )


def run_pair(module: str, args: list[str], *, what: str) -> dict[str, list[float]]:
    """Run ``python -m module --port P --rank R *args`` as two processes (R = 0, 1) over a ``TCPStore``
    this process binds (it picks the port: no race), one intra-op thread each as torchrun starts a
    rank, and return rank 0's last stdout line as JSON (``{name: [seconds, ...]}``).

    Raises:
        PlanError: naming ``what`` was measured, when a process failed or took longer than ``TIMEOUT_S``
            (its error kept); one failing stops the other (it would wait for its peer).
    """
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cmd = [sys.executable, "-m", module, "--port", str(store.port), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as torchrun starts each rank
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode for p in procs if p.poll() is not None) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        outs = [p.communicate() for p in procs]
        del store
    if any(p.returncode for p in procs):
        late = time.monotonic() > deadline
        err = next((e for (_, e), p in zip(outs, procs) if p.returncode and e), "")
        why = f"took longer than {TIMEOUT_S:.0f} s (the machine is too busy?)" if late else f"a process failed (exit codes {[p.returncode for p in procs]})"
        raise PlanError(f"measuring {what}: {why}: {err[-2000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def _rank(rank: int, port: int, sizes: list[int], repeats: int, activation_sizes: Sequence[int] = ()) -> None:
    """One of the two processes: join the group over the caller's store, time the collectives; rank 0 prints the seconds."""
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        seconds: dict[str, list[float]] = {}
        for nbytes in sizes:
            half = nbytes // 8  # float32 elements of one rank's shard
            full, shard = torch.ones(2 * half), torch.ones(half)
            for r in range(repeats + 1):
                for name in ("all_gather", "reduce_scatter"):
                    dist.barrier()
                    t0 = time.perf_counter()
                    if name == "all_gather":
                        dist.all_gather_into_tensor(full, shard)
                    else:
                        dist.reduce_scatter_tensor(shard, full)
                    if r:
                        seconds.setdefault(f"{name}/{nbytes}", []).append(time.perf_counter() - t0)
        for nbytes in activation_sizes:
            act = torch.ones(nbytes // 4)
            received = torch.empty_like(act)  # an all-to-all's: half of each rank's rows go to the other
            # two warm-ups: the first sends of a size open their buffers; up to 1 MiB, SMALL_REPEATS times the
            # rounds (milliseconds each): one scheduling hiccup moved a single 256 KiB median 10x on 2 cores
            rounds = repeats * (SMALL_REPEATS if nbytes <= 2**20 else 1)
            for r in range(rounds + 2):
                for name in ("all_reduce", "send", "all_to_all"):
                    dist.barrier()
                    t0 = time.perf_counter()
                    if name == "all_reduce":
                        dist.all_reduce(act)
                    elif name == "all_to_all":
                        dist.all_to_all_single(received, act)
                    elif rank == 0:  # there and back, as a pipeline stage's activations and their gradient
                        dist.send(act, 1)
                        dist.recv(act, 1)
                    else:
                        dist.recv(act, 0)
                        dist.send(act, 0)
                    if r > 1:
                        seconds.setdefault(f"{name}/{nbytes}", []).append(time.perf_counter() - t0)
        if rank == 0:
            print(json.dumps(seconds), flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one of measure_gloo's two processes")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bytes", default=",".join(map(str, GLOO_SIZES)), help="comma-separated tensor sizes")
    parser.add_argument("--activation-bytes", default=",".join(map(str, ACTIVATION_SIZES)), help="comma-separated sizes of the all-reduce, send and all-to-all (empty: none)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    acts = [int(n) for n in args.activation_bytes.split(",") if n]
    _rank(args.rank, args.port, [int(n) for n in args.bytes.split(",")], args.repeats, acts)


if __name__ == "__main__":  # a member of a gloo group: ends without interpreter teardown (flowrl.runtime.backends.torchrun.rank_exit)
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process

    main()
    end_rank_process(0)
