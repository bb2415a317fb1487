"""``flowrl run --resume auto``: one command for a job's first start and every restart.

Into a directory with no checkpoint it starts fresh; run again after a failure, it continues from the
newest complete checkpoint with no metrics row repeated or missing (the prompts of an uninterrupted
run, ``tests.reliability.killresume.check_run``); a directory of another graph is refused as by
``--resume``; an incomplete newest checkpoint and an interrupted save are skipped, each named. Under
torchrun's elastic agent (``TORCHELASTIC_MAX_RESTARTS``), a run that a restart could not continue is
warned about at start. The synthetic operators (the default example's graph, sleeps for operators).
"""

from __future__ import annotations

import json

import pytest

from flowrl.cli.main import main
from flowrl.errors import ConfigError
from flowrl.runtime.config import RunConfig
from tests.reliability.killresume import check_run, reference_prompts, rows_of

STEPS, K = 10, 1  # the default example's max_staleness


def _argv(ck, metrics, *extra: str, steps: int = STEPS) -> list[str]:
    return ["run", "--synthetic", "--quiet", "--steps", str(steps), "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
            "--metrics", str(metrics), "--resume", "auto", *extra]


def _err(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


def test_auto_starts_fresh_then_continues_after_a_failure_exactly(tmp_path, capsys):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    # the first start: no directory yet, so a fresh run; gen fails at step 7 (after the checkpoint of step 6 at most)
    assert main(_argv(ck, metrics, "--option", "fail_node=gen", "--option", "fail_step=7")) == 1
    err = _err(capsys)
    assert f"--resume auto: {ck} holds no complete checkpoint; starting fresh" in err, err
    assert "resuming from" not in err
    latest = (ck / "LATEST").read_text()
    assert latest in ("step-00000004", "step-00000006"), latest
    assert len(rows_of(metrics)) >= int(latest[-2:])  # rows after the checkpoint, if any, the resume drops
    # the same command again (without the injected failure): continues from LATEST, to the end
    assert main(_argv(ck, metrics)) == 0
    assert f"resuming from {ck / latest}" in _err(capsys)
    problems: list[str] = []
    lost, repeated = check_run(metrics, reference_prompts(STEPS, K), K, problems)
    assert not problems and (lost, repeated) == (0, 0), problems


def test_auto_into_another_graphs_directory_is_refused(tmp_path, capsys):
    first, second, ck = tmp_path / "g1.json", tmp_path / "g2.json", tmp_path / "ck"
    assert main(["viz", "llamarl", "--format", "json", "-o", str(first)]) == 0
    raw = json.loads(first.read_text())
    next(n for n in raw["nodes"] if n["name"] == "gen")["sampling"]["temperature"] = 0.7
    second.write_text(json.dumps(raw))
    assert main([*_argv(ck, tmp_path / "m.jsonl", steps=2), str(first)]) == 0
    capsys.readouterr()
    assert main([*_argv(ck, tmp_path / "m.jsonl", steps=4), str(second)]) == 2
    err = _err(capsys)
    assert "was written for graph 'llamarl' with a different definition (checkpoint -> now: nodes['gen'].sampling.temperature: 1.0 -> 0.7)" in err, err
    assert (ck / "LATEST").read_text() == "step-00000002"  # untouched


def test_an_interrupted_newest_checkpoint_is_skipped_naming_it(tmp_path, capsys):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    assert main(_argv(ck, metrics, steps=6)) == 0
    # step 6's state cut short (a save interrupted where renames are not atomic), and the staging
    # folder of a save of step 8 whose writer (a pid no process has) was killed
    (ck / "step-00000006" / "policy-policy.pt").unlink()
    (ck / ".step-00000008.tmp-4194304").mkdir()
    capsys.readouterr()
    assert main(_argv(ck, metrics)) == 0
    err = _err(capsys)
    assert (f"skipping {ck / 'step-00000006'} (its state policy-policy.pt is not whole: its save did not finish); "
            "resuming from step-00000004, the newest complete one") in err, err
    assert f"skipping {ck / '.step-00000008.tmp-4194304'} (the save of step 8 was interrupted)" in err, err
    assert f"resuming from {ck / 'step-00000004'}" in err
    problems: list[str] = []
    lost, repeated = check_run(metrics, reference_prompts(STEPS, K), K, problems)
    assert not problems and (lost, repeated) == (0, 0), problems
    assert not (ck / ".step-00000008.tmp-4194304").exists()  # swept by the next save


@pytest.mark.parametrize(
    ("flags", "warning"),
    [
        ([], "torchrun restarts this job up to 3 times (--max-restarts 3), but it writes no checkpoints: a restart begins from step 0"),
        (["--checkpoint-dir", "CK"], "a restart is refused, the directory then holding this run's checkpoints; use --resume auto"),
        (["--checkpoint-dir", "CK", "--resume", "auto"], "it checkpoints only at the end (no --checkpoint-every): a restart begins from step 0"),
    ],
    ids=["no-checkpoint-dir", "no-resume-auto", "no-checkpoint-every"],
)
def test_max_restarts_without_what_a_restart_needs_is_a_warning(tmp_path, capsys, monkeypatch, flags, warning):
    """torchrun's agent exports --max-restarts to its workers as TORCHELASTIC_MAX_RESTARTS."""
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    argv = ["run", "--synthetic", "--quiet", "--steps", "2", *[str(tmp_path / "ck") if f == "CK" else f for f in flags]]
    assert main(argv) == 0
    err = _err(capsys)
    assert "flowrl run: warning: torchrun restarts this job up to 3 times (--max-restarts 3), but" in err and warning in err, err
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # no restarts: nothing to say
    assert main(["run", "--synthetic", "--quiet", "--steps", "2"]) == 0
    assert "torchrun restarts" not in _err(capsys)


def test_a_run_ready_for_restarts_gets_no_warning(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert main(_argv(tmp_path / "ck", tmp_path / "m.jsonl", steps=2)) == 0
    assert "warning" not in _err(capsys)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--checkpoint-dir", "CK", "--resume", "auto", "--overwrite-checkpoints"], "--resume auto continues the checkpoints in --checkpoint-dir, --overwrite-checkpoints deletes them; pick one"),
        (["--checkpoint-dir", "CK", "--resume", "later", "llamarl"], "--resume later: --resume takes no value (continue; the directory must hold a checkpoint) or 'auto'"),
        (["--resume", "auto"], "checkpointing and --resume need a checkpoint directory (--checkpoint-dir DIR)"),
    ],
    ids=["with-overwrite", "bad-value", "no-dir"],
)
def test_bad_resume_flags_exit_2(tmp_path, capsys, argv, message):
    assert main(["run", "--synthetic", "--quiet", "--steps", "2", *[str(tmp_path / "ck") if a == "CK" else a for a in argv]]) == 2
    assert message in _err(capsys)


def test_resume_before_the_graph_argument_still_reads_the_graph(tmp_path, capsys):
    """``--resume GRAPH``: argparse offers the graph as the flag's value; it is the graph, and --resume plain."""
    ck = tmp_path / "ck"
    assert main(["run", "--synthetic", "--quiet", "--steps", "2", "--checkpoint-dir", str(ck)]) == 0
    assert main(["run", "--synthetic", "--quiet", "--steps", "3", "--checkpoint-dir", str(ck), "--resume", "llamarl"]) == 0
    assert f"resuming from {ck / 'step-00000002'}" in _err(capsys)


def test_run_config_refuses_another_resume_value():
    with pytest.raises(ConfigError, match="resume='yes': one of True"):
        RunConfig(checkpoint_dir="ck", resume="yes")
    assert RunConfig(checkpoint_dir="ck", resume="auto").resume == "auto"
