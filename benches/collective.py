"""Collective weight transport vs raw gloo send/recv of the same bytes between the same ranks, in the same run.

Four CPU ranks in one gloo group, ranks 0, 1 the trainer's, ranks 2, 3 the generator's, three layouts:

- ``fsdp->tp2``: the trainer holds its weights with FSDP (dim 0 split), the generator with tp2
  (matrices split on dim 1, vectors on dim 0), so every generator rank needs a quarter of every
  matrix from each trainer rank. The weights are a model-like state of 1024 x 1024 float32 matrices
  (4 MiB each) with a 1024-vector each. Each block's slice of the trainer's shard is strided (one
  pack), of the generator's shard contiguous (received in place).
- ``fsdp->tp2-dim0``: the same state, the generator's matrices split on dim 0 (column-parallel
  weights, as q/k/v and the MLP's up projections are): each trainer rank's shard is exactly the
  slice one generator rank needs, contiguous on both sides, so nothing is staged (the direct path).
- ``tp->other-tp``: 4 x 512 x 512 float32 tensors (4 MiB each) split on dim 1 by the trainer and
  on dim 2 by the generator: nothing is contiguous on either side (one pack, one unpack per byte).

For each size it times, alternating the two so that both see the same load (median and best of
``--repeats`` after one warm-up, barrier to barrier on rank 0):

- ``raw``: each trainer rank sends each generator rank one contiguous buffer of exactly the bytes the
  transport sends that pair (``batch_isend_irecv``, the transport's own primitive);
- ``transport``: trainer ranks ``publish`` their shards (copy into send buffers + post), generator
  ranks ``fetch_into`` their shard targets (receive into staging + copy into the targets).

and prints JSON with both throughputs (wire bytes / second), ``ratio_to_raw`` (transport throughput /
raw throughput), the bytes the transport put on the wire against ``minimum_bytes``, the bytes it
copied through staging buffers against what ``resharding.transfer_volume`` (the planner's figure)
says, the seconds spent packing/unpacking, and the CPU seconds of all four ranks in each phase
(``getrusage``: this machine's cores are the bound when ``cpu_s / wall_s`` nears their count). Each
sync is checked (every generator shard holds the published version). On a machine with a CUDA
device it also times the CUDA-IPC transport (see ``--ipc-sizes``) against a device-to-device copy.
The collective on NCCL is not timed here (``"nccl"`` in the output says why): it needs one GPU per
rank (since NCCL 2.5 two ranks on one GPU fail at init with ncclInvalidUsage "Duplicate GPU
detected"); ``tests/runtime/test_collective_nccl.py`` runs it on 2 or more GPUs.

    python benches/collective.py [--sizes 100MB 1GB] [--layouts fsdp->tp2 fsdp->tp2-dim0 tp->other-tp] [--repeats 5]

Sizes are MiB/GiB (powers of 1024). The 1 GB case needs about 6 GB of memory across the 4 ranks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import math
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from flowrl.placement.resharding import fsdp, minimum_bytes, sharded, tp_column, tp_row, transfer_volume
from flowrl.runtime.transports.collective import CollectiveTransport

WORLD = 4
TRAINER, GENERATOR = (0, 1), (2, 3)
DIM = 1024
UNITS = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def parse_size(text: str) -> int:
    for unit, scale in UNITS.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


LAYOUTS = ("fsdp->tp2", "fsdp->tp2-dim0", "tp->other-tp")


def model(size: int, layout: str = "fsdp->tp2") -> tuple[dict, dict, dict]:
    """params, trainer layouts, generator layouts of a state of about ``size`` bytes."""
    n = max(1, size // (DIM * DIM * 4))
    params, trainer, generator = {}, {}, {}
    for i in range(n):
        if layout == "tp->other-tp":
            params[f"layer{i:03d}.qkv"] = {"shape": [4, DIM // 2, DIM // 2], "dtype": "float32"}
            trainer[f"layer{i:03d}.qkv"] = sharded(TRAINER, 1)
            generator[f"layer{i:03d}.qkv"] = sharded(GENERATOR, 2)
            continue
        params[f"layer{i:03d}.weight"] = {"shape": [DIM, DIM], "dtype": "float32"}
        params[f"layer{i:03d}.norm"] = {"shape": [DIM], "dtype": "float32"}
        trainer[f"layer{i:03d}.weight"] = trainer[f"layer{i:03d}.norm"] = fsdp(TRAINER)
        generator[f"layer{i:03d}.weight"] = tp_column(GENERATOR) if layout == "fsdp->tp2-dim0" else tp_row(GENERATOR)
        generator[f"layer{i:03d}.norm"] = tp_column(GENERATOR)
    return params, trainer, generator


def _cpu_s() -> float:
    """CPU seconds of this process, every thread (gloo's included)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _barrier_time(fn, cpu: list[float]) -> float:
    dist.barrier()
    start, used = time.perf_counter(), _cpu_s()
    fn()
    cpu.append(_cpu_s() - used)
    dist.barrier()
    return time.perf_counter() - start


def run_size(rank: int, size: int, layout: str, repeats: int, chunk_bytes: int, direct_min: int) -> dict:
    params, trainer, generator = model(size, layout)
    t = CollectiveTransport(params=params, trainer_layout=trainer, generator_layout=generator, direct_min_bytes=direct_min,
                            channel=f"bench{size}{layout}", timeout_s=600, fetch_wait_s=600, chunk_bytes=chunk_bytes)
    # raw: the same bytes per (trainer, generator) pair (header and padding included), one contiguous
    # buffer each, with the transport's own primitive
    raw_bufs = []
    for (s, d), n in sorted(t.message_sizes().items()):
        if rank in (s, d):
            raw_bufs.append(dist.P2POp(dist.isend if rank == s else dist.irecv, torch.ones(n, dtype=torch.uint8), peer=d if rank == s else s))

    def raw_once() -> None:
        for w in dist.batch_isend_irecv(raw_bufs) if raw_bufs else []:
            w.wait()

    shards = {n: torch.zeros(s) for n, s in t.local_shapes("trainer").items()}
    target = {n: torch.zeros(s) for n, s in t.local_shapes("generator").items()}
    side_s: list[float] = []
    bad: list[str] = []

    def sync(version: int) -> None:
        start = time.perf_counter()
        if t.is_trainer:
            t.publish(shards, version)
        if t.is_generator:
            got = t.fetch_into(target, newer_than=version - 1)
            assert got == version, got
        side_s.append(time.perf_counter() - start)

    raw, times, raw_cpu, tr_cpu, staged = [], [], [], [], []
    for v in range(repeats + 1):  # raw and transport alternate, so that both see the same machine load
        raw.append(_barrier_time(raw_once, raw_cpu))
        for x in shards.values():
            x.fill_(float(v))
        before = t.stats()
        times.append(_barrier_time(lambda: sync(v), tr_cpu))
        after = t.stats()
        staged.append((after["bytes_staged"] - before["bytes_staged"], after["staging_s"] - before["staging_s"]))
        if t.is_generator:
            bad += [f"{n}@{v}" for n, x in target.items() if not bool((x == float(v)).all())]
    stats = t.stats()
    t.close()
    return {"raw_s": raw[1:], "transport_s": times[1:], "side_s": side_s[1:], "stats": stats, "bad": bad[:5],
            "raw_cpu_s": raw_cpu[1:], "transport_cpu_s": tr_cpu[1:], "staged": staged[1:], "is_trainer": rank in TRAINER}


def worker(argv: list[str]) -> None:
    rank, init, out, repeats, chunk_bytes, direct_min = int(argv[0]), argv[1], Path(argv[2]), int(argv[3]), int(argv[4]), int(argv[5])
    layouts, sizes = argv[6].split(","), [int(s) for s in argv[7:]]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=900))
    try:
        # the big sizes get fewer repeats: they dominate the run and vary less
        result = {f"{lay}@{s}": run_size(rank, s, lay, repeats if s < (512 << 20) else max(1, repeats // 2), chunk_bytes, direct_min)
                  for lay in layouts for s in sizes}
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def summarise(size: int, layout: str, ranks: list[dict]) -> dict:
    params, trainer, generator = model(size, layout)
    weights = sum(4 * math.prod(p["shape"]) for p in params.values())
    minimum = sum(minimum_bytes(p["shape"], p["dtype"], trainer[n], generator[n]) for n, p in params.items())
    volume = transfer_volume({n: (p["shape"], p["dtype"]) for n, p in params.items()}, trainer, generator)
    versions = len(ranks[0]["transport_s"]) + 1
    moved = sum(r["stats"]["bytes_sent"] for r in ranks) / versions
    staged = [sum(r["staged"][i][0] for r in ranks) for i in range(versions - 1)]
    pack_s = [max(r["staged"][i][1] for r in ranks if r["is_trainer"]) for i in range(versions - 1)]
    unpack_s = [max(r["staged"][i][1] for r in ranks if not r["is_trainer"]) for i in range(versions - 1)]
    raw_cpu = [sum(r["raw_cpu_s"][i] for r in ranks) for i in range(versions - 1)]
    tr_cpu = [sum(r["transport_cpu_s"][i] for r in ranks) for i in range(versions - 1)]
    raw_s = statistics.median(ranks[0]["raw_s"])
    tr_s = statistics.median(ranks[0]["transport_s"])
    best_raw, best_tr = min(ranks[0]["raw_s"]), min(ranks[0]["transport_s"])
    return {
        "weights_bytes": weights,
        "params": len(params),
        "wire_bytes_per_sync": int(moved),
        "minimum_bytes": minimum,
        "bytes_moved_over_minimum": round(moved / minimum, 6),
        "raw_gloo_s": round(raw_s, 4),
        "raw_gloo_GBps": round(minimum / raw_s / 1e9, 3),
        "transport_s": round(tr_s, 4),
        "transport_GBps": round(minimum / tr_s / 1e9, 3),
        "ratio_to_raw": round(raw_s / tr_s, 3),
        "ratios_per_repeat": [round(a / b, 3) for a, b in zip(ranks[0]["raw_s"], ranks[0]["transport_s"])],
        "best_raw_gloo_s": round(best_raw, 4),
        "best_transport_s": round(best_tr, 4),
        "best_ratio_to_raw": round(best_raw / best_tr, 3),
        "staged_bytes_per_sync": int(statistics.median(staged)),
        "planner_copied_bytes": volume.copied_bytes,
        "planner_wire_bytes": volume.wire_bytes,
        "copies_per_byte": round(volume.copies_per_byte, 3),
        "pack_s": round(statistics.median(pack_s), 4),
        "unpack_s": round(statistics.median(unpack_s), 4),
        "raw_cpu_s_all_ranks": round(statistics.median(raw_cpu), 4),
        "transport_cpu_s_all_ranks": round(statistics.median(tr_cpu), 4),
        "raw_cores_busy": round(statistics.median(c / w for c, w in zip(raw_cpu, ranks[0]["raw_s"])), 2),
        "transport_cores_busy": round(statistics.median(c / w for c, w in zip(tr_cpu, ranks[0]["transport_s"])), 2),
        "publish_s": round(statistics.median(s for r in ranks if r["is_trainer"] for s in r["side_s"]), 4),
        "fetch_s": round(statistics.median(s for r in ranks if not r["is_trainer"] for s in r["side_s"]), 4),
        "all_generator_shards_exact": not any(r["bad"] for r in ranks),
    }


def cuda_ipc_bench(sizes: list[int]) -> dict:
    """CUDA IPC publish + fetch of states of ``sizes`` bytes against a device-to-device copy (CUDA only)."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine"}
    from cuda_ipc import run  # noqa: PLC0415 - CUDA only; the sibling bench (this script's folder is on sys.path)

    return run(sizes)


def nccl_note() -> dict:
    """Why this bench prints no NCCL figures on this machine."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        return {"skipped": f"NCCL needs one GPU per rank (two ranks on one GPU fail at init: 'Duplicate GPU detected'); this machine has {gpus}"}
    return {"skipped": f"not timed by this bench; {gpus} GPUs: python -m pytest tests/runtime/test_collective_nccl.py runs the collective on NCCL"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["100MB", "1GB"], help="weights sizes (e.g. 100MB 1GB)")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS, help="trainer -> generator layouts")
    p.add_argument("--repeats", type=int, default=5, help="timed syncs per size (after one warm-up; half for sizes >= 512MB)")
    p.add_argument("--ipc-sizes", nargs="*", default=["1GB", "8GB"], help="CUDA IPC states to time (CUDA only)")
    p.add_argument("--chunk-bytes", default="8MB", help="the transport's chunk_bytes (0: whole messages)")
    p.add_argument("--direct-min-bytes", default="64KB", help="the transport's direct_min_bytes (blocks this big go unstaged where contiguous)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds before the ranks are killed")
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker)
        return
    sizes = [parse_size(s) for s in args.sizes]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--worker"]
        chunk = parse_size(args.chunk_bytes)
        # a TCP store, as torchrun's: versions are announced and polled there (a FileStore re-reads its whole
        # file on every operation, which the generators' polling makes slower with every version)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        procs = [subprocess.Popen([*cmd, str(r), f"tcp://127.0.0.1:{port}", tmp, str(args.repeats), str(chunk), str(parse_size(args.direct_min_bytes)), ",".join(args.layouts),
                                   *map(str, sizes)], env=env)
                 for r in range(WORLD)]
        deadline = time.monotonic() + args.timeout
        try:
            codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            sys.exit(f"benches/collective.py: ranks did not finish in {args.timeout:.0f} s")
        if any(codes):
            sys.exit(f"benches/collective.py: worker exit codes {codes}")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD)]
    out = {
        "ranks": WORLD,
        "trainer": "fsdp over ranks [0, 1]",
        "generator": "tp2 over ranks [2, 3] (matrices split on dim 1, vectors on dim 0)",
        "repeats": args.repeats,
        "chunk_bytes": parse_size(args.chunk_bytes),
        "direct_min_bytes": parse_size(args.direct_min_bytes),
        "torch": torch.__version__,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "layouts": {lay: {text: summarise(size, lay, [r[f"{lay}@{size}"] for r in ranks]) for text, size in zip(args.sizes, sizes)}
                    for lay in args.layouts},
        "cuda_ipc": cuda_ipc_bench([parse_size(s) for s in args.ipc_sizes]),
        "nccl": nccl_note(),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
