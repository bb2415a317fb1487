"""CollectiveTransport: resharding across real gloo ranks (bit for bit, bytes == minimum), the contract
across ranks, faults that must end in an error rather than a hang, and the conformance suite on one rank.

The multi-rank tests start this module as 4 worker processes (``python -m tests.runtime.test_collective
RANK WORLD INIT_FILE OUT_DIR``, one gloo group over a FileStore) that run every resharding case, the
cross-rank contract, then the faults (last: they leave the group unusable); each rank writes its
findings as JSON (no pickle) and the tests below read them. A run that does not finish in time is
killed and fails. The worker does not import hypothesis (see the bottom of the module).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from flowrl.errors import ConfigError, TransportError
from flowrl.planners.estimate.sync import estimate_sync, sync_params
from flowrl.modelspec import ModelSpec
from flowrl.planners.parallel import ParallelDims
from flowrl.placement.resharding import (
    DIRECT_MIN_BYTES,
    ShardLayout,
    dp_replicas,
    dp_tp,
    fsdp,
    local_slice,
    minimum_bytes,
    TransferVolume,
    plan_state,
    replicated,
    sharded,
    tp_column,
    tp_row,
    transfer_volume,
)
from flowrl.runtime.transports.weight_transport import layout_of
from flowrl.runtime.transports.collective import CollectiveTransport
from flowrl.runtime.transports.collective.messages import HEADER_BYTES, ParamSpec, Spec, build_messages, piece_limit
from flowrl.runtime.transports.collective.send_buffer import SendBuffer
from flowrl.runtime.transports.registry import create_transport
from tests.runtime.helpers import launch_ranks

VERSIONS = (0, 1, 2)

# --- the resharding table ------------------------------------------------------------------------

#: name -> (full shape, dtype): a matrix with uneven splits, a vector, a scalar, an integer matrix.
PARAMS: dict[str, tuple[tuple[int, ...], str]] = {
    "w": ((6, 5), "float32"),
    "b": ((7,), "bfloat16"),
    "s": ((), "float32"),
    "e": ((4, 3), "int64"),
}


def _by_ndim(params: dict, matrix: ShardLayout, vector: ShardLayout, scalar: ShardLayout) -> dict[str, ShardLayout]:
    return {n: (scalar if not len(s) else vector if len(s) == 1 else matrix) for n, (s, _) in params.items()}


def _case(src: Callable[[int], ShardLayout], dst: Callable[[int], ShardLayout], params=PARAMS, chunk_bytes: int = 1,
          direct_min_bytes: int = 0):
    """A resharding case: layouts per parameter from a function of the parameter's ndim. Every block is
    a message of its own, sent from the shard and received into the target where its slice is
    contiguous (``direct_min_bytes=0``), unless the case says otherwise; small blocks packed together go
    in pieces of one block each unless ``chunk_bytes`` says otherwise (0: all together)."""
    return {
        "chunk_bytes": chunk_bytes,
        "direct_min_bytes": direct_min_bytes,
        "params": params,
        "trainer": {n: src(len(s)) for n, (s, _) in params.items()},
        "generator": {n: dst(len(s)) for n, (s, _) in params.items()},
    }


def _nd(matrix, vector, scalar):
    return lambda ndim: scalar if ndim == 0 else vector if ndim == 1 else matrix


R01, G23, ALL = (0, 1), (2, 3), (0, 1, 2, 3)
FSDP2 = _nd(fsdp(R01), fsdp(R01), replicated(R01))  # the trainer of most cases (scalars replicated)


def _tp(ranks: tuple[int, ...]) -> Callable[[int], ShardLayout]:
    """Generator tensor parallelism: matrices split on dim 1, vectors on dim 0, scalars replicated."""
    return _nd(tp_row(ranks), tp_column(ranks), replicated(ranks))


CASES: dict[str, dict[str, Any]] = {
    # the table
    "replicated->tp2": _case(lambda n: replicated(R01), _nd(tp_column(G23), tp_column(G23), replicated(G23)), chunk_bytes=0),
    "fsdp2->tp2": _case(FSDP2, _tp(G23)),
    "fsdp2->tp2-packed": _case(FSDP2, _tp(G23), direct_min_bytes=1 << 16),
    # contiguous on the sender, strided on the receiver; strided on both sides (3-d: dim 1 -> dim 2)
    "tp-row->fsdp2-strided-target": _case(_nd(tp_row(R01), tp_column(R01), replicated(R01)), _nd(fsdp(G23), fsdp(G23), replicated(G23))),
    "tp->other-tp-nothing-contiguous": _case(
        lambda n: sharded(R01, 1), lambda n: sharded(G23, 2), params={"q": ((3, 4, 6), "float32"), "k": ((2, 2, 2), "bfloat16")}
    ),
    "replicated->tp2-column-direct": _case(lambda n: replicated(R01), _nd(tp_column(G23), tp_column(G23), replicated(G23))),
    "tp2->tp4": _case(_nd(tp_column(R01), tp_column(R01), replicated(R01)), _nd(tp_column(ALL), tp_column(ALL), replicated(ALL))),
    "fsdp2->dp-replicas": _case(FSDP2, lambda n: dp_replicas(G23), chunk_bytes=40, direct_min_bytes=1 << 16),
    # colocated and combined meshes
    "fsdp2->dp2xtp2-colocated": _case(
        FSDP2,
        _nd(dp_tp(ALL, dp=2, tp=2, tp_dim=1), dp_tp(ALL, dp=2, tp=2, tp_dim=0), replicated(ALL)),
    ),
    "fsdp2->tp2-swapped-colocated": _case(FSDP2, _tp((1, 0))),
    # colocated ranks that publish twice before fetching (the second publish exchanges the first version)
    "two-publishes-per-fetch-colocated": {**_case(FSDP2, _tp((1, 2, 0))), "per_fetch": 2},
    "two-publishes-per-fetch-swapped": {**_case(FSDP2, _tp((1, 0)), chunk_bytes=0), "per_fetch": 2},
    "fsdp2xtp2->tp2": _case(
        _nd(dp_tp(ALL, dp=2, tp=2, tp_dim=0, fsdp=True), dp_tp(ALL, dp=2, tp=2, tp_dim=0, fsdp=True), replicated(ALL)),
        _nd(tp_column(G23), tp_column(G23), replicated(G23)),
    ),
    "replicated4->tp2-overlap": _case(lambda n: replicated(ALL), _nd(tp_row((3, 0)), tp_column((3, 0)), replicated((3, 0)))),
    # send buffers far smaller than a rank's share (pieces of at most half a bucket: large blocks go in parts):
    # everything packed through one reused buffer; parts sent in place; strided parts staged on both sides
    "fsdp2->dp-replicas-in-buckets": {
        **_case(FSDP2, lambda n: dp_replicas(G23), params={**PARAMS, "big": ((64, 32), "float32")}, chunk_bytes=0,
                direct_min_bytes=1 << 16),
        "bucket_bytes": 1024,
    },
    "replicated->tp2-column-direct-in-parts": {
        **_case(lambda n: replicated(R01), _nd(tp_column(G23), tp_column(G23), replicated(G23))), "bucket_bytes": 64,
    },
    "tp->other-tp-in-parts": {
        **_case(lambda n: sharded(R01, 1), lambda n: sharded(G23, 2), params={"q": ((3, 4, 6), "float32"), "k": ((2, 2, 2), "bfloat16")}),
        "bucket_bytes": 64,
    },
    # uneven torch.chunk splits: trainer rank 1 and generator rank 3 hold empty shards, so rank 3 only gets headers
    "uneven-empty-shards": {
        "params": {"v": ((1, 4), "float32"), "u": ((1,), "float16")},
        "trainer": {"v": fsdp(R01), "u": fsdp(R01)},
        "generator": {"v": tp_column(G23), "u": tp_column(G23)},
    },
}


# the planner's view of a small model (blocks of 64 KiB and more in float32) on trainer ranks 0, 1 and a tp2
# generator on ranks 2, 3: what it prices must be what the transport moves (test_planner_prices_what_moved)
PLANNED_MODEL = ModelSpec(name="wide", n_layers=2, dim=128, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=64)
PLANNED_DIMS = ParallelDims(tp=2)
_planned = sync_params(PLANNED_MODEL, R01, G23, PLANNED_DIMS, layers=PLANNED_MODEL.n_layers, wb=4)
CASES["planner-layouts"] = {"params": _planned[0], "trainer": _planned[1], "generator": _planned[2],
                            "chunk_bytes": 8 << 20, "direct_min_bytes": DIRECT_MIN_BYTES}
# the same with an FSDP policy (sharding="fsdp"): the trainer ranks send from their dim-0 shards
_planned_fsdp = sync_params(PLANNED_MODEL, R01, G23, PLANNED_DIMS, layers=PLANNED_MODEL.n_layers, wb=4, trainer_sharded=True)
CASES["planner-layouts-fsdp"] = {"params": _planned_fsdp[0], "trainer": _planned_fsdp[1], "generator": _planned_fsdp[2],
                                 "chunk_bytes": 8 << 20, "direct_min_bytes": DIRECT_MIN_BYTES}


def _full(name: str, shape: tuple[int, ...], dtype: str, version: int) -> torch.Tensor:
    """The trainer's full tensor of ``name`` at ``version``: seeded random values, shifted by the version."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)) * 1000 + version)
    if dtype == "int64":
        return torch.randint(-1000, 1000, shape, generator=gen) + version
    return (torch.randn(shape, generator=gen) + version).to(getattr(torch, dtype))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _expected_bytes(case: dict[str, Any]) -> tuple[int, int]:
    """(minimum wire bytes, locally copied bytes) per version of a case, from the pure functions."""
    wire = sum(minimum_bytes(s, d, case["trainer"][n], case["generator"][n]) for n, (s, d) in case["params"].items())
    plans = plan_state(case["params"], case["trainer"], case["generator"])
    size = {n: torch.empty((), dtype=getattr(torch, d)).element_size() for n, (_, d) in case["params"].items()}
    local = sum(t.numel * size[n] for n, ts in plans.items() for t in ts if t.local)
    return wire, local


