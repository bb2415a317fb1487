"""Graph-to-graph rewrites that the command line offers: a graph is data, so a change is a new graph.

``with_engine(graph, engine)`` sets every generator's engine (``flowrl run hf_copy --engine vllm``);
the node checks what that engine accepts (``flowrl.graph.engines``).

``with_sharding(graph, sharding)`` sets how every policy holds its state on several ranks
(``flowrl run hf_copy --sharding fsdp --backend torchrun``): ``OptimizerConfig.sharding``.

``with_model_path(graph, path)`` points every Hugging Face model of a graph at another local
directory (``flowrl run qwen_math --model ~/models/Qwen2.5-0.5B-Instruct``): the model's ``path``,
its ``tokenizer`` when that named the old directory, and the tokenizer of every source that read the
old directory. Built-in models are left alone. The result is validated like any graph.

Example:
    >>> from flowrl.examples import build_example
    >>> g = with_model_path(build_example("hf_copy"), "/models/mine")
    >>> g.node("gen").model.path, g.node("prompts").source.tokenizer
    ('/models/mine', '/models/mine')
    >>> with_sharding(build_example("hf_copy"), "fsdp").node("policy").optimizer.sharding
    'fsdp'
"""

from __future__ import annotations

import msgspec

from flowrl.errors import ConfigError
from flowrl.graph.configs import HFModelConfig
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import TRAINABLE_KINDS, GeneratorNode, PolicyNode, SourceNode

__all__ = ["with_model_path", "with_engine", "with_sharding"]


def with_model_path(graph: Graph, path: str) -> Graph:
    """``graph`` with the policy's Hugging Face model at ``path``: every model (and tokenizer) read from
    the directory a policy trains (its generators' and references' too), not a reward model's own
    classifier or judge in another directory. A graph without an HF policy repoints every HF model.

    Raises:
        ConfigError: when the graph has no Hugging Face model to point elsewhere.
    """
    hf = [(n, m) for n in graph.nodes if isinstance(m := getattr(n, "model", None), HFModelConfig)]
    every = {m.path for _, m in hf}
    trained = {m.path for n, m in hf if n.kind in TRAINABLE_KINDS}
    old = trained or every
    if not old:
        raise ConfigError(
            f"--model {path!r}: graph {graph.name!r} has no Hugging Face model (its models are the built-in "
            "transformer); --model points HFModelConfig nodes at a local model directory"
        )
    nodes = []
    for node in graph.nodes:
        model = getattr(node, "model", None)
        if isinstance(model, HFModelConfig) and model.path in old:
            tokenizer = path if model.tokenizer in old else model.tokenizer
            node = msgspec.structs.replace(node, model=msgspec.structs.replace(model, path=path, tokenizer=tokenizer))
        elif isinstance(node, SourceNode) and node.source.tokenizer in old:
            node = msgspec.structs.replace(node, source=msgspec.structs.replace(node.source, tokenizer=path))
        nodes.append(node)
    return Graph(msgspec.structs.replace(graph.spec, nodes=tuple(nodes)), defaults=graph.defaults)


def with_engine(graph: Graph, engine: str) -> Graph:
    """``graph`` with every generator sampling with ``engine`` (``"builtin"`` or ``"vllm"``).

    Raises:
        ConfigError: when the graph has no generator, or a generator's settings do not suit ``engine``.
    """
    if not any(n.kind == "generator" for n in graph.nodes):
        raise ConfigError(f"--engine {engine!r}: graph {graph.name!r} has no generator")
    nodes = tuple(msgspec.structs.replace(n, engine=engine) if isinstance(n, GeneratorNode) else n for n in graph.nodes)
    return Graph(msgspec.structs.replace(graph.spec, nodes=nodes), defaults=graph.defaults)


def with_sharding(graph: Graph, sharding: str) -> Graph:
    """``graph`` with every policy's state held as ``sharding`` says on its ranks: ``"replicate"``
    (data-parallel replicas) or ``"fsdp"`` (FSDP2 shards; torchrun only, which ``run_graph`` checks).

    Raises:
        ConfigError: when the graph has no policy, or ``sharding`` is neither.
    """
    if not any(isinstance(n, PolicyNode) for n in graph.nodes):
        raise ConfigError(f"--sharding {sharding!r}: graph {graph.name!r} has no policy to shard")
    nodes = tuple(
        msgspec.structs.replace(n, optimizer=msgspec.structs.replace(n.optimizer, sharding=sharding)) if isinstance(n, PolicyNode) else n
        for n in graph.nodes
    )
    return Graph(msgspec.structs.replace(graph.spec, nodes=nodes), defaults=graph.defaults)
