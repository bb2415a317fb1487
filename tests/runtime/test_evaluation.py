"""Evaluation during training (``eval_every``): pass@k by hand, eval rows on the right steps whose figures
equal a direct evaluation of that step's checkpoint, and the inputs refused before any work."""

from __future__ import annotations

import itertools
import json
import threading

import pytest

from flowrl.cli.main import main
from flowrl.errors import ConfigError
from flowrl.runtime.config import RunConfig
from flowrl.runtime.evaluation.during_run import eval_metrics, pass_at_k
from flowrl.runtime.evaluation.policy_samples import Scored


def _subsets_with_a_pass(n: int, c: int, k: int) -> float:
    """pass@k counted the long way: the fraction of the k-subsets of n samples (c passing) holding a pass."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("k, expected", [(1, 2 / 5), (2, 7 / 10), (3, 9 / 10), (4, 1.0), (5, 1.0)])
def test_pass_at_k_equals_hand_values_for_5_samples_2_passing(k, expected):
    # by hand: 1 - C(3,k)/C(5,k): k=1: 1 - 3/5; k=2: 1 - 3/10; k=3: 1 - 1/10; k>=4: C(3,k) = 0
    assert pass_at_k(5, 2, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n", [1, 4, 7])
def test_pass_at_k_equals_counting_subsets(n):
    for c, k in itertools.product(range(n + 1), range(1, n + 1)):
        assert pass_at_k(n, c, k) == pytest.approx(_subsets_with_a_pass(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in ((5, 6, 1), (5, 2, 0), (5, 2, 6), (5, -1, 1)):
        with pytest.raises(ValueError, match="0 <= c <= n and 1 <= k <= n"):
            pass_at_k(n, c, k)


def _scored(*rewards: float) -> list[Scored]:
    return [Scored(prompt="p", completion="c", reward=r, rewards={"rewards": r}) for r in rewards]


def test_eval_metrics_by_hand():
    greedy = _scored(1.0, 0.5)  # row 0 passes, row 1 does not (pass_reward 1.0)
    sampled = _scored(1.0, 0.0, 1.0, 0.25) + _scored(0.0, 0.0, 1.0, 0.0)  # row 0: 2 of 4 pass; row 1: 1 of 4
    m = eval_metrics(greedy, sampled, samples=4, pass_reward=1.0)
    assert m["eval/rows"] == 2 and m["eval/greedy_pass"] == 0.5
    assert m["eval/greedy_reward_mean"] == pytest.approx(0.75)
    assert m["eval/sampled_reward_mean"] == pytest.approx(3.25 / 8)
    # pass@1 = mean(2/4, 1/4); pass@2 = mean(1 - C(2,2)/C(4,2), 1 - C(3,2)/C(4,2)) = mean(5/6, 1/2); pass@4 = 1
    assert m["eval/pass@1"] == pytest.approx(0.375)
    assert m["eval/pass@2"] == pytest.approx((5 / 6 + 1 / 2) / 2)
    assert m["eval/pass@4"] == pytest.approx(1.0)
    assert sorted(k for k in m if k.startswith("eval/pass@")) == ["eval/pass@1", "eval/pass@2", "eval/pass@4"]
    with pytest.raises(ValueError, match="2 rows need 4 sampled completions each; got 7"):
        eval_metrics(greedy, sampled[:7], samples=4, pass_reward=1.0)


def _rows(path, n, *, start=0, fields=("prompt", "answer")):
    from flowrl.examples.hf_copy import make_prompts

    rows = make_prompts(start + n, seed=7)[start:]
    path.write_text("".join(json.dumps({f: r[f] for f in fields}) + "\n" for r in rows))
    return path


def _direct_eval(step_dir, data, *, samples, pass_reward):
    """The figures of a checkpoint, computed here from ``flowrl eval``'s rollout, on one torch thread (as the
    evaluation thread runs), with pass@k counted over subsets."""
    from flowrl.runtime.parallel.threads import set_intra_op_threads
    from flowrl.runtime.evaluation.policy_samples import eval_positions, load_policy, rollout

    out = {}

    def work():
        set_intra_op_threads(1)
        policy = load_policy(step_dir, seed=0, data=str(data))
        rows = eval_positions(policy, 10**6)
        greedy = rollout(policy, rows, n_samples=1, greedy=True)
        sampled = rollout(policy, rows, n_samples=samples, greedy=False)
        passed = [sum(s.reward >= pass_reward for s in sampled[i * samples : (i + 1) * samples]) for i in range(len(rows))]
        out.update({
            "eval/version": policy.version,
            "eval/rows": len(rows),
            "eval/greedy_reward_mean": sum(s.reward for s in greedy) / len(rows),
            "eval/sampled_reward_mean": sum(s.reward for s in sampled) / len(sampled),
            "eval/greedy_pass": sum(s.reward >= pass_reward for s in greedy) / len(rows),
            **{f"eval/pass@{k}": sum(_subsets_with_a_pass(samples, c, k) for c in passed) / len(rows) for k in (1, 2, 3)},
        })

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return out


def test_eval_rows_come_every_n_steps_and_equal_a_direct_evaluation_of_that_steps_checkpoint(tmp_path):
    """hf_copy at k=1 (the generator runs a step ahead, so the evaluated weights must be the step's own, not
    the newest): every 2nd row holds eval/ figures equal to scoring the checkpoint of that step directly."""
    from flowrl.examples.hf_copy import build_hf_copy
    from flowrl.runtime.observe.metrics import read_metrics
    from flowrl.runtime.run import run_graph

    held, ck, metrics = _rows(tmp_path / "held.jsonl", 12, start=600), tmp_path / "ck", tmp_path / "m.jsonl"
    config = RunConfig(
        steps=4, eval_every=2, eval_data=str(held), eval_samples=3, eval_pass_reward=0.6,
        checkpoint_dir=str(ck), checkpoint_every=2, keep_checkpoints=2, metrics=str(metrics),
    )
    handed = []  # what on_step got, copied when it got it: a row goes out once its evaluation is in
    result = run_graph(build_hf_copy(max_staleness=1), config, on_step=lambda row: handed.append(dict(row)))
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == [r["step"] for r in handed] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "eval/greedy_reward_mean" in r] == [2, 4]
    assert [r.get("eval/version") for r in handed] == [r.get("eval/version") for r in result.rows] == [None, 2, None, 4]
    figures = {}
    for row in rows[1::2]:
        step = row["step"]
        figures[step] = expected = _direct_eval(ck / f"step-{step:08d}", held, samples=3, pass_reward=0.6)
        for key, value in expected.items():
            assert row[key] == pytest.approx(value, abs=1e-9), (step, key)
        assert row["eval/time_s"] > 0 and 0 < row["eval/save_s"] < row["eval/time_s"]
    assert figures[2] != figures[4]  # the policy moved: equal figures above are the step's own weights


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--eval-every", "2"], "--eval-every 2 needs --eval-data, a prompt file of held-out rows"),
        (["--eval-every", "0", "--eval-data", "{held}"], "--eval-every 0: N must be >= 1"),
        (["--eval-every", "-3", "--eval-data", "{held}"], "--eval-every -3: N must be >= 1"),
        (["--eval-data", "{held}"], "--eval-data '{held}' is read only with --eval-every"),
        (["--eval-every", "2", "--eval-data", "{missing}"], "--eval-data '{missing}': no such file; give a prompt file with the fields of"),
        (["--eval-every", "2", "--eval-data", "{no_answer}"],
         "--eval-data '{no_answer}': scorer 'reward' asks for row field(s) ['answer'], which the prompt rows lack"),
        (["--eval-every", "2", "--eval-data", "{no_prompt}"], "no row has the prompt field 'prompt'; the fields present are ['answer']"),
        (["--eval-every", "2", "--eval-data", "{held}", "--eval-samples", "0"], "--eval-samples 0 must be >= 1"),
    ],
    ids=["no-data", "zero", "negative", "data-alone", "missing-file", "no-answer-column", "no-prompt-column", "zero-samples"],
)
def test_bad_eval_options_are_a_cli_error_before_any_work(tmp_path, capsys, extra, message):
    paths = {
        "held": str(_rows(tmp_path / "held.jsonl", 2)),
        "missing": str(tmp_path / "nope.jsonl"),
        "no_answer": str(_rows(tmp_path / "q.jsonl", 2, fields=("prompt",))),
        "no_prompt": str(_rows(tmp_path / "a.jsonl", 2, fields=("answer",))),
    }
    argv = ["run", "hf_copy", "--steps", "2", "--quiet", "--checkpoint-dir", str(tmp_path / "ck")] + [a.format(**paths) for a in extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message.format(**paths) in " ".join(err.split()), err
    assert "Traceback" not in err
    assert "flowrl run: graph" not in err and not (tmp_path / "ck").exists()  # refused before the run starts


def test_eval_data_for_a_task_graph_names_the_way_to_evaluate_it(tmp_path, capsys):
    held = _rows(tmp_path / "held.jsonl", 2)
    assert main(["run", "--steps", "2", "--quiet", "--eval-every", "1", "--eval-data", str(held)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "draws prompts from task 'copy', not a file" in err and "flowrl eval CHECKPOINT" in err


def test_run_config_refuses_eval_mistakes_for_python_users():
    with pytest.raises(ConfigError, match=r"eval_every=-1 must be >= 1"):
        RunConfig(eval_every=-1)
    with pytest.raises(ConfigError, match=r"eval_every=5 needs eval_data"):
        RunConfig(eval_every=5)


def test_an_evaluation_that_fails_fails_the_run_naming_the_evaluation_and_keeps_the_rows(tmp_path, capsys):
    """A scorer that raises on an eval row (``answer`` not text: the hf_copy reward calls ``.split()``) fails
    the run with the evaluated version and the eval file named, and the cause's traceback; the metrics file
    keeps the steps done."""
    held, metrics = tmp_path / "held.jsonl", tmp_path / "m.jsonl"
    held.write_text(json.dumps({"prompt": "copy 1 2 3 :", "answer": 123}) + "\n")
    argv = ["run", "hf_copy", "--steps", "4", "--quiet", "--eval-every", "1", "--eval-data", str(held), "--metrics", str(metrics)]
    assert main(argv) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"evaluating policy 'policy' at version 1 (eval_every=1, eval_data='{held}') failed: " in err
    assert "scorer 'reward' (flowrl.examples.hf_copy:reward) raised AttributeError: 'int' object has no attribute 'split'" in err
    assert "Traceback" in err  # a bug in user code: its traceback is what helps
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert rows and rows[0]["step"] == 1 and "eval/version" not in rows[0]
