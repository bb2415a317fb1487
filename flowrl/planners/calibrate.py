"""Calibration: measure this machine's own figures (matmul FLOP/s, memory-copy bandwidth, operator overhead).

``measure()`` runs three micro-benchmarks on every core at once (one thread per core, as the local
backend runs colocation groups side by side; a device of the ``cpu`` preset is one core) and
keeps the median of several repeats: a run gets what a core delivers while its neighbours work
and while the rest of the machine does whatever it does, not what an idle core does at its best
moment (on a shared machine the two differ by 2-3x; ``statistic="best"`` gives the latter):

- matmul: ``C = A @ B`` on float32 ``n x n`` matrices; ``2 n^3 / seconds``;
- memory copy: ``dst.copy_(src)`` of a float32 buffer; ``bytes / seconds`` (one read and one
  write of each byte count once, as the estimates' "bytes read" do);
- operator overhead: a transformer-block-shaped chain of 16 operators (norms, linears, softmax,
  SiLU, residual adds) on 8-wide tensors, where the work is nil; seconds / 16 is the fixed cost of
  one operator as model code calls it (dispatch, allocation, Python, the GIL shared with the
  other threads), the planner's ``kernel_overhead_s``.

``calibrated_cluster(measurements)`` (pure) turns them into a ``ClusterSpec`` named
``cpu-calibrated``; ``flowrl calibrate -o cpu.json`` writes it and ``--cluster cpu.json`` reads it.

Example:
    >>> m = Measurements(matmul_flops=40e9, copy_bandwidth=6e9, op_overhead_s=4e-6, cores=2, memory_bytes=8 * 2**30)
    >>> calibrated_cluster(m).device.peak_flops
    40000000000.0
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import msgspec

from flowrl.errors import PlanError
from flowrl.planners.cluster import ClusterSpec, _host_cores, host_memory_bytes, cpu_device

__all__ = ["Measurements", "measure", "calibrated_cluster"]


class Measurements(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``measure`` found, per core, with every core busy.

    Attributes:
        matmul_flops: float32 matmul FLOP/s on one thread.
        copy_bandwidth: bytes/s of a large memory copy on one thread.
        op_overhead_s: seconds of one tiny operator (dispatch and launch, no work).
        cores: usable cores of this machine.
        memory_bytes: the machine's RAM.
        matmul_size: the n of the n x n matmul.
        copy_bytes: the size of the copied buffer.
        flops_by_width: ``(w, FLOP/s)`` of a ``[256 x w] @ [w x w]`` float32 matmul on one thread,
            every core busy, for ``w`` in ``WIDTHS`` (``DeviceSpec.flops_by_width``).
        thread_speedup: time of a transformer-block-shaped chain on ``[256 x 64]`` tensors with one
            intra-op thread over its time with ``cores`` threads, this process alone
            (``DeviceSpec.thread_speedup``).
        decode_step_overhead_s: seconds of one decode step of the built-in generator outside its
            transformer blocks, at one row (``DeviceSpec.decode_step_overhead_s``; ``_decode_overhead``).
    """

    matmul_flops: float
    copy_bandwidth: float
    op_overhead_s: float
    cores: int
    memory_bytes: int
    matmul_size: int = 256
    copy_bytes: int = 32 * 2**20
    flops_by_width: tuple[tuple[int, float], ...] = ()
    thread_speedup: float = 0.0
    decode_step_overhead_s: float = 0.0


def _timed(calls: list[Callable[[], object]], *, inner: int, repeats: int, statistic: str) -> float:
    """Seconds of one call while one thread per entry of ``calls`` runs its own at once:
    ``statistic`` (``"median"`` or ``"best"``) over ``repeats`` rounds of ``inner`` calls per thread."""
    times: list[float] = []
    for _ in range(repeats):
        start = threading.Barrier(len(calls))
        spent = [0.0] * len(calls)

        def work(i: int) -> None:
            start.wait()
            t0 = time.perf_counter()
            for _ in range(inner):
                calls[i]()
            spent[i] = (time.perf_counter() - t0) / inner

        pool = [threading.Thread(target=work, args=(i,)) for i in range(len(calls))]
        for th in pool:
            th.start()
        for th in pool:
            th.join()
        times.extend(spent)
    return min(times) if statistic == "best" else statistics.median(times)


#: Operators in ``_tiny_block``.
BLOCK_OPS = 16
#: Matmul widths ``flops_by_width`` measures (the built-in examples are 32-128 wide).
WIDTHS = (32, 64, 128, 256, 512)


def _tiny_block(rows: int = 4, width: int = 8) -> Callable[[], object]:
    """16 operators shaped like one transformer block's forward on ``[rows x width]`` tensors (the
    default: too small to do work)."""
    import torch as t
    import torch.nn.functional as F

    x, w = t.randn(rows, width), t.randn(width, width)

    def block() -> object:
        h = F.rms_norm(x, (width,))  # 1
        q, k, v = F.linear(h, w), F.linear(h, w), F.linear(h, w)  # 4
        a = t.softmax(q @ k.T, dim=-1)  # 6
        y = x + F.linear(a @ v, w)  # 9
        h2 = F.rms_norm(y, (width,))  # 10
        g = F.silu(F.linear(h2, w)) * F.linear(h2, w)  # 14
        return y + F.linear(g, w)  # 16

    return block


