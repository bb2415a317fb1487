"""``weight_sync.py``'s FSDP2 case: a 3-rank torchrun job (vLLM generator on rank 0, an FSDP2 policy on
ranks 1-2) on the bench's model, each rank's RSS split by phase.

The job trains the HF example's task (2 prompts x 4 samples x 8 new tokens, k = 1) for ``steps``
steps with a sharded checkpoint after every step. Weights go from each policy rank's shards to rank 0
over the collective transport, then into vLLM's worker over the weight-sync group.

This file is also every rank's entry point (``python benches/weight_sync_fsdp.py OUT MODEL_DIR STEPS``):
before the run it wraps the methods that are the phases, so the runtime itself knows nothing of the bench:

- ``sync``: on a policy rank ``ShardedPolicy.publish`` (its shards onto the wire); on rank 0
  ``VLLMGenerator._push`` (the received state into vLLM's worker);
- ``checkpoint``: on a policy rank ``ShardedPolicy.save`` (its shards to disk) or ``.snapshot`` (a run's
  checkpoint: its shards staged in memory, the write following behind training); on rank 0 the
  checkpointer's ``take_run_checkpoint``.

Each rank's peak RSS in a phase is exact for its own process (the kernel's high-water mark, reset on
entry: ``/proc/self/clear_refs``) and sampled every 10 ms for vLLM's worker (a child of rank 0). Each
rank writes ``OUT/rank{R}.json``: its RSS after imports (``base``), its peak over the whole run, and
per phase the calls, seconds, RSS on entry and on exit, and peak RSS.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()

from cluster import GRAPH, _free_port  # noqa: E402  (the same layout's graph file; benches/ is on the path)


def _status_kb(field: str, pid: int | str = "self") -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class Phases:
    """Per phase: calls, seconds, and the peak RSS (GB) of this process and of vLLM's worker(s)."""

    def __init__(self, worker_pids: Callable[[], list[int]] | None = None) -> None:
        self.base_gb = _status_kb("VmRSS") / 2**20
        self.run_peak_gb = self.base_gb
        self.phases: dict[str, dict] = {}
        self._active: dict[str, int] = {}
        self._lock = threading.Lock()
        self._worker_pids = worker_pids
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        pids: list[int] = []
        for i in itertools.count():
            if self._stop.is_set():
                return
            if self._worker_pids and i % 50 == 0:  # vLLM's worker: looked up twice a second (a walk of /proc)
                pids = self._worker_pids()
            own = _status_kb("VmRSS") / 2**20
            workers = max((_status_kb("VmRSS", p) for p in pids), default=0) / 2**20
            with self._lock:
                self.run_peak_gb = max(self.run_peak_gb, own)
                for name in self._active:
                    ph = self.phases[name]
                    ph["peak_gb"] = max(ph["peak_gb"], own)
                    if self._worker_pids:
                        ph["vllm_worker_peak_gb"] = max(ph.get("vllm_worker_peak_gb", 0.0), workers)
            self._stop.wait(0.01)

    def wrap(self, owner: object, name: str, phase: str) -> None:
        """Make ``owner.name`` (a class's method or a module's function) count as ``phase``."""
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            with self._lock:
                ph = self.phases.setdefault(phase, {"calls": 0, "seconds": [], "peak_gb": 0.0, "rss_before_gb": [], "rss_after_gb": []})
                ph["rss_before_gb"].append(round(_status_kb("VmRSS") / 2**20, 3))
                self._active[phase] = self._active.get(phase, 0) + 1
                Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from now
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                hwm = _status_kb("VmHWM") / 2**20
                with self._lock:
                    ph["calls"] += 1
                    ph["rss_after_gb"].append(round(_status_kb("VmRSS") / 2**20, 3))
                    ph["seconds"].append(round(time.perf_counter() - start, 3))
                    ph["peak_gb"] = max(ph["peak_gb"], hwm)
                    self.run_peak_gb = max(self.run_peak_gb, hwm)
                    self._active[phase] -= 1
                    if not self._active[phase]:
                        del self._active[phase]

        setattr(owner, name, timed)

    def close(self) -> dict:
        self._stop.set()
        self._thread.join()
        r = lambda x: round(x, 3)  # noqa: E731
        return {"base_gb": r(self.base_gb), "run_peak_gb": r(self.run_peak_gb),
                "phases": {n: {**p, "peak_gb": r(p["peak_gb"]), **({"vllm_worker_peak_gb": r(p["vllm_worker_peak_gb"])} if "vllm_worker_peak_gb" in p else {})}
                           for n, p in self.phases.items()}}


