"""What a policy writes: load a checkpoint (or a run's weights) with its graph, sample, score, decode.

Shared by ``flowrl sample``, ``flowrl eval`` and evaluation during training (``flowrl.runtime.evaluation.during_run``,
which builds a ``LoadedPolicy`` from the running graph with ``policy_on_rows`` and loads each
evaluated version's weights with ``load_weights``). A checkpoint directory (``step-*``, or a checkpoint
root whose ``LATEST`` names one) holds ``graph.json``; the generator that the policy feeds samples
with the policy's weights (built-in or Hugging Face), the graph's scorers score (text scorers with
their rows' fields), and ``decode`` turns ids into text with the generator model's tokenizer.

Which prompts (``eval_positions``): a built-in task is an endless, seeded stream indexed from 0 and
a run reads indices ``0 .. data_position - 1``; ``HELD_OUT_START`` (2**40) is beyond what any run
reads, so the prompts from there on are ones training never consumed (a task with few distinct
prompts, ``copy``: 1000, can still repeat a training prompt's text). A prompt file has no such
tail: give held-out rows as another file (``data=``), read in file order from its first row;
without one, the training file's first rows are used and ``held_out`` says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowrl.errors import CheckpointError, ConfigError
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import GeneratorNode, LossNode, ScorerNode, SourceNode

__all__ = ["HELD_OUT_START", "LoadedPolicy", "load_policy", "policy_on_rows", "rows_and_scorers", "reward_model_scorers", "load_weights", "decode", "eval_positions", "rollout", "Scored"]

#: First prompt index of held-out prompts: beyond anything a training run reads.
HELD_OUT_START = 1 << 40


@dataclass
class LoadedPolicy:
    """A checkpoint's graph, its generator with the policy's weights, the prompt source and the scorers.

    Attributes:
        held_out: whether ``eval_positions`` gives prompts training never read.
    """

    path: Path
    graph: Graph
    version: int
    generator: Any
    generator_node: GeneratorNode
    source: Any
    scorers: list[Any]
    reward_weights: dict[str, float]
    decode_ids: Any
    held_out: bool


@dataclass
class Scored:
    """One prompt and completion, decoded, with its total reward and each scorer's."""

    prompt: str
    completion: str
    reward: float
    rewards: dict[str, float]


def _step_dir(path: Path) -> Path:
    from flowrl.runtime.checkpointing.store import latest_checkpoint

    if (path / "meta.json").is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; give a --checkpoint-dir or one of its step-* directories")
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointError(f"{str(path)!r} holds no checkpoint (no meta.json, no LATEST); give a --checkpoint-dir or one of its step-* directories")
    return found


def load_policy(path: str | Path, *, seed: int = 0, data: str | None = None) -> LoadedPolicy:
    """The policy of the checkpoint at ``path`` (a step directory or a checkpoint root), ready to sample.

    Args:
        path: a step directory or a checkpoint root.
        seed: seed of sampling.
        data: a prompt file of held-out rows for a graph whose source reads a file (same fields).

    Raises:
        CheckpointError: for a missing or incomplete checkpoint, one without its graph, or a graph
            with no generator fed by a policy.
        ConfigError: ``data`` for a graph whose source is a task, or a file that cannot be read or
            lacks a field the prompt or a scorer needs.
    """
    from flowrl.graph.serialize import from_json
    from flowrl.runtime.checkpointing.store import GRAPH_FILE, read_meta
    from flowrl.runtime.checkpointing.sharded_state import read_state

    step = _step_dir(Path(path))
    if not (step / GRAPH_FILE).is_file():
        raise CheckpointError(
            f"checkpoint {step} has no {GRAPH_FILE} (written by a flowrl from before checkpoints stored their graph); "
            "resume the run for one step with this flowrl to write a checkpoint that has it"
        )
    graph = from_json((step / GRAPH_FILE).read_bytes())
    meta = read_meta(step, graph)
    saved = [w.src for w in graph.weight_edges if w.src in meta.files and graph.node(w.dst).kind == "generator"]
    if not saved:
        raise CheckpointError(f"checkpoint {step}: graph {graph.name!r} has no generator that receives a saved policy's weights")
    policy = policy_on_rows(graph, policy=saved[0], seed=seed, data=data)
    policy.path = step
    load_weights(policy, read_state(step / meta.files[saved[0]]))  # one file, or a sharded policy's shards consolidated
    return policy


def policy_on_rows(graph: Graph, *, policy: str | None = None, seed: int = 0, data: str | None = None) -> LoadedPolicy:
    """A generator of ``graph`` that ``policy`` feeds (the first policy if None), its scorers and
    prompt source, with the generator's initial weights (``load_weights`` sets a policy's).

    With ``data``, a graph whose source reads a file reads ``data`` instead (same fields), in file
    order from its first row; without it, the source's own file, also in file order.

    Raises:
        CheckpointError: when no generator receives ``policy``'s weights.
        ConfigError: ``data`` for a graph whose source is a task, or a file that cannot be read or
            lacks a field the prompt or a scorer needs.
    """
    from flowrl.models.registry import model_tokens
    from flowrl.operators.generation import Generator

    edges = [(w.src, w.dst) for w in graph.weight_edges if (policy is None or w.src == policy) and graph.node(w.dst).kind == "generator"]
    if not edges:
        raise CheckpointError(f"graph {graph.name!r} has no generator that receives policy {policy!r}'s weights")
    gen_node = graph.node_of(edges[0][1], GeneratorNode)
    graph, prompts, scorers = rows_and_scorers(graph, data)
    scorers += reward_model_scorers(graph)
    loss = next(iter(graph.nodes_of(LossNode)), None)
    return LoadedPolicy(
        path=Path(prompts.config.data or "."),
        graph=graph,
        version=0,
        generator=Generator(gen_node, seed=seed),
        generator_node=gen_node,
        source=prompts,
        scorers=scorers,
        reward_weights=dict(loss.loss.reward_weights) if loss is not None else {"rewards": 1.0},
        decode_ids=model_tokens(gen_node.model).decode,
        held_out=prompts.stream is None or bool(data),
    )