def _decode_overhead(repeats: int) -> float:
    """Seconds of one decode step of the built-in generator outside its blocks, at one row: with
    ``g(L, C)`` the median time to generate ``C`` tokens with ``L`` layers, a decode step costs
    ``d(L) = (g(L, 5) - g(L, 1)) / 4`` and its non-block part is ``2 d(1) - d(2)``."""
    import torch

    from flowrl.graph.configs import ModelConfig, SamplingConfig
    from flowrl.graph.nodes import GeneratorNode
    from flowrl.operators.generation import Generator

    prompt = {"prompt_ids": torch.tensor([[1, 4, 14, 3, 5]]), "prompt_lens": torch.tensor([5]), "prompt_index": torch.tensor([0])}

    def step_s(layers: int) -> float:
        model = ModelConfig(vocab_size=16, dim=64, n_layers=layers, n_heads=4, n_kv_heads=4, max_seq_len=32)
        gens = {}
        for tokens in (1, 5):  # stop_tokens=() : every row runs to max_new_tokens
            node = GeneratorNode(name="gen", model=model, sampling=SamplingConfig(n_samples=1, max_new_tokens=tokens, stop_tokens=(99,)))
            gens[tokens] = Generator(node, seed=0)
            gens[tokens].generate(prompt)
        g1 = _timed([lambda: gens[1].generate(prompt)], inner=20, repeats=repeats, statistic="median")
        g5 = _timed([lambda: gens[5].generate(prompt)], inner=20, repeats=repeats, statistic="median")
        return (g5 - g1) / 4

    return max(0.0, 2 * step_s(1) - step_s(2))


def measure(*, matmul_size: int = 256, copy_mib: int = 32, repeats: int = 5, statistic: str = "median") -> Measurements:
    """Run the micro-benchmarks (a few seconds) on every core at once, each thread with one intra-op
    thread; restores the thread count.

    Args:
        statistic: ``"median"`` (what a run gets, the default) or ``"best"`` (an idle core's peak).

    Raises:
        PlanError: for an unknown ``statistic``.
    """
    import torch

    if statistic not in ("median", "best"):
        raise PlanError(f"calibration statistic {statistic!r} is not one of median, best")
    cores = _host_cores()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = matmul_size

        def matmul_call() -> Callable[[], object]:
            a, b, out = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
            torch.matmul(a, b, out=out)  # warm up
            return lambda: torch.matmul(a, b, out=out)

        inner = max(1, int(2e8 // (2 * n**3)) or 1)
        t_mm = _timed([matmul_call() for _ in range(cores)], inner=inner, repeats=repeats, statistic=statistic)

        numel = copy_mib * 2**20 // 4

        def copy_call() -> Callable[[], object]:
            src, dst = torch.randn(numel), torch.empty(numel)
            dst.copy_(src)
            return lambda: dst.copy_(src)

        t_copy = _timed([copy_call() for _ in range(cores)], inner=2, repeats=repeats, statistic=statistic)
        blocks = [_tiny_block() for _ in range(cores)]
        for block in blocks:
            block()
        t_op = _timed(blocks, inner=200, repeats=repeats, statistic=statistic) / BLOCK_OPS

        by_width = []
        for width in WIDTHS:
            def width_call(width: int = width) -> Callable[[], object]:
                a, b, out = torch.randn(256, width), torch.randn(width, width), torch.empty(256, width)
                torch.matmul(a, b, out=out)
                return lambda: torch.matmul(a, b, out=out)

            t_w = _timed([width_call() for _ in range(cores)], inner=max(1, int(5e7 // (2 * 256 * width**2))), repeats=repeats, statistic=statistic)
            by_width.append((width, 2 * 256 * width**2 / t_w))

        block = _tiny_block(256, 64)
        block()
        t_one = _timed([block], inner=50, repeats=repeats, statistic=statistic)
        torch.set_num_threads(cores)
        for _ in range(20):  # start the intra-op thread pool
            block()
        t_all = _timed([block], inner=50, repeats=repeats, statistic=statistic)
        torch.set_num_threads(1)
        decode_s = _decode_overhead(repeats)
    finally:
        torch.set_num_threads(threads)
    return Measurements(
        matmul_flops=2 * n**3 / t_mm,
        copy_bandwidth=numel * 4 / t_copy,
        op_overhead_s=t_op,
        cores=cores,
        memory_bytes=host_memory_bytes(),
        matmul_size=n,
        copy_bytes=numel * 4,
        flops_by_width=tuple(by_width),
        thread_speedup=t_one / t_all,
        decode_step_overhead_s=decode_s,
    )


def calibrated_cluster(m: Measurements, *, cores: int | None = None) -> ClusterSpec:
    """A ``cpu`` cluster with measured figures: one host, one device per core (``cores`` of them, default all)."""
    n = cores or m.cores
    device = cpu_device(
        cores=m.cores,
        memory_bytes=m.memory_bytes // m.cores,
        peak_flops=m.matmul_flops,
        memory_bandwidth=m.copy_bandwidth,
        kernel_overhead_s=m.op_overhead_s,
        name="cpu",
        flops_by_width=m.flops_by_width,
        thread_speedup=m.thread_speedup,
        decode_step_overhead_s=m.decode_step_overhead_s,
    )
    return ClusterSpec(name="cpu-calibrated", hosts=1, devices_per_host=n, device=device)
