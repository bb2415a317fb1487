"""Cluster specs: hosts x devices per host, each device's memory, FLOP/s and bandwidths; presets and parsing.

A cluster is ``hosts`` hosts of ``devices_per_host`` identical devices. Device ids run host by
host: device ``d`` lives on host ``d // devices_per_host``. Every figure is per device:

- ``memory_bytes``: memory one device holds (HBM on a GPU; on the ``cpu`` preset, the host's RAM
  divided by its cores, since there a device is one core);
- ``peak_flops``: dense FLOP/s at the compute dtype (bf16 on GPUs, float32 on CPU);
  ``peak_flops_8bit``: the same for 8-bit weights (FP8 on H100/H200; 0 = not supported);
- ``memory_bandwidth``: bytes/s between the device and its own memory;
- ``intra_host_bandwidth`` / ``inter_host_bandwidth``: bytes/s one device can send in one
  direction to another device on the same host (NVLink) / on another host (its NIC share);
- ``host_bandwidth``: bytes/s one device moves to or from host memory (PCIe; offloading; 0 = none);
- ``kernel_overhead_s``: fixed cost of launching one operator (dominant for tiny models on CPU).

String forms (``parse_cluster``)::

    1024xH100       1024 H100s, 8 per host (128 hosts)
    128x8xH100      128 hosts x 8 H100s
    4xA100          one host with 4 A100s
    cpu             this machine, one device per core (uncalibrated defaults)
    cpu:4           this machine's figures, 4 cores
    my_cluster.json / my_cluster.toml   a ClusterSpec file (e.g. from ``flowrl calibrate -o cpu.json``)

Example:
    >>> c = parse_cluster("128x8xH100")
    >>> c.n_devices, c.device.name
    (1024, 'H100')
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Literal

import msgspec

from flowrl.errors import PlanError
from flowrl.fileio import decode_errors
from flowrl.host import host_cores, host_memory_bytes

__all__ = [
    "CpuTerms",
    "DeviceKind",
    "DEVICE_TRAITS",
    "DeviceSpec",
    "ClusterSpec",
    "DEVICE_PRESETS",
    "CLUSTER_FORMS",
    "parse_cluster",
    "cpu_device",
    "cpu_cluster",
    "load_cluster_file",
    "cluster_to_json",
    "MAX_DEVICES",
]


#: Most devices a cluster may have: plans list every device id of every mesh, and the search
#: compares them, so a cluster of millions of devices would take minutes and gigabytes to plan
#: (131072 devices, 16384 hosts of 8, plan in about 20 s). The largest RL jobs use a few thousand.
MAX_DEVICES = 2**17


class DeviceKind(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a kind of device is (``DeviceSpec.kind``): the facts the planner's estimates, a plan's
    placement and the check of a plan against this machine read, instead of the kind's name.

    Attributes:
        label: how messages name it (``"GPU"``).
        cuda: its devices are CUDA GPUs: a plan for it runs only where torch sees them.
        pinned: a device is one core of the host: the runtime pins each node to its cores
            (``Placement.pin``), and its memory is the host's, so a memory transport's copies are priced
            at its memory bandwidth.
        tensor_cores: matrix units with 16-bit activations and KV cache; float32 math runs as TF32 at
            half the 16-bit rate.
        cross_step_slots: continuous batching's free slots take the next step's prompts by default.
        packs_sequences: a trainer whose policy says ``packing=False`` is still priced packed (GPU:
            as production trainers run; the default ``packing`` packs on every kind).
    """

    label: str
    cuda: bool = False
    pinned: bool = False
    tensor_cores: bool = False
    cross_step_slots: bool = False
    packs_sequences: bool = False


#: Every kind of device, by ``DeviceSpec.kind``.
DEVICE_TRAITS: dict[str, DeviceKind] = {
    "gpu": DeviceKind(label="GPU", cuda=True, tensor_cores=True, cross_step_slots=True, packs_sequences=True),
    "cpu": DeviceKind(label="CPU", pinned=True),
}

CLUSTER_FORMS = (
    "CLUSTER is one of: 'NxDEVICE' (e.g. '1024xH100': N devices, 8 per host), 'HxDxDEVICE' "
    "(e.g. '128x8xH100': H hosts of D devices), 'cpu' (this machine, one device per core), "
    "'cpu:N' (N cores of this machine), or a .json/.toml ClusterSpec file (e.g. written by "
    "'flowrl calibrate -o cpu.json'). DEVICE is one of: " + ", ".join(("H100", "H200", "A100")) + "."
)