def _volume(case: dict[str, Any]) -> TransferVolume:
    """What the planner prices for one sync of a case (the transport's own rules)."""
    return transfer_volume(case["params"], case["trainer"], case["generator"], direct_min_bytes=case.get("direct_min_bytes", 0))


# --- worker side (runs in the spawned processes) -------------------------------------------------


def _held_bytes(transport: CollectiveTransport) -> int:
    """Bytes of every tensor storage the transport holds (its attributes, through containers and
    flowrl objects such as its send buffer), each storage once: what a rank's transport weighs."""
    storages: dict[int, int] = {}

    def walk(x: Any, depth: int) -> None:
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif depth > 5:
            return
        elif isinstance(x, dict):
            for v in x.values():
                walk(v, depth + 1)
        elif isinstance(x, (list, tuple, set, frozenset)) or type(x).__name__ == "deque":
            for v in x:
                walk(v, depth + 1)
        elif type(x).__module__.startswith("flowrl.") and hasattr(x, "__dict__"):
            walk(vars(x), depth + 1)

    walk(vars(transport), 0)
    return sum(storages.values())


def _run_case(rank: int, name: str, case: dict[str, Any], *, device: str = "cpu", group: Any = None) -> dict[str, Any]:
    """Publish ``len(VERSIONS) * per_fetch`` versions; generators fetch until they hold each round's last.
    Shards and targets live on ``device`` (the transport's buffers too); ``group`` is the edge's process group.
    With ``bucket_bytes`` in the case, the most bytes the transport held whenever it posted (``held_peak``)."""
    if not any(rank in lay.ranks for side in ("trainer", "generator") for lay in case[side].values()):
        return {"stats": {"bytes_sent": 0, "bytes_received": 0, "bytes_copied_locally": 0}, "staged_first_version": 0, "mismatches": [],
                "is_trainer": False, "is_generator": False}  # not a participant: constructs nothing
    params = {n: {"shape": list(s), "dtype": d} for n, (s, d) in case["params"].items()}
    per_fetch = case.get("per_fetch", 1)
    buckets = {"bucket_bytes": case["bucket_bytes"]} if "bucket_bytes" in case else {}
    t = CollectiveTransport(
        params=params, trainer_layout=case["trainer"], generator_layout=case["generator"], channel=name,
        timeout_s=60, fetch_wait_s=60, chunk_bytes=case.get("chunk_bytes", 1),
        direct_min_bytes=case.get("direct_min_bytes", 0), device=device, group=group, **buckets,
    )
    held_peak = 0
    if buckets:
        post = t._post

        def measured_post(ops: list[Any]) -> list[Any]:
            nonlocal held_peak
            held_peak = max(held_peak, _held_bytes(t))
            return post(ops)

        t._post = measured_post  # type: ignore[method-assign]
    mismatches: list[str] = []
    got_versions: list[int | None] = []
    staged_first_version = 0

    def check(tensors: dict[str, torch.Tensor], version: int, how: str) -> None:
        for n, tensor in tensors.items():
            s, d = case["params"][n]
            want = _full(n, s, d, version)[local_slice(case["generator"][n], s, rank)]
            if not torch.equal(_bits(tensor.cpu()), _bits(want.to(tensor.dtype))):
                mismatches.append(f"version {version} ({how}): {n!r} on rank {rank}")

    try:
        shapes = t.local_shapes("generator")
        native = {n: torch.zeros(shape, dtype=getattr(torch, case["params"][n][1]), device=device) for n, shape in shapes.items()}
        cast = {n: torch.zeros(shape, dtype=torch.float64, device=device) for n, shape in shapes.items()}  # never received into directly
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        for r in VERSIONS:
            target = cast if r == 1 else native
            if t.is_trainer and r:  # publish round r once every generator rank is done with round r - 1
                store.wait([f"rounds/{name}/{r - 1}/{g}" for g in t.generator_ranks])
            last = (r + 1) * per_fetch - 1
            for v in range(r * per_fetch, last + 1) if t.is_trainer else ():
                full = {n: _full(n, s, d, v) for n, (s, d) in case["params"].items()}
                shards = {n: full[n][local_slice(case["trainer"][n], full[n].shape, rank)].to(device, copy=True) for n in t.local_shapes("trainer")}
                t.publish(shards, v)
                for x in shards.values():  # the trainer changes its weights after publishing
                    x.fill_(-7)
            got: int | None = r * per_fetch - 1
            while t.is_generator and got is not None and got < last:
                got = t.fetch_into(target, newer_than=got)
                got_versions.append(got)
                if got is not None:
                    check(target, got, "fetched")
            if r == 0:
                staged_first_version = t.stats()["bytes_staged"]
            if t.is_generator:  # fetched again into fresh tensors: from staging, or from the target it went straight into
                again = {n: torch.zeros_like(x) for n, x in native.items()}
                if t.fetch_into(again, newer_than=last - 1) != last:
                    mismatches.append(f"version {last} could not be fetched again on rank {rank}")
                check(again, last, "fetched again")
                store.set(f"rounds/{name}/{r}/{rank}", "done")
        return {"stats": t.stats(), "staged_first_version": staged_first_version, "versions": got_versions, "mismatches": mismatches,
                "is_trainer": t.is_trainer, "is_generator": t.is_generator, "held_peak": held_peak}
    finally:
        t.close()


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _expect_error(fn: Callable[[], Any], match: str, log: list[str], what: str) -> None:
    import re

    try:
        fn()
    except TransportError as exc:
        if not re.search(match, str(exc)):
            log.append(f"{what}: message {str(exc)!r} does not match {match!r}")
        return
    log.append(f"{what}: no TransportError")


