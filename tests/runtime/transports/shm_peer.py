"""A writer or reader process of a shared-memory weight edge, for the cross-process tests.

Run as ``python -m tests.runtime.transports.shm_peer {writer|reader} SEGMENT VERSIONS NUMEL``; it
talks to the test over stdin/stdout lines (see ``test_shm.py``). Every tensor of version v is filled
with v, so a reader can tell a torn state from a whole one.
"""

from __future__ import annotations

import json
import sys
import time

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


def reader(segment: str, versions: int, numel: int) -> None:
    t = SharedMemoryTransport(segment, create=False)
    print("ready", flush=True)
    target = make_state(numel)
    seen: list[int] = []
    torn: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = t.fetch_into(target)
        if got is None:
            time.sleep(0.001)
            continue
        bad = [k for k, x in target.items() if not bool((x == got).all())]
        if bad:
            torn.append(f"version {got}: {bad}")
            break
        if not seen:
            print("saw 0", flush=True)
        seen.append(got)
        if got == versions - 1:
            break
    t.close()
    print(json.dumps({"seen": seen, "torn": torn}), flush=True)


def main(argv: list[str]) -> None:
    role, segment, versions, numel = argv
    {"writer": writer, "reader": reader}[role](segment, int(versions), int(numel))


if __name__ == "__main__":
    main(sys.argv[1:])
