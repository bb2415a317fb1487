"""``flowrl.host``: the machine's figures, and freed memory given back to the system."""

from __future__ import annotations

import ctypes.util
import os
import platform

import pytest
import torch

from flowrl import host


def _rss_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(platform.system() != "Linux" or not ctypes.util.find_library("c"), reason="glibc's malloc_trim is Linux's")
def test_release_freed_memory_gives_the_heap_that_freed_tensors_left_back():
    """The pattern torch produces: a freed 256 KiB block raises glibc's mmap threshold, so the next
    ones come from the heap, where a small live tensor after each keeps the freed pages resident."""
    kib, mib = 1 << 10, 1 << 20
    first = torch.empty(256 * kib, dtype=torch.uint8)
    del first  # a freed mmapped block: glibc's threshold now above 256 KiB
    big, small = [], []
    for _ in range(512):
        big.append(torch.ones(256 * kib, dtype=torch.uint8))  # touched: resident
        small.append(torch.ones(64, dtype=torch.uint8))
    held = _rss_bytes()
    big.clear()  # 128 MiB freed behind live small blocks
    host.release_freed_memory()
    given_back = held - _rss_bytes()
    assert given_back > 64 * mib, f"only {given_back / mib:.1f} MiB of 128 given back"
    assert all(int(t.sum()) == 64 for t in small)  # what is live stays intact


def test_run_graph_releases_freed_memory_when_it_returns_or_fails(monkeypatch):
    from flowrl.errors import NodeExecutionError
    from flowrl.examples import build_example
    from flowrl.runtime.run import run_graph
    from tests.runtime.helpers import synthetic_config

    calls = []
    monkeypatch.setattr(host, "release_freed_memory", lambda: calls.append(1))
    graph = build_example("llamarl")
    run_graph(graph, synthetic_config(graph, steps=2, progress=False))
    assert calls == [1]
    with pytest.raises(NodeExecutionError):
        run_graph(graph, synthetic_config(graph, steps=4, progress=False, options={"fail_node": "policy", "fail_step": 1}))
    assert calls == [1, 1]


def test_host_figures_are_positive():
    assert host.host_memory_bytes() > 0 and host.host_cores() >= 1
