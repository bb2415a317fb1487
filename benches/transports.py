"""Weight-transfer throughput of each transport against a plain ``torch`` copy of the same bytes.

For each size (a float32 state of many tensors shaped like a transformer's: embeddings, attention and
MLP matrices, norms) and each transport, it times ``publish`` and ``fetch_into`` (median of
``--repeats`` after one warm-up) and, in the same run, ``dst.copy_(src)`` of one flat tensor of the
same bytes (measured next to each transport, so both see the same machine load), and prints JSON
with GB/s and the ratio ``transport GB/s / copy GB/s`` (1.0 = as fast as a memory copy). For context
it also prints ``per_tensor_copy_GBps``: ``copy_`` tensor by tensor into a preallocated state, which
on a busy machine is much slower than one flat copy (see ``copy_tensor`` in ``transports/base.py``). The shm and file readers are separate objects attached by name, as another process
would. The file transport fsyncs each version (its default), so its publish measures the disk.

    python benches/transports.py                      # 100MB and 1GB, inprocess/shm/file and collective
    python benches/transports.py --quick              # 100MB, 2 repeats
    python benches/transports.py --transports shm --repeats 5
    python benches/transports.py --transports collective   # only the collective transport (4 CPU ranks)

``collective`` (the torch.distributed transport) is measured by ``benches/collective.py``, launched as a
subprocess with the same sizes and repeats: 4 gloo ranks, trainer FSDP over ranks 0-1 -> generator
tp2 over ranks 2-3, throughput as a ratio to raw gloo send/recv of the same bytes between the same
ranks in the same run, and the bytes moved against ``resharding.minimum_bytes``. Its JSON goes under
``"collective"`` (its sizes are powers of 1024: 100MB = 100 MiB there).

Memory: the state, a target and two copies inside the transport (2 x in /dev/shm for shm, on disk
for file): about 4x the size at peak (4 GB for 1GB).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from flowrl.runtime.transports.file import FileTransport
from flowrl.runtime.transports.inprocess import InProcessTransport
from flowrl.runtime.transports.shm import SharedMemoryTransport

SIZES = {"100MB": 100 * 10**6, "1GB": 10**9}


def model_state(nbytes: int) -> dict[str, torch.Tensor]:
    """A float32 state of about ``nbytes``, laid out like a small decoder-only transformer."""
    d = 512 if nbytes < 4 * 10**8 else 1024
    vocab = 8192
    per_layer = 4 * d * d + 2 * 4 * d * d + 2 * d
    layers = max(1, round((nbytes / 4 - 2 * vocab * d) / per_layer))
    gen = torch.Generator().manual_seed(0)
    shapes = {"embed.weight": (vocab, d)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {p + n: (d, d) for n in ("attn.q", "attn.k", "attn.v", "attn.o")}
        shapes |= {p + "mlp.up": (4 * d, d), p + "mlp.down": (d, 4 * d), p + "norm1": (d,), p + "norm2": (d,)}
    shapes |= {"norm.weight": (d,), "lm_head.weight": (vocab, d)}
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(first call's seconds, median seconds of ``repeats`` more calls)."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def copy_baselines(state: dict[str, torch.Tensor], repeats: int) -> tuple[float, float]:
    """Seconds of ``dst.copy_(src)`` for one flat tensor of the state's bytes, and of ``copy_`` per tensor."""
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    flat = timed(lambda: dst.copy_(src), repeats)[1]
    del src, dst
    target = {k: torch.empty_like(v) for k, v in state.items()}
    per_tensor = timed(lambda: [target[k].copy_(v) for k, v in state.items()], repeats)[1]
    return flat, per_tensor


def open_pair(name: str, workdir: str):
    if name == "inprocess":
        t = InProcessTransport()
        return t, t
    if name == "shm":
        seg = f"flowrl-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        return SharedMemoryTransport(seg, create=True), SharedMemoryTransport(seg, create=False)
    if name == "file":
        directory = os.path.join(workdir, f"weights-{uuid.uuid4().hex[:8]}")
        return FileTransport(directory), FileTransport(directory)
    raise SystemExit(f"unknown transport {name!r}; choose from inprocess, shm, file, collective")


def bench_transport(name: str, state: dict[str, torch.Tensor], repeats: int, workdir: str) -> dict[str, float]:
    writer, reader = open_pair(name, workdir)
    target = {k: torch.empty_like(v) for k, v in state.items()}
    version = iter(range(10**9))
    try:
        first_pub, pub = timed(lambda: writer.publish(state, next(version)), repeats)
        first_fetch, fetch = timed(lambda: reader.fetch_into(target), repeats)
        if not all(torch.equal(target[k], state[k]) for k in state):
            raise SystemExit(f"{name}: fetched weights differ from the published ones")
    finally:
        reader.close()
        writer.close()
    return {"publish_s": pub, "fetch_s": fetch, "first_publish_s": first_pub, "first_fetch_s": first_fetch}


def bench_collective(sizes: list[str], repeats: int, timeout_s: float) -> dict:
    """Run benches/collective.py (4 gloo ranks) and return its JSON."""
    script = Path(__file__).with_name("collective.py")
    cmd = [sys.executable, str(script), "--sizes", *sizes, "--repeats", str(repeats), "--timeout", str(timeout_s)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(script.parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 60, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"benches/collective.py failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES), help="state sizes to run")
    p.add_argument("--transports", nargs="+", default=["inprocess", "shm", "file", "collective"])
    p.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (median), after one warm-up")
    p.add_argument("--workdir", default=None, help="where the file transport writes (default: a temp dir on disk)")
    p.add_argument("--quick", action="store_true", help="100MB only, 2 repeats")
    p.add_argument("--collective-timeout", type=float, default=1200, help="seconds before the collective ranks are killed")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.repeats = ["100MB"], min(args.repeats, 2)
    local = [t for t in args.transports if t != "collective"]
    out: dict[str, object] = {
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version()},
        "repeats": args.repeats,
        "results": [],
    }
    with tempfile.TemporaryDirectory(prefix="flowrl-bench-", dir=args.workdir) as workdir:
        for size in args.sizes if local else []:
            state = model_state(SIZES[size])
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            for name in local:
                copy_s, state_copy_s = copy_baselines(state, args.repeats)  # next to each transport: same load
                copy_gbps = nbytes / copy_s / 1e9
                r = bench_transport(name, state, args.repeats, workdir)
                pub_gbps, fetch_gbps = nbytes / r["publish_s"] / 1e9, nbytes / r["fetch_s"] / 1e9
                out["results"].append({
                    "size": size, "bytes": nbytes, "tensors": len(state), "transport": name,
                    "copy_GBps": round(copy_gbps, 3), "per_tensor_copy_GBps": round(nbytes / state_copy_s / 1e9, 3),
                    "publish_GBps": round(pub_gbps, 3), "fetch_GBps": round(fetch_gbps, 3),
                    "publish_vs_copy": round(pub_gbps / copy_gbps, 3), "fetch_vs_copy": round(fetch_gbps / copy_gbps, 3),
                    "first_publish_s": round(r["first_publish_s"], 4), "first_fetch_s": round(r["first_fetch_s"], 4),
                })
            del state
    if "collective" in args.transports:
        out["collective"] = bench_collective(args.sizes, args.repeats, args.collective_timeout)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
