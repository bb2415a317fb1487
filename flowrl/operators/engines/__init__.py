"""Generator engines: the table from a node's ``engine`` to the class that samples for it.

An engine is a class built as ``cls(node, *, seed, device, transport)`` (``transport``: its weight
edge's route, an object the engine may ask its hop; a name outside a run) that the generator program
(``flowrl.runtime.programs.nodes.GeneratorProgram``) drives through ``GeneratorEngine``: it fetches
weights into ``weight_targets()`` and sets ``version`` (which makes the engine use them), then calls
``generate(prompts)``, which returns the rollout (``flowrl.graph.fields.ROLLOUT_FIELDS``, built by
``flowrl.operators.generation.rollout_batch``), and ``close()`` at the end of the run.

``ENGINES`` holds one ``EngineSpec`` per engine of ``flowrl.graph.engines.ENGINE_CAPS``:

- ``builtin``: ``flowrl.operators.generation.Generator`` (and the slot batcher for continuous batching);
  its multi-turn episodes: ``flowrl.operators.multiturn.MultiTurnGenerator``;
- ``vllm``: ``flowrl.operators.engines.vllm_engine.VLLMGenerator``; its multi-turn episodes:
  ``flowrl.operators.engines.vllm_multiturn.VLLMMultiTurn`` (vLLM's step API, environments stepping
  while other samples decode).
- ``vllm``: ``flowrl.operators.engines.vllm_engine.VLLMGenerator`` (and ``vllm_stream.VLLMSlotBatcher``,
  samples streamed into vLLM, for continuous batching).

``check_engine(node)`` runs an engine's machine checks (is it installed, can it load this model
here) and is what ``flowrl.runtime.run.run_graph`` calls for every generator before any program is
built; the node-level checks (which settings an engine accepts) are ``flowrl.graph.engines``.

Example:
    >>> sorted(ENGINES), ENGINES["vllm"].generator
    (['builtin', 'vllm'], 'flowrl.operators.engines.vllm_engine:VLLMGenerator')
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from flowrl.graph.refs import resolve
from flowrl.models.families import FAMILIES

if TYPE_CHECKING:
    import torch

    from flowrl.graph.configs import SamplingConfig
    from flowrl.graph.nodes import GeneratorNode

__all__ = ["GeneratorEngine", "EngineSpec", "ENGINES", "build_engine", "check_engine", "check_routing_replay"]


class GeneratorEngine(Protocol):
    """What the generator program needs from an engine (``Generator`` and ``VLLMGenerator`` have it).

    Optional: ``close()``; ``sleep()`` / ``wake_up()`` with a ``sleep_mode=True`` keyword at
    construction, for colocated offloading (``flowrl.runtime.programs.offload``: ``VLLMGenerator``'s)."""

    name: str
    sampling: SamplingConfig

    @property
    def version(self) -> int: ...

    @version.setter
    def version(self, value: int) -> None: ...

    def weight_targets(self) -> dict[str, torch.Tensor]: ...

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None: ...

    def generate(self, prompts: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class EngineSpec:
    """One engine.

    Attributes:
        generator: ``module:qualname`` of its class, ``cls(node, *, seed, device, transport)``.
        check: ``module:qualname`` of ``check(node, *, device)``, which raises ``ConfigError`` for
            what this machine cannot run (``""``: nothing to check beyond the node's own checks).
        episodes: ``module:qualname`` of the class that runs a generator's multi-turn episodes
            (``env=``) on this engine, built as ``cls(engine, node, rows=...)``.
        batcher: ``module:qualname`` of the continuous batcher ``cls(engine, *, slots, rng)`` that
            ``flowrl.runtime.programs.continuous.ContinuousRollouts`` drives (``batching="continuous"``).
    """

    generator: str
    check: str = ""
    episodes: str = "flowrl.operators.multiturn:MultiTurnGenerator"
    batcher: str = "flowrl.operators.slots:SlotBatcher"


ENGINES: dict[str, EngineSpec] = {
    "builtin": EngineSpec(generator="flowrl.operators.generation:Generator"),
    "vllm": EngineSpec(
        generator="flowrl.operators.engines.vllm_engine:VLLMGenerator",
        check="flowrl.operators.engines.vllm_engine:check_vllm",
        episodes="flowrl.operators.engines.vllm_multiturn:VLLMMultiTurn",
        batcher="flowrl.operators.engines.vllm_stream:VLLMSlotBatcher",
    ),
}


def check_engine(node: GeneratorNode, *, device: str = "cpu") -> None:
    """Raise ``ConfigError`` if ``node``'s engine cannot run here (before anything is loaded)."""
    spec = ENGINES[node.engine]
    if spec.check:
        resolve(spec.check)(node, device=device)


def check_routing_replay(node: GeneratorNode, *, device: str = "cpu") -> None:
    """Refuse, before anything is loaded, ``routing_replay=True`` where ``node`` cannot record routing:
    a dense model (its family declares no routers, ``flowrl.models.family.ModelFamily.router``), or
    the vLLM engine on a CPU (vLLM returns routed experts, ``enable_return_routed_experts``, only from
    its Model Runner V2, which needs Triton, which has no CPU backend).

    Raises:
        ConfigError: naming the generator, what it cannot record and the fix.
    """
    from flowrl.errors import ConfigError
    from flowrl.models.registry import family_of

    owner = f"generator {node.name!r}: routing_replay=True"
    family = family_of(node.model, owner=f"generator {node.name!r}")
    if not family.router:
        moe = [name for name, f in FAMILIES.items() if f.router]
        raise ConfigError(
            f"{owner} records a mixture of experts' routing, but its model ({family.name!r}) is dense, without routers; "
            f"drop routing_replay, or sample from a model of a MoE family ({', '.join(moe)})"
        )
    if node.engine == "vllm" and not str(device).startswith("cuda"):
        raise ConfigError(
            f"{owner} with engine='vllm' on {device!r}: vLLM returns routed experts (enable_return_routed_experts) only from "
            "its Model Runner V2, which needs Triton, and Triton does not run on a CPU; use engine='builtin' (it records "
            "routing on any device), run on CUDA GPUs, or drop routing_replay"
        )


def build_engine(node: GeneratorNode, *, seed: int = 0, device: str = "cpu", transport: Any = "inprocess", **options: Any) -> Any:
    """The engine that samples for ``node`` (a ``GeneratorEngine``), fed weights over its weight edge's
    route ``transport`` (the runtime's route object; an engine that moves weights on once more, as vLLM
    into its workers, asks it how: ``vllm_engine.hop_of``);
    ``options`` go to engines that take them (``sleep_mode=True``: vLLM's, for colocated offloading)."""
    return resolve(ENGINES[node.engine].generator)(node, seed=seed, device=device, transport=transport, **options)
