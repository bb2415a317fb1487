"""Preflight checks a run makes before it allocates anything: does the graph fit in this machine, can its
generator engines run here, does every node's program run the mesh the placement gives it?

Each check refuses before any work, naming the node, the values and the fix:

- ``check_engines``: every generator's engine is installed and able to load its model here, under a
  backend it runs on, as its ``ENGINE_CAPS`` row says (and no weight edge into a CPU vLLM
  mixture-of-experts generator, whose MoE kernel ignores a sync);
- ``check_meshes``: every node's mesh axes of size > 1 are ones its program runs on the backend, as
  the mesh capability table ``flowrl.mesh_support`` says (``MESH_SUPPORT``: kind, a generator's
  engine, axis and backend; ``COMBINATIONS``: axes that run alone but not together or not with a
  node's settings), saying what would run instead; it runs in ``run_graph``, in the local and
  process backends' driver and on every torchrun rank, default placements included
  (``executor_placement.one_device_meshes``);
- ``check_engine_meshes``: a vLLM generator's tp no larger than its ranks, nor on a CPU than the
  cores a process may use;
- ``check_fits_in_memory`` / ``check_ranks_fit``: the models' memory against this machine's or each
  rank's;
- ``check_packing_families``: ``packing=True`` only on model families that take packed rows;
- ``check_teachers``: a teacher's Hugging Face tokenizer is its student's (on every backend and
  torchrun rank).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from flowrl.errors import ConfigError
from flowrl.graph.ir import Graph
from flowrl.graph.configs import AnyModelConfig, HFModelConfig
from flowrl.graph.engines import ENGINE_CAPS
from flowrl.graph.kinds import KINDS
from flowrl.graph.nodes import GeneratorNode, SourceNode
from flowrl.host import host_memory_bytes
from flowrl.mesh_support import node_facts, refusal
from flowrl.placement.layout import AXES, Placement
from flowrl.models.hf import check_hf_dir
from flowrl.modelspec import ModelSpec, model_from_config
from flowrl.replan import plan_command
from flowrl.runtime.parallel.expert_parallel import check_expert_mesh

__all__ = ["check_meshes", "check_expert_split", "check_fits_in_memory", "check_engines", "check_engine_meshes", "check_ranks_fit", "rank_needs", "check_packing_families", "check_teachers"]


def check_meshes(graph: Graph, placement: Placement, *, backend: str, device: str, skip: Mapping[str, str] | frozenset[str] = frozenset()) -> None:
    """Refuse, before any work (under torchrun on every rank alike), a node whose mesh has an axis of
    size > 1 that its program does not execute on ``backend`` on ``device`` (``"cpu"`` or ``"cuda"``),
    as ``flowrl.mesh_support.MESH_SUPPORT`` says: what would run instead is never run silently.
    Nodes in ``skip`` run a user's program (``RunConfig.programs``), which the table does not describe.

    Raises:
        ConfigError: naming the node, the axis and its size, what would run instead and the fix
            (``flowrl.mesh_support.refusal``).

    Example:
        >>> from flowrl.examples import build_example
        >>> from flowrl.placement import NodeMesh
        >>> placement = Placement(nodes={"gen": NodeMesh(devices=(0,)), "policy": NodeMesh(devices=(1, 2, 3, 4), mesh_shape=(1, 2, 2))})
        >>> check_meshes(build_example("llamarl"), placement, backend="torchrun", device="cpu")
        Traceback (most recent call last):
        ...
        flowrl.errors.ConfigError: policy 'policy' has dp=2 and tp=2 on its mesh {"dp": 2, "tp": 2}, but dp beside tp runs only as FSDP2 over dp on the 2-D mesh: set sharding='fsdp' on the policy, or give it a mesh of tp only
    """
    for name, mesh in placement.nodes.items():
        if name in skip or name not in graph:
            continue
        node = graph.node(name)
        axes = mesh.sizes()
        message = refusal(node.kind, name, axes, backend, devices=mesh.devices, engine=getattr(node, "engine", None), device=device, facts=node_facts(node))
        if message is not None:
            raise ConfigError(message)
        if mesh.ep > 1:
            check_expert_split(name, node.model, mesh.ep, dp=mesh.size("dp"))  # type: ignore[attr-defined]  # refusal lets ep through on a policy only, which has a model


def check_expert_split(node: str, model: AnyModelConfig, ep: int, *, dp: int) -> None:
    """Refuse ``ep`` > 1 on policy ``node`` (on ``dp`` ranks) unless its ``model`` is a mixture of experts whose
    experts ``ep`` divides, and ``ep`` is its ``dp`` (``flowrl.runtime.parallel.expert_parallel.check_expert_mesh``).

    Raises:
        ConfigError: naming the node, the model, its experts and the ``ep`` values that would run.

    Example:
        >>> from flowrl.graph.configs import ModelConfig
        >>> check_expert_split("policy", ModelConfig(), 2, dp=2)
        Traceback (most recent call last):
        ...
        flowrl.errors.ConfigError: policy 'policy' has ep=2 on its mesh, but its model 2L64d is dense (no routed experts to split): expert parallelism needs a mixture of experts (a qwen3_moe or qwen2_moe directory); give it a mesh without ep
    """
    spec = model_from_config(model)
    if spec.n_experts == 0:
        raise ConfigError(
            f"policy {node!r} has ep={ep} on its mesh, but its model {spec.name} is dense (no routed experts to split): "
            "expert parallelism needs a mixture of experts (a qwen3_moe or qwen2_moe directory); give it a mesh without ep"
        )
    if spec.n_experts % ep:
        fits = [d for d in range(1, spec.n_experts + 1) if spec.n_experts % d == 0]
        raise ConfigError(
            f"policy {node!r} has ep={ep} on its mesh, but ep must divide the {spec.n_experts} routed experts of its model {spec.name} "
            f"({spec.n_experts} % {ep} = {spec.n_experts % ep}): each ep rank holds as many experts; pick an ep among {fits} that divides its dp ranks"
        )
    check_expert_mesh(node, dp=dp, ep=ep, experts=spec.n_experts)


def check_fits_in_memory(graph: Graph, memory_bytes: int | None = None, *, skip: frozenset[str] = frozenset(), graph_arg: str | None = None) -> None:
    """Refuse a graph whose models or rollouts cannot fit in ``memory_bytes`` (default: this host's RAM).

    A lower bound, counted before anything is allocated, so that a graph file with absurd sizes
    (a 10**12-prompt batch, a 2**40-token vocabulary) is a one-line error rather than an allocator
    traceback or a run that fills the memory for minutes: float32 weights of every model node (a
    policy also holds gradients and two AdamW moments: 4x), plus, per generator, the token ids of
    its rollout and one decode step's logits (``prompts * n_samples * (max_seq_len * 8 + vocab * 4)``).
    ``graph_arg``: the graph as the user named it on the command line, which the ``flowrl plan``
    command the error suggests names (``flowrl.replan.plan_command``).

    Raises:
        ConfigError: naming the node, its size, the estimate and the memory available.
    """
    limit = host_memory_bytes() if memory_bytes is None else memory_bytes
    need, shapes = _node_needs(graph, skip)
    for name, nbytes in need.items():
        if nbytes > limit:
            node = graph.node(name)
            shape, seq = shapes[name]
            size = f"vocab_size={shape.vocab_size}, dim={shape.dim}, n_layers={shape.n_layers}, max_seq_len={seq}, {shape.params:.3g} parameters"
            if isinstance(node, GeneratorNode):
                size += f", n_samples={node.sampling.n_samples}, prompts per batch={sum(p.source.batch_size for p in graph.producers(name) if isinstance(p, SourceNode))}"
            raise ConfigError(
                f"node {name!r} ({node.kind}) needs at least {nbytes / 2**30:.3g} GiB ({size}), more than the "
                f"{limit / 2**30:.3g} GiB of memory of this machine; shrink it, or plan it for a cluster with "
                f"`{plan_command(graph_arg, '--cluster 8xH100')}` (or another cluster spec: 'flowrl plan --help')"
            )
    total = sum(need.values())
    if total > limit:
        raise ConfigError(
            f"graph {graph.name!r} needs at least {total / 2**30:.3g} GiB for its models and rollouts "
            f"({', '.join(f'{n}: {b / 2**30:.3g} GiB' for n, b in need.items())}), more than the "
            f"{limit / 2**30:.3g} GiB of memory of this machine; shrink the models or the batch"
        )


def _node_needs(graph: Graph, skip: frozenset[str]) -> tuple[dict[str, int], dict[str, tuple[ModelSpec, int]]]:
    """Node -> the lower bound of bytes it holds (see ``check_fits_in_memory``), and its model's shape."""
    need: dict[str, int] = {}
    shapes: dict[str, tuple[ModelSpec, int]] = {}
    for node in graph.nodes:
        model = getattr(node, "model", None)
        if model is None or getattr(model, "preset", None) or node.name in skip:  # a preset is refused by the runtime
            continue
        if isinstance(model, HFModelConfig):
            raw = check_hf_dir(model, owner=f"node {node.name!r}")  # the model's own errors first: path, family, weights
            spec, seq = model_from_config(model), model.max_seq_len or int(raw.get("max_position_embeddings") or 0)
        else:
            spec, seq = model_from_config(model), model.max_seq_len
        shapes[node.name] = (spec, seq)
        need[node.name] = spec.params * 4 * (4 if KINDS[node.kind].publishes_weights else 1)  # a trainer: weights, grads, Adam's two
        if isinstance(node, GeneratorNode):
            prompts = sum(p.source.batch_size for p in graph.producers(node.name) if isinstance(p, SourceNode))
            sequences = prompts * node.sampling.n_samples
            tokens = min(seq, 2 * node.sampling.max_new_tokens + 4096) if seq else node.sampling.max_new_tokens
            need[node.name] += sequences * (tokens * 8 + spec.vocab_size * 4)
    return need, shapes


def rank_needs(graph: Graph, ranks: Mapping[str, tuple[int, ...]], *, skip: frozenset[str] = frozenset()) -> dict[int, dict[str, int]]:
    """Rank -> node -> the lower bound of bytes that rank holds for the node under a torchrun placement:
    a policy with ``sharding="fsdp"`` holds 1/dp of its state on each of its ranks, every other node
    a whole copy on each rank (replicas; a generator's rollout is split over its replicas).

    Example:
        >>> from flowrl.examples.llamarl import build_llamarl
        >>> needs = rank_needs(build_llamarl(), {"gen": (0,), "policy": (1, 2)})
        >>> sorted(needs), sorted(needs[1])
        ([0, 1, 2], ['policy'])
    """
    need, shapes = _node_needs(graph, skip)
    out: dict[int, dict[str, int]] = {}
    for name, nbytes in need.items():
        rs = tuple(ranks.get(name, ()))
        node = graph.node(name)
        sharded = node.kind == "policy" and getattr(getattr(node, "optimizer", None), "sharding", "") == "fsdp"
        spec = shapes[name][0]
        weights = spec.params * 4
        for r in rs:
            if sharded:
                share = nbytes // len(rs)
            elif node.kind == "generator":
                share = weights + (nbytes - weights) // len(rs)
            else:
                share = nbytes
            out.setdefault(r, {})[name] = share
    return out


def check_ranks_fit(
    graph: Graph,
    ranks: Mapping[str, tuple[int, ...]],
    *,
    device: str,
    memory_bytes: int,
    ranks_per_host: int,
    skip: frozenset[str] = frozenset(),
) -> None:
    """Refuse, on every rank alike before any work, a torchrun placement whose models do not fit its ranks.

    On ``cuda`` each rank holds its nodes in its own GPU's ``memory_bytes``; on the ``cpu`` the ranks of
    a host (``ranks_per_host`` consecutive ranks, torchrun's LOCAL_WORLD_SIZE) share its ``memory_bytes``.
    Devices and hosts are taken as alike (every rank decides from its own), so every rank gives the same answer.

    Raises:
        ConfigError: naming the rank or host, what it holds, the memory and the fixes.

    Example:
        >>> from flowrl.examples.llamarl import build_llamarl
        >>> check_ranks_fit(build_llamarl(), {"gen": (0,), "policy": (1,)}, device="cpu", memory_bytes=2**34, ranks_per_host=2)
    """
    needs = rank_needs(graph, ranks, skip=skip)

    def held(rs: list[int]) -> str:
        return ", ".join(f"rank {r} {n}: {b / 2**30:.3g} GiB" for r in rs for n, b in sorted(needs.get(r, {}).items()))

    if device == "cuda":
        for r, nodes in sorted(needs.items()):
            if sum(nodes.values()) > memory_bytes:
                raise ConfigError(
                    f"rank {r} needs at least {sum(nodes.values()) / 2**30:.3g} GiB ({held([r])}), more than its GPU's "
                    f"{memory_bytes / 2**30:.3g} GiB; shard the policy over more ranks (sharding='fsdp'), place the nodes "
                    "on other ranks, or shrink the models (see 'flowrl plan GRAPH --cluster ...')"
                )
        return
    hosts: dict[int, list[int]] = {}
    for r in needs:
        hosts.setdefault(r // max(ranks_per_host, 1), []).append(r)
    for h, rs in sorted(hosts.items()):
        total = sum(sum(needs[r].values()) for r in rs)
        if total > memory_bytes:
            raise ConfigError(
                f"the ranks of host {h} ({sorted(rs)}) need at least {total / 2**30:.3g} GiB together ({held(sorted(rs))}), "
                f"more than the host's {memory_bytes / 2**30:.3g} GiB of memory; place nodes on other hosts' ranks, "
                "shard the policy (sharding='fsdp'), or shrink the models"
            )


def check_engines(graph: Graph, *, backend: str, device: str, skip: frozenset[str] = frozenset()) -> None:
    """Refuse, before any node is built, a generator whose engine cannot run here: not installed,
    a model it cannot load, a backend it does not run under (``flowrl.operators.engines.check_engine``),
    ``routing_replay`` it cannot record (``flowrl.operators.engines.check_routing_replay``).

    Raises:
        ConfigError: naming the generator, what is missing and the fix.
    """
    from flowrl.operators.engines import check_engine, check_routing_replay

    for node in graph.nodes_of(GeneratorNode):
        if node.name in skip:
            continue
        if node.routing_replay:  # a dense model; vLLM on a CPU
            check_routing_replay(node, device=device)
        engine = node.engine
        caps = ENGINE_CAPS[engine]
        if caps.backends and backend not in caps.backends:
            raise ConfigError(
                f"generator {node.name!r}: engine={engine!r} runs under the backends {list(caps.backends)}, not "
                f"{backend!r}; use --backend {caps.backends[0]}, or engine='builtin'"
            )
        if caps.machine_check:
            check_engine(node, device=device)


def check_engine_meshes(
    graph: Graph, axes: Mapping[str, tuple[tuple[str, ...], tuple[int, ...]]], ranks: Mapping[str, Sequence[int]] | None = None, *, cores: int | None = None
) -> None:
    """Refuse, on every torchrun rank before any work, a vLLM generator's mesh that cannot run
    (``flowrl.runtime.parallel.vllm_replicas.check_vllm_mesh``): each replica (a tp group of the
    mesh) is one vLLM engine with ``tensor_parallel_size = tp``, so ``tp`` may not exceed the
    generator's ranks, nor on a CPU the cores a process may use (``cores``; None: not checked).

    Args:
        axes: node -> (axis names, shape) of its mesh (nodes without a named mesh are absent).
        ranks: node -> its ranks (default: a mesh's size of ranks, each mesh checked alone).

    Raises:
        ConfigError: naming the generator, its mesh and the fix.
    """
    from flowrl.runtime.parallel.vllm_replicas import check_vllm_mesh

    for node in graph.nodes:
        engine = getattr(node, "engine", "builtin")
        if node.kind != "generator" or ENGINE_CAPS[engine].tensor_parallel or node.name not in axes:
            continue
        names, shape = axes[node.name]
        held = tuple(ranks[node.name]) if ranks is not None and node.name in ranks else tuple(range(math.prod(shape)))
        check_vllm_mesh(node.name, held, (tuple(names), tuple(shape)), cores=cores)


def check_packing_families(graph: Graph, *, skip: frozenset[str] = frozenset()) -> None:
    """Refuse, before any node is built, a policy (``OptimizerConfig.packing``) or a reference
    (``ReferenceConfig.packing``) asked to pack (``True``) with a model family that cannot take packed rows
    (``flowrl.operators.packing.check_packing``; the trainer and the reference check it again).

    Raises:
        ConfigError: naming the node, its family and the families that can.
    """
    from flowrl.operators.packing import check_packing

    for node in graph.nodes:
        config = getattr(node, "optimizer", None) or getattr(node, "reference", None)
        model = getattr(node, "model", None)  # every node with an optimizer or a reference has one
        if getattr(config, "packing", None) is True and node.name not in skip and model is not None:  # the default (None) pads a family that cannot pack
            check_packing(model, owner=f"{node.kind} {node.name!r}")


def check_teachers(graph: Graph, *, skip: frozenset[str] = frozenset()) -> None:
    """Refuse, before any node is built (under torchrun on every rank alike), a Hugging Face teacher
    whose tokenizer or ``vocab_size`` is not its student generator's (``flowrl.graph.teacher``: the
    graph's rules compare the configs; this reads the directories' ``config.json`` and tokenizers).

    Raises:
        ConfigError: naming the teacher, both directories and the first difference.
    """
    from flowrl.graph.teacher import TeacherNode
    from flowrl.operators.teacher import check_same_tokenizer

    for teacher in graph.nodes_of(TeacherNode):
        if teacher.name in skip or not isinstance(teacher.model, HFModelConfig):
            continue
        for gen in (p for p in graph.producers(teacher.name) if isinstance(p, GeneratorNode)):
            if not isinstance(gen.model, HFModelConfig):
                continue
            owner = f"teacher {teacher.name!r}"
            vocab = {n: model_from_config(m).vocab_size for n, m in (("teacher", teacher.model), ("student", gen.model))}
            if vocab["teacher"] != vocab["student"]:
                raise ConfigError(
                    f"{owner}: its model's vocab_size={vocab['teacher']} ({teacher.model.path}) differs from the student generator "
                    f"{gen.name!r}'s vocab_size={vocab['student']} ({gen.model.path}); a teacher scores the student's token ids as they are "
                    "(cross-tokenizer distillation is not supported): give the teacher a model with the student's vocabulary"
                )
            if teacher.model.tokenizer_path != gen.model.tokenizer_path:
                check_same_tokenizer(teacher.model.tokenizer_path, gen.model.tokenizer_path, owner=owner)
