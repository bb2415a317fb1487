"""The workload of one RL step: prompts, samples per prompt, prompt and generation lengths.

Every predicted time depends on it, so a ``Plan`` records it. From a graph it is read off the
nodes (the source's batch size, the generator's ``n_samples``, ``max_new_tokens`` and batching
mode, ``sampling.batching`` when the graph's config has one, else lock-step). ``prompt_len`` is
the longest prompt the run encodes: the ``max_prompt_len`` of the source feeding the generator when
it sets one, else the longest prompt the model accepts (``max_seq_len - max_new_tokens``), the
same limit the run uses (``flowrl.data.wiring.default_max_prompt_len``); both are upper bounds. A
source that reads a prompt file has the lengths of its prompts instead, but the planner reads no
files: ``flowrl plan`` measures them (``flowrl.cli.prompt_lengths``) and passes ``prompt_len``, and
``prompt_len_from`` says where the length came from. Completion lengths (``lengths``, a
``flowrl.planners.lengths.LengthDistribution``) default to every completion running to
``gen_len``; a real run's metrics file, or a mean and tail, replace that. Dry-runs of published models
(``--model llama3-70b``) use ``LLM_DEFAULTS`` instead, a math-reasoning-sized step.

Example:
    >>> Workload(prompts_per_step=4, samples_per_prompt=2, prompt_len=10, gen_len=6).tokens_per_step
    128
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from flowrl.errors import PlanError
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import GeneratorNode, SourceNode
from flowrl.planners.lengths import Batching, LengthDistribution, check_batching, fixed_lengths

if TYPE_CHECKING:
    from flowrl.modelspec import ModelSpec

__all__ = ["Workload", "LLM_DEFAULTS", "workload_from_graph", "graph_batching", "default_workload", "check_context"]


class Workload(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Tokens of one trainer step.

    Attributes:
        prompts_per_step: prompts the trainer consumes per optimizer step.
        samples_per_prompt: completions per prompt (the AIPO group size).
        prompt_len: tokens per prompt.
        gen_len: the longest completion (the generator's ``max_new_tokens``).
        lengths: how long completions are; None: every one runs to ``gen_len``.
        batching: the generator's batching mode, ``"lockstep"`` or ``"continuous"``
            (``flowrl.planners.lengths``).
        env_s: seconds per step the generator waits on environments (multi-turn rollouts,
            ``flowrl.operators.multiturn``): a generator-side delay added to its estimated time
            (``estimate.generate``). A graph cannot know it: 0 unless given (a run's metrics rows
            report it as ``env/seconds``).
        prompt_len_from: where ``prompt_len`` came from, for the plan's reader (``""``: not said).
    """

    prompts_per_step: int
    samples_per_prompt: int
    prompt_len: int
    gen_len: int
    lengths: LengthDistribution | None = None
    batching: Batching = "lockstep"
    env_s: float = 0.0
    prompt_len_from: str = ""

    def __post_init__(self) -> None:
        if not (self.env_s >= 0.0 and self.env_s != float("inf")):
            raise PlanError(f"workload env_s={self.env_s} must be a finite number >= 0 (seconds per step)")
        for name in ("prompts_per_step", "samples_per_prompt", "prompt_len", "gen_len"):
            if getattr(self, name) < 1:
                raise PlanError(f"workload {name}={getattr(self, name)} must be >= 1")
        check_batching(self.batching, "workload")
        if self.lengths is not None and self.lengths.max_len > self.gen_len:
            raise PlanError(
                f"workload: completion lengths reach {self.lengths.max_len} tokens, over gen_len={self.gen_len} "
                f"(max_new_tokens); raise --gen-len to at least {self.lengths.max_len}"
            )

    @property
    def length_dist(self) -> LengthDistribution:
        """``lengths``, or every completion ``gen_len`` long."""
        return self.lengths if self.lengths is not None else fixed_lengths(self.gen_len)

    @property
    def mean_gen_len(self) -> float:
        """Mean generated tokens per completion."""
        return self.lengths.mean if self.lengths is not None else float(self.gen_len)

    @property
    def mean_seq_len(self) -> float:
        """Mean tokens per sequence (prompt + completion): what a trainer packing sequences processes."""
        return self.prompt_len + self.mean_gen_len

    @property
    def sequences(self) -> int:
        """Completions per step: prompts x samples."""
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len

    @property
    def tokens_per_step(self) -> int:
        """Tokens the trainer processes per step (prompt + completion of every sequence)."""
        return self.sequences * self.seq_len

    @property
    def generated_tokens(self) -> int:
        return self.sequences * self.gen_len

    def short(self) -> str:
        lengths = f", completions {self.lengths.short()}" if self.lengths is not None else ""
        batching = f", {self.batching} batching" if self.batching != "lockstep" else ""
        prompt = f", prompt length from {self.prompt_len_from}" if self.prompt_len_from else ""
        return (
            f"{self.prompts_per_step} prompts x {self.samples_per_prompt} samples, "
            f"{self.prompt_len}+{self.gen_len} tokens ({self.tokens_per_step:,} tokens/step){lengths}{batching}{prompt}"
        )


