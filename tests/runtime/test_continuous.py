"""Continuous batching and in-flight weights in runs: exactly-once delivery (also across one and two
resumes), each sample with the prompt its index names, staleness on the oldest token, and in-flight
polls that take the published version, record it on the tokens and report the swap."""

from __future__ import annotations

import pytest
import torch

from flowrl.examples.longtail import LONGTAIL_MODEL
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.ir import Graph
from flowrl.runtime.checkpointing.store import latest_checkpoint, read_meta
from flowrl.runtime.config import RunConfig
from flowrl.runtime.control.controller import Controller
from flowrl.runtime.run import run_graph
from tests.tolerances import rollout_logprob_atol


def _prompt_checker(graph: Graph, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Spy on every batch the trainer consumes: each sample's prompt tokens must be those of the prompt
    its ``prompt_index[group_ids[s]]`` names, as the source itself serves it (what a text scorer
    decodes and looks its row up by). Returns each batch's ``prompt_index``, in delivery order."""
    from flowrl.operators.source import PromptSource

    source = PromptSource(graph.node("prompts"))
    order: list[list[int]] = []
    original = Controller._on_train_step

    def spy(self, ex, seq, batch, info, idle):
        index, groups = batch["prompt_index"].tolist(), batch["group_ids"].tolist()
        for s, g in enumerate(groups):
            length = int(batch["sample_prompt_lens"][s])
            got = batch["sample_prompt_ids"][s, batch["sample_prompt_ids"].shape[1] - length :].tolist()
            assert got == source.prompt(index[g]), f"step {seq}: sample {s} holds another prompt than position {index[g]}'s"
        order.append(index)
        return original(self, ex, seq, batch, info, idle)

    monkeypatch.setattr(Controller, "_on_train_step", spy)
    return order


def test_each_sample_holds_the_prompt_its_index_names_when_groups_finish_out_of_order(monkeypatch):
    graph = _graph(k=2)
    order = _prompt_checker(graph, monkeypatch)
    run_graph(graph, RunConfig(steps=8, progress=False))
    delivered = [i for batch in order for i in batch]
    assert len(order) == 8 and delivered != sorted(delivered)  # groups did finish out of order


def _graph(*, k: int, in_flight: bool = False, **optimizer: int) -> Graph:
    b = GraphBuilder("lt", model=LONGTAIL_MODEL)
    prompts = b.source("prompts", task="longtail", batch_size=4)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=32, batching="continuous")
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:longtail_reward")
    policy = b.policy("policy", b.loss("aipo", gen, reward), lr=1e-3, **optimizer)
    b.weights(policy, gen, max_staleness=k, in_flight=in_flight)
    return b.build()


@pytest.mark.parametrize(
    "k, in_flight, backend",
    [(0, False, "local"), (2, False, "local"), (2, True, "local"), (2, True, "process")],
    ids=["sync", "async", "in-flight", "in-flight-process"],
)
def test_every_prompt_is_delivered_once_within_the_bound_on_its_oldest_token(k, in_flight, backend, monkeypatch):
    seen, spans = [], []
    original = Controller._on_train_step

    def spy(self, ex, seq, batch, info, idle):
        mask = batch["completion_mask"]
        versions = batch["token_versions"][mask]
        seen.append((seq, int(versions.min()), int(batch["rollout_version"])))
        for row, real in zip(batch["token_versions"], mask):
            ordered = row[real]
            assert bool((ordered[1:] >= ordered[:-1]).all())  # a sample's versions never go back
            spans.append(int(ordered[-1] - ordered[0]))
        return original(self, ex, seq, batch, info, idle)

    monkeypatch.setattr(Controller, "_on_train_step", spy)
    swaps, trace_step = [], Controller._trace_step

    def gen_info(self, ex, seq, t0, t1, info):  # what each generator step reports, in this process for every backend
        if ex.kind == "generator":
            swaps.append(info["slots/weight_swaps"])
        return trace_step(self, ex, seq, t0, t1, info)

    monkeypatch.setattr(Controller, "_trace_step", gen_info)
    result = run_graph(_graph(k=k, in_flight=in_flight), RunConfig(steps=8, progress=False, backend=backend))
    assert (max(swaps) > 0) == in_flight  # weights taken between decode steps only when in flight
    assert [r["slots/weight_swaps"] for r in result.rows] == swaps[:8]  # each step's row reports its generator step's
    assert all(0 < r["slots/utilisation"] <= 1 and r["slots/decode_steps"] >= 1 for r in result.rows)
    delivered = [i for step in result.consumed for i in step]
    assert len(delivered) == len(set(delivered)) == 8 * 4  # once each
    # Only prompts read (k batches ahead) are delivered; groups may finish out of order, so with k > 0 a
    # long one may still be decoding when the run stops (none is lost: the resume test below).
    assert max(delivered) < (8 + k) * 4 and (k or sorted(delivered) == list(range(32)))
    for seq, oldest, rollout_version in seen:
        assert oldest >= seq - k and oldest == rollout_version
    if k:  # samples carried across steps meet newer weights: their tokens record both versions
        assert max(spans) >= 1
    else:
        assert max(spans) == 0


