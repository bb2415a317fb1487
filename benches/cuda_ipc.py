"""CUDA IPC weight transfer between two processes on one GPU, against a device-to-device copy (CUDA only).

For each state size: this process publishes with ``CudaIpcTransport`` (one device-to-device copy into
a slot), a second process on the same GPU fetches into its own tensors (one copy out of the mapped
slot); both are timed (median of ``repeats`` after a warm-up), and compared with one ``copy_`` of the
same bytes within one process. The state is float32 tensors of 256 MiB. Called by
``benches/collective.py`` when a CUDA device is there; alone:

    python benches/cuda_ipc.py [--sizes 1GB 8GB] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

import torch

from flowrl.runtime.transports.cuda_ipc import CudaIpcTransport

__all__ = ["run"]

PIECE = 256 << 20  # bytes per tensor


def _state(size: int) -> dict[str, torch.Tensor]:
    n, rest = divmod(size, PIECE)
    shapes = [PIECE // 4] * n + ([rest // 4] if rest >= 4 else [])
    return {f"w{i:03d}": torch.zeros(s, device="cuda") for i, s in enumerate(shapes)}


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _reader(segment: str, size: int) -> None:
    """The generator's side: fetch each announced version, print the seconds it took."""
    t = CudaIpcTransport(segment, create=False)
    target = _state(size)
    for line in sys.stdin:
        v = int(line)
        start = time.perf_counter()
        got = t.fetch_into(target, newer_than=v - 1)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        ok = got == v and all(bool((x == v).all()) for x in target.values())
        print(json.dumps({"fetch_s": elapsed, "ok": ok}), flush=True)
    t.close()


def run(sizes: list[int], repeats: int = 5) -> dict:
    """Time publish + fetch (two processes) against a device-to-device copy, per size in bytes."""
    out: dict[str, dict] = {}
    for size in sizes:
        free, _ = torch.cuda.mem_get_info()
        if 5 * size > free:  # state, 2 slots, the reader's target, the copy's destination
            out[str(size)] = {"skipped": f"needs about {5 * size / 2**30:.0f} GiB of GPU memory, {free / 2**30:.0f} GiB free"}
            continue
        state = _state(size)
        dst = {k: torch.empty_like(v) for k, v in state.items()}
        d2d = [_timed(lambda: [dst[k].copy_(v) for k, v in state.items()]) for _ in range(repeats + 1)][1:]
        dst.clear()
        segment = f"flowrl-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        writer = CudaIpcTransport(segment, create=True)
        writer.publish(state, 0)  # creates the slots and the segment before the reader attaches
        reader = subprocess.Popen([sys.executable, __file__, "--reader", segment, str(size)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        publish, fetch, ok = [], [], True
        try:
            for v in range(1, repeats + 2):
                for x in state.values():
                    x.fill_(float(v))
                publish.append(_timed(lambda: writer.publish(state, v)))
                reader.stdin.write(f"{v}\n")
                reader.stdin.flush()
                answer = json.loads(reader.stdout.readline())
                fetch.append(answer["fetch_s"])
                ok &= answer["ok"]
        finally:
            reader.stdin.close()
            reader.wait(60)
            writer.close()
        p, f, c = statistics.median(publish[1:]), statistics.median(fetch[1:]), statistics.median(d2d)
        out[str(size)] = {
            "bytes": sum(x.numel() * 4 for x in state.values()),
            "publish_s": round(p, 5), "fetch_s": round(f, 5), "publish_plus_fetch_s": round(p + f, 5),
            "device_copy_s": round(c, 5), "ratio_to_device_copy": round(c / (p + f), 3),
            "publish_plus_fetch_GBps": round(size / (p + f) / 1e9, 2), "device_copy_GBps": round(size / c / 1e9, 2),
            "fetched_exact": ok,
        }
        state.clear()
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "sizes": out}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--reader":
        _reader(sys.argv[2], int(sys.argv[3]))
        return
    from collective import parse_size  # noqa: PLC0415 - the sibling bench (this script's folder is on sys.path)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["1GB", "8GB"])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benches/cuda_ipc.py needs a CUDA device")
    print(json.dumps(run([parse_size(s) for s in args.sizes], args.repeats), indent=2))


if __name__ == "__main__":
    main()
