"""Collective weight transport vs raw gloo send/recv of the same bytes between the same ranks, in the same run.

Four CPU ranks in one gloo group: ranks 0, 1 hold the trainer's weights with FSDP (dim 0 split),
ranks 2, 3 the generator's with tp2 (matrices split on dim 1, vectors on dim 0), so every
generator rank needs a quarter of every matrix from each trainer rank. The weights are a model-like
state of 1024 x 1024 float32 matrices (4 MiB each) with a 1024-vector each.

For each size it times, alternating the two so that both see the same load (median and best of
``--repeats`` after one warm-up, barrier to barrier on rank 0):

- ``raw``: each trainer rank sends each generator rank one contiguous buffer of exactly the bytes the
  transport sends that pair (``batch_isend_irecv``, the transport's own primitive);
- ``transport``: trainer ranks ``publish`` their shards (copy into send buffers + post), generator
  ranks ``fetch_into`` their shard targets (receive into staging + copy into the targets).

and prints JSON with both throughputs (wire bytes / second), ``ratio_to_raw`` (transport throughput /
raw throughput), and the bytes the transport put on the wire against ``minimum_bytes``. Each sync is
checked (every generator shard holds the published version).

    python benches/collective.py [--sizes 100MB 1GB] [--repeats 3] [--chunk-bytes 8MB]

Sizes are MiB/GiB (powers of 1024). The 1 GB case needs about 6 GB of memory across the 4 ranks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from flowrl.runtime.resharding import fsdp, minimum_bytes, tp_column, tp_row
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


def model(size: int) -> tuple[dict, dict, dict]:
    """params, trainer layouts, generator layouts of a state of about ``size`` bytes."""
    n = max(1, size // (DIM * DIM * 4))
    params, trainer, generator = {}, {}, {}
    for i in range(n):
        params[f"layer{i:03d}.weight"] = {"shape": [DIM, DIM], "dtype": "float32"}
        params[f"layer{i:03d}.norm"] = {"shape": [DIM], "dtype": "float32"}
        trainer[f"layer{i:03d}.weight"] = trainer[f"layer{i:03d}.norm"] = fsdp(TRAINER)
        generator[f"layer{i:03d}.weight"] = tp_row(GENERATOR)
        generator[f"layer{i:03d}.norm"] = tp_column(GENERATOR)
    return params, trainer, generator


def _barrier_time(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def run_size(rank: int, size: int, repeats: int, chunk_bytes: int) -> dict:
    params, trainer, generator = model(size)
    t = CollectiveTransport(params=params, trainer_layout=trainer, generator_layout=generator,
                            channel=f"bench{size}", timeout_s=600, fetch_wait_s=600, chunk_bytes=chunk_bytes)
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

    raw, times = [], []
    for v in range(repeats + 1):  # raw and transport alternate, so that both see the same machine load
        raw.append(_barrier_time(raw_once))
        for x in shards.values():
            x.fill_(float(v))
        times.append(_barrier_time(lambda: sync(v)))
        if t.is_generator:
            bad += [f"{n}@{v}" for n, x in target.items() if not bool((x == float(v)).all())]
    stats = t.stats()
    t.close()
    return {"raw_s": raw[1:], "transport_s": times[1:], "side_s": side_s[1:], "stats": stats, "bad": bad[:5],
            "is_trainer": rank in TRAINER}


def worker(argv: list[str]) -> None:
    rank, init, out, repeats, chunk_bytes = int(argv[0]), argv[1], Path(argv[2]), int(argv[3]), int(argv[4])
    sizes = [int(s) for s in argv[5:]]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=900))
    try:
        result = {str(s): run_size(rank, s, repeats, chunk_bytes) for s in sizes}
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def summarise(size: int, ranks: list[dict]) -> dict:
    params, trainer, generator = model(size)
    weights = sum(4 * (DIM * DIM if len(p["shape"]) == 2 else DIM) for p in params.values())
    minimum = sum(minimum_bytes(p["shape"], p["dtype"], trainer[n], generator[n]) for n, p in params.items())
    versions = len(ranks[0]["transport_s"]) + 1
    moved = sum(r["stats"]["bytes_sent"] for r in ranks) / versions
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
        "best_raw_gloo_s": round(best_raw, 4),
        "best_transport_s": round(best_tr, 4),
        "best_ratio_to_raw": round(best_raw / best_tr, 3),
        "publish_s": round(statistics.median(s for r in ranks if r["is_trainer"] for s in r["side_s"]), 4),
        "fetch_s": round(statistics.median(s for r in ranks if not r["is_trainer"] for s in r["side_s"]), 4),
        "all_generator_shards_exact": not any(r["bad"] for r in ranks),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["100MB", "1GB"], help="weights sizes (e.g. 100MB 1GB)")
    p.add_argument("--repeats", type=int, default=3, help="timed syncs per size (after one warm-up)")
    p.add_argument("--chunk-bytes", default="8MB", help="the transport's chunk_bytes (0: whole messages)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds before the ranks are killed")
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker)
        return
    sizes = [parse_size(s) for s in args.sizes]
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--worker"]
        chunk = parse_size(args.chunk_bytes)
        procs = [subprocess.Popen([*cmd, str(r), f"{tmp}/pg", tmp, str(args.repeats), str(chunk), *map(str, sizes)], env=env)
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
        "torch": torch.__version__,
        "sizes": {text: summarise(size, [r[str(size)] for r in ranks]) for text, size in zip(args.sizes, sizes)},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