def _contract(rank: int) -> dict[str, Any]:
    """The contract across ranks: 2 trainer ranks (fsdp) -> 2 generator ranks (tp row split)."""
    params = {"w": {"shape": [4, 6], "dtype": "float32"}, "n": {"shape": [6], "dtype": "bfloat16"}}
    trainer = {"w": fsdp(R01), "n": replicated(R01)}
    generator = {"w": tp_row(G23), "n": tp_column(G23)}
    fails: list[str] = []
    log: dict[str, Any] = {}
    t = CollectiveTransport(params=params, trainer_layout=trainer, generator_layout=generator, channel="contract", timeout_s=60)

    def shards(value: float) -> dict[str, torch.Tensor]:
        return {n: torch.full(s, value, dtype=getattr(torch, params[n]["dtype"])) for n, s in t.local_shapes("trainer").items()}

    target = {n: torch.zeros(s, dtype=getattr(torch, params[n]["dtype"])) for n, s in t.local_shapes("generator").items()}

    def holds(tensors: dict[str, torch.Tensor], value: float) -> bool:
        return all(bool((x == value).all()) for x in tensors.values())

    # nothing published yet
    if t.latest_version() != -1:
        fails.append(f"latest_version before any publish is {t.latest_version()}")
    if t.is_generator and t.fetch_into(target) is not None:
        fails.append("fetch before any publish returned a version")
    _barrier()
    # publish copies; fetch returns the version; newer_than semantics
    if t.is_trainer:
        state = shards(3.0)
        t.publish(state, 3)
        for x in state.values():
            x.fill_(999.0)
        _expect_error(lambda: t.publish(shards(1.0), 3), r"version 3 published after version 3", fails, "equal version")
        _expect_error(lambda: t.publish(shards(1.0), 2), r"must strictly increase", fails, "older version")
        _expect_error(lambda: t.publish(shards(1.0), -2), r"negative", fails, "negative version")
        _expect_error(lambda: t.publish({"w": torch.ones(9, 9)}, 4), r"lacks tensor\(s\) 'n'", fails, "missing tensor")
        _expect_error(lambda: t.publish({**shards(1.0), "w": torch.ones(1, 6)}, 4), r"'w' is float32\[1, 6\] at version 4",
                      fails, "wrong shard shape")
        _expect_error(lambda: t.fetch_into(target), r"trainer rank only", fails, "fetch on a trainer")
        if t.latest_version() != 3:
            fails.append(f"trainer latest_version {t.latest_version()} != 3")
    _barrier()
    if t.is_generator:
        _expect_error(lambda: t.publish(shards(1.0), 9), r"generator rank only", fails, "publish on a generator")
        _expect_error(lambda: t.fetch_into({"w": target["w"]}), r"lacks tensor\(s\) 'n'", fails, "target missing a tensor")
        _expect_error(lambda: t.fetch_into({**target, "w": torch.zeros(4, 6)}), r"target tensor 'w' has shape \[4, 6\] but .*\[4, 3\]",
                      fails, "full tensor as target")
        if t.latest_version() != 3:
            fails.append(f"generator latest_version {t.latest_version()} != 3 after the publish")
        if not holds(target, 0.0):
            fails.append("target written before fetch_into")
        got = [t.fetch_into(target, newer_than=10), t.fetch_into(target, newer_than=3)]
        if got != [None, None] or not holds(target, 0.0):
            fails.append(f"fetch with newer_than >= 3 returned {got} or wrote the target")
        if t.fetch_into(target, newer_than=2) != 3 or not holds(target, 3.0):
            fails.append("fetch newer_than=2 did not return version 3 with the published values (publish must copy)")
        if t.fetch_into(target, newer_than=-1) != 3:
            fails.append("the newest version cannot be fetched again with newer_than=-1")
    _barrier()
    # casting into another dtype; a long run of versions never torn, versions only grow
    if t.is_trainer:
        for v in range(10, 30):
            t.publish(shards(float(v)), v)
    if t.is_generator:
        cast = {n: torch.zeros(x.shape, dtype=torch.float64) for n, x in target.items()}
        seen: list[int] = []
        deadline = time.monotonic() + 60
        while (not seen or seen[-1] < 29) and time.monotonic() < deadline:
            got = t.fetch_into(cast, newer_than=seen[-1] if seen else 3)
            if got is None:
                time.sleep(0.001)
                continue
            if not holds(cast, float(got)):
                fails.append(f"version {got}: target holds other values (torn or not cast)")
            seen.append(got)
        if not seen or seen[-1] != 29 or seen != sorted(set(seen)):
            fails.append(f"versions seen: {seen}")
        log["seen"] = seen
    _barrier()
    stats = t.stats()
    t.close()
    t.close()
    _expect_error(lambda: t.publish(shards(1.0), 99) if t.is_trainer else t.fetch_into(target), r"after close\(\)", fails, "use after close")
    # options that differ between ranks are caught at construction, on every rank
    other = {**params, "w": {"shape": [4, 7], "dtype": "float32"}} if rank == 0 else params
    _expect_error(
        lambda: CollectiveTransport(params=other, trainer_layout=trainer, generator_layout=generator, channel="mismatch", timeout_s=60),
        r"rank\(s\) \[.*\] were constructed with other params", fails, "options that differ",
    )
    return {"fails": fails, "stats": stats, **log}


