"""The writer process of a CUDA-IPC weight edge, for the cross-process test (CUDA only).

Run as ``python -m tests.runtime.transports.cuda_ipc_peer SEGMENT VERSIONS NUMEL``; it talks to the
test (the reader process) over stdin/stdout lines (see ``test_cuda_ipc.py``). Every tensor of version
v is filled with v on the GPU, so the reader can tell a torn state from a whole one.
"""

from __future__ import annotations

import sys

import torch

from flowrl.runtime.transports.cuda_ipc import CudaIpcTransport

__all__ = ["make_state", "main"]


def make_state(numel: int, device: str = "cuda") -> dict[str, torch.Tensor]:
    state = {f"layers.{i}.weight": torch.zeros(numel, device=device) for i in range(4)}
    state |= {"norm": torch.zeros(numel // 16, dtype=torch.bfloat16, device=device), "step": torch.zeros((), dtype=torch.int64, device=device)}
    return state


def main(argv: list[str]) -> None:
    segment, versions, numel = argv[0], int(argv[1]), int(argv[2])
    t = CudaIpcTransport(segment, create=True)
    state = make_state(numel)
    t.publish(state, 0)
    print("published 0", flush=True)
    sys.stdin.readline()  # "go": the reader has mapped the slots and seen version 0
    for v in range(1, versions):
        for x in state.values():
            x.fill_(v)
        t.publish(state, v)
    print("published all", flush=True)
    sys.stdin.readline()  # "close": the reader is done with the slots
    t.close()


if __name__ == "__main__":
    main(sys.argv[1:])