class CpuTerms(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``flowrl calibrate`` measures of a CPU besides its peak rates: how flowrl's own passes and
    executors run there (``DeviceSpec.cpu``; ``calibrate.Measurements.cpu``). The defaults measure nothing.
    Its rates (``vllm_sync_bandwidth``, ``gloo_by_bytes``) price CPU ranks only: a GPU cluster's
    syncs and collectives are priced with its ``DeviceSpec``'s links (``planners.estimate.rates``).

    Attributes:
        flops_by_width: ``(width, FLOP/s)`` pairs, widths ascending: what the built-in transformer's
            forward pass reaches on one device at width ``w`` (prefill-shaped: 256 rows of 8 tokens),
            FLOPs counted as ``ModelSpec.forward_flops_per_token`` counts them (measured by ``flowrl
            calibrate``). It is what the machine achieves on the whole pass (norms, attention, launches
            included), so an estimate that uses it applies no MFU factor and no launch term. A model
            of width ``h`` computes at the rate interpolated at ``h`` (``flops_at``); empty (GPU
            presets): ``peak_flops`` x the ``Tuning`` MFU, plus launches.
        decode_flops_by_width: the same for a decode-shaped pass (one token on each of 256 rows);
            empty: ``flops_by_width``.
        decode_rows_fraction: ``(rows, fraction)`` pairs, rows ascending: the decode pass's rate on
            ``rows`` rows over its rate on the table's rows (``calibration.measure.pass_rows``), at the
            widest calibrated width (``flowrl calibrate``: ``_decode_rows``). A decode step of few rows
            streams every weight for little arithmetic, and on a CPU core that streaming is not hidden
            behind the matmuls: 8 rows of a width-896 model decoded at ~0.4 of 73 rows' rate on this
            project's CPU. A generator of ``b`` rows decodes at the rate times the fraction
            interpolated at ``b`` (``DeviceSpec.decode_rows_factor``; 1 from the table's last rows
            up); empty: 1 (the roofline's memory term alone).
        train_flops_by_width: the same for forward + backward (three times the forward FLOPs);
            empty: ``flops_by_width``.
        thread_speedup: how much faster one process runs the built-in model's training pass with
            every core of the host as intra-op threads than with one (measured by ``flowrl
            calibrate``; below 1 when the machine's other load stalls one of the threads). When > 0,
            a mesh of ``n`` such devices is one replica sped up ``1 + (thread_speedup - 1) * (n - 1)
            / (devices_per_host - 1)`` times (the local runtime runs a CPU mesh as one process with
            ``n`` threads), not ``n`` data-parallel replicas, and the search gives it no tensor or
            pipeline split (there is none to run); 0 (GPU presets): ``n`` replicas.
        gen_thread_speedup: the same for a generator's decode passes (many small operators, which
            gain less from threads and lose more to the other executor's spinning OpenMP workers);
            0: ``thread_speedup``.
        shared_slowdown: how much slower two meshes of one host run while both are busy than each
            alone (>= 1; measured by ``flowrl calibrate``: a generator's and a trainer's pass side by
            side in one process, each on its own core); the asynchronous schedule applies it while
            they overlap (``schedule.shared_step_s``). 1: no slowdown (GPU presets: separate devices).
        decode_step_overhead_s: fixed seconds of one decode step outside the transformer blocks
            (embedding, output head, sampling: softmax, random draws, Gumbel argmax, stop checks,
            the Python loop), measured by ``flowrl calibrate`` on the built-in generator; 0: not modelled.
        slot_row_overhead_s: seconds a continuous generator spends per busy row per decode step
            outside the forward (flowrl's slot batcher: each row's token, log-prob and version
            recorded, its stop checked, its slot freed or fed), measured by ``flowrl calibrate``; 0:
            not modelled.
        train_step_overhead_s: fixed seconds of one optimizer step besides the blocks' passes (loss,
            backward bookkeeping), set by hand in a cluster file; 0 (what ``flowrl calibrate``
            writes: the built-in trainer's step is its passes plus the ``optimizer`` term within a
            millisecond): the ``optimizer`` term only.
        vllm_decode_speedup: how many times the built-in engine's decode rate on one core vLLM's CPU
            build decodes at, as the runtime starts it for a one-device generator (measured by
            ``flowrl calibrate --vllm``: ``flowrl.calibration.vllm_rates``); 0: not measured
            (``Tuning.vllm_cpu_decode_speedup``'s default).
        vllm_sync_bandwidth: bytes/s of the last hop of a sync into a vLLM generator (the weight-sync
            group's broadcast and vLLM's reload, ``flowrl.operators.engines.vllm_sync``), measured by
            ``flowrl calibrate --vllm``; 0: not measured (``Tuning.vllm_group_bandwidth``'s default).
        gloo_by_bytes: ``(bytes, bytes/s)`` pairs, sizes ascending: the rate of a gloo all-gather or
            reduce-scatter of a tensor of that many bytes between two processes of the host (loopback
            TCP), in ``estimate.common.all_gather_s``'s terms, the slower of the two at each size
            (``flowrl.calibration.gloo_rate``; ``flowrl calibrate --gloo``, or ``--graph`` of a graph
            with an FSDP2 policy): what an FSDP2 policy's collectives run at on CPU ranks. The rate
            falls with the size (on this project's 2-core CPU a 64 MiB gather ran at a fifth of a
            16 MiB one), so a collective of ``n`` bytes takes the rate interpolated at ``n``
            (``gloo_rate``); empty: not measured (``tuning.GLOO_BANDWIDTH``).
        gloo_all_reduce_by_bytes: ``(bytes, bytes/s)`` pairs, sizes ascending: gloo's all-reduce of a
            tensor of that many bytes between two processes of the host, in ``estimate.common.all_reduce_s``'
            terms (``2 * (n - 1) / n * bytes / bandwidth``, n = 2), measured at activations' sizes (16 KiB
            to 4 MiB): what a tensor-parallel policy's all-reduces of ``[tokens, hidden]`` run at on CPU
            ranks (``estimate.cpu_ranks``); empty: ``gloo_by_bytes``' rate (on this project's CPU 2-4
            times slower at these sizes: gloo's reduce-scatter is its slow half).
        gloo_send_by_bytes: the same for one ``send`` of that many bytes (``bytes / bandwidth``): a
            pipeline stage's activations and their gradients; empty: ``gloo_by_bytes``' rate.
        gloo_all_to_all_by_bytes: the same for an ``all_to_all_single`` of that many bytes per rank, in
            ``estimate.common.all_to_all_s``' terms (``(n - 1) / n * bytes / bandwidth``, n = 2): an
            expert-parallel policy's tokens to their experts' ranks and back (``estimate.train``);
            empty: ``gloo_by_bytes``' rate.
        adamw_s_per_param: seconds per parameter of one AdamW step on one thread (``flowrl calibrate``:
            ``torch.optim.AdamW.step`` over 16M float32 parameters; on a CPU torch steps each tensor in
            its own loop of elementwise passes, several times the bytes of the parameters, gradients
            and two moments that the memory-bandwidth term counts). When > 0 a CPU rank's optimizer
            step is its stepped parameters times it (``estimate.train``); 0: the bandwidth term.
        tp_train_efficiency: how well a CPU rank of a tp = 2 policy runs its training pass: the
            planner's terms for it (half the whole pass at the one-core rate, plus its all-reduces at
            gloo's rates) over the pass measured through the trainer's own tensor parallelism
            (``flowrl.calibration.rank_passes``, ``flowrl calibrate --gloo``): narrower matmuls,
            DTensor's dispatch and the ranks waiting for each other, which are no FLOP or byte. A tp
            rank's compute term is divided by it (``estimate.cpu_ranks``); 0: not measured (1).
        tp_decode_efficiency: the same for the built-in generator's tp decode step (8 rows).
        pp_train_efficiency: the same for a 2-stage 1F1B schedule against its terms (compute, bubble,
            sends): a pipeline stage's compute term is divided by it.
        host_cores: the host's cores when its devices (ranks) may outnumber them (``flowrl
            calibrate`` writes the cores it measured; ``calibrated_cluster(m, cores=n)`` with n
            above them is that many ranks on fewer cores): meshes busy together on more devices
            than this time-share the cores (``schedule.shared_step_s``); 0: a core per device.
    """

    flops_by_width: tuple[tuple[int, float], ...] = ()
    decode_flops_by_width: tuple[tuple[int, float], ...] = ()
    decode_rows_fraction: tuple[tuple[int, float], ...] = ()
    train_flops_by_width: tuple[tuple[int, float], ...] = ()
    thread_speedup: float = 0.0
    gen_thread_speedup: float = 0.0
    shared_slowdown: float = 1.0
    decode_step_overhead_s: float = 0.0
    slot_row_overhead_s: float = 0.0
    train_step_overhead_s: float = 0.0
    vllm_decode_speedup: float = 0.0
    vllm_sync_bandwidth: float = 0.0
    gloo_by_bytes: tuple[tuple[int, float], ...] = ()
    gloo_all_reduce_by_bytes: tuple[tuple[int, float], ...] = ()
    gloo_send_by_bytes: tuple[tuple[int, float], ...] = ()
    gloo_all_to_all_by_bytes: tuple[tuple[int, float], ...] = ()
    adamw_s_per_param: float = 0.0
    tp_train_efficiency: float = 0.0
    tp_decode_efficiency: float = 0.0
    pp_train_efficiency: float = 0.0
    host_cores: int = 0

    def __post_init__(self) -> None:
        for field in ("thread_speedup", "gen_thread_speedup", "decode_step_overhead_s", "slot_row_overhead_s", "train_step_overhead_s", "vllm_decode_speedup", "vllm_sync_bandwidth", "adamw_s_per_param"):
            value = getattr(self, field)
            if not (value >= 0 and value < float("inf")):
                raise PlanError(f"CpuTerms: {field}={value} must be a finite number >= 0")
        if not (isinstance(self.host_cores, int) and self.host_cores >= 0):
            raise PlanError(f"CpuTerms: host_cores={self.host_cores!r} must be an integer >= 0 (0: a core per device)")
        if not 1 <= self.shared_slowdown < float("inf"):
            raise PlanError(f"CpuTerms: shared_slowdown={self.shared_slowdown} must be a finite number >= 1")
        for field in ("flops_by_width", "decode_flops_by_width", "train_flops_by_width"):
            table = getattr(self, field)
            widths = [w for w, _ in table]
            if widths != sorted(set(widths)) or any(w < 1 or not 0 < f < float("inf") for w, f in table):
                raise PlanError(
                    f"CpuTerms: {field}={table} must be (width >= 1, FLOP/s > 0) pairs, widths strictly ascending"
                )
        for field in ("gloo_by_bytes", "gloo_all_reduce_by_bytes", "gloo_send_by_bytes", "gloo_all_to_all_by_bytes"):
            table = getattr(self, field)
            sizes = [n for n, _ in table]
            if sizes != sorted(set(sizes)) or any(n < 1 or not 0 < r < float("inf") for n, r in table):
                raise PlanError(f"CpuTerms: {field}={table} must be (bytes >= 1, bytes/s > 0) pairs, sizes strictly ascending")
        for field in ("tp_train_efficiency", "tp_decode_efficiency", "pp_train_efficiency"):
            if not 0 <= getattr(self, field) <= 4:
                raise PlanError(f"CpuTerms: {field}={getattr(self, field)} must be in [0, 4] (0: not measured)")
        rows = [r for r, _ in self.decode_rows_fraction]
        if rows != sorted(set(rows)) or any(r < 1 or not 0 < f <= 4 for r, f in self.decode_rows_fraction):
            raise PlanError(f"CpuTerms: decode_rows_fraction={self.decode_rows_fraction} must be (rows >= 1, 0 < fraction <= 4) pairs, rows strictly ascending")

    def gloo_rate(self, nbytes: float) -> float | None:
        """The measured gloo rate (bytes/s) of a collective of ``nbytes``: ``gloo_by_bytes`` interpolated
        linearly in log(bytes), clamped to its ends; None when not measured.

        Example:
            >>> t = CpuTerms(gloo_by_bytes=((2**24, 0.4e9), (2**26, 0.1e9)))
            >>> [round(t.gloo_rate(n) / 1e9, 3) for n in (2**20, 2**25, 2**30)], CpuTerms().gloo_rate(2**20)
            ([0.4, 0.25, 0.1], None)
        """
        return _by_bytes(self.gloo_by_bytes, nbytes)

    def gloo_all_reduce_rate(self, nbytes: float) -> float | None:
        """``gloo_all_reduce_by_bytes`` at ``nbytes``, as ``gloo_rate`` reads its table; None when not measured."""
        return _by_bytes(self.gloo_all_reduce_by_bytes, nbytes)

    def gloo_send_rate(self, nbytes: float) -> float | None:
        """``gloo_send_by_bytes`` at ``nbytes``, as ``gloo_rate`` reads its table; None when not measured."""
        return _by_bytes(self.gloo_send_by_bytes, nbytes)

    def gloo_all_to_all_rate(self, nbytes: float) -> float | None:
        """``gloo_all_to_all_by_bytes`` at ``nbytes``, as ``gloo_rate`` reads its table; None when not measured."""
        return _by_bytes(self.gloo_all_to_all_by_bytes, nbytes)


def _by_bytes(table: tuple[tuple[int, float], ...], nbytes: float) -> float | None:
    """A ``(bytes, bytes/s)`` table at ``nbytes``: interpolated linearly in log(bytes), clamped to its ends."""
    if not table:
        return None
    if nbytes <= table[0][0]:
        return table[0][1]
    if nbytes >= table[-1][0]:
        return table[-1][1]
    (n0, r0), (n1, r1) = next((a, b) for a, b in zip(table, table[1:]) if a[0] <= nbytes <= b[0])
    return r0 + (r1 - r0) * math.log(nbytes / n0) / math.log(n1 / n0)


class DeviceSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One device's figures (see the module docstring for units).

    Attributes:
        name: short name used in cluster strings (``"H100"``, ``"cpu"``).
        kind: ``"gpu"`` or ``"cpu"``; on ``"cpu"`` a device is one core and the runtime pins to it.
        memory_bytes: device memory.
        peak_flops: dense FLOP/s at ``compute_dtype``.
        peak_flops_8bit: dense FLOP/s with 8-bit weights and activations; 0 when unsupported.
        memory_bandwidth: device-memory bytes/s.
        intra_host_bandwidth: bytes/s per device per direction to a device on the same host.
        inter_host_bandwidth: bytes/s per device per direction to a device on another host.
        intra_host_latency_s: fixed cost of one step (hop) of a collective among devices of one host.
        inter_host_latency_s: fixed cost of one step (hop) of a collective that crosses hosts.
        kernel_overhead_s: fixed cost of one operator launch.
        host_bandwidth: bytes/s per device per direction to host memory (PCIe); 0: the planner
            never offloads to the host.
        compute_dtype: the dtype ``peak_flops`` refers to, and the trainer's parameter dtype.
        default_devices_per_host: devices per host assumed by the ``NxDEVICE`` form.
        cpu: what ``flowrl calibrate`` measured of a CPU (:class:`CpuTerms`); its defaults (a GPU
            preset, or an uncalibrated CPU) measure nothing and change no estimate.
    """

    name: str
    kind: Literal["gpu", "cpu"] = "gpu"
    memory_bytes: int
    peak_flops: float
    peak_flops_8bit: float = 0.0
    memory_bandwidth: float
    intra_host_bandwidth: float
    inter_host_bandwidth: float
    intra_host_latency_s: float = 2e-6
    inter_host_latency_s: float = 5e-6
    kernel_overhead_s: float = 2e-6
    host_bandwidth: float = 0.0
    compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    default_devices_per_host: int = 8
    cpu: CpuTerms = msgspec.field(default_factory=lambda: CpuTerms())

    def __post_init__(self) -> None:
        for field in ("memory_bytes", "peak_flops", "memory_bandwidth", "intra_host_bandwidth", "inter_host_bandwidth"):
            value = getattr(self, field)
            if not (value > 0 and value < float("inf")):
                raise PlanError(f"DeviceSpec {self.name!r}: {field}={value} must be a finite number > 0")
        for field in ("peak_flops_8bit", "intra_host_latency_s", "inter_host_latency_s", "kernel_overhead_s", "host_bandwidth"):
            value = getattr(self, field)
            if not (value >= 0 and value < float("inf")):
                raise PlanError(f"DeviceSpec {self.name!r}: {field}={value} must be a finite number >= 0")
        if self.default_devices_per_host < 1:
            raise PlanError(f"DeviceSpec {self.name!r}: default_devices_per_host={self.default_devices_per_host} must be >= 1")

    def flops_at(self, width: int, pass_kind: str = "forward") -> float:
        """FLOP/s of a model of residual width ``width`` in one pass (``"forward"``, ``"decode"`` or
        ``"train"``): ``measured_flops`` when ``cpu`` has a table, else ``peak_flops``.

        Example:
            >>> d = cpu_device(cores=2, memory_bytes=2**30, peak_flops=100e9, cpu=CpuTerms(flops_by_width=((32, 10e9), (128, 40e9))))
            >>> d.flops_at(64) / 1e9, d.flops_at(16) / 1e9, d.flops_at(4096) / 1e9, d.flops_at(64, "train") / 1e9
            (25.0, 10.0, 40.0, 25.0)
        """
        measured = self.measured_flops(width, pass_kind)
        return self.peak_flops if measured is None else measured

    def measured_flops(self, width: int, pass_kind: str = "forward") -> float | None:
        """The calibrated FLOP/s of a ``pass_kind`` pass at ``width``, or None (no table: a GPU preset).

        The pass's own table (``decode_flops_by_width``, ``train_flops_by_width``), else
        ``flops_by_width``, interpolated linearly in log(width) and clamped to its ends.

        Raises:
            PlanError: for an unknown ``pass_kind``.
        """
        if pass_kind not in ("forward", "decode", "train"):
            raise PlanError(f"pass kind {pass_kind!r} is not one of forward, decode, train")
        c = self.cpu
        table = {"decode": c.decode_flops_by_width, "train": c.train_flops_by_width}.get(pass_kind) or c.flops_by_width
        if not table:
            return None
        if width <= table[0][0]:
            return table[0][1]
        if width >= table[-1][0]:
            return table[-1][1]
        (w0, f0), (w1, f1) = next((a, b) for a, b in zip(table, table[1:]) if a[0] <= width <= b[0])
        return f0 + (f1 - f0) * math.log(width / w0) / math.log(w1 / w0)

    def rank_efficiency(self, pass_kind: str, *, tp: int = 1, pp: int = 1) -> float:
        """How well CPU ranks of a ``tp`` x ``pp`` mesh run a ``pass_kind`` (``"train"`` or ``"decode"``)
        pass against the planner's terms: the product of ``CpuTerms``' measured efficiencies of the
        axes > 1 (an unmeasured one counts 1).

        Example:
            >>> d = cpu_device(cores=2, memory_bytes=2**30, cpu=CpuTerms(tp_train_efficiency=0.6, pp_train_efficiency=0.7))
            >>> d.rank_efficiency("train", tp=2), round(d.rank_efficiency("train", tp=2, pp=2), 6), d.rank_efficiency("decode", tp=2), d.rank_efficiency("train")
            (0.6, 0.42, 1.0, 1.0)
        """
        c = self.cpu
        tp_eff = c.tp_decode_efficiency if pass_kind == "decode" else c.tp_train_efficiency
        pp_eff = c.pp_train_efficiency if pass_kind == "train" else 0.0
        return (tp_eff or 1.0 if tp > 1 else 1.0) * (pp_eff or 1.0 if pp > 1 else 1.0)

    def decode_rows_factor(self, rows: float) -> float:
        """``CpuTerms.decode_rows_fraction`` interpolated at ``rows`` (linearly in log(rows), clamped to
        its first entry; 1 from its last entry up, and without a table).

        Example:
            >>> d = cpu_device(cores=2, memory_bytes=2**30, cpu=CpuTerms(decode_rows_fraction=((1, 0.1), (16, 0.5), (64, 1.0))))
            >>> d.decode_rows_factor(1), d.decode_rows_factor(4), d.decode_rows_factor(100), cpu_device(cores=2).decode_rows_factor(4)
            (0.1, 0.3, 1.0, 1.0)
        """
        table = self.cpu.decode_rows_fraction
        if not table or rows >= table[-1][0]:
            return 1.0
        if rows <= table[0][0]:
            return table[0][1]
        (r0, f0), (r1, f1) = next((a, b) for a, b in zip(table, table[1:]) if a[0] <= rows <= b[0])
        return f0 + (f1 - f0) * math.log(rows / r0) / math.log(r1 / r0)

    def mesh_speedup(self, n: int, per_host: int, *, generator: bool = False) -> float:
        """How much faster ``n`` of these devices, on hosts of ``per_host``, run one mesh's work than
        one device; ``n`` unless ``thread_speedup`` is set (see its attribute; a ``generator``'s
        mesh uses ``gen_thread_speedup`` when set).

        Example:
            >>> d = cpu_device(cores=4, memory_bytes=2**30, cpu=CpuTerms(thread_speedup=1.6, gen_thread_speedup=1.3))
            >>> round(d.mesh_speedup(3, 4), 6), round(d.mesh_speedup(3, 4, generator=True), 6)
            (1.4, 1.2)
        """
        c = self.cpu
        if c.thread_speedup <= 0 or n <= 1:
            return float(n)
        speedup = c.gen_thread_speedup if generator and c.gen_thread_speedup > 0 else c.thread_speedup
        return 1 + (speedup - 1) * (n - 1) / max(1, per_host - 1)

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one element of ``compute_dtype``."""
        return 2 if self.compute_dtype == "bfloat16" else 4


class ClusterSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``hosts`` x ``devices_per_host`` identical devices.

    Attributes:
        name: how the cluster was named (``"1024xH100"``, ``"cpu:2"``); plans record it.
        hosts: number of hosts.
        devices_per_host: devices on each host.
        device: the figures of one device.
    """

    name: str
    hosts: int
    devices_per_host: int
    device: DeviceSpec

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.devices_per_host < 1:
            raise PlanError(
                f"cluster {self.name!r}: hosts={self.hosts} and devices_per_host={self.devices_per_host} must both be >= 1"
            )
        if self.hosts * self.devices_per_host > MAX_DEVICES:
            raise PlanError(
                f"cluster {self.name!r}: hosts({self.hosts}) * devices_per_host({self.devices_per_host}) = "
                f"{self.hosts * self.devices_per_host} devices, over the {MAX_DEVICES} a plan can list; plan the slice "
                "of the cluster one job gets"
            )

    @property
    def n_devices(self) -> int:
        return self.hosts * self.devices_per_host

    def host_of(self, device: int) -> int:
        return device // self.devices_per_host

    def with_devices(self, hosts: int, devices_per_host: int | None = None) -> ClusterSpec:
        """The same devices, a different count (used by the scaling property and benches)."""
        dph = devices_per_host or self.devices_per_host
        return ClusterSpec(name=f"{hosts}x{dph}x{self.device.name}", hosts=hosts, devices_per_host=dph, device=self.device)


GiB = 1024**3

#: Public datasheet figures (dense, no sparsity). Bandwidths are per direction, per device.
DEVICE_PRESETS: dict[str, DeviceSpec] = {
    "H100": DeviceSpec(
        name="H100",
        memory_bytes=80 * GiB,
        peak_flops=989e12,  # H100 SXM bf16 dense
        peak_flops_8bit=1979e12,  # FP8 dense
        memory_bandwidth=3.35e12,  # HBM3
        intra_host_bandwidth=450e9,  # NVLink 4: 900 GB/s bidirectional
        inter_host_bandwidth=50e9,  # one 400 Gb/s NIC per GPU
        host_bandwidth=64e9,  # PCIe Gen5 x16: 64 GB/s per direction
    ),
    "H200": DeviceSpec(
        name="H200",
        memory_bytes=141 * 10**9,
        peak_flops=989e12,
        peak_flops_8bit=1979e12,
        memory_bandwidth=4.8e12,  # HBM3e
        intra_host_bandwidth=450e9,
        inter_host_bandwidth=50e9,
        host_bandwidth=64e9,  # PCIe Gen5 x16
    ),
    "A100": DeviceSpec(
        name="A100",
        memory_bytes=80 * GiB,
        peak_flops=312e12,  # A100 SXM bf16 dense
        peak_flops_8bit=0.0,  # no FP8
        memory_bandwidth=2.039e12,
        intra_host_bandwidth=300e9,  # NVLink 3: 600 GB/s bidirectional
        inter_host_bandwidth=25e9,  # one 200 Gb/s NIC per GPU
        host_bandwidth=32e9,  # PCIe Gen4 x16
    ),
}


def cpu_device(
    *,
    cores: int | None = None,
    memory_bytes: int | None = None,
    peak_flops: float = 30e9,
    memory_bandwidth: float = 8e9,
    kernel_overhead_s: float = 10e-6,
    name: str = "cpu",
    cpu: CpuTerms | None = None,
) -> DeviceSpec:
    """One core of this machine as a device.

    The defaults are deliberately round, uncalibrated guesses for one modern x86 core in float32
    (``flowrl calibrate`` measures the real ones): 30 GFLOP/s matmul, 8 GB/s memory copy, 10 us per
    operator launch; ``cpu``: the measured :class:`CpuTerms` (none by default). A core's memory is
    the host's RAM divided by its cores; a collective between cores is a memory copy, so both
    bandwidths are ``memory_bandwidth``.
    """
    n = cores or host_cores()
    mem = memory_bytes if memory_bytes is not None else host_memory_bytes() // n
    return DeviceSpec(
        name=name,
        kind="cpu",
        memory_bytes=mem,
        peak_flops=peak_flops,
        peak_flops_8bit=0.0,
        memory_bandwidth=memory_bandwidth,
        intra_host_bandwidth=memory_bandwidth,
        inter_host_bandwidth=memory_bandwidth,
        host_bandwidth=memory_bandwidth,
        intra_host_latency_s=1e-6,
        inter_host_latency_s=1e-6,
        kernel_overhead_s=kernel_overhead_s,
        compute_dtype="float32",
        default_devices_per_host=n,
        cpu=cpu or CpuTerms(),
    )


def cpu_cluster(cores: int | None = None, *, device: DeviceSpec | None = None) -> ClusterSpec:
    """This machine: one host, one device per core (``cores`` of them; default: all usable cores)."""
    n = cores or host_cores()
    if n < 1:
        raise PlanError(f"cpu cluster: cores={n} must be >= 1")
    dev = device or cpu_device(cores=host_cores())
    return ClusterSpec(name="cpu" if cores is None else f"cpu:{n}", hosts=1, devices_per_host=n, device=dev)


def cluster_to_json(cluster: ClusterSpec) -> bytes:
    """The cluster as indented JSON (what ``flowrl calibrate -o`` writes and ``--cluster FILE`` reads)."""
    return msgspec.json.format(msgspec.json.encode(cluster), indent=2) + b"\n"


def load_cluster_file(path: str | Path) -> ClusterSpec:
    """A ClusterSpec from a .json or .toml file; never runs code.

    Raises:
        PlanError: naming the file and what is wrong with it.
    """
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"cluster file {str(path)!r} does not exist. {CLUSTER_FORMS}")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PlanError(f"cannot read cluster file {str(path)!r}: {exc.strerror}") from None
    hint = (
        "; expected fields name, hosts, devices_per_host and device{name, memory_bytes, peak_flops, "
        "memory_bandwidth, intra_host_bandwidth, inter_host_bandwidth, ..., cpu{flops_by_width, thread_speedup, ...}}"
        " (a file from 'flowrl calibrate' before the measured terms moved under device.cpu: run 'flowrl calibrate -o FILE' again)"
    )
    with decode_errors(PlanError, mismatch=f"cluster file {str(path)!r} does not match the ClusterSpec schema",
                       invalid=f"cluster file {str(path)!r} is not valid JSON", hint=hint):
        if path.suffix == ".toml":
            if sys.version_info < (3, 11):  # tomllib is 3.11's
                raise PlanError(f"cluster file {str(path)!r}: reading TOML needs Python 3.11 or later (tomllib); write the cluster file as JSON")
            else:
                import tomllib

                try:
                    raw = tomllib.loads(data.decode("utf-8"))
                except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                    raise PlanError(f"cluster file {str(path)!r} is not valid TOML: {exc}") from None
                return msgspec.convert(raw, type=ClusterSpec)
        return msgspec.json.decode(data, type=ClusterSpec)


_N_DEV = re.compile(r"^(\d+)x([A-Za-z][A-Za-z0-9]*)$")
_H_D_DEV = re.compile(r"^(\d+)x(\d+)x([A-Za-z][A-Za-z0-9]*)$")
_CPU = re.compile(r"^cpu(?::(\d+))?$")


def _preset(name: str, text: str) -> DeviceSpec:
    for key, spec in DEVICE_PRESETS.items():
        if key.lower() == name.lower():
            return spec
    raise PlanError(f"cluster {text!r}: unknown device {name!r}; known devices: {', '.join(DEVICE_PRESETS)}. {CLUSTER_FORMS}")


def parse_cluster(text: str) -> ClusterSpec:
    """The cluster named by ``text`` (see the module docstring for the forms).

    Raises:
        PlanError: listing the accepted forms when ``text`` matches none of them.

    Example:
        >>> parse_cluster("1024xH100").hosts
        128
    """
    text = text.strip()
    if text.endswith((".json", ".toml")):
        return load_cluster_file(text)
    if any(len(digits) > 12 for digits in re.findall(r"\d+", text)):  # int() of thousands of digits raises
        raise PlanError(f"cluster {text[:40]!r}{'...' if len(text) > 40 else ''}: a count of over 12 digits; at most {MAX_DEVICES} devices can be planned")
    if m := _CPU.match(text):
        cores = int(m.group(1)) if m.group(1) else None
        if cores is not None and cores < 1:
            raise PlanError(f"cluster {text!r}: cores={cores} must be >= 1")
        return cpu_cluster(cores)
    if m := _H_D_DEV.match(text):
        hosts, dph, dev = int(m.group(1)), int(m.group(2)), _preset(m.group(3), text)
        if hosts < 1 or dph < 1:
            raise PlanError(f"cluster {text!r}: hosts={hosts} and devices per host={dph} must both be >= 1")
        return ClusterSpec(name=f"{hosts}x{dph}x{dev.name}", hosts=hosts, devices_per_host=dph, device=dev)
    if m := _N_DEV.match(text):
        n, dev = int(m.group(1)), _preset(m.group(2), text)
        per_host = dev.default_devices_per_host
        if n < 1:
            raise PlanError(f"cluster {text!r}: device count {n} must be >= 1")
        if n <= per_host:
            return ClusterSpec(name=f"{n}x{dev.name}", hosts=1, devices_per_host=n, device=dev)
        if n % per_host:
            raise PlanError(
                f"cluster {text!r}: {n} {dev.name}s do not fill hosts of {per_host} ({n} % {per_host} = {n % per_host}); "
                f"write it as HOSTSxPER_HOSTx{dev.name}, e.g. '{-(-n // per_host)}x{per_host}x{dev.name}'"
            )
        return ClusterSpec(name=f"{n}x{dev.name}", hosts=n // per_host, devices_per_host=per_host, device=dev)
    raise PlanError(f"cannot parse cluster {text!r}. {CLUSTER_FORMS}")