def _faults(rank: int) -> dict[str, Any]:
    """Rank 0 trains; rank 2 dies; a peer never constructs; rank 1 stops fetching. Rank 0 gets errors, never hangs."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    out: dict[str, Any] = {}
    params = {"w": {"shape": [8, 8], "dtype": "float32"}}
    w = {"w": torch.ones(8, 8)}
    if rank in (0, 2):
        dead = CollectiveTransport(params=params, trainer_layout=replicated((0,)), generator_layout=replicated((2,)), channel="dead", timeout_s=30)
        if rank == 2:
            os._exit(0)  # dies without a word
        out["dead"] = _error_of(lambda: (dead.publish(w, 0), time.sleep(0.5), dead.publish(w, 1)))
        dead.close()
    if rank == 0:  # a peer that never constructs: the handshake times out naming it
        out["lonely"] = _error_of(lambda: CollectiveTransport(
            params=params, trainer_layout=replicated((0,)), generator_layout=replicated((3,)), channel="lonely", timeout_s=1))
        store.set("faults/slow", "go")
    if rank in (0, 1):
        store.wait(["faults/slow"])
        slow = CollectiveTransport(params=params, trainer_layout=replicated((0,)), generator_layout=replicated((1,)), channel="slow", timeout_s=1)
        if rank == 0:  # rank 1 never fetches version 0
            out["slow"] = _error_of(lambda: (slow.publish(w, 0), slow.publish(w, 1)))
        else:
            time.sleep(2)
        slow.close()
    return out


def _error_of(fn: Callable[[], Any]) -> str:
    start = time.monotonic()
    try:
        fn()
    except TransportError as exc:
        return f"{exc} [after {time.monotonic() - start:.1f} s]"
    return "no TransportError"


def _worker_main(argv: list[str]) -> None:
    """One rank: every resharding case, the contract, then the faults (which leave the group unusable)."""
    import torch.distributed as dist

    rank, world, init, out_dir = int(argv[0]), int(argv[1]), argv[2], Path(argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    result: dict[str, Any] = {"cases": {}}
    out = out_dir / f"rank{rank}.json"
    try:
        for name, case in CASES.items():
            try:
                result["cases"][name] = _run_case(rank, name, case)
            except Exception:  # noqa: BLE001 - reported per case
                result["cases"][name] = {"error": traceback.format_exc()}
            _barrier()
        result["contract"] = _contract(rank)
        _barrier()
        out.write_text(json.dumps(result))  # before the faults: rank 2 dies there
        result["faults"] = _faults(rank)
    except Exception:  # noqa: BLE001 - reported to the test
        result["error"] = traceback.format_exc()
    out.write_text(json.dumps(result))
    os._exit(0)  # the faults leave a dead peer and timed-out pairs: skip gloo's teardown


# --- test side -----------------------------------------------------------------------------------


def _launch(world: int, tmp: Path, timeout_s: float = 150) -> dict[int, dict[str, Any]]:
    """Run ``world`` worker ranks; their results, plus every rank's output under key -1."""
    results, logs = launch_ranks("tests.runtime.test_collective", world, tmp, timeout_s)
    return results | {-1: {"logs": logs}}


