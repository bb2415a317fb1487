"""CollectiveTransport on NCCL: device buffers, shards and targets on the GPU, one process group per edge.

The worker ranks (``python -m tests.runtime.test_collective_nccl RANK WORLD INIT_FILE OUT_DIR``) join
an NCCL group, one GPU each, and run resharding cases of ``test_collective`` through its own
``_run_case`` with ``device="cuda:<rank>"``; each case gets a group of exactly its participating ranks,
created by every rank in the same order and warmed with an all-reduce (as ``runtime.weights.torchrun_edges``
does), so that NCCL's first point-to-point batch need not involve every rank. With 4 GPUs the whole
table runs; with 2, the cases on ranks 0 and 1 (pure sender -> pure receiver, and colocated ranks that
send and receive in one batch). With 1 GPU (or none) these tests skip, visibly: NCCL does not
support two ranks of one communicator on the same GPU (NCCL user guide, "Creating a Communicator":
"not supported and may lead to hangs"), and since NCCL 2.5 ``ncclCommInitRank`` refuses it with
``ncclInvalidUsage`` ("Duplicate GPU detected : rank 1 and rank 0 both on CUDA device ..."), MPS or
not (NVIDIA/nccl#418). Two processes sharing one GPU exchange weights with ``cuda_ipc`` instead.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from flowrl.placement.resharding import fsdp, replicated, tp_column, tp_row
from tests.runtime import test_collective as table
from tests.runtime.helpers import launch_ranks

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLD = 4 if GPUS >= 4 else 2
R0, R1, R01 = (0,), (1,), (0, 1)

#: cases on ranks 0 and 1 only (a 2-GPU machine)
TWO_RANK_CASES: dict[str, dict[str, Any]] = {
    "replicated0->replicated1": table._case(lambda n: replicated(R0), lambda n: replicated(R1)),
    "replicated0->replicated1-packed": table._case(lambda n: replicated(R0), lambda n: replicated(R1), direct_min_bytes=1 << 16),
    "fsdp01->tp01-colocated": table._case(table._nd(fsdp(R01), fsdp(R01), replicated(R01)), table._nd(tp_row(R01), tp_column(R01), replicated(R01))),
    "fsdp01->tp10-swapped": table._case(table._nd(fsdp(R01), fsdp(R01), replicated(R01)), table._nd(tp_row((1, 0)), tp_column((1, 0)), replicated((1, 0)))),
}
CASES = table.CASES if WORLD == 4 else TWO_RANK_CASES


def _participants(case: dict[str, Any]) -> list[int]:
    return sorted({r for side in ("trainer", "generator") for lay in case[side].values() for r in lay.ranks})


def _worker_main(argv: list[str]) -> None:
    import torch.distributed as dist

    rank, world, init, out_dir = int(argv[0]), int(argv[1]), argv[2], Path(argv[3])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank))
    result: dict[str, Any] = {"cases": {}}
    try:
        for name, case in CASES.items():
            ranks = _participants(case)
            group = dist.new_group(ranks)  # every rank, in the same order
            if rank in ranks:
                dist.all_reduce(torch.ones(1, device="cuda"), group=group)  # warm: the first NCCL op involves all
            try:
                result["cases"][name] = table._run_case(rank, name, case, device=f"cuda:{rank}", group=group if rank in ranks else None)
            except Exception:  # noqa: BLE001 - reported per case
                result["cases"][name] = {"error": traceback.format_exc()}
            dist.barrier(device_ids=[rank])
    except Exception:  # noqa: BLE001 - reported to the test
        result["error"] = traceback.format_exc()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    os._exit(0)


#: why one GPU is not enough (see the module docstring)
ONE_GPU_PER_RANK = ("NCCL needs one GPU per rank: since NCCL 2.5 two ranks on one GPU fail at init with ncclInvalidUsage "
                    "'Duplicate GPU detected'")
needs_gpus = pytest.mark.skipif(GPUS < 2, reason=f"{ONE_GPU_PER_RANK}; this machine has {GPUS} GPU(s), 2 or more needed")


@pytest.fixture(scope="module")
def nccl_run(tmp_path_factory) -> dict[int, dict[str, Any]]:
    results, logs = launch_ranks("tests.runtime.test_collective_nccl", WORLD, tmp_path_factory.mktemp("nccl"), 300)
    missing = [r for r in range(WORLD) if r not in results]
    assert not missing, f"ranks {missing} wrote no result; output:\n" + "\n".join(logs)
    errors = [results[r]["error"] for r in range(WORLD) if "error" in results[r]]
    assert not errors, "\n".join(errors)
    return results


@needs_gpus
@pytest.mark.parametrize("name", list(CASES))
def test_resharding_on_nccl_is_bit_exact_with_minimum_bytes(nccl_run, name):
    case = CASES[name]
    results = [nccl_run[r]["cases"][name] for r in range(WORLD)]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    assert not [m for r in results for m in r["mismatches"]]
    per_fetch = case.get("per_fetch", 1)
    wire, _ = table._expected_bytes(case)
    assert sum(r["stats"]["bytes_sent"] for r in results) == wire * len(table.VERSIONS) * per_fetch
    if per_fetch == 1:
        assert sum(r["staged_first_version"] for r in results) == table._volume(case).copied_bytes


def test_the_two_rank_table_covers_direct_and_staged_pieces():
    """Guards the 2-GPU table: one case moves everything without a copy, one stages everything."""
    staged = {name: table._volume(case).copies_per_byte for name, case in TWO_RANK_CASES.items()}
    assert staged["replicated0->replicated1"] == 0.0 and staged["replicated0->replicated1-packed"] == 2.0


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
