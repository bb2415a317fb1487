"""Exactly-once resume after SIGKILL: of the whole run (local and process backends, at a random
moment and while a checkpoint is being written) and of one worker process. See ``killresume.py``.

Default run: three kills (about 50 s on 2 shared cores). ``--runslow`` adds a sweep over k in 0..4
and checkpoint intervals 1..4 with random kill moments.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.reliability.killresume import kill_and_resume, reference_prompts, worker_dies_and_resume

STEPS = 30


@pytest.fixture(scope="module")
def want():
    """The uninterrupted prompts per k (computed once)."""
    cache: dict[int, list[list[int]]] = {}

    def get(k: int) -> list[list[int]]:
        if k not in cache:
            cache[k] = reference_prompts(STEPS, k)
        return cache[k]

    return get


def _assert_exact(out) -> None:
    assert not out.problems, "\n".join(out.problems)
    assert out.lost == 0 and out.repeated == 0
    assert not out.orphans


@pytest.mark.parametrize(("k", "every", "seed"), [pytest.param(0, 1, 1, marks=pytest.mark.slow), (2, 3, 2)], ids=["k0-every1", "k2-every3"])
def test_sigkill_at_a_random_moment_then_resume_is_exact(tmp_path: Path, want, k: int, every: int, seed: int) -> None:
    out = kill_and_resume(tmp_path, steps=STEPS, k=k, every=every, rng=random.Random(seed), want=want(k))
    _assert_exact(out)
    assert not out.finished, "the kill came after the run had finished: nothing was tested"


@pytest.mark.slow  # CI time; the process backend's test below kills mid-checkpoint too and checks the same
def test_sigkill_while_a_checkpoint_is_written_never_leaves_one_that_looks_complete(tmp_path: Path, want) -> None:
    out = kill_and_resume(tmp_path, steps=STEPS, k=1, every=2, mode="checkpoint", save_s=0.5, want=want(1))
    assert out.mid_checkpoint, "the kill did not land while a checkpoint was being written"
    _assert_exact(out)
    assert out.resumed_from < out.killed_rows or out.resumed_from == 0  # the half-written one was not used


def test_sigkill_of_the_process_backend_controller_kills_its_workers(tmp_path: Path, want) -> None:
    out = kill_and_resume(tmp_path, steps=STEPS, k=1, every=2, backend="process", mode="checkpoint", save_s=0.3, want=want(1))
    assert len(out.workers) == 5, out.workers  # the zygote and its workers: prompts, gen, reward, policy
    assert out.mid_checkpoint
    _assert_exact(out)


def test_a_sigkilled_worker_fails_the_run_naming_its_node_and_resume_is_exact(tmp_path: Path, want) -> None:
    out = worker_dies_and_resume(tmp_path, steps=STEPS, k=1, every=3, node="gen", die_step=8, want=want(1))
    _assert_exact(out)
    assert out.resumed_from in (3, 6) and out.killed_rows >= out.resumed_from


@pytest.mark.slow
@pytest.mark.parametrize("k", range(5))
@pytest.mark.parametrize("every", range(1, 5))
def test_sigkill_sweep(tmp_path: Path, want, k: int, every: int) -> None:
    rng = random.Random(k * 10 + every)
    backend = "process" if (k + every) % 4 == 0 else "local"
    mode = "checkpoint" if every % 2 else "random"
    out = kill_and_resume(tmp_path, steps=STEPS, k=k, every=every, backend=backend, mode=mode, rng=rng, want=want(k))
    _assert_exact(out)