@pytest.fixture(scope="module")
def table_run(tmp_path_factory) -> dict[int, dict[str, Any]]:
    """The results of one 4-rank run (each rank: per case, the contract, the faults)."""
    return _launch(4, tmp_path_factory.mktemp("collective"))


def _ranks(run: dict[int, dict[str, Any]], world: int) -> list[dict[str, Any]]:
    missing = [r for r in range(world) if r not in run]
    assert not missing, f"ranks {missing} wrote no result; output:\n" + "\n".join(run[-1]["logs"])
    errors = [run[r]["error"] for r in range(world) if "error" in run[r]]
    assert not errors, "\n".join(errors)
    return [run[r] for r in range(world)]


@pytest.mark.parametrize("name", list(CASES))
def test_resharding_is_bit_exact_with_minimum_bytes(table_run, name):
    case = CASES[name]
    results = [r["cases"][name] for r in _ranks(table_run, 4)]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    assert not [m for r in results for m in r["mismatches"]]
    per_fetch = case.get("per_fetch", 1)
    versions = len(VERSIONS) * per_fetch
    for r in results:
        if r["is_generator"]:  # versions only grow (a colocated rank may skip one its publish exchanged)
            got = r["versions"]
            assert None not in got and got == sorted(set(got)) and got[-1] == versions - 1
    # every version reaches every generator rank once (a second publish pushes the first one out)
    wire, local = _expected_bytes(case)
    assert sum(r["stats"]["bytes_sent"] for r in results) == wire * versions
    assert sum(r["stats"]["bytes_received"] for r in results) == wire * versions
    assert sum(r["stats"]["bytes_copied_locally"] for r in results) == local * versions
    assert all(r["stats"]["exchanges"] == versions for r in results if r["is_generator"])
    volume = _volume(case)
    assert (volume.wire_bytes, volume.local_bytes) == (wire, local)
    if per_fetch == 1:  # version 0, delivered once into its native target: the staging copies the planner prices
        assert sum(r["staged_first_version"] for r in results) == volume.copied_bytes


