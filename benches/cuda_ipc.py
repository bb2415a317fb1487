"""CUDA IPC weight transfer between two processes on one GPU, against a device-to-device copy.

For each state size: this process publishes with ``CudaIpcTransport`` (one device-to-device copy into
a slot), a second process on the same GPU fetches into its own tensors (one copy out of the mapped
slot); both are timed (median of ``repeats`` after a warm-up), and compared with one ``copy_`` of the
same bytes within one process. The state is float32 tensors of 256 MiB. Called by
``benches/collective.py`` when a CUDA device is there; alone:

    python benches/cuda_ipc.py [--sizes 1GB 8GB] [--repeats 5] [--memory cuda|host]

``--memory host`` runs the same protocol with the slots in POSIX shared memory and the states in
host memory (the transport's ``memory="host"``), against a host ``copy_``: it runs on any machine,
and shows what the protocol itself costs beyond its two copies.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid

import torch

from flowrl.runtime.transports.cuda_ipc import CudaIpcTransport

__all__ = ["run"]

PIECE = 256 << 20  # bytes per tensor


def _state(size: int, device: str) -> dict[str, torch.Tensor]:
    n, rest = divmod(size, PIECE)
    shapes = [PIECE // 4] * n + ([rest // 4] if rest >= 4 else [])
    return {f"w{i:03d}": torch.zeros(s, device=device) for i, s in enumerate(shapes)}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _free_bytes(memory: str) -> int:
    """What the size check may use: free GPU memory, or for host slots the smaller of free RAM and /dev/shm."""
    if memory == "cuda":
        return torch.cuda.mem_get_info()[0]
    ram = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(ram, shutil.disk_usage("/dev/shm").free * 5 // 2)  # 2 of the 5 states are slots in /dev/shm


def _reader(segment: str, size: int, device: str) -> None:
    """The generator's side: fetch each announced version, print the seconds it took."""
    t = CudaIpcTransport(segment, create=False)
    target = _state(size, device)
    for line in sys.stdin:
        v = int(line)
        start = time.perf_counter()
        got = t.fetch_into(target, newer_than=v - 1)
        _sync(device)
        elapsed = time.perf_counter() - start
        ok = got == v and all(bool((x == v).all()) for x in target.values())
        print(json.dumps({"fetch_s": elapsed, "ok": ok}), flush=True)
    t.close()


def run(sizes: list[int], repeats: int = 5, memory: str = "cuda") -> dict:
    """Time publish + fetch (two processes) against a device-to-device copy, per size in bytes
    (``memory="host"``: host slots and states, against a host copy)."""
    device = "cuda" if memory == "cuda" else "cpu"
    out: dict[str, dict] = {}
    for size in sizes:
        free = _free_bytes(memory)
        if 5 * size > free:  # state, 2 slots, the reader's target, the copy's destination
            out[str(size)] = {"skipped": f"needs about {5 * size / 2**30:.0f} GiB of {memory} memory, {free / 2**30:.0f} GiB free"}
            continue
        state = _state(size, device)
        dst = {k: torch.empty_like(v) for k, v in state.items()}
        d2d = [_timed(lambda: [dst[k].copy_(v) for k, v in state.items()], device) for _ in range(repeats + 1)][1:]
        dst.clear()
        segment = f"flowrl-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        writer = CudaIpcTransport(segment, create=True, memory=memory)
        writer.publish(state, 0)  # creates the slots and the segment before the reader attaches
        reader = subprocess.Popen([sys.executable, __file__, "--reader", segment, str(size), device],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        publish, fetch, ok = [], [], True
        try:
            for v in range(1, repeats + 2):
                for x in state.values():
                    x.fill_(float(v))
                publish.append(_timed(lambda: writer.publish(state, v), device))
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
        if device == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if device == "cuda" else f"host memory ({os.cpu_count()} CPUs)"
    return {"memory": memory, "device": name, "threads": torch.get_num_threads(), "sizes": out}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--reader":
        _reader(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    from collective import parse_size  # noqa: PLC0415 - the sibling bench (this script's folder is on sys.path)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["1GB", "8GB"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--memory", choices=("cuda", "host"), default="cuda", help="GPU memory through CUDA IPC, or host shared memory")
    args = p.parse_args()
    if args.memory == "cuda" and not torch.cuda.is_available():
        sys.exit("benches/cuda_ipc.py: no CUDA device here; --memory host runs the same protocol in host shared memory")
    print(json.dumps(run([parse_size(s) for s in args.sizes], args.repeats, args.memory), indent=2))


if __name__ == "__main__":
    main()
