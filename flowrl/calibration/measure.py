"""Calibration: measure this machine's own figures as the local runtime meets them (pass rates, threads, overheads).

``measure()`` keeps the median of several repeats of each figure: a run gets what the machine
delivers while the rest of it does whatever it does, not its best moment (on a shared machine
the two differ by 2-3x; ``statistic="best"`` gives the latter). The first three run on every core
at once (one thread per core; a device of the ``cpu`` preset is one core); the model's passes run
on one thread, and what running beside another mesh costs is measured on its own:

- matmul: ``C = A @ B`` on float32 ``n x n`` matrices; ``2 n^3 / seconds``;
- memory copy: ``dst.copy_(src)`` of a float32 buffer; ``bytes / seconds`` (one read and one
  write of each byte count once, as the estimates' "bytes read" do);
- operator overhead: a transformer-block-shaped chain of 16 operators (norms, linears, softmax,
  SiLU, residual adds) on 8-wide tensors, where the work is nil; seconds / 16 is the fixed cost of
  one operator as model code calls it (dispatch, allocation, Python, the GIL shared with the
  other threads), the planner's ``kernel_overhead_s``;
- the built-in transformer's own passes by width (``_pass_rates``), one thread alone (how the local
  runtime runs a node with its cores to itself; ``shared_slowdown`` is what running beside another
  costs): for each ``w`` in ``WIDTHS`` (and the widths ``measure(widths=...)`` adds: a graph's model
  widths, ``flowrl.calibration.needs``), a 2-layer model of width ``w`` runs a forward on
  ``[r x 8]`` tokens (prefill-shaped), a forward of one token on ``r`` rows (decode-shaped) and a
  forward + backward on ``[r x 8]`` (training), ``r = pass_rows(w)``: 256 up to width 256, fewer
  above (the pass's FLOPs grow with the width, not its cube: a width-896 training pass takes about
  a second, not six); FLOP/s
  is the FLOPs the planner counts for that pass (``ModelSpec.forward_flops_per_token``, three times
  it for forward + backward) over the seconds it took. The rate so includes everything the pass
  really does beside its matmuls (norms, attention, SiLU, launches: on a CPU core at these widths
  matmuls are a third of a training step), so the estimates apply neither an MFU factor nor a
  launch term to it (``DeviceSpec.flops_by_width``);
- ``shared_slowdown``: how much slower a decode-shaped pass and the training pass run side by side,
  each on a core of its own, than alone (``_shared_slowdown``: a disaggregated generator and trainer
  in one process share its GIL, the memory system and whatever else the machine runs);
- ``thread_speedup`` / ``gen_thread_speedup``: the width-64 training pass (a generator's turn: 8
  decode-shaped passes) alone on one thread over its time with one intra-op thread per core when
  the two passes take turns on one thread with one intra-op thread per core (``_taking_turns``).
  That is how the local runtime runs a colocated mesh: its executors hand their steps to the
  group's one compute thread (``flowrl.runtime.control.compute_threads``: one OpenMP team per group, since
  libgomp stops spinning once the workers of several teams outnumber the cores), so a mesh gains
  what one thread's pass with all of them gains, shared with whatever else the machine runs;
- ``decode_step_overhead_s``: a decode step of the built-in generator outside its blocks (``_decode_overhead``);
- ``slot_row_overhead_s``: what the continuous generator's slot batcher spends per busy row per
  decode step beyond lock step (``_slot_row_overhead``).

``calibrated_cluster(measurements)`` (pure) turns them into a ``ClusterSpec`` named
``cpu-calibrated``; ``flowrl calibrate -o cpu.json`` writes it and ``--cluster cpu.json`` reads it.

Example:
    >>> m = Measurements(matmul_flops=40e9, copy_bandwidth=6e9, op_overhead_s=4e-6, cores=2, memory_bytes=8 * 2**30)
    >>> calibrated_cluster(m).device.peak_flops
    40000000000.0
"""

