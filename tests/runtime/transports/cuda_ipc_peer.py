"""The writer process of a CUDA-IPC weight edge, for the cross-process tests (``memory`` cuda or host).

Run as ``python -m tests.runtime.transports.cuda_ipc_peer SEGMENT MEMORY NUMEL SLOTS``. It opens the
writer, prints ``ready`` (nothing published yet), then obeys one command per stdin line, answering
one stdout line each:

    publish N   publish the next N versions                               -> published V (the last)
    stream N    publish versions up to N, back to back                    -> published N
    stall K     start the next version, stop after copying K tensors into its slot (seq odd)
                                                                          -> stalled V
    resume      finish the stalled version                                -> published V
    close       close the writer (readers see it closed; slots unlinked) -> closed

At end of input it exits without ``close()``. Every tensor of version v is filled with v (on the slot
memory's device), so the reader can tell a torn state from a whole one.
"""

from __future__ import annotations

import sys

import torch

import flowrl.runtime.transports.cuda_ipc as cuda_ipc
from flowrl.runtime.transports.cuda_ipc import CudaIpcTransport

__all__ = ["make_state", "main"]


def make_state(numel: int, device: str = "cuda") -> dict[str, torch.Tensor]:
    state = {f"layers.{i}.weight": torch.zeros(numel, device=device) for i in range(4)}
    state |= {"norm": torch.zeros(numel // 16, dtype=torch.bfloat16, device=device), "step": torch.zeros((), dtype=torch.int64, device=device)}
    return state


def _stalling_copy(after: int):
    """``copy_tensor`` that stops for a ``resume`` line after ``after`` copies."""
    real, done = cuda_ipc.copy_tensor, [0]

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        real(dst, src)
        done[0] += 1
        if done[0] == after:
            print(f"stalled {int(src.flatten()[0].item()) if src.numel() else -1}", flush=True)
            if sys.stdin.readline().strip() != "resume":
                raise SystemExit("cuda_ipc_peer: expected 'resume' after a stall")

    return copy


def main(argv: list[str]) -> None:
    segment, memory, numel, slots = argv[0], argv[1], int(argv[2]), int(argv[3])
    device = "cuda" if memory == "cuda" else "cpu"
    t = CudaIpcTransport(segment, create=True, memory=memory, slots=slots)
    state = make_state(numel, device)
    version = -1

    def publish_next() -> None:
        nonlocal version
        version += 1
        for x in state.values():
            x.fill_(version)
        t.publish(state, version)

    print("ready", flush=True)
    for line in sys.stdin:
        op, *args = line.split()
        if op == "publish":
            for _ in range(int(args[0])):
                publish_next()
        elif op == "stream":
            while version < int(args[0]):
                publish_next()
        elif op == "stall":
            real = cuda_ipc.copy_tensor
            cuda_ipc.copy_tensor = _stalling_copy(int(args[0]))
            try:
                publish_next()
            finally:
                cuda_ipc.copy_tensor = real
        elif op == "close":
            t.close()
            print("closed", flush=True)
            continue
        else:
            raise SystemExit(f"cuda_ipc_peer: unknown command {line.strip()!r}")
        print(f"published {version}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
