"""What a graph needs calibrated: the widths of its models, and the shape of a vLLM generator's model.

The pass-rate tables are measured at ``measure.WIDTHS`` (32-256); a model wider than the table's
last width takes that width's rate, which under-rates it (a width-896 training pass runs ~1.2x the
rate of a width-256 one on this project's CPU). ``calibration_needs(graph)`` lists the widths of the
models the graph's nodes run (``ModelSpec.dim``: generators, policies, references, critics, reward
models: every node with a model), for ``measure(widths=...)``, and the model of its first vLLM
generator with the rows and new tokens of one of its calls (the sources' prompts per step x its
samples, its ``max_new_tokens``; at most ``MAX_VLLM_ROWS`` and ``MAX_VLLM_TOKENS``: the measurement's
time), for ``flowrl.calibration.vllm_rates`` (its decode rate and its weight-sync rate at that
shape), and whether a policy shards with FSDP2 (``sharding="fsdp"``: its collectives run over gloo
between the ranks' processes on a CPU, ``flowrl.calibration.gloo_rate``). ``flowrl calibrate --graph
GRAPH`` reads it.

Example:
    >>> from flowrl.examples import build_example
    >>> needs = calibration_needs(build_example("llamarl"))
    >>> needs.widths, needs.vllm_model is None, needs.gloo
    ((64,), True, False)
"""

from __future__ import annotations

import msgspec

from flowrl.graph.ir import Graph
from flowrl.graph.nodes import GeneratorNode, PolicyNode, SourceNode
from flowrl.modelspec import ModelSpec, model_from_config

__all__ = ["CalibrationNeeds", "calibration_needs", "MAX_VLLM_ROWS", "MAX_VLLM_TOKENS"]

#: Most rows and new tokens per row ``CalibrationNeeds`` asks vLLM's decode to be measured at.
MAX_VLLM_ROWS, MAX_VLLM_TOKENS = 64, 32


class CalibrationNeeds(msgspec.Struct, frozen=True, kw_only=True):
    """What ``calibration_needs`` found.

    Attributes:
        widths: the distinct model widths of the graph's nodes, ascending.
        vllm_model: the model shape of the graph's first generator with ``engine="vllm"``; None: none.
        vllm_rows: rows of one of its calls (capped); 0: no vLLM generator.
        vllm_new_tokens: its ``max_new_tokens`` (capped); 0: no vLLM generator.
        gloo: a policy shards with FSDP2 (``OptimizerConfig.sharding="fsdp"``): measure gloo's
            collective rate (``flowrl.calibration.gloo_rate``).
        policy_model: the first policy's model shape; None: no policy.
        policy_rows: sequences of its batch (the sources' prompts per step x its generator's samples,
            at most ``MAX_VLLM_ROWS``); policy_tokens: its generator's ``max_new_tokens`` (at most
            ``MAX_VLLM_TOKENS``): the shape ``flowrl.calibration.rank_passes`` runs the split passes at.
    """

    widths: tuple[int, ...] = ()
    vllm_model: ModelSpec | None = None
    vllm_rows: int = 0
    vllm_new_tokens: int = 0
    gloo: bool = False
    policy_model: ModelSpec | None = None
    policy_rows: int = 0
    policy_tokens: int = 0


def calibration_needs(graph: Graph) -> CalibrationNeeds:
    """The widths of ``graph``'s models and its first vLLM generator's model (module docstring)."""
    widths: set[int] = set()
    vllm: ModelSpec | None = None
    rows = tokens = 0
    prompts = sum(s.source.batch_size for s in graph.nodes_of(SourceNode)) or 1
    for node in graph.nodes:
        config = getattr(node, "model", None)
        if config is None:
            continue
        spec = model_from_config(config)
        widths.add(spec.dim)
        if vllm is None and isinstance(node, GeneratorNode) and node.engine == "vllm":
            vllm = spec
            rows = min(MAX_VLLM_ROWS, prompts * node.sampling.n_samples)
            tokens = min(MAX_VLLM_TOKENS, node.sampling.max_new_tokens)
    fsdp = any(getattr(getattr(n, "optimizer", None), "sharding", "replicate") == "fsdp" for n in graph.nodes)
    policy = next(iter(graph.nodes_of(PolicyNode)), None)
    gens = graph.nodes_of(GeneratorNode)
    p_rows = min(MAX_VLLM_ROWS, prompts * gens[0].sampling.n_samples) if gens else 0
    p_tokens = min(MAX_VLLM_TOKENS, gens[0].sampling.max_new_tokens) if gens else 0
    return CalibrationNeeds(
        widths=tuple(sorted(widths)), vllm_model=vllm, vllm_rows=rows, vllm_new_tokens=tokens, gloo=fsdp,
        policy_model=model_from_config(policy.model) if policy is not None else None, policy_rows=p_rows, policy_tokens=p_tokens,
    )