from __future__ import annotations

import functools
import math
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from flowrl.errors import PlanError
from flowrl.host import host_cores, host_memory_bytes
from flowrl.planners.cluster import ClusterSpec, CpuTerms, cpu_device
from flowrl.modelspec import ModelSpec

__all__ = ["Measurements", "measure", "calibrated_cluster", "pass_flops", "pass_rows", "PASSES", "WIDTHS"]


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
        cpu: the :class:`~flowrl.planners.cluster.CpuTerms` measured: the pass rates by width
            (``_pass_rates``: the built-in transformer's forward, one-token forward and forward +
            backward at each of ``WIDTHS`` on one thread alone); ``thread_speedup`` and
            ``gen_thread_speedup`` (time of the width-64 training pass, and of 8 decode-shaped
            passes, on one thread alone over its time with ``cores`` intra-op threads, the two
            taking turns on one compute thread); ``shared_slowdown`` (``_shared_slowdown``);
            ``slot_row_overhead_s`` (``_slot_row_overhead``); ``decode_rows_fraction`` (``_decode_rows``,
            at the widest width measured); ``adamw_s_per_param`` (``_adamw_step``); ``decode_step_overhead_s`` (one
            decode step of the built-in generator outside its blocks, ``_decode_overhead``).
    """

    matmul_flops: float
    copy_bandwidth: float
    op_overhead_s: float
    cores: int
    memory_bytes: int
    matmul_size: int = 256
    copy_bytes: int = 32 * 2**20
    cpu: CpuTerms = msgspec.field(default_factory=lambda: CpuTerms())


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
#: Model widths the pass rates are measured at (the built-in examples are 64 wide; a CPU core
#: trains a 512-wide model too slowly to be worth a calibration second, the table's last rate holds above).
WIDTHS = (32, 64, 128, 256)
#: Rows and tokens per row of the prefill-shaped and training passes (decode: one token per row)
#: up to width ``WIDTHS[-1]``; above it ``pass_rows``.
PASS_ROWS, PASS_TOKENS = 256, 8


def pass_rows(width: int) -> int:
    """Rows of a calibration pass at ``width``: ``PASS_ROWS`` up to ``WIDTHS[-1]``, then fewer in
    proportion (at least 32), so that a pass's FLOPs grow linearly above it, not as the cube.

    Example:
        >>> pass_rows(64), pass_rows(896), pass_rows(8192)
        (256, 73, 32)
    """
    return PASS_ROWS if width <= WIDTHS[-1] else max(32, PASS_ROWS * WIDTHS[-1] // width)


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


#: The passes ``_pass_rates`` times: (rows, tokens per row, forward + backward).
PASSES = {"forward": (PASS_ROWS, PASS_TOKENS, False), "decode": (PASS_ROWS, 1, False), "train": (PASS_ROWS, PASS_TOKENS, True)}


def _pass_model(width: int) -> tuple[Any, ModelSpec]:
    """The built-in 2-layer transformer of width ``width`` (16-wide heads) and its planner spec."""
    from flowrl.graph.configs import ModelConfig
    from flowrl.models import build_model
    from flowrl.modelspec import model_from_config

    heads = max(1, width // 16)
    config = ModelConfig(vocab_size=16, dim=width, n_layers=2, n_heads=heads, n_kv_heads=heads, max_seq_len=2 * PASS_TOKENS)
    return build_model(config), model_from_config(config)


def _pass_call(width: int, kind: str, rows: int | None = None) -> Callable[[], object]:
    """One ``PASSES[kind]`` pass of a fresh width-``width`` model on ``rows`` rows (default
    ``pass_rows(width)``), warmed up."""
    import torch

    model, _ = _pass_model(width)
    _, tokens, backward = PASSES[kind]
    rows = rows or pass_rows(width)
    x = torch.randint(0, 16, (rows, tokens))
    valid = torch.ones_like(x, dtype=torch.bool)

    def call() -> object:
        if backward:
            model(x, valid=valid).float().sum().backward()
            return None
        with torch.no_grad():
            return model(x, valid=valid)

    call()
    return call


def pass_flops(width: int, kind: str) -> float:
    """FLOPs the planner counts for one ``PASSES[kind]`` pass at ``width``, ``pass_rows(width)`` rows
    (``ModelSpec.forward_flops_per_token`` at the mean context, three times it with the backward).

    Example:
        >>> round(pass_flops(64, "train") / pass_flops(64, "forward"), 6)
        3.0
    """
    _, spec = _pass_model(width)
    _, tokens, backward = PASSES[kind]
    return pass_rows(width) * tokens * spec.forward_flops_per_token(tokens / 2) * (3 if backward else 1)


#: Rows of the decode passes ``_decode_rows`` times beside the table's (a generator's batch on a CPU).
DECODE_ROWS = (1, 4, 16)


def _decode_rows(width: int, *, repeats: int, statistic: str) -> tuple[tuple[int, float], ...]:
    """``CpuTerms.decode_rows_fraction`` at ``width``: the decode pass's FLOP/s on each of
    ``DECODE_ROWS`` rows (those below ``pass_rows(width)``) over its rate on ``pass_rows(width)``, one
    thread, the passes taking turns so that each sees the machine's load alike."""
    full = pass_rows(width)
    rows = [r for r in DECODE_ROWS if r < full] + [full]
    calls = {r: _pass_call(width, "decode", r) for r in rows}
    seconds: dict[int, list[float]] = {r: [] for r in rows}
    for _ in range(repeats):
        for r, call in calls.items():
            seconds[r].append(_timed([call], inner=3, repeats=1, statistic=statistic))
    pick = min if statistic == "best" else statistics.median
    per_row = {r: pick(seconds[r]) / r for r in rows}  # seconds per row: FLOPs are proportional to rows
    return tuple((r, per_row[full] / per_row[r]) for r in rows[:-1])