@pytest.mark.parametrize("k, in_flight", [(1, False), (2, True)], ids=["k1", "k2-in-flight"])
def test_several_updates_per_batch_keep_the_bound_in_trainer_steps(k, in_flight, monkeypatch):
    """num_iterations=2 x num_mini_batches=2: U = 4 versions per step, only versions 4 * seq published.
    Every consumed batch's oldest token is at most k steps old (``U * seq - oldest <= U * k``), every
    prompt is delivered once, and carried samples span versions a step apart (multiples of U)."""
    seen = []
    original = Controller._on_train_step

    def spy(self, ex, seq, batch, info, idle):
        versions = batch["token_versions"][batch["completion_mask"]]
        seen.append((seq, int(versions.min()), sorted({int(v) for v in versions.tolist()})))
        return original(self, ex, seq, batch, info, idle)

    monkeypatch.setattr(Controller, "_on_train_step", spy)
    result = run_graph(_graph(k=k, in_flight=in_flight, num_iterations=2, num_mini_batches=2), RunConfig(steps=8, progress=False))
    assert [r["policy_version"] for r in result.rows] == [4 * s for s in range(1, 9)]
    delivered = [i for step in result.consumed for i in step]
    assert len(delivered) == len(set(delivered)) == 8 * 4
    for seq, oldest, versions in seen:
        assert 4 * seq - oldest <= 4 * k, (seq, oldest)
        assert all(v % 4 == 0 for v in versions), versions
    assert max(4 * seq - oldest for seq, oldest, _ in seen) == 4 * k  # the bound is used, not just kept
    assert all(0 <= r["staleness"] <= 4 * k for r in result.rows)


@pytest.mark.parametrize("updates", [{}, {"num_iterations": 2}], ids=["one-update", "two-updates"])
def test_exactly_once_across_a_stop_and_resume(tmp_path, updates):
    graph = _graph(k=2, **updates)
    first = run_graph(graph, RunConfig(steps=2, progress=False, checkpoint_dir=str(tmp_path), checkpoint_every=2))
    meta = read_meta(latest_checkpoint(tmp_path), graph)
    assert meta.delivered_ahead  # groups delivered out of order before the checkpoint: what the resume must skip
    second = run_graph(graph, RunConfig(steps=10, progress=False, checkpoint_dir=str(tmp_path), resume=True))
    delivered = [i for step in first.consumed + second.consumed for i in step]
    assert len(delivered) == len(set(delivered)) == 10 * 4
    assert sorted(delivered)[:32] == list(range(32))  # a prefix of the stream, whatever order it came in


def test_exactly_once_across_two_resumes_in_a_row(tmp_path, monkeypatch):
    """Stop at 2, resume to 4, stop, resume to 10: every prompt delivered once, with the prompt its index
    names; each checkpoint's data position is the first prompt not delivered by then (past those
    delivered ahead of it), and its ``delivered_ahead`` are exactly the ones delivered above it."""
    graph = _graph(k=2)
    order = _prompt_checker(graph, monkeypatch)
    metas, delivered_by = [], []
    for steps in (2, 4, 10):
        config = RunConfig(steps=steps, progress=False, checkpoint_dir=str(tmp_path), checkpoint_every=100, resume=steps > 2)
        run_graph(graph, config)
        metas.append(read_meta(latest_checkpoint(tmp_path), graph))
        delivered_by.append([i for batch in order for i in batch])
    delivered = delivered_by[-1]
    assert len(order) == 10 and len(delivered) == len(set(delivered)) == 10 * 4
    assert sorted(delivered)[:32] == list(range(32))
    for meta, so_far in zip(metas, delivered_by):
        position, ahead = meta.data_position, set(so_far)
        assert set(range(position)) <= ahead and position not in ahead  # the watermark: first prompt not delivered
        assert list(meta.delivered_ahead) == sorted(i for i in ahead if i > position)
    assert metas[0].delivered_ahead and metas[1].delivered_ahead  # both resumes had prompts delivered ahead to skip
    assert metas[0].data_position < metas[1].data_position < metas[2].data_position