def test_a_trainer_rank_holds_one_bucket_however_much_it_sends(table_run):
    """A trainer rank's transport holds at most one send buffer of ``bucket_bytes`` (plus a 32-byte header per
    destination) while each version it sends is many buckets, all packed: it reuses the buffer as its sends
    complete. A transport that staged a rank's whole share (a copy of its shards per destination) fails here."""
    name = "fsdp2->dp-replicas-in-buckets"
    case, results = CASES[name], [r["cases"][name] for r in _ranks(table_run, 4)]
    assert not [r["error"] for r in results if "error" in r]
    bucket, trainers = case["bucket_bytes"], [r for r in results if r["is_trainer"] and not r["is_generator"]]
    assert len(trainers) == 2
    for r in trainers:
        per_version = r["stats"]["bytes_sent"] // len(VERSIONS)
        assert per_version >= 8 * bucket, "the case must send many buckets per version to test anything"
        assert r["stats"]["bytes_staged"] == r["stats"]["bytes_sent"]  # every byte went through the buffer
        assert 0 < r["stats"]["send_buffer_peak_bytes"] <= r["stats"]["send_buffer_bytes"] <= bucket
        assert 0 < r["held_peak"] <= bucket + HEADER_BYTES * len(G23)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if "bucket_bytes" in c])
def test_blocks_go_in_parts_of_at_most_half_a_bucket(name):
    """Every rank cuts the same pieces, none over ``piece_limit(bucket_bytes)``, and the case cuts some block."""
    case = CASES[name]
    spec = Spec(params={n: ParamSpec(shape=s, dtype=d) for n, (s, d) in case["params"].items()}, trainer=case["trainer"],
                generator=case["generator"], chunk_bytes=case["chunk_bytes"], direct_min_bytes=case["direct_min_bytes"],
                bucket_bytes=case["bucket_bytes"])
    plans = plan_state(case["params"], case["trainer"], case["generator"])
    limit, cut = piece_limit(case["bucket_bytes"]), False
    messages = {r: build_messages(spec, plans, r) for r in ALL}
    for r, m in messages.items():
        assert all(p.hi - p.lo <= limit for side in (m.send_pieces, m.recv_pieces) for ps in side.values() for p in ps)
        for d, ps in m.send_pieces.items():  # the receiver cuts the same message alike
            assert [(p.lo, p.hi) for p in ps] == [(p.lo, p.hi) for p in messages[d].recv_pieces[r]]
        cut |= sum(len(p.blocks) for ps in m.send_pieces.values() for p in ps) > sum(map(len, m.sends.values()))
    assert cut