def _pass_rates(widths: tuple[int, ...], *, repeats: int, statistic: str) -> dict[str, tuple[tuple[int, float], ...]]:
    """``{pass: ((width, FLOP/s), ...)}`` for every pass of ``PASSES`` and width of ``widths``
    (ascending), one thread alone. The repeats go round every (pass, width) in turn, so each one's
    statistic spans the whole measurement rather than one moment of a shared machine's load."""
    calls = {(kind, width): _pass_call(width, kind) for kind in PASSES for width in widths}
    seconds: dict[tuple[str, int], list[float]] = {key: [] for key in calls}
    for _ in range(repeats):
        for key, call in calls.items():
            seconds[key].append(_timed([call], inner=1, repeats=1, statistic=statistic))
    pick = min if statistic == "best" else statistics.median
    return {kind: tuple((width, pass_flops(width, kind) / pick(seconds[(kind, width)])) for width in widths) for kind in PASSES}


def _shared_slowdown(decode: Callable[[], object], train: Callable[[], object], *, cores: int, repeats: int, statistic: str) -> float:
    """How much slower a generator's and a trainer's passes run side by side, each on its own core
    with one intra-op thread (a disaggregated placement in one process), than each alone: the
    geometric mean of the decode pass's and the training pass's ratio; 1 on one core."""
    if cores < 2:
        return 1.0
    decode_alone = _timed([decode], inner=8, repeats=repeats, statistic=statistic)
    train_alone = _timed([train], inner=2, repeats=repeats, statistic=statistic)
    stop = threading.Event()
    done: list[float] = []

    def generate() -> None:  # decode passes for as long as the trainer runs
        while not stop.is_set():
            t0 = time.perf_counter()
            decode()
            done.append(time.perf_counter() - t0)

    side = threading.Thread(target=generate)
    side.start()
    try:
        train_side = _timed([train], inner=2, repeats=repeats, statistic=statistic)
    finally:
        stop.set()
        side.join()
    decode_side = (min if statistic == "best" else statistics.median)(done[1:] or done)
    return max(1.0, math.sqrt(decode_side / decode_alone * train_side / train_alone))


