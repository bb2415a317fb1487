"""Exactly-once resume of a run whose prompts come from a file (JSONL and Parquet), across epoch boundaries.

Real operators (the built-in model, a word-level tokenizer saved as a Hugging Face directory): a run
stopped after a checkpoint and resumed consumes exactly the stream positions, hence the file rows,
of an uninterrupted run.
"""

from __future__ import annotations

import pytest

from flowrl.data.wiring import open_source_stream
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph
from tests.data.helpers import data_graph, word_tokenizer, write_jsonl
from tests.operators import userfns

ROWS = [{"prompt": f"what is {a} plus {b} ?", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (0, 3)]]
STEPS, FIRST = 7, 3  # 7 steps x 3 prompts = 21 positions over 5 rows: epochs 0..4


def _write(tmp_path, fmt):
    if fmt == "jsonl":
        return write_jsonl(tmp_path / "train.jsonl", ROWS)
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    return path


@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_stopped_and_resumed_run_consumes_what_an_uninterrupted_one_does(tmp_path, fmt, k):
    data = _write(tmp_path, fmt)
    g = data_graph(str(data), str(word_tokenizer(tmp_path / "tok")), scorer="tests.operators.userfns:text_record",
                   inputs="text", batched=True, k=k, seed=5)
    stream = open_source_stream(g, "prompts", warn=False)  # opened apart from the runs: positions name the same rows

    def run(**kw):
        userfns.SEEN.clear()
        result = run_graph(g, RunConfig(stall_timeout_s=120, **kw))
        scored = list(userfns.SEEN)  # the prompts of each batch, in step order (then any not yet consumed)
        for step, positions in enumerate(result.consumed):
            assert scored[step] == [ROWS[stream.row_of(p)]["prompt"] for p in positions for _ in range(2)]
        return result

    whole = run(steps=STEPS)
    ck = tmp_path / "ck"
    first = run(steps=FIRST, checkpoint_dir=str(ck), checkpoint_every=FIRST)
    resumed = run(steps=STEPS, checkpoint_dir=str(ck), resume=True)
    assert [r["step"] for r in resumed.rows] == list(range(FIRST + 1, STEPS + 1))
    assert first.consumed + resumed.consumed == whole.consumed
    flat = [p for step in whole.consumed for p in step]
    assert flat == list(range(3 * STEPS))  # every position once, in order
    rows = [stream.row_of(p) for p in flat]
    assert len({stream.epoch_of(p) for p in flat}) == 5 and all(sorted(rows[e * 5:(e + 1) * 5]) == list(range(5)) for e in range(4))
    assert [r["prompt_index"] for r in first.rows + resumed.rows] == [r["prompt_index"] for r in whole.rows]
    # the source's data metrics reach the rows: the epoch of the step's first position, nothing dropped
    assert [r["data/epoch"] for r in whole.rows] == [min(p) // len(ROWS) for p in whole.consumed]  # no row dropped: 5 positions an epoch
    assert {r["data/prompts_dropped"] for r in whole.rows} == {0}
    if k == 0:  # synchronous: the resumed run trains on the same rows with the same weights, so it scores the same
        assert [r["reward_mean"] for r in first.rows + resumed.rows] == [r["reward_mean"] for r in whole.rows]
        assert [r["loss"] for r in first.rows + resumed.rows] == pytest.approx([r["loss"] for r in whole.rows], rel=1e-5)