#: Workload of the ``--model`` dry-runs: 2048 completions of 512 + 2048 tokens (5.2M tokens/step).
LLM_DEFAULTS = Workload(prompts_per_step=256, samples_per_prompt=8, prompt_len=512, gen_len=2048)


def workload_from_graph(graph: Graph, **overrides: object) -> Workload:
    """The step workload the graph declares, with ``overrides`` (non-None keyword arguments) applied.

    ``prompt_len`` is the ``max_prompt_len`` of the source feeding the first generator, when set,
    else that generator's ``max_seq_len - max_new_tokens`` (``prompt_len_from`` says which, or
    ``"given"`` for an override without a ``prompt_len_from`` of its own).

    The batching mode is the first generator's ``sampling.batching`` when its config has that field
    (``"lockstep"`` otherwise).

    Raises:
        PlanError: if the graph has no source or no generator to read from and nothing overrides it.
    """
    sources = graph.nodes_of(SourceNode)
    gens = graph.nodes_of(GeneratorNode)
    values: dict[str, Any] = {  # Workload's fields, of several types
        "prompts_per_step": sum(s.source.batch_size for s in sources) if sources else None,
        "samples_per_prompt": max(g.sampling.n_samples for g in gens) if gens else None,
        "gen_len": max(_model_tokens(g) for g in gens) if gens else None,
        "prompt_len": None,
    }
    optional: dict[str, Any] = {"batching": graph_batching(graph)}
    if gens:
        g = gens[0]
        limits = [p.source.max_prompt_len for p in graph.producers(g.name) if isinstance(p, SourceNode) and p.source.max_prompt_len]
        if limits:
            values["prompt_len"] = max(limits)
            optional["prompt_len_from"] = "the upper bound max_prompt_len of the source"
        else:
            values["prompt_len"] = max(1, g.model.max_seq_len - _model_tokens(g))
            optional["prompt_len_from"] = f"the upper bound max_seq_len - max_new_tokens of generator {g.name!r}"
    if overrides.get("prompt_len") is not None:
        optional["prompt_len_from"] = "given"
    optional.update({k: overrides.pop(k) for k in ("lengths", "batching", "env_s", "prompt_len_from") if overrides.get(k) is not None})
    values.update({k: v for k, v in overrides.items() if v is not None})
    missing = [k for k, v in values.items() if v is None]
    if missing:
        flags = {"prompts_per_step": "--prompts-per-step", "samples_per_prompt": "--samples", "prompt_len": "--prompt-len", "gen_len": "--gen-len"}
        raise PlanError(f"graph {graph.name!r} does not say its {', '.join(missing)}; give {' and '.join(flags[m] for m in missing)}")
    return Workload(**values, **optional)


def _model_tokens(gen: GeneratorNode) -> int:
    """The most tokens a generator's model samples per completion: ``max_new_tokens`` per model turn, times
    ``max_turns`` for a multi-turn generator (``env``; its environments' tokens are not sampled)."""
    return gen.sampling.max_new_tokens * (gen.env.max_turns if gen.env is not None else 1)


def graph_batching(graph: Graph) -> str:
    """The batching mode of the graph's first generator (``sampling.batching`` if the config has it), else ``"lockstep"``."""
    gens = graph.nodes_of(GeneratorNode)
    return gens[0].sampling.batching if gens else "lockstep"


def default_workload(graph: Graph, *, model_override: bool = False, **overrides: object) -> Workload:
    """``LLM_DEFAULTS`` when a published model is planned (``model_override`` or a node's ``preset``),
    else what the graph declares; non-None ``overrides`` replace single fields either way."""
    presets = any(getattr(getattr(n, "model", None), "preset", None) for n in graph.nodes)
    if model_override or presets:
        given = {k: v for k, v in overrides.items() if v is not None}
        said = {"prompt_len_from": "given" if "prompt_len" in given else "the published-model defaults (LLM_DEFAULTS)"}
        return Workload(**{**msgspec.structs.asdict(LLM_DEFAULTS), "batching": graph_batching(graph), **said, **given})
    return workload_from_graph(graph, **overrides)


def check_context(workload: Workload, models: Mapping[str, ModelSpec]) -> None:
    """Refuse a workload whose sequences (prompt + completion) are longer than a node's model accepts.

    Args:
        workload: the step's tokens.
        models: node name -> the model shape planned for it.

    Raises:
        PlanError: naming the node, the model, prompt + generation length against its context, and
            the fix.
    """
    for name, model in models.items():
        if workload.seq_len <= model.max_seq_len:
            continue
        room = model.max_seq_len - workload.prompt_len
        fix = f"lower --gen-len (the generator's max_new_tokens) to at most {room:,}" if room >= 1 else "shorten --prompt-len"
        raise PlanError(
            f"node {name!r}: prompt_len {workload.prompt_len:,} + max_new_tokens {workload.gen_len:,} = {workload.seq_len:,} tokens, "
            f"longer than the {model.max_seq_len:,}-token context of model {model.name}; {fix}, or plan a model with a longer context"
        )
