"""A graph with a teacher node runs in one process and from ``flowrl run`` under torchrun (the teacher on
a rank of its own), and a teacher whose tokenizer is not the student's is refused at run start.

The graph's teacher is the student's own initial model (``twin_graph``): the first batch, sampled by
those weights, is scored by the same weights, so its mean reverse KL is 0 within float32 rounding of
two evaluations of one model (``tests.tolerances.graph_logprob_atol``); a teacher that scored other
tokens, at another temperature than the rollout's 0.7, or stale inputs would be off by far more.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.errors import ConfigError
from flowrl.examples.llamarl import DEFAULT_MODEL
from flowrl.graph.builder import GraphBuilder
from tests.tolerances import graph_logprob_atol

ROOT = Path(__file__).resolve().parents[2]


def twin_graph():
    """prompts -> gen -> reward and teacher (the student's initial model) -> opd (reward weight 0.5) -> policy."""
    b = GraphBuilder("twin", model=DEFAULT_MODEL)
    gen = b.generator("gen", b.source("prompts", task="copy", batch_size=4), n_samples=4, max_new_tokens=5, temperature=0.7)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    teacher = b.teacher("teacher", gen, model=DEFAULT_MODEL)
    loss = b.loss("opd", gen, reward, teacher, objective="opd", reward_weights={"rewards": 0.5})
    b.weights(b.policy("policy", loss), gen, max_staleness=0)
    return b.build()


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _check_rows(rows: list[dict], steps: int) -> None:
    assert len(rows) == steps
    atol = graph_logprob_atol(twin_graph(), steps=0)
    assert abs(rows[0]["distill/reverse_kl"]) <= atol, (rows[0]["distill/reverse_kl"], atol)
    assert all(r["distill/teacher_logprob"] < 0 and "reward/rewards" in r for r in rows)


def test_a_run_distills_in_one_process():
    """In one process (``run_graph``, what ``flowrl run`` calls; the torchrun test below goes through the CLI)."""
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    _check_rows(run_graph(twin_graph(), RunConfig(steps=2, progress=False, device="cpu")).rows, 2)


def test_flowrl_run_distills_under_torchrun_with_the_teacher_on_its_own_rank(tmp_path):
    from tests.runtime.test_torchrun import _torchrun

    (tmp_path / "place.json").write_text(json.dumps({"gen": [0], "policy": [0], "teacher": [1]}))
    proc = _torchrun(2, ["-m", "flowrl", "run", "tests.runtime.test_teacher:twin_graph", "--backend", "torchrun", "--plan", "place.json",
                         "--steps", "2", "--quiet", "--metrics", "m.jsonl", "--device", "cpu"], tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _rows(tmp_path / "m.jsonl")
    _check_rows(rows, 2)
    assert rows[0]["layout"]["teacher"]["devices"] == [1], rows[0]["layout"]


# -- a Hugging Face teacher with another tokenizer: refused at run start ----------------------------------
def _hf_dirs(tmp_path: Path, *, swap: tuple[str, str] | None = None, vocab_size: int | None = None) -> tuple[Path, Path]:
    """The shipped HF example's directory for the student, and a copy for the teacher: two of its
    tokens' ids swapped (``swap``), or its config's ``vocab_size`` changed."""
    from flowrl.examples.hf_copy import ASSETS

    teacher = tmp_path / "teacher"
    shutil.copytree(ASSETS, teacher)
    if swap is not None:
        tok = json.loads((teacher / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        vocab[swap[0]], vocab[swap[1]] = vocab[swap[1]], vocab[swap[0]]
        (teacher / "tokenizer.json").write_text(json.dumps(tok))
    if vocab_size is not None:
        config = json.loads((teacher / "config.json").read_text())
        config["vocab_size"] = vocab_size
        (teacher / "config.json").write_text(json.dumps(config))
    return ASSETS, teacher


def hf_graph(student: Path, teacher: Path):
    from flowrl.graph.configs import HFModelConfig

    b = GraphBuilder("hf_distill", model=HFModelConfig(path=str(student), init="random", seed=0))
    prompts = b.source("prompts", data=str(student / "prompts.jsonl"), prompt_field="prompt", batch_size=2)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=3)
    score = b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text")
    t = b.teacher("teacher", gen, model=HFModelConfig(path=str(teacher), init="random", seed=1))
    b.weights(b.policy("policy", b.loss("opd", gen, score, t, objective="opd")), gen)
    return b.build()


def test_a_teacher_with_another_tokenizer_is_refused_before_any_work(tmp_path):
    pytest.importorskip("transformers")
    import threading

    from flowrl.examples.hf_copy import WORDS
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.preflight import check_teachers
    from flowrl.runtime.run import run_graph

    student, same = _hf_dirs(tmp_path / "same")
    check_teachers(hf_graph(student, same))  # another directory, the same tokenizer: accepted
    threads = threading.active_count()
    _, swapped = _hf_dirs(tmp_path / "swapped", swap=("a", "b"))
    with pytest.raises(ConfigError) as info:
        run_graph(hf_graph(student, swapped), RunConfig(steps=1, progress=False, metrics=str(tmp_path / "m.jsonl")))
    text = str(info.value)
    a, b = WORDS.index("a"), WORDS.index("b")
    assert text.startswith("teacher 'teacher': its tokenizer (") and f"token 'a' is id {b} in the teacher's and {a} in the student's" in text, text
    assert "cross-tokenizer distillation is not supported" in text
    assert threading.active_count() <= threads and not (tmp_path / "m.jsonl").exists()
    _, wider = _hf_dirs(tmp_path / "wider", vocab_size=40)
    with pytest.raises(ConfigError, match=r"teacher 'teacher': its model's vocab_size=40 \(.*\) differs from the student generator 'gen''s vocab_size=32"):
        run_graph(hf_graph(student, wider), RunConfig(steps=1, progress=False))