def rows_and_scorers(graph: Graph, data: str | None = None) -> tuple[Graph, Any, list[Any]]:
    """``graph`` with its source reading ``data`` (if given; a file source only) in file order, that
    source's ``PromptSource`` and the graph's scorers (text scorers with the rows' fields): what
    scoring rows needs, without a model.

    Raises:
        ConfigError: ``data`` for a graph whose source is a task, or a file that cannot be read or
            lacks a field the prompt or a scorer needs.
    """
    import msgspec

    from flowrl.operators.scoring import Scorer
    from flowrl.operators.source import PromptSource
    from flowrl.operators.text_inputs import TextInputs

    source = next(n for n in graph.nodes_of(SourceNode))
    config = source.source
    if data and not config.data:
        raise ConfigError(f"--data {data!r}: graph {graph.name!r} draws prompts from task {config.task!r}, not a file; drop --data")
    if config.data:  # file order, from the first row: positions name rows
        config = msgspec.structs.replace(config, data=data or config.data, shuffle=False)
        source = msgspec.structs.replace(source, source=config)
        nodes = tuple(source if n.name == source.name else n for n in graph.nodes)
        graph = type(graph)(msgspec.structs.replace(graph.spec, nodes=nodes), validate=False)
    prompts = PromptSource(source)  # reads the file: a missing file or prompt field fails here
    scorers = [Scorer(n, TextInputs(graph, n.name) if n.inputs == "text" else None) for n in graph.nodes if isinstance(n, ScorerNode)]
    return graph, prompts, scorers


class _ModelScorer:
    """A reward-model node as a scorer: ``score`` gives its reward field (its metrics are dropped)."""

    def __init__(self, reward_model: Any) -> None:
        self.reward_model = reward_model

    def score(self, rollout: Any) -> dict[str, Any]:
        return self.reward_model.score(rollout)[0]


def reward_model_scorers(graph: Graph) -> list[Any]:
    """The graph's reward-model nodes as scorers, each with its model loaded (on the CPU): without
    them a reward a reward model gives would count as 0 in every score."""
    from flowrl.graph.nodes import RewardModelNode
    from flowrl.operators.reward_models import RewardModel
    from flowrl.operators.text_inputs import TextInputs

    return [_ModelScorer(RewardModel(n, TextInputs(graph, n.name))) for n in graph.nodes if isinstance(n, RewardModelNode)]


def load_weights(policy: LoadedPolicy, state: dict[str, Any]) -> None:
    """Load a policy's saved state (``PolicyProgram.save``: ``model`` and ``version``) into ``policy``'s generator."""
    targets = policy.generator.weight_targets()  # a checkpoint's state_dict also lists tied aliases (lm_head.weight)
    policy.version = int(state["version"])
    policy.generator.load_weights({k: v for k, v in state["model"].items() if k in targets}, policy.version)


def eval_positions(policy: LoadedPolicy, n: int) -> range:
    """Stream positions of ``n`` evaluation prompts (see the module docstring)."""
    if policy.source.stream is None:
        return range(HELD_OUT_START, HELD_OUT_START + n)
    return range(min(n, len(policy.source.stream)))


def decode(policy: LoadedPolicy, ids: Sequence[int]) -> str:
    """The text of token ``ids`` with the generator model's tokenizer (special tokens kept)."""
    return policy.decode_ids([int(i) for i in ids])


def rollout(policy: LoadedPolicy, indices: Sequence[int], *, n_samples: int, greedy: bool) -> list[Scored]:
    """Sample ``n_samples`` completions (or one greedy one) for the task's prompts ``indices``; score and decode them.

    Raises:
        ConfigError: when the task gives an empty prompt.
    """
    import msgspec
    import torch

    from flowrl.operators.scoring import unpad
    from flowrl.operators.source import pad_left

    prompts = [policy.source.prompt(i) for i in indices]
    if any(not len(p) for p in prompts):
        raise ConfigError(f"source {policy.source.name!r} gave an empty prompt")
    ids, lens = pad_left(prompts, policy.source.pad_id)
    trained = policy.generator_node.sampling  # the graph's settings; greedy keeps only the most likely token
    policy.generator.sampling = msgspec.structs.replace(
        trained, n_samples=1 if greedy else n_samples, top_k=1 if greedy else trained.top_k
    )
    out = policy.generator.generate({"prompt_ids": ids, "prompt_lens": lens, "prompt_index": torch.tensor(list(indices))})
    rewards = {}
    for scorer in policy.scorers:
        rewards.update({k: v.tolist() for k, v in scorer.score(out).items()})
    prompt_rows, completion_rows = unpad(out)
    scored = []
    for i, (p, c) in enumerate(zip(prompt_rows, completion_rows)):
        mine = {k: float(v[i]) for k, v in rewards.items()}
        total = sum(w * mine.get(k, 0.0) for k, w in policy.reward_weights.items())
        scored.append(Scored(prompt=decode(policy, p), completion=decode(policy, c), reward=total, rewards=mine))
    return scored

