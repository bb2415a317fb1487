"""The critic node kind: a trained value model, its config, and the graph rules it keeps.

A ``critic`` node holds a causal LM whose output head is a scalar (``flowrl.operators.critic``):
``V(x, y_<t)``, the expected reward of a completion from the state before its token ``t``. Each
step it reads a rollout and its reward fields, writes ``values`` (``[sample, ctime]``) and the
version of the weights that computed them (``value_version``), then trains on that same batch:
GAE returns (``flowrl.operators.gae``, the ``gamma`` and ``lam`` of the loss it feeds) regressed
with PPO's clipped value loss. The loss it feeds (``objective="ppo"``) turns the same values and
rewards into token-level GAE advantages.

Its step ``s`` waits for the policy's step ``s - 1`` (``version_needed``): the critic never runs
ahead of the policy, so its values of batch ``s`` come from critic version ``s`` (its optimizer
steps per batch times ``s``), it trains on the batches the policy trains on under the same
``max_staleness``, and a checkpoint holds both at the same batch.

Rules (``critic_problems``, run by ``flowrl.graph.validate``): a critic feeds exactly one loss, whose
objective is ``"ppo"`` and whose reward fields are the ones the critic reads; a ``"ppo"`` loss is fed
by a critic (``no_critic``).

Across the layers: a critic is a device kind of its own that trains (``KindSpec.trains``) and
publishes no weights; the planner prices it as training (``flowrl.planners.roles.critic_role``).
``flowrl.operators.gae`` holds the pure GAE, whitening and explained variance, and
``flowrl.operators.losses.loss_advantages``, which the trainer calls for any objective, picks group
baselines or a critic's GAE; ``flowrl.operators.critic`` holds the value head and the clipped value
loss; ``flowrl.runtime.programs.critic`` its program. The controller writes a checkpoint before it
advances the version clock, so a checkpoint holds the critic and the policy at the same batch
(``keeps_state``). Under torchrun it runs on one rank, or tensor-parallel over a ``tp`` axis
(``RANK_PROGRAMS["critic"]``: ``flowrl.runtime.backends.torchrun.tp_critic``, one step equal to one
process's within float32 bounds); a ``dp`` or ``pp`` mesh is refused before any work
(``flowrl.mesh_support``).

Example:
    >>> from flowrl.graph.builder import GraphBuilder
    >>> b = GraphBuilder("ppo")
    >>> gen = b.generator("gen", b.source("prompts", task="copy"))
    >>> reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    >>> b.critic("critic", gen, lr=1e-3).describe()
    'model=2L64d, lr=0.001, value_clip=0.2, rewards=rewards'
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec

from flowrl.errors import ConfigError
from flowrl.graph.configs import AnyModelConfig, LossConfig, ModelConfig, OptimizerConfig
from flowrl.graph.fields import FIELDS, REWARD_TYPE
from flowrl.graph.nodes import LossNode, NodeBase, Signature
from flowrl.graph.objectives import BUILTIN_OBJECTIVES, OBJECTIVES

if TYPE_CHECKING:
    from flowrl.graph.structure import GraphStructure

__all__ = ["CriticNode", "CRITIC_INPUTS", "VALUE_FIELDS", "critic_problems", "no_critic", "CRITIC_OBJECTIVES", "reads_values"]

#: Rollout fields a critic reads (besides its reward fields).
CRITIC_INPUTS: tuple[str, ...] = ("sample_prompt_ids", "sample_prompt_lens", "completion_ids", "completion_mask", "completion_lens", "group_ids")
#: What a critic writes, and a loss that uses a learned value reads.
VALUE_FIELDS: tuple[str, ...] = ("values", "value_version")
#: The built-in objectives whose advantages come from a critic's values (``flowrl.operators.gae``):
#: the rows with ``advantages="gae"`` (``flowrl.graph.objectives``).
CRITIC_OBJECTIVES: frozenset[str] = frozenset(n for n, r in BUILTIN_OBJECTIVES.items() if r.advantages == "gae")


def reads_values(config: LossConfig) -> bool:
    """Whether a loss's objective takes its advantages from a critic's values (its row's ``advantages``)."""
    row = config.row or OBJECTIVES.get(config.objective)
    return row is not None and row.advantages == "gae"


class CriticNode(NodeBase, tag="critic", frozen=True):
    """A trained value model (module docstring).

    Attributes:
        model: its model (built-in or Hugging Face, ``lora`` allowed): the causal LM whose output
            head becomes a scalar value head.
        optimizer: its own AdamW, schedule and passes (``num_iterations`` passes over each batch,
            ``micro_batch_size``; one mini-batch a pass).
        value_clip: PPO's value clipping: the new value is kept within ``value_clip`` of the value
            computed before the step (the loss is the larger of the clipped and unclipped squared
            errors); None: no clipping.
        rewards: the reward fields it reads, the same as those of the loss it feeds (whose
            ``reward_weights`` combine them).
    """

    model: AnyModelConfig = msgspec.field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = msgspec.field(default_factory=OptimizerConfig)
    value_clip: float | None = 0.2
    rewards: tuple[str, ...] = ("rewards",)

    def __post_init__(self) -> None:
        owner = f"critic {self.name!r}"
        if self.value_clip is not None and not self.value_clip > 0:
            raise ConfigError(f"{owner}: value_clip={self.value_clip} must be > 0 (None: no value clipping)")
        if not self.rewards:
            raise ConfigError(f"{owner}: rewards must name at least one reward field (those of the loss it feeds)")
        if self.optimizer.num_mini_batches != 1:
            raise ConfigError(f"{owner}: num_mini_batches={self.optimizer.num_mini_batches}: a critic takes one mini-batch a pass; use num_iterations for more steps a batch")
        if self.optimizer.sharding != "replicate":
            raise ConfigError(f"{owner}: sharding={self.optimizer.sharding!r}: a critic runs on one rank (its mesh's lead); drop sharding=")

    def signature(self) -> Signature:
        inputs = {n: FIELDS[n] for n in CRITIC_INPUTS}
        if not isinstance(self.model, ModelConfig):  # a Hugging Face critic may be a mixture of experts: it replays the routing
            inputs["routed_experts"] = FIELDS["routed_experts"]
        inputs.update({r: REWARD_TYPE for r in self.rewards})
        return Signature(inputs, {n: FIELDS[n] for n in VALUE_FIELDS})

    def describe(self) -> str:
        clip = "none" if self.value_clip is None else f"{self.value_clip:g}"
        return f"model={self.model.short()}, lr={self.optimizer.lr:g}, value_clip={clip}, rewards={'+'.join(self.rewards)}"

    def keeps_state(self) -> bool:
        return True  # its weights, optimizer and version

    def version_needed(self, seq: int, updates: int) -> int:
        """The policy after ``seq`` trainer steps: the critic never runs ahead of it (module docstring)."""
        return updates * seq


def no_critic(g: GraphStructure, loss: NodeBase) -> str:
    """A ``"ppo"`` loss that no critic feeds: the builder calls that add one."""
    gens = [p.name for p in g.producers(loss.name) if p.kind == "generator"] or [n.name for n in g.nodes_of_kind("generator")]
    gen = gens[0] if gens else "gen"
    return (
        f"loss {loss.name!r} has objective='ppo', whose advantages come from a learned value, but no critic feeds it; "
        f"add one: critic = b.critic('critic', {gen!r}, lr=...), and list it: b.loss({loss.name!r}, ..., critic) "
        "(or use objective='grpo', whose group baseline needs no critic)"
    )


def critic_problems(g: GraphStructure) -> Iterable[str]:
    """The critic rules of the module docstring, as messages."""
    for critic in g.nodes_of(CriticNode):
        losses = [u for u in g.users(critic.name) if isinstance(u, LossNode)]
        if len(losses) != 1:
            yield (
                f"critic {critic.name!r} feeds {len(losses)} losses {[u.name for u in losses]}; its values serve exactly one loss "
                "with objective='ppo': list it in that loss (b.loss(..., critic, objective='ppo')), or remove the critic"
            )
            continue
        (loss,) = losses
        objective = loss.loss.objective
        if not reads_values(loss.loss):
            yield (
                f"critic {critic.name!r} feeds loss {loss.name!r}, whose objective {objective!r} does not use a learned value; "
                "set objective='ppo' on the loss, or remove the critic"
            )
        wanted = sorted(loss.loss.reward_weights)
        if sorted(critic.rewards) != wanted:
            yield (
                f"critic {critic.name!r} reads the reward fields {sorted(critic.rewards)} but its loss {loss.name!r} "
                f"combines {wanted}: the critic learns the value of the reward the loss trains on; set rewards={tuple(wanted)} on the critic"
            )
