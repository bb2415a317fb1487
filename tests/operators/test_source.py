"""The prompt source: left-padded batches, an advancing position, exact resume."""

from __future__ import annotations

import torch

from flowrl.operators.source import PromptSource, pad_left
from flowrl.operators.tasks import make_task

from .helpers import source_node


def test_batches_are_left_padded_with_lengths_and_indices():
    source = PromptSource(source_node("add", batch_size=6))
    batch = source.next_batch()
    task = make_task("add", 0)
    assert batch["prompt_index"].tolist() == list(range(6))
    assert source.position == 6
    width = batch["prompt_ids"].shape[1]
    for row, n, i in zip(batch["prompt_ids"], batch["prompt_lens"], batch["prompt_index"]):
        assert row[width - n :].tolist() == task.prompt(int(i))
        assert (row[: width - n] == 0).all()
    assert int(batch["prompt_lens"].max()) == width


def test_resume_from_state_continues_the_stream_exactly():
    straight = PromptSource(source_node(batch_size=3))
    expected = [straight.next_batch() for _ in range(4)]
    first = PromptSource(source_node(batch_size=3))
    got = [first.next_batch(), first.next_batch()]
    resumed = PromptSource(source_node(batch_size=3))
    resumed.load_state(first.state())
    assert resumed.state() == {"position": 6}
    got += [resumed.next_batch(), resumed.next_batch()]
    for a, b in zip(expected, got):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_pad_left():
    ids, lens = pad_left([[5], [6, 7, 8]], pad_id=0)
    assert ids.tolist() == [[0, 0, 5], [6, 7, 8]] and lens.tolist() == [1, 3]
