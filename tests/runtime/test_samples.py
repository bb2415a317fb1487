"""``--log-samples``: decoded samples of the consumed batches land in the metrics rows and above the bar."""

from __future__ import annotations

import io
import json

from flowrl.cli.main import main
from flowrl.examples.llamarl import build_llamarl
from flowrl.operators.tasks import copy_reward
from flowrl.models.families.builtin.tokenizer import DEFAULT_TOKENIZER
from flowrl.runtime.config import RunConfig
from flowrl.runtime.observe.progress import ProgressBar
from flowrl.runtime.run import run_graph


def test_every_nth_row_holds_decoded_samples_whose_rewards_are_the_batchs():
    result = run_graph(build_llamarl(max_staleness=0), RunConfig(steps=4, log_samples=2))
    logged = [r for r in result.rows if "samples_text" in r]
    assert [r["step"] for r in logged] == [2, 4]
    for row in logged:
        assert len(row["samples_text"]) == 2
        for s in row["samples_text"]:
            prompt, completion = DEFAULT_TOKENIZER.encode(s["prompt"]), DEFAULT_TOKENIZER.encode(s["completion"])
            assert s["prompt"].startswith("<s>") and s["prompt"].endswith("=")
            assert abs(s["reward"] - copy_reward(prompt, completion)) < 1e-4  # the reward of that very sample


def test_the_cli_prints_samples_and_keeps_them_in_the_metrics_file(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    assert main(["run", "--steps", "4", "--log-samples", "2", "--metrics", str(metrics)]) == 0
    err = capsys.readouterr().err
    assert err.count("  sample: '<s>") == 4
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert ["samples_text" in r for r in rows] == [False, True, False, True]


def test_the_bar_prints_samples_above_itself():
    out = io.StringIO()
    bar = ProgressBar(2, stream=out)
    bar({"step": 1, "reward_mean": 0.5, "staleness": 0, "samples": 4, "samples_text": [{"prompt": "p", "completion": "c", "reward": 1.0}]})
    assert "  sample: 'p' -> 'c'  reward 1.000\n" in out.getvalue()
