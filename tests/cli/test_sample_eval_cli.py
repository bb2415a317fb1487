"""``flowrl sample`` and ``flowrl eval`` on a real checkpoint of the built-in example."""

from __future__ import annotations

import json

import pytest

from flowrl.cli.main import main
from flowrl.runtime.evaluation.policy_samples import HELD_OUT_START
from flowrl.operators.tasks import CopyTask


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    ck = tmp_path_factory.mktemp("ck")
    assert main(["run", "--steps", "3", "--checkpoint-dir", str(ck), "--quiet"]) == 0
    return ck


def test_sample_prints_held_out_prompts_decoded(checkpoint, capsys):
    capsys.readouterr()
    assert main(["sample", str(checkpoint), "-n", "3"]) == 0
    out = capsys.readouterr().out
    task = CopyTask(0)
    for i in range(3):
        prompt = task.tokenizer.decode(task.prompt(HELD_OUT_START + i))
        assert f"  {prompt!r} -> " in out
    assert "policy version 3" in out and "mean reward" in out


def test_eval_reports_greedy_and_sampled_reward(checkpoint, capsys):
    capsys.readouterr()
    assert main(["eval", str(checkpoint / "step-00000003"), "--prompts", "8", "--samples", "2", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["policy_version"] == 3 and figures["prompts"] == 8
    assert 0.0 <= figures["greedy_reward_mean"] <= 1.0 and 0.0 <= figures["sampled_reward_mean"] <= 1.0


def test_eval_reports_pass_at_k_as_the_runs_evaluation_does_by_hand(checkpoint, capsys):
    """pass@1 is the mean share of a prompt's S sampled completions that pass; pass@S the share of prompts
    with at least one (the unbiased estimator's ends, by hand); greedy_pass the share of greedy ones."""
    from flowrl.runtime.evaluation.policy_samples import eval_positions, load_policy, rollout

    policy = load_policy(checkpoint)
    indices = eval_positions(policy, 8)
    sampled = [r.reward for r in rollout(policy, indices, n_samples=2, greedy=False)]
    greedy = [r.reward for r in rollout(policy, indices, n_samples=1, greedy=True)]
    above = sorted(r for r in sampled if r > 0)
    assert above, sampled  # a 3-step policy of the copy task gets some tokens right (seeded: always the same draws)
    threshold = above[0]  # some pass, most do not: both ends of pass@k are informative
    capsys.readouterr()
    argv = ["eval", str(checkpoint), "--prompts", "8", "--samples", "2", "--pass-reward", repr(threshold), "--json"]
    assert main(argv) == 0
    figures = json.loads(capsys.readouterr().out)
    passed = [[r >= threshold for r in sampled[2 * i : 2 * i + 2]] for i in range(8)]
    assert figures["pass@1"] == pytest.approx(sum(sum(p) / 2 for p in passed) / 8)
    assert figures["pass@2"] == pytest.approx(sum(any(p) for p in passed) / 8)
    assert figures["greedy_pass"] == pytest.approx(sum(r >= threshold for r in greedy) / 8)
    assert 0 < figures["pass@1"] < 1 and figures["pass_reward"] == threshold
    assert main(["eval", str(checkpoint), "--prompts", "8", "--samples", "2", "--pass-reward", repr(threshold)]) == 0
    assert f"pass@1 {figures['pass@1']:.3f}, pass@2 {figures['pass@2']:.3f}" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["sample", "eval"])
def test_checkpoint_mistakes(tmp_path, checkpoint, capsys, command):
    assert main([command, str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "old").mkdir()
    step = checkpoint / "step-00000003"
    for f in ("meta.json", "policy-policy.pt"):
        (tmp_path / "old" / f).write_bytes((step / f).read_bytes())
    assert main([command, str(tmp_path / "old")]) == 2
    assert "has no graph.json" in " ".join(capsys.readouterr().err.split())


def test_greedy_is_deterministic_and_sampling_is_not_greedy(checkpoint):
    from flowrl.runtime.evaluation.policy_samples import load_policy, rollout

    policy = load_policy(checkpoint)
    indices = range(HELD_OUT_START, HELD_OUT_START + 16)
    greedy = [r.completion for r in rollout(policy, indices, n_samples=1, greedy=True)]
    assert greedy == [r.completion for r in rollout(load_policy(checkpoint, seed=1), indices, n_samples=1, greedy=True)]
    sampled = [r.completion for r in rollout(policy, indices, n_samples=1, greedy=False)]
    assert sampled != greedy  # after a greedy call, sampling uses the graph's settings again


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    ck = tmp_path_factory.mktemp("hf_ck")
    assert main(["run", "hf_copy", "--steps", "2", "--checkpoint-dir", str(ck), "--quiet"]) == 0
    return ck


def test_sample_and_eval_an_hf_model_on_a_prompt_file(hf_checkpoint, tmp_path, capsys):
    """The HF example: prompts decoded with its tokenizer, rows of the file in file order, the text
    scorer fed the row's ``answer``; --data reads held-out rows."""
    from flowrl.runtime.evaluation.policy_samples import load_policy, rollout
    from flowrl.examples.hf_copy import ASSETS, reward

    rows = [json.loads(line) for line in (ASSETS / "prompts.jsonl").read_text().splitlines()[:3]]
    capsys.readouterr()
    assert main(["sample", str(hf_checkpoint), "-n", "3"]) == 0
    out = capsys.readouterr().out
    assert "prompts of the training file" in out
    for row in rows:
        assert f"  {row['prompt']!r} -> " in out
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt": f"copy {d} {d} {d} :", "answer": f"{d} {d} {d}"}) + "\n" for d in "123"))
    scored = rollout(load_policy(hf_checkpoint, data=str(held)), range(3), n_samples=1, greedy=True)
    for d, s in zip("123", scored):
        assert s.prompt == f"copy {d} {d} {d} :"
        assert s.reward == pytest.approx(reward(s.prompt, s.completion.replace("</s>", " ").strip(), answer=f"{d} {d} {d}"))
    assert main(["eval", str(hf_checkpoint), "--data", str(held), "--prompts", "3", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["held_out"] is True and figures["prompts"] == 3


BESIDE = '''
from flowrl.operators.tasks import CopyTask


def beside_reward(prompt_ids, completion_ids):
    return float(len(completion_ids) > 0)


def beside_task(seed):
    return CopyTask(seed)
'''

SCRIPT_IMPORTING = '''
from flowrl import GraphBuilder, ModelConfig
{imports}

b = GraphBuilder("beside", model=ModelConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2, n_kv_heads=2, max_seq_len=32))
prompts = b.source("prompts", task={task}, batch_size=4)
gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=4)
b.weights(b.policy("policy", b.loss("aipo", gen, b.scorer("reward", gen, fn={fn})), lr=1e-3), gen, max_staleness=1)
graph = b.build()
'''


@pytest.mark.parametrize(
    "form",
    [
        dict(imports="from rewards_beside import beside_reward, beside_task", task="beside_task", fn="beside_reward"),
        dict(imports="import rewards_beside", task="rewards_beside.beside_task", fn="rewards_beside.beside_reward"),
    ],
    ids=["from-import", "import"],
)
def test_sample_and_eval_import_what_run_imported_from_the_graphs_folder(tmp_path, form):
    """A graph script importing a module beside it trains, and ``flowrl sample`` / ``flowrl eval`` of its
    checkpoint, each a fresh process started in another directory without the script's folder on
    PYTHONPATH, import that module too (the graph references it through the script)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "rewards_beside.py").write_text(BESIDE)
    (project / "train.py").write_text(SCRIPT_IMPORTING.format(**form))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}  # this checkout's flowrl, nothing else

    def flowrl(*argv: str) -> str:
        done = subprocess.run([sys.executable, "-m", "flowrl", *argv], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    flowrl("run", str(project / "train.py"), "--steps", "2", "--checkpoint-dir", "ck", "--quiet")
    graph = json.loads(next((elsewhere / "ck").glob("step-*/graph.json")).read_text())
    refs = {n.get("fn") or n.get("source", {}).get("task") for n in graph["nodes"]} - {None}
    assert all(ref.startswith(f"{project / 'train.py'}:") for ref in refs), refs  # through the script, not 'rewards_beside:...'
    assert "mean reward 1.000" in flowrl("sample", "ck", "-n", "2")
    assert json.loads(flowrl("eval", "ck", "--prompts", "2", "--json"))["policy_version"] == 2