def _in_flight_program(tmp_path):
    """Node ``gen`` of an in-flight continuous graph as its program, over an inprocess edge whose
    writer this test holds; the policy's initial weights (version 0) published."""
    from flowrl.runtime.programs.table import build_program
    from flowrl.runtime.programs.nodes import ProgramEnv, SharedTransports
    from flowrl.runtime.weights.edges import transport_specs

    graph = _graph(k=2, in_flight=True)
    specs = transport_specs(graph, str(tmp_path))
    transports = SharedTransports(specs)
    program = build_program(graph, "gen", ProgramEnv(transports=specs, weight_timeout_s=10.0), transports)
    writer = transports.writer("policy", "gen")
    writer.publish({k: v.clone() for k, v in program.generator.weight_targets().items()}, 0)
    return graph, program, writer, transports


def _perturbed(weights, seed: int):
    noise = torch.Generator().manual_seed(seed)
    return {k: v + 0.3 * torch.randn(v.shape, generator=noise) for k, v in weights.items()}


def test_an_unsharded_generators_poll_takes_the_published_version_and_its_weights(tmp_path):
    """The policy published version 3 (versions 1 and 2 never reached this generator): one poll loads
    those weights and sets the version to 3; a poll with nothing newer changes nothing."""
    _, program, writer, transports = _in_flight_program(tmp_path)
    try:
        v3 = _perturbed(program.generator.weight_targets(), seed=1)
        writer.publish(v3, 3)
        program._poll()
        assert program.generator.version == 3
        for name, value in program.generator.weight_targets().items():
            assert torch.equal(value, v3[name]), name
        program._poll()
        assert program.generator.version == 3
    finally:
        transports.close()


def test_in_flight_tokens_record_the_version_loaded_and_the_step_reports_the_swap(tmp_path, monkeypatch):
    """Version 3 is published after decode step 4 of the generator's first step: the tokens drawn
    before carry version 0, those after carry 3 (the version loaded, not 1), the step reports one
    weight swap, and a sample drawn wholly by either version has the log-probs of that version's
    model (a full forward pass of the prompt and completion, alone)."""
    from flowrl.operators.generation import Generator
    from flowrl.operators.logprobs import completion_logprobs
    from flowrl.operators.slots import SlotBatcher
    from flowrl.operators.source import PromptSource, pad_left

    graph, program, writer, transports = _in_flight_program(tmp_path)
    weights = {0: {k: v.clone() for k, v in program.generator.weight_targets().items()}}
    weights[3] = _perturbed(weights[0], seed=1)
    original = SlotBatcher.step

    def step(self, admit=None):
        finished = original(self, admit)
        if self.steps == 6:
            writer.publish(weights[3], 3)
        return finished

    monkeypatch.setattr(SlotBatcher, "step", step)
    source = PromptSource(graph.node("prompts"))
    try:
        ids, lens = pad_left([source.prompt(i) for i in range(12)], 0)  # what the controller reads ahead: (1 + k) * P prompts
        rollout, info = program.step(0, {"prompt_ids": ids, "prompt_lens": lens, "prompt_index": torch.arange(12)}, -2)  # k = 2
        rollouts = [rollout, program.step(1, {}, -1)[0]]
    finally:
        transports.close()
    reference = {}
    for v, state in weights.items():
        gen = Generator(graph.node("gen"))
        gen.load_weights(state, v)
        reference[v] = gen.model
    whole = {0: 0, 3: 0}
    for r in rollouts:
        mask = r["completion_mask"]
        assert set(r["token_versions"][mask].tolist()) <= {0, 3}
        for s in range(mask.shape[0]):
            versions = set(r["token_versions"][s][mask[s]].tolist())
            if len(versions) != 1:
                continue
            (v,) = versions
            whole[v] += 1
            n = int(r["sample_prompt_lens"][s])
            ids, lens = pad_left([r["sample_prompt_ids"][s, -n:].tolist()], 0)
            with torch.no_grad():
                mu = completion_logprobs(reference[v], ids, lens, r["completion_ids"][s : s + 1], mask[s : s + 1])
            one = {"sample_prompt_ids": ids, "sample_prompt_lens": lens, "completion_ids": r["completion_ids"][s : s + 1], "completion_mask": mask[s : s + 1]}
            torch.testing.assert_close(r["behaviour_logprobs"][s : s + 1], mu, rtol=0, atol=rollout_logprob_atol(reference[v], one))
    assert whole[0] and whole[3], whole
    assert any(set(r["token_versions"][s][r["completion_mask"][s]].tolist()) == {0, 3} for r in rollouts for s in range(r["completion_mask"].shape[0]))
    assert info["slots/weight_swaps"] == 1
