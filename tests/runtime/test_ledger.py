"""The prompt ledger alone: watermark, prompts consumed ahead, exactly once, a resume's skips."""

from __future__ import annotations

import pytest
import torch

from flowrl.operators.source import pad_left
from flowrl.runtime.control.ledger import PromptLedger
from flowrl.runtime.staleness import StalenessViolation


def test_in_order_steps_keep_nothing_ahead():
    ledger = PromptLedger()
    for step in range(3):
        ledger.consume([4 * step + i for i in range(4)])
    assert ledger.watermark == 12 and ledger.delivered_ahead() == ()
    assert ledger.consumed == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_out_of_order_steps_move_the_watermark_once_the_gap_fills():
    ledger = PromptLedger()
    ledger.consume([0, 3, 5])
    assert (ledger.watermark, ledger.delivered_ahead()) == (1, (3, 5))
    ledger.consume([2, 1])
    assert (ledger.watermark, ledger.delivered_ahead()) == (4, (5,))


@pytest.mark.parametrize("twice", [0, 3], ids=["below-watermark", "ahead"])
def test_a_prompt_consumed_twice_is_a_bug(twice):
    ledger = PromptLedger()
    ledger.consume([0, 1, 3])
    with pytest.raises(StalenessViolation, match=f"prompt {twice} was consumed twice"):
        ledger.consume([twice])


def test_a_restored_ledger_skips_what_was_consumed_ahead():
    ledger = PromptLedger(watermark=4, ahead=(6, 9))
    assert ledger.skip == {6, 9} and ledger.delivered_ahead() == (6, 9)
    assert ledger.extra_steps(4) == 1 and ledger.extra_steps(1) == 2 and PromptLedger().extra_steps(4) == 0
    with pytest.raises(StalenessViolation):
        ledger.consume([6])
    ledger.consume([4, 5])
    assert ledger.watermark == 7 and ledger.delivered_ahead() == (9,)


def _batch(indices: list[int]) -> dict[str, torch.Tensor]:
    prompts = [[100 + i] * (1 + i % 3) for i in indices]  # each prompt's tokens name it, lengths differ
    ids, lens = pad_left(prompts, 0)
    return {"prompt_ids": ids, "prompt_lens": lens, "prompt_index": torch.tensor(indices)}


def test_read_ahead_fills_to_want_without_the_skipped_prompts():
    feed = iter([_batch([4, 5]), _batch([6, 7]), _batch([8, 9]), _batch([10, 11])])
    ledger = PromptLedger(watermark=4, ahead=(5, 8))
    got = ledger.read_ahead("gen", 3, lambda: next(feed))
    assert got["prompt_index"].tolist() == [4, 6, 7]  # 5 skipped; reads whole batches
    for row, i in enumerate(got["prompt_index"].tolist()):
        n = int(got["prompt_lens"][row])
        assert got["prompt_ids"][row, got["prompt_ids"].shape[1] - n :].tolist() == [100 + i] * n
    assert ledger.read_ahead("gen", 3, lambda: next(feed)) == {}  # holds enough already
    assert ledger.read_ahead("gen", 4, lambda: next(feed))["prompt_index"].tolist() == [9]  # 8 skipped
    assert ledger.pulled == {"gen": 4}


def test_a_continuous_feed_reads_k_batches_ahead_and_its_source_runs_longer():
    from flowrl.examples.longtail import build_longtail
    from flowrl.runtime.control.ledger import continuous_feeds
    from flowrl.runtime.staleness import StalenessGate

    graph = build_longtail(max_staleness=2, batching="continuous")
    (gen,) = graph.nodes_of_kind("generator")
    ((name, (source, P, k)),) = continuous_feeds(graph, StalenessGate.of(graph)).items()
    assert (name, k) == (gen.name, 2) and gen.name in [u.name for u in graph.users(source)]
    assert P == graph.node(source).source.batch_size
    assert continuous_feeds(build_longtail(max_staleness=2), StalenessGate.of(graph)) == {}  # lock step: none

    ledger = PromptLedger(feeds={"gen": ("prompts", 4, 2)})
    assert [ledger.want("gen", s) for s in range(3)] == [12, 16, 20]  # (s + 1 + k) * P
    assert ledger.steps_of("prompts", 10) == 13 and ledger.steps_of("gen", 10) == 10 == ledger.steps_of("policy", 10)
    ledger.restore(8, (9, 11, 13, 14, 15))  # five prompts skipped: two more source steps of 4
    assert ledger.steps_of("prompts", 10) == 15 and ledger.skip == {9, 11, 13, 14, 15} and ledger.watermark == 8