#: What each rank wraps: (owner, its method or function, the phase it counts as). flowrl's own names,
#: so ``tests/test_benches.py`` checks that each still exists (a rename would break this bench only).
PHASES: tuple[tuple[str, str, str], ...] = (
    ("flowrl.runtime.backends.torchrun.rank_programs:ShardedPolicy", "__init__", "build"),  # RSS on entry: libraries, no model yet
    ("flowrl.runtime.backends.torchrun.rank_programs:ShardedPolicy", "publish", "sync"),
    ("flowrl.runtime.backends.torchrun.rank_programs:ShardedPolicy", "save", "checkpoint"),
    ("flowrl.runtime.backends.torchrun.rank_programs:ShardedPolicy", "snapshot", "checkpoint"),  # a run's checkpoint: the shards staged (their write follows behind training)
    ("flowrl.operators.engines.vllm_engine:VLLMGenerator", "_push", "sync"),
    ("flowrl.runtime.checkpointing.checkpointer", "take_run_checkpoint", "checkpoint"),  # the name the Checkpointer calls (the state taken; a remote policy saves in it)
)


def phase_owner(ref: str) -> object:
    """The class (``module:Class``) or module (``module``) a ``PHASES`` entry names."""
    import importlib

    module, _, qualname = ref.partition(":")
    owner: object = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        owner = getattr(owner, part)
    return owner


def _record_transport_stats() -> list[dict]:
    """The collective transport's counters on this rank (bytes sent, staged, its send buffer's
    high-water mark), taken as the job closes it: one dict per transport."""
    from flowrl.runtime.transports.collective import CollectiveTransport

    recorded: list[dict] = []
    close = CollectiveTransport.close

    @functools.wraps(close)
    def closing(self, **kwargs):
        if not self._closed:
            recorded.append(self.stats())
        return close(self, **kwargs)

    CollectiveTransport.close = closing
    return recorded


def _job(out: str, model_dir: str, steps: str) -> int:
    """One rank of the job: wrap the phases, run the graph, write ``out/rank{R}.json``."""
    sys.path.insert(0, str(ROOT / "benches"))
    import torch  # noqa: F401  (the base RSS includes torch, as every rank's does)

    from weight_sync import _worker_pids

    from flowrl.graph.refs import load_file_module
    from flowrl.placement import load_placement
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    rank = int(os.environ["RANK"])
    phases = Phases(worker_pids=(lambda: _worker_pids(os.getpid())) if rank == 0 else None)
    for owner, name, phase in PHASES:
        phases.wrap(phase_owner(owner), name, phase)
    transports = _record_transport_stats()
    graph = load_file_module(Path("graph.py")).build_graph()
    config = RunConfig(steps=int(steps), backend="torchrun", checkpoint_dir="ck", checkpoint_every=1, metrics="m.jsonl")
    run_graph(graph, load_placement("place.json", graph), config)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"rank": rank, **phases.close(), "transport": transports}))
    return 0


def run_fsdp_case(tmp: Path, model_dir: Path, steps: int, route: str) -> dict:
    """Run the 3-rank job in ``tmp`` with weights by ``route`` (``group``: the collective transport, then
    vLLM's weight-sync group; ``file``: a ``file`` weight edge, gathered on the policy's lead); each
    rank's record and the metrics rows."""
    (tmp / "graph.py").write_text(GRAPH.format(name="weight_sync_fsdp", model=str(model_dir), max_new_tokens=8, transport="inprocess" if route == "group" else "file"))
    (tmp / "place.json").write_text(json.dumps({"gen": [0], "policy": [1, 2]}))
    out = tmp / "rss"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLOWRL_DIST_TIMEOUT_S": "600"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(THIS), str(out), str(model_dir), str(steps)]
    start = time.perf_counter()
    run = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        sys.exit(f"the torchrun job failed:\n{run.stderr[-4000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    rows = [json.loads(line) for line in (tmp / "m.jsonl").read_text().splitlines()]
    return {"job_s": round(time.perf_counter() - start, 1), "ranks": ranks, "rows": rows}


if __name__ == "__main__":  # a rank: ends without interpreter teardown (flowrl.runtime.backends.torchrun.rank_exit)
    sys.path.insert(0, str(ROOT))
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process

    end_rank_process(_job(*sys.argv[1:4]))
