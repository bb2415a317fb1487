"""The writer process of a shared-memory weight edge, for the cross-process test.

Run as ``python -m tests.runtime.transports.shm_peer writer SEGMENT VERSIONS NUMEL``; it talks to the
test (the reader process) over stdin/stdout lines (see ``test_shm.py``). Every tensor of version v is
filled with v, so the reader can tell a torn state from a whole one.
"""

from __future__ import annotations

import sys

import torch

from flowrl.runtime.transports.shm import SharedMemoryTransport

__all__ = ["make_state", "main"]


def make_state(numel: int) -> dict[str, torch.Tensor]:
    state = {f"layers.{i}.weight": torch.zeros(numel) for i in range(8)}
    state |= {"norm": torch.zeros(numel // 16, dtype=torch.bfloat16), "step": torch.zeros((), dtype=torch.int64)}
    return state


def writer(segment: str, versions: int, numel: int) -> None:
    t = SharedMemoryTransport(segment, create=True)
    state = make_state(numel)
    t.publish(state, 0)
    print("published 0", flush=True)
    sys.stdin.readline()  # "go": the reader has seen version 0
    for v in range(1, versions):
        for x in state.values():
            x.fill_(v)
        t.publish(state, v)
    print("published all", flush=True)
    if sys.stdin.readline().strip() == "close":
        t.close()
    # otherwise exit without close(): the segment must still be unlinked at interpreter exit


def main(argv: list[str]) -> None:
    role, segment, versions, numel = argv
    if role != "writer":
        raise SystemExit(f"unknown role {role!r}; this peer only writes")
    writer(segment, int(versions), int(numel))


if __name__ == "__main__":
    main(sys.argv[1:])