def _generation_like(decode: Callable[[], object], steps: int = 8) -> Callable[[], object]:
    """``steps`` decode-shaped passes in a row: a generator's turn."""

    def generate() -> object:
        for _ in range(steps):
            decode()
        return None

    return generate


def _taking_turns(calls: list[Callable[[], object]], *, rounds: int, statistic: str) -> list[float]:
    """Seconds of one call of each of ``calls`` when they take turns on one compute thread with the
    caller's intra-op threads, as colocated executors' steps do (``runtime.control.compute_threads``),
    ``rounds`` turns each; the first round is warm-up."""
    import torch

    from flowrl.runtime.control.compute_threads import ComputeThread

    times: list[list[float]] = [[] for _ in calls]

    def timed(call: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0

    runner = ComputeThread("flowrl-calibrate", intra_op_threads=torch.get_num_threads())
    try:
        for r in range(rounds + 1):
            for i, call in enumerate(calls):
                seconds = runner.call(functools.partial(timed, call))
                if r:
                    times[i].append(seconds)
    finally:
        runner.close()
    return [min(t) if statistic == "best" else statistics.median(t) for t in times]


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


#: Parameters of ``_adamw_step``'s model: 8 tensors of 2M float32 (each state as large as the caches'
#: several times over, as a real policy's are).
ADAMW_TENSORS, ADAMW_NUMEL = 8, 2**21


def _adamw_step(repeats: int, statistic: str) -> float:
    """Seconds per parameter of ``torch.optim.AdamW.step`` on one thread, as the trainer builds it
    (its defaults: on a CPU torch takes the per-parameter loop), over ``ADAMW_TENSORS`` tensors of
    ``ADAMW_NUMEL`` float32 with gradients: ``CpuTerms.adamw_s_per_param``."""
    import torch

    params = [torch.nn.Parameter(torch.randn(ADAMW_NUMEL)) for _ in range(ADAMW_TENSORS)]
    for p in params:
        p.grad = torch.randn(ADAMW_NUMEL)
    opt = torch.optim.AdamW(params, lr=1e-4)
    opt.step()  # the states are made on the first step
    seconds = _timed([opt.step], inner=2, repeats=repeats, statistic=statistic)
    return seconds / (ADAMW_TENSORS * ADAMW_NUMEL)


def _slot_row_overhead(repeats: int, *, rows: int = 64, tokens: int = 8) -> float:
    """Seconds per busy row per decode step that flowrl's slot batcher spends beyond lock step: the
    same ``rows`` samples of ``tokens`` tokens (no stop token, no refill) drawn by a ``SlotBatcher``
    and by ``Generator.generate``, the difference over ``rows * tokens``."""
    import torch

    from flowrl.graph.configs import ModelConfig, SamplingConfig
    from flowrl.graph.nodes import GeneratorNode
    from flowrl.operators.generation import Generator
    from flowrl.operators.slots import Sample, SlotBatcher

    model = ModelConfig(vocab_size=16, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, max_seq_len=16)
    node = GeneratorNode(name="gen", model=model, sampling=SamplingConfig(n_samples=1, max_new_tokens=tokens, stop_tokens=(99,)))
    gen = Generator(node, seed=0)
    prompt = [1, 4, 14, 3, 5]
    batch = {"prompt_ids": torch.tensor([prompt] * rows), "prompt_lens": torch.tensor([len(prompt)] * rows)}

    def slots() -> None:
        batcher = SlotBatcher(gen, slots=rows, rng=torch.Generator().manual_seed(0))
        for i in range(rows):
            batcher.add(Sample(key=(i, 0), prompt=prompt))
        while batcher.busy or batcher.waiting:
            batcher.step()

    slots()
    gen.generate(batch)
    t_slots = _timed([slots], inner=3, repeats=repeats, statistic="median")
    t_lock = _timed([lambda: gen.generate(batch)], inner=3, repeats=repeats, statistic="median")
    return max(0.0, (t_slots - t_lock) / (rows * tokens))


def measure(
    *, matmul_size: int = 256, copy_mib: int = 32, repeats: int = 5, statistic: str = "median", widths: tuple[int, ...] = ()
) -> Measurements:
    """Run the micro-benchmarks (a few seconds) on every core at once, each thread with one intra-op
    thread; restores the thread count.

    Args:
        statistic: ``"median"`` (what a run gets, the default) or ``"best"`` (an idle core's peak).
        widths: model widths whose pass rates to measure beside ``WIDTHS`` (a graph's models':
            ``flowrl.calibration.needs.calibration_needs``); a wider model than the table's last
            width takes that width's rate, which under-rates it (a width-896 training pass runs
            ~1.2x the rate of a width-256 one).

    Raises:
        PlanError: for an unknown ``statistic`` or a width below 16.
    """
    import torch

    if statistic not in ("median", "best"):
        raise PlanError(f"calibration statistic {statistic!r} is not one of median, best")
    if any(not isinstance(w, int) or w < 16 for w in widths):
        raise PlanError(f"calibration widths {list(widths)}: each must be an integer >= 16 (a model's hidden size)")
    table_widths = tuple(sorted({*WIDTHS, *widths}))
    cores = host_cores()
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

        rates = _pass_rates(table_widths, repeats=repeats, statistic=statistic)
        decode_rows = _decode_rows(table_widths[-1], repeats=repeats, statistic=statistic)
        train_64, decode_64 = _pass_call(64, "train"), _pass_call(64, "decode")
        t_one = _timed([train_64], inner=2, repeats=repeats, statistic=statistic)
        shared = _shared_slowdown(decode_64, train_64, cores=cores, repeats=repeats, statistic=statistic)
        generate_64 = _generation_like(decode_64)
        t_gen_one = _timed([generate_64], inner=1, repeats=repeats, statistic=statistic)
        torch.set_num_threads(cores)
        t_gen_all, t_all = _taking_turns([generate_64, train_64], rounds=4 * repeats, statistic=statistic)
        torch.set_num_threads(1)
        decode_s = _decode_overhead(repeats)
        slot_s = _slot_row_overhead(repeats)
        adamw_s = _adamw_step(repeats, statistic)
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
        cpu=CpuTerms(
            flops_by_width=rates["forward"],
            decode_flops_by_width=rates["decode"],
            decode_rows_fraction=decode_rows,
            train_flops_by_width=rates["train"],
            thread_speedup=t_one / t_all,
            gen_thread_speedup=t_gen_one / t_gen_all,
            shared_slowdown=shared,
            decode_step_overhead_s=decode_s,
            slot_row_overhead_s=slot_s,
            adamw_s_per_param=adamw_s,
        ),
    )


def calibrated_cluster(m: Measurements, *, cores: int | None = None) -> ClusterSpec:
    """A ``cpu`` cluster with measured figures: one host, one device per core (``cores`` of them,
    default all; more than the machine's cores are ranks sharing them: ``CpuTerms.host_cores``)."""
    n = cores or m.cores
    device = cpu_device(
        cores=m.cores,
        memory_bytes=m.memory_bytes // m.cores,
        peak_flops=m.matmul_flops,
        memory_bandwidth=m.copy_bandwidth,
        kernel_overhead_s=m.op_overhead_s,
        name="cpu",
        cpu=msgspec.structs.replace(m.cpu, host_cores=m.cores),
    )
    return ClusterSpec(name="cpu-calibrated", hosts=1, devices_per_host=n, device=device)
