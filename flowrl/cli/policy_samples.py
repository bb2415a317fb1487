"""What a checkpoint's policy writes: load a checkpoint with its graph, sample, score, decode.

Shared by ``flowrl sample`` and ``flowrl eval``. A checkpoint directory (``step-*``, or a checkpoint
root whose ``LATEST`` names one) holds ``graph.json``; the generator that the policy feeds samples
with the policy's weights, the graph's scorers score, and ``decode`` turns ids into text with the
task's tokenizer (the one place to extend for other model families).

Held-out prompts: a task is an endless, seeded stream indexed from 0 and a run reads indices
``0 .. data_position - 1``; ``HELD_OUT_START`` (2**40) is beyond what any run reads, so the prompts
from there on are ones training never consumed. A task with few distinct prompts (``copy``: 1000)
can still repeat a training prompt's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowrl.errors import CheckpointError, ConfigError
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import GeneratorNode, ScorerNode

__all__ = ["HELD_OUT_START", "LoadedPolicy", "load_policy", "decode", "rollout", "Scored"]

#: First prompt index of held-out prompts: beyond anything a training run reads.
HELD_OUT_START = 1 << 40


@dataclass
class LoadedPolicy:
    """A checkpoint's graph, its generator with the policy's weights, the task and the scorers."""

    path: Path
    graph: Graph
    version: int
    generator: Any
    generator_node: GeneratorNode
    task: Any
    scorers: list[Any]
    reward_weights: dict[str, float]


@dataclass
class Scored:
    """One prompt and completion, decoded, with its total reward and each scorer's."""

    prompt: str
    completion: str
    reward: float
    rewards: dict[str, float]


def _step_dir(path: Path) -> Path:
    from flowrl.runtime.checkpoint import latest_checkpoint

    if (path / "meta.json").is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; give a --checkpoint-dir or one of its step-* directories")
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointError(f"{str(path)!r} holds no checkpoint (no meta.json, no LATEST); give a --checkpoint-dir or one of its step-* directories")
    return found


def load_policy(path: str | Path, *, seed: int = 0) -> LoadedPolicy:
    """The policy of the checkpoint at ``path`` (a step directory or a checkpoint root), ready to sample.

    Raises:
        CheckpointError: for a missing or incomplete checkpoint, one without its graph, or a graph
            with no generator fed by a policy.
    """
    from flowrl.graph.serialize import from_json
    from flowrl.operators.generation import Generator
    from flowrl.operators.scoring import Scorer
    from flowrl.operators.tasks import make_task
    from flowrl.runtime.checkpoint import GRAPH_FILE, read_meta

    step = _step_dir(Path(path))
    if not (step / GRAPH_FILE).is_file():
        raise CheckpointError(
            f"checkpoint {step} has no {GRAPH_FILE} (written by a flowrl from before checkpoints stored their graph); "
            "resume the run for one step with this flowrl to write a checkpoint that has it"
        )
    graph = from_json((step / GRAPH_FILE).read_bytes())
    meta = read_meta(step, graph)
    edges = [(w.src, w.dst) for w in graph.weight_edges if w.src in meta.files and graph.node(w.dst).kind == "generator"]
    if not edges:
        raise CheckpointError(f"checkpoint {step}: graph {graph.name!r} has no generator that receives a saved policy's weights")
    policy_name, gen_name = edges[0]
    state = torch.load(step / meta.files[policy_name], weights_only=True)
    gen_node = graph.node(gen_name)
    generator = Generator(gen_node, seed=seed)  # type: ignore[arg-type]
    generator.load_weights(state["model"], int(state["version"]))
    source = next(n for n in graph.nodes_of_kind("source"))
    loss = next(iter(graph.nodes_of_kind("loss")), None)
    return LoadedPolicy(
        path=step,
        graph=graph,
        version=int(state["version"]),
        generator=generator,
        generator_node=gen_node,  # type: ignore[arg-type]
        task=make_task(source.source.task, source.source.seed),  # type: ignore[attr-defined]
        scorers=[Scorer(n) for n in graph.nodes if isinstance(n, ScorerNode)],
        reward_weights=dict(loss.loss.reward_weights) if loss is not None else {"rewards": 1.0},  # type: ignore[attr-defined]
    )


def decode(policy: LoadedPolicy, ids: Sequence[int]) -> str:
    """The text of token ``ids`` (the task's tokenizer: the built-in model's)."""
    tokenizer = getattr(policy.task, "tokenizer", None)
    if tokenizer is None:
        return " ".join(map(str, ids))
    return tokenizer.decode([int(i) for i in ids])


def rollout(policy: LoadedPolicy, indices: Sequence[int], *, n_samples: int, greedy: bool) -> list[Scored]:
    """Sample ``n_samples`` completions (or one greedy one) for the task's prompts ``indices``; score and decode them.

    Raises:
        ConfigError: when the task gives an empty prompt.
    """
    import msgspec

    from flowrl.operators.scoring import unpad
    from flowrl.operators.source import pad_left

    prompts = [policy.task.prompt(i) for i in indices]
    if any(not len(p) for p in prompts):
        raise ConfigError(f"task {policy.task!r} gave an empty prompt")
    ids, lens = pad_left(prompts, int(getattr(policy.task, "pad_id", 0)))
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