def test_the_send_buffer_reuses_a_region_once_its_send_is_out_and_waits_for_each_send_once():
    waited: list[str] = []
    buf = SendBuffer(64, "cpu", wait=waited.extend)
    for n, work in ((32, "w0"), (32, "w1")):
        lo, region = buf.take(n)
        assert region.numel() == n
        buf.sent(lo, n, [work])
    assert waited == [] and buf.peak_bytes == 64
    lo, _ = buf.take(16)  # no room left at the end: back to the start, once the send reading it is out
    assert (lo, waited) == (0, ["w0"])
    buf.sent(lo, 16, ["w2"])
    assert buf.pending() == ["w1", "w2"]
    buf.drain()
    assert waited == ["w0", "w1", "w2"] and buf.pending() == []  # gloo hangs on a send work waited for twice
    assert buf.allocated_bytes == 64
    with pytest.raises(ValueError, match="does not fit a send buffer of 64"):
        buf.take(65)


def test_the_table_covers_local_copies_and_header_only_ranks():
    """Guards the table itself: some cases must move bytes locally, and one must leave a rank with nothing;
    some send or receive blocks without staging them, and some stage every block."""
    staged = {name: _volume(case).copies_per_byte for name, case in CASES.items() if case.get("per_fetch", 1) == 1}
    assert staged["replicated->tp2-column-direct"] == 0.0  # contiguous on both sides: no copy at all
    assert 0.0 < staged["fsdp2->tp2"] < staged["fsdp2->tp2-packed"] == 2.0
    assert 0.5 < staged["tp-row->fsdp2-strided-target"] < 1.0  # a receiver-side copy of every matrix byte
    assert staged["tp->other-tp-nothing-contiguous"] == 2.0
    assert _expected_bytes(CASES["tp2->tp4"])[1] > 0
    assert _expected_bytes(CASES["replicated->tp2"])[1] == 0
    case = CASES["uneven-empty-shards"]
    assert local_slice(case["generator"]["v"], (1, 4), 3) == (slice(1, 1), slice(0, 4))


@pytest.mark.parametrize("sharded", [False, True], ids=["replicas", "fsdp"])
def test_planner_prices_what_moved(table_run, sharded):
    """The planner's sync estimate (wire bytes, staging copies) equals what the transport did in a real gloo run,
    from replicas and from FSDP shards (``src_sharded``: the layout an FSDP policy publishes)."""
    from tests.planners.test_estimates import ctx

    assert CASES["planner-layouts-fsdp"]["trainer"]["layers.0.wq"] == fsdp(R01)
    results = [r["cases"]["planner-layouts-fsdp" if sharded else "planner-layouts"] for r in _ranks(table_run, 4)]
    assert not [r["error"] for r in results if "error" in r]
    est = estimate_sync(PLANNED_MODEL, src="policy", dst="gen", transport="collective", src_devices=R01, src_dims=ParallelDims(dp=2),
                        dst_devices=G23, dst_dims=PLANNED_DIMS, dst_bytes_per_param=4.0, src_bytes_per_param=4.0, ctx=ctx(),
                        src_sharded=sharded)
    assert sum(r["stats"]["bytes_sent"] for r in results) == est.wire_bytes * len(VERSIONS)
    assert sum(r["staged_first_version"] for r in results) == est.copied_bytes
    assert 0 < est.copied_bytes < 2 * est.wire_bytes  # some blocks went without a copy, some with one or two


def test_contract_across_ranks(table_run):
    results = _ranks(table_run, 4)
    fails = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["contract"]["fails"]]
    assert not fails, "\n".join(fails)
    assert results[2]["contract"]["seen"][-1] == 29
    # the contract run moved w (fsdp -> tp row: all of it) and n (replicated -> tp column: all of it) per version
    versions = 1 + 20
    sent = sum(r["contract"]["stats"]["bytes_sent"] for r in results)
    per_version = minimum_bytes((4, 6), "float32", fsdp(R01), tp_row(G23)) + minimum_bytes((6,), "bfloat16", replicated(R01), tp_column(G23))
    assert sent == versions * per_version


def test_faults_end_in_errors_not_hangs(table_run):
    assert 0 in table_run, "rank 0 wrote no result:\n" + "\n".join(table_run[-1]["logs"])
    assert "error" not in table_run[0], table_run[0]["error"]
    trainer = table_run[0]["faults"]
    assert "rank(s) [3] did not construct" in trainer["lonely"]
    assert "sending version 0 to generator rank(s) [1] did not complete" in trainer["slow"]
    assert "stop the job" in trainer["slow"]
    assert "rank(s) [2]" in trainer["dead"] and "stop the job" in trainer["dead"]


# --- options: plain data, errors (one process, no process group) -------------------------------


def _open(rank: int, **options: Any) -> CollectiveTransport:
    import torch.distributed as dist

    return create_transport("collective", rank=rank, store=dist.HashStore(), handshake=False, **options)


def test_options_are_plain_data_through_the_registry():
    """What a backend sends to a rank: dicts and lists (msgspec builtins), no structs needed."""
    options = msgspec.json.decode(msgspec.json.encode({
        "params": {"w": {"shape": [4, 6], "dtype": "bfloat16"}, "n": {"shape": [6]}},
        "trainer_layout": fsdp(R01),
        "generator_layout": {"w": tp_row(G23), "n": tp_column(G23)},
        "chunk_bytes": 0,
    }))
    t = _open(2, **options)
    assert isinstance(t, CollectiveTransport) and t.name == "collective"
    assert t.local_shapes("generator") == {"n": (3,), "w": (4, 3)} and t.local_shapes("trainer") == {}
    assert (t.is_trainer, t.is_generator) == (False, True)
    # one message from each trainer rank: header + its 2 rows x 3 columns of bf16 (padded to 16) + its part of n
    assert {k: v for k, v in t.message_sizes().items() if k[1] == 2} == {(0, 2): 32 + 16 + 16, (1, 2): 32 + 16}
    assert t.latest_version() == -1 and t.fetch_into({"w": torch.zeros(4, 3), "n": torch.zeros(3)}) is None
    t.close()


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"generator_layout": {"w": tp_row(G23)}}, ConfigError, r"missing layouts for \['n'\]"),
        ({"trainer_layout": {"w": fsdp(R01), "n": fsdp(R01), "x": fsdp(R01)}}, ConfigError, r"unknown parameters \['x'\]"),
        ({"params": {"w": {"shape": [4, 6], "dtype": "float8"}}}, ConfigError, r"dtype 'float8' is not one of"),
        ({"rank": 7}, TransportError, r"rank 7 is in neither the trainer ranks \[0, 1\] nor the generator ranks \[2, 3\]"),
        ({"timeout_s": 0}, ConfigError, r"timeout_s=0 must be > 0"),
        ({"bucket_bytes": 32}, ConfigError, r"bucket_bytes=32 must be at least 64"),
    ],
    ids=["missing-layout", "unknown-param", "dtype", "not-a-participant", "timeout", "bucket"],
)
def test_option_errors(options, error, match):
    base = {"params": {"w": {"shape": [4, 6]}, "n": {"shape": [6]}}, "trainer_layout": fsdp(R01),
            "generator_layout": {"w": tp_row(G23), "n": tp_column(G23)}, "rank": 2}
    base |= options
    with pytest.raises(error, match=match):
        _open(**base)


# --- the conformance suite, on one rank that is trainer and generator ---------------------------


class _OneRank:
    """A rank-0 world with both roles (local copies only, no process group): the transport is opened on
    the first publish, from that state's names, shapes and dtypes (the suite does not declare them)."""

    name = "collective"

    def __init__(self) -> None:
        import torch.distributed as dist

        self._store = dist.HashStore()
        self._t: CollectiveTransport | None = None
        self._closed = False

    def publish(self, state, version):
        if self._t is None and not self._closed:
            layout = layout_of(state, transport="collective")
            params = {s.name: {"shape": list(s.shape), "dtype": s.dtype} for s in layout.tensors}
            self._t = CollectiveTransport(params=params, trainer_layout=replicated((0,)), generator_layout=replicated((0,)),
                                          rank=0, store=self._store, timeout_s=30)
        if self._t is None:
            raise TransportError("collective: publish() called after close()")
        self._t.publish(state, version)

    def latest_version(self):
        return -1 if self._t is None else self._t.latest_version()

    def fetch_into(self, target, *, newer_than=-1):
        if self._t is None:
            if self._closed:
                raise TransportError("collective: fetch_into() called after close()")
            return None
        return self._t.fetch_into(target, newer_than=newer_than)

    def close(self):
        self._closed = True
        if self._t is not None:
            self._t.close()


if __name__ == "__main__":  # a worker rank: no hypothesis import (it costs a second per rank on a busy machine)
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process  # no interpreter teardown (rank_exit)

    _worker_main(sys.argv[1:])
    end_rank_process(0)
else:
    from tests.runtime.transports.conformance import TransportConformance

    class TestCollectiveOneRankConformance(TransportConformance):
        concurrent_versions = 60
        random_examples = 8

        def open_pair(self, tmp_path):
            t = _OneRank()
            return t, t
