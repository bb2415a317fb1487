"""The policy node's operator: pi's weights, AdamW, the learning-rate schedule and the version clock.

One ``train_step(batch)`` takes ``num_iterations * num_mini_batches`` optimizer steps on one rollout
batch (``OptimizerConfig``; 1 by default): ``num_iterations`` passes, each over ``num_mini_batches``
mini-batches of whole prompt groups in an order drawn from ``(seed, version at the batch's start,
pass)``, so a resumed run draws the same. With more than one step, or an objective that reads it
(``flowrl.graph.objectives.recomputes_logprobs``: ``decoupled_ppo``), it first computes log pi_prox of the whole batch with the
weights it starts with (no gradient, micro-batched; the batch field ``proximal_logprobs``), which the
``old/*`` metrics and the mismatch metrics then use, and the PPO-style objectives clip their ratio
against (``losses.ANCHORED_AT_OLD``: pi / pi_old, TRL's ``old_per_token_logps``, not pi / mu). Each optimizer step, on its mini-batch:

1. reads the rollout and its reward fields (and, for ``ppo``, a critic's ``values``: token-level GAE,
   ``losses.loss_advantages``); advantages come from the whole mini-batch (group
   baselines need every sample of a prompt, and a mini-batch holds whole groups);
2. in micro-batches of ``optimizer.micro_batch_size`` samples (0: one), recomputes log pi of the
   completions with gradients (``completion_logprobs``, the same layout and the same temperature,
   top-k and top-p, ``sampling_temperature`` / ``sampling_top_k`` / ``sampling_top_p``, the generator
   sampled with: pi truncated by its own kept set, renormalised), applies the loss node's objective,
   and back-propagates (optionally under bf16/fp16 ``torch.autocast`` and with gradient checkpointing); term sums are divided by the whole
   batch's count under ``loss_agg`` (tokens, or sequences: ``losses.batch_normalizer``), so accumulation gives exactly the whole-batch gradient.
   Before that the batch is shaped (``flowrl.operators.shaping``: dynamic sampling, the overlong
   penalty, truncated completions masked) as the loss config says. A sampled token
   outside pi's kept set (pi = 0 there, so the ratio is 0) is left out of the objective (weight 0,
   still counted in the token count) and never produces inf or nan;
3. clips the global gradient norm, sets the scheduled learning rate, steps AdamW (the norm before
   clipping, the rate and pi's entropy over the completion tokens, from the logits of step 2, are
   the ``policy/*`` metrics);
4. measures the engine/trainer mismatch on the tokens drawn by its current weights
   (``flowrl.operators.mismatch``: ``mismatch/kl``, ``mismatch/abs_logp_max``, ``mismatch/tokens``,
   ``mismatch/outside_kept_frac``), from what every engine writes; with a rollout that carries
   ``routed_experts`` (a generator's ``routing_replay``, a mixture of experts), every forward of
   step 2 routes each token through the generator's experts (``flowrl.models.routing``) and the step
   reports ``routing/agreement``, the share of token-layer choices where its own routers' top-k set
   equals the generator's, over ``routing/tokens`` choices (the mismatch above is then replay's);
5. bumps ``version`` (completed optimizer steps, 0 before the first): a batch advances it by
   ``updates_per_batch``.

A mixture-of-experts model (a family with ``ModelFamily.router``) has its routers hooked
(``flowrl.operators.router_load``): every step's metrics report the experts' load over the real
tokens of its forwards (``moe/load_max_over_mean``, ``moe/load_max_over_mean_max``, ``moe/aux_loss``),
and ``OptimizerConfig.router_aux_loss_coef`` adds the load-balancing loss to each micro-batch's
(refused on a dense model).

A model description with ``lora`` (``flowrl.models.lora``) trains adapters only: the optimizer holds
them, ``weights()`` and the state's ``model`` are them, the base weights stay as built.

State (``state()`` / ``load_state``) is the model, the optimizer and the version: tensors, ints,
floats, strings, tuples and dicts only, so that a checkpoint loads with ``torch.load(weights_only=True)``.
The schedule has no state of its own: the learning rate is a pure function of the version.

The model is any ``flowrl.models`` family (``build_model``), held in float32 (master weights);
``weights()`` names its tensors once each (a tied output projection is not repeated).

Device: the model and the optimizer live on ``device`` (``"cpu"``, ``"cuda:N"``); a batch arrives as
CPU tensors and is moved there; ``weights()`` are the device tensors (transports copy them out);
``state()`` holds CPU copies, so a checkpoint written on a GPU machine loads on a CPU-only one.

``OptimizerConfig.seed`` is recorded for the trainer's own randomness; the built-in model has no
dropout, so a step is deterministic given the batch and the state.

Example:
    >>> from flowrl.graph.nodes import LossNode, PolicyNode
    >>> from flowrl.graph.configs import ModelConfig
    >>> trainer = Trainer(PolicyNode(name="policy", model=ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=1)),
    ...                   LossNode(name="aipo"))
    >>> trainer.version
    0
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any, Protocol, runtime_checkable

import msgspec
import torch
from torch import Tensor

from flowrl.errors import CheckpointError, ConfigError
from flowrl.graph.configs import OptimizerConfig
from flowrl.graph.nodes import LossNode, PolicyNode
from flowrl.graph.objectives import recomputes_logprobs
from flowrl.operators.batch import leading_dim, split
from flowrl.operators.generation import DTYPES, _mix, copy_weights
from flowrl.operators.logprobs import completion_logprobs, completion_logprobs_and_entropy
from flowrl.operators.losses import (
    batch_normalizer,
    check_objective,
    combined_rewards,
    compute_loss,
    loss_advantages,
    proximal_metrics,
)
from flowrl.operators.packing import packs
from flowrl.operators.shaping import dynamic_sample, shape_batch
from flowrl.operators.mismatch import mismatch_metrics
from flowrl.models.causal_lm import weight_dict
from flowrl.models.lora import adapter_weights, add_adapters, lora_of
from flowrl.models.families import FAMILIES
from flowrl.models.registry import build_model, family_of
from flowrl.operators.router_load import RouterLoad, real_tokens
from flowrl.models.routing import RoutingAgreement

__all__ = ["Trainer", "learning_rate", "cpu_copy", "TRAIN_FIELDS", "TOKEN_MEANS"]

#: Rollout fields a training step reads (besides the reward fields of the loss).
TRAIN_FIELDS: tuple[str, ...] = (
    "sample_prompt_ids",
    "sample_prompt_lens",
    "completion_ids",
    "completion_mask",
    "behaviour_logprobs",
    "group_ids",
)


#: Metrics that are means over tokens -> the count of the tokens each covers: a batch's optimizer steps
#: are combined (``_combine``), and data-parallel ranks reduced (``flowrl.runtime.parallel.distributed.reduce_metrics``),
#: weighted by that count, so the figure is the mean over every token of the batch, whatever the split.
TOKEN_MEANS: dict[str, str] = {"mismatch/kl": "mismatch/tokens", "policy/entropy": "policy/tokens", "routing/agreement": "routing/tokens"}


def learning_rate(config: OptimizerConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based).

    Linear warm-up over ``warmup_steps`` (step s gets ``lr * (s + 1) / warmup_steps``), then
    ``constant``, or ``cosine``/``linear`` decay to 0 at ``total_steps`` (no decay when it is 0).

    Example:
        >>> learning_rate(OptimizerConfig(lr=1.0, schedule="linear", warmup_steps=2, total_steps=6), 4)
        0.5
    """
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.schedule == "constant" or config.total_steps == 0:
        return config.lr
    span = max(1, config.total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    if config.schedule == "cosine":
        return config.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.lr * (1.0 - progress)


def _whole(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    return batch


@runtime_checkable
class _Recomputes(Protocol):
    """What ``gradient_checkpointing=True`` calls: a ``CausalLM``'s method, which a pipeline stage has too."""

    def enable_gradient_checkpointing(self) -> None: ...


def _router_load(node: PolicyNode, model: torch.nn.Module) -> RouterLoad | None:
    """The routers' hooks of a mixture-of-experts policy (``flowrl.operators.router_load``); None for a dense one.

    Raises:
        ConfigError: for ``router_aux_loss_coef`` on a dense model.
    """
    coef = node.optimizer.router_aux_loss_coef
    family = family_of(node.model)
    if not family.router:
        if coef:
            moe = [f.name for f in FAMILIES.values() if f.router]
            raise ConfigError(
                f"policy {node.name!r}: router_aux_loss_coef={coef} is a mixture of experts' load-balancing loss, and its model "
                f"family {family.name!r} is dense (the families with routers: {moe}); remove router_aux_loss_coef"
            )
        return None
    if not isinstance(getattr(model, "hf", None), torch.nn.Module):  # a pipeline stage (its own trainer refuses the loss)
        return None
    return RouterLoad(model, family, coef)


def _combine(steps: list[dict[str, float]]) -> dict[str, float]:
    """One row from the metrics of a batch's optimizer steps: each key's mean over the steps that have it
    (``*_max``: the largest; a mean over tokens, ``TOKEN_MEANS``: weighted by each step's tokens).

    Example:
        >>> _combine([{"loss": 1.0, "old/ratio_max": 1.0}, {"loss": 3.0, "old/ratio_max": 1.5}])
        {'loss': 2.0, 'old/ratio_max': 1.5}
        >>> _combine([{"policy/entropy": 1.0, "policy/tokens": 1.0}, {"policy/entropy": 2.0, "policy/tokens": 3.0}])
        {'policy/entropy': 1.75, 'policy/tokens': 2.0}
    """
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in steps for k in m):
        having = [m for m in steps if key in m]
        values = [m[key] for m in having]
        weights = [m.get(TOKEN_MEANS[key], 0.0) for m in having] if key in TOKEN_MEANS else []
        if key.endswith("_max"):
            out[key] = max(values)
        elif weights and sum(weights) > 0:
            out[key] = sum(v * w for v, w in zip(values, weights)) / sum(weights)
        else:
            out[key] = sum(values) / len(values)
    return out


def cpu_copy(value: Any) -> Any:
    """A deep copy of ``value`` with every tensor copied to the CPU (a checkpoint loads anywhere)."""
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: cpu_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_copy(v) for v in value)
    return value


class Trainer:
    """Trains pi with the objective of ``loss`` (see the module docstring).

    Args:
        node: the policy node (model shape, optimizer).
        loss: the loss node its objective comes from.
        device: where the model and the optimizer live (``"cpu"``, ``"cuda:N"``).
        model: ``node.model``'s model already built, LoRA adapters included (None: ``build_model`` and
            ``add_adapters`` here); an FSDP rank passes one with its parameters on the meta device,
            which ``flowrl.runtime.parallel.fsdp.shard_trainer_`` shards and materialises (the
            optimizer is rebuilt there).

    Attributes:
        model: pi (a ``flowrl.models.CausalLM``, float32, trainable), on ``device``.
        optimizer: AdamW over the model's parameters.
        version: completed optimizer steps.
        loss_scale: a factor on the loss before ``backward`` (1; an FSDP rank sets its token share,
            ``flowrl.runtime.parallel.fsdp.token_scale``).
        part_of: ``(mini_batch) -> this rank's part of it`` (whole prompt groups), called before each
            optimizer step and once on the whole batch (for the rollout's metrics); a data-parallel
            program sets it (``flowrl.runtime.backends.torchrun.rank_programs``), and sets its rank's share of the
            loss there. The identity in one process.
        clip_grad_norm: ``(parameters, max_norm) -> the global norm before clipping``, clipping in place:
            ``torch.nn.utils.clip_grad_norm_``, or a tensor-parallel rank's (``flowrl.runtime.parallel.tp_train``).

    Raises:
        ConfigError: for an unknown objective, or ``packing=True`` with a model family that cannot
            take packed rows (``flowrl.operators.packing.packs``; the default packs where it can).
    """

    #: set on a data-parallel replica's trainer by ``flowrl.runtime.parallel.distributed.make_data_parallel``:
    #: its share of the batch's loss divisor, and every optimizer step's global gradient norm
    dp_token_share: float
    dp_grad_norms: list[float]

    def __init__(self, node: PolicyNode, loss: LossNode, *, device: str | torch.device = "cpu", model: torch.nn.Module | None = None) -> None:
        check_objective(loss.loss)
        self.packing = packs(node.optimizer.packing, node.model, owner=f"policy {node.name!r}")  # None: where the family can
        self.name = node.name
        self.node, self.loss = node, loss
        self.device = torch.device(device)
        opt = node.optimizer
        # a given model is node.model's, built elsewhere: an FSDP rank's on the meta device (flowrl.runtime.parallel.fsdp_init)
        self.model = (build_model(node.model, device=self.device) if model is None else model).train()
        self.lora = lora_of(node.model)  # LoRA: only the adapters train, travel and are checkpointed
        if model is None:  # a given model has its adapters already (fsdp_init.meta_build)
            add_adapters(self.model, node.model, owner=f"policy {node.name!r}")
        if opt.gradient_checkpointing:
            recomputing = self.model
            if not isinstance(recomputing, _Recomputes):  # every flowrl model and pipeline stage is one
                raise ConfigError(
                    f"policy {node.name!r}: gradient_checkpointing=True, and its model ({type(recomputing).__name__}) has no "
                    "enable_gradient_checkpointing(); give it one, or set gradient_checkpointing=False"
                )
            recomputing.enable_gradient_checkpointing()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=learning_rate(opt, 0), betas=opt.betas, weight_decay=opt.weight_decay
        )
        self.version = 0
        self._weights = adapter_weights(self.model) if self.lora else weight_dict(self.model)  # views of the parameters, updated in place
        self.loss_scale = 1.0  # a factor on the loss before backward, set per step by flowrl.runtime.parallel.fsdp
        self.part_of: Callable[[dict[str, Tensor]], dict[str, Tensor]] = _whole  # a data-parallel rank's share
        self.clip_grad_norm: Callable[[Any, float], Tensor] = torch.nn.utils.clip_grad_norm_  # a tensor-parallel rank's counts each shard once
        self.router = _router_load(node, self.model)  # a mixture of experts: the experts' load, the load-balancing loss
        self._agreement = RoutingAgreement()  # the current optimizer step's routing agreement (routing replay)

    def train_step(self, batch: Mapping[str, Tensor]) -> dict[str, float]:
        """One rollout batch: ``num_iterations * num_mini_batches`` optimizer steps (module docstring), each
        bumping ``version``; a rollout plus its reward fields, and ``ref_logprobs`` for a KL term.

        Returns:
            Metrics: ``loss``, ``reward_mean``, ``reward/<field>`` per reward field, ``policy/grad_norm``
            (the global gradient norm before clipping), ``policy/lr`` (the learning rate of the step),
            ``policy/entropy`` (pi's entropy, the mean over the step's completion tokens of the
            distribution each was evaluated under: temperature, top-k and top-p as sampled; from the
            logits of the step's own forward pass) and ``policy/tokens`` (the completion tokens it
            covers), ``staleness`` (version at the batch's start minus ``rollout_version``, when the
            batch has it), the ``mismatch/*`` metrics, the ``shaping/*`` metrics of the shaping applied,
            and the loss's own metrics (over the tokens inside pi's kept set). ``reward_mean`` and
            ``reward/<field>`` are the rollout's, before shaping. With several optimizer steps, each
            step's loss metrics, ``loss`` and the ``policy/*`` metrics are averaged over the steps
            (``*_max``: the largest; ``policy/entropy`` weighted by each step's ``policy/tokens``, so it
            is the mean over all their tokens: ``TOKEN_MEANS``), the ``old/*`` metrics (``losses.proximal_metrics``: pi against the
            batch's starting weights) are added, and ``updates`` counts the steps.

        Raises:
            ConfigError: naming a field the batch lacks.
        """
        missing = [f for f in TRAIN_FIELDS if f not in batch]
        if missing:
            raise ConfigError(f"policy {self.name!r}: the training batch lacks {missing} (it has {sorted(batch)})")
        batch = {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in batch.items()}
        config, opt = self.loss.loss, self.node.optimizer
        start_version = self.version
        proximal = recomputes_logprobs(config, updates_per_batch=opt.updates_per_batch)  # the planner prices the same rule
        mine = self.part_of(batch)  # this rank's samples (all of them in one process): the rollout's metrics
        raw_rewards = combined_rewards(config, mine)  # [S], before shaping: what reward_mean reports
        rollout = {
            "reward_mean": float(raw_rewards.mean()) if raw_rewards.numel() else 0.0,
            **{f"reward/{name}": float(mine[name].float().mean()) if raw_rewards.numel() else 0.0 for name in config.reward_weights},
        }
        batch, sampled = dynamic_sample(config, batch)  # the whole batch, once: every rank keeps the same groups
        mine = self.part_of(batch)
        if proximal:  # log pi_prox: the weights the batch starts with, once, without gradients
            batch["proximal_logprobs"] = self._logprobs(batch, grad=False)
            mine = self.part_of(batch)
        steps = [self._update(self.part_of(part), mismatch=not proximal) for part in self._mini_batches(batch, start_version)]
        metrics = steps[0] if len(steps) == 1 else _combine(steps)
        if len(steps) > 1:
            metrics["updates"] = float(len(steps))
        if proximal:  # the trainer's weights at the batch's start against the engine's, once per batch
            prox = mine["proximal_logprobs"]
            kept = ~torch.isneginf(prox)
            versions = mine.get("token_versions", mine.get("rollout_version", torch.tensor(start_version)))
            metrics.update(
                mismatch_metrics(
                    torch.where(kept, prox, 0.0), mine["behaviour_logprobs"], mine["completion_mask"], versions=versions, version=start_version, kept=kept
                )
            )
        metrics.update(shape_batch(config, mine)[2] if len(steps) > 1 else {})
        metrics.update(sampled)  # the whole batch's dynamic sampling (the steps saw it done)
        metrics.update(rollout)
        if "rollout_version" in batch:
            metrics["staleness"] = float(start_version - int(batch["rollout_version"]))
        return metrics

    def _mini_batches(self, batch: dict[str, Tensor], version: int) -> list[dict[str, Tensor]]:
        """The batch's mini-batches, pass after pass: ``num_mini_batches`` sets of whole prompt groups
        per pass, in an order drawn from ``(seed, version, pass)`` (so a resumed run draws the same);
        with one mini-batch, the batch itself every pass."""
        opt = self.node.optimizer
        if opt.num_mini_batches == 1:
            return [batch] * opt.num_iterations
        gid = batch["group_ids"].cpu()
        n = int(gid.shape[0])
        starts = [0] + [i for i in range(1, n) if int(gid[i]) != int(gid[i - 1])] if n else []
        bounds = list(zip(starts, starts[1:] + [n]))  # [G] row ranges of the groups (contiguous)
        out = []
        for p in range(opt.num_iterations):
            order = torch.randperm(len(bounds), generator=torch.Generator().manual_seed(_mix(opt.seed, version, p)))
            for chunk in torch.tensor_split(order, opt.num_mini_batches):
                rows = [r for g in sorted(chunk.tolist()) for r in range(*bounds[g])]
                index = torch.tensor(rows, dtype=torch.int64, device=gid.device).to(self.device)
                out.append({k: v.index_select(0, index) if leading_dim(k) == "sample" else v for k, v in batch.items()})
        return out

    def _logprobs(self, part: Mapping[str, Tensor], *, grad: bool) -> Tensor:
        """log pi ``[s, C]`` of ``part``'s completions (sampling's temperature, top-k, top-p; -inf outside pi's
        kept set), under the policy's autocast; without ``grad``, in micro-batches under ``no_grad``."""
        if not grad:
            size = self.node.optimizer.micro_batch_size or max(int(part["completion_mask"].shape[0]), 1)
            with torch.no_grad():
                pieces = [self._logprobs(p, grad=True) for p in split(part, size)]
            return torch.cat(pieces) if pieces else torch.zeros_like(part["behaviour_logprobs"])
        return self._forward(part, completion_logprobs)

    def _forward(self, part: Mapping[str, Tensor], fn: Callable[..., Any]) -> Any:
        """``fn`` (``completion_logprobs`` or ``completion_logprobs_and_entropy``) of ``part``'s completions
        under the policy's autocast, with gradients."""
        precision = self.node.optimizer.autocast
        with torch.autocast(self.device.type, dtype=DTYPES[precision], enabled=precision != "float32"):
            return fn(
                self.model,
                part["sample_prompt_ids"],
                part["sample_prompt_lens"],
                part["completion_ids"],
                part["completion_mask"],
                temperature=part.get("sampling_temperature", 1.0),
                top_k=part.get("sampling_top_k", 0),
                top_p=part.get("sampling_top_p", 1.0),
                completion_lens=part.get("completion_lens"),  # the extent: a multi-turn sample's env tokens are attended, not trained
                packing=self.packing,
                routed_experts=part.get("routed_experts"),  # a generator's routing_replay: route as the engine did
                agreement=self._agreement,
            )

    def _update(self, batch: dict[str, Tensor], *, mismatch: bool) -> dict[str, float]:
        """One optimizer step on ``batch`` (a mini-batch, or this rank's part of one): shape, advantages,
        micro-batches, clip, AdamW, ``version += 1``; its metrics (``mismatch/*`` when ``mismatch``)."""
        config = self.loss.loss
        batch, rewards, shaping = shape_batch(config, batch)  # dynamic sampling, overlong penalty, truncated masked
        adv = loss_advantages(config, rewards, batch)  # [S] a group baseline's, or [S, C] a critic's GAE ("ppo")
        mask = batch["completion_mask"]  # [S, C]
        normalizer = batch_normalizer(mask, config.loss_agg)  # the whole (mini-)batch's tokens / sequences (loss_agg)
        lengths = mask.sum(1)  # [S], real tokens, those outside pi's kept set included
        n = int(mask.shape[0])
        size = self.node.optimizer.micro_batch_size or max(n, 1)
        lr = learning_rate(self.node.optimizer, self.version)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        self._agreement = RoutingAgreement()
        pieces, kept_pieces, entropy_sum = self._accumulate(batch, adv, normalizer, lengths, size)
        with torch.no_grad():
            all_logprobs = torch.cat(pieces) if pieces else torch.zeros_like(batch["behaviour_logprobs"])
            all_kept = torch.cat(kept_pieces) if kept_pieces else torch.ones_like(mask)
            inside = {**batch, "completion_mask": mask & all_kept}
            if "proximal_logprobs" in batch:
                inside["proximal_logprobs"] = torch.where(all_kept, batch["proximal_logprobs"], 0.0)
            loss, metrics = compute_loss(config, all_logprobs, inside, advantages=adv, normalizer=normalizer, lengths=lengths)
            metrics.update(shaping)
            if mismatch:
                versions = batch.get("token_versions", batch.get("rollout_version", torch.tensor(self.version)))
                metrics.update(
                    mismatch_metrics(all_logprobs, batch["behaviour_logprobs"], mask, versions=versions, version=self.version, kept=all_kept)
                )
            if "proximal_logprobs" in batch:
                low, high = config.clip_range()
                metrics.update(proximal_metrics(all_logprobs, inside["proximal_logprobs"], mask & all_kept, clip_eps_low=low, clip_eps_high=high))
        grad_norm = self._clip_gradients(self.node.optimizer.grad_clip or float("inf"))
        self.optimizer.step()
        tokens = int(mask.sum())
        metrics.update({
            "loss": float(loss),
            "policy/grad_norm": float(grad_norm),
            "policy/lr": lr,
            "policy/entropy": float(entropy_sum) / max(tokens, 1),
            "policy/tokens": float(tokens),
            **self._agreement.metrics(),
        })  # fmt: skip
        if self.router is not None:
            metrics.update(self.router.metrics())
        self.version += 1
        return metrics

    def _accumulate(
        self, batch: dict[str, Tensor], adv: Tensor, normalizer: float, lengths: Tensor, size: int
    ) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """Forward and backward of ``batch`` in micro-batches of ``size`` samples (gradients accumulate).

        Returns:
            Per micro-batch, in row order: pi's log-probs ``[s, C]`` (detached, 0 outside the kept set),
            the kept set ``[s, C]``; and pi's entropy summed over the completion tokens (float64).
        """
        n = int(batch["completion_mask"].shape[0])
        pieces: list[Tensor] = []
        kept_pieces: list[Tensor] = []
        entropy_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # pi's entropy over the completion tokens
        total = real_tokens(batch) if self.router is not None else 0  # the forwards' real tokens: the aux loss's weights
        for start, part in zip(range(0, n, size), split(batch, size)):
            with self.router.counting(part) if self.router is not None else nullcontext():
                logprobs, entropy = self._forward(part, completion_logprobs_and_entropy)  # [s, C] each; entropy 0 off the mask
            entropy_sum += entropy.sum(dtype=torch.float64)
            loss, kept, logprobs = self._micro_loss(part, logprobs, adv[start : start + size], normalizer, lengths[start : start + size])
            if self.router is not None and self.router.coef and self.router.aux is not None:  # the load-balancing loss, token-weighted
                loss = loss + self.router.coef * self.router.aux * (real_tokens(part) / total)
            if loss.requires_grad:  # a micro-batch without a trainable token (e.g. multi-turn samples that all failed) adds nothing
                (loss * self.loss_scale).backward()
            pieces.append(logprobs.detach())
            kept_pieces.append(kept)
        return pieces, kept_pieces, entropy_sum

    def _micro_loss(self, part: Mapping[str, Tensor], logprobs: Tensor, adv: Tensor, normalizer: float, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The objective's loss of one micro-batch ``part`` from pi's log-probs ``[s, C]`` of it (with gradients).

        Returns:
            ``(loss, kept, logprobs)``: the loss (its term sums over the whole batch's ``normalizer``),
            the tokens inside pi's (and pi_prox's) kept set, the log-probs with 0 outside it.
        """
        config = self.loss.loss
        # pi = 0 (-inf) only for a sampled token outside pi's kept set: weight 0, never inf or nan
        kept = ~torch.isneginf(logprobs)  # [s, C]
        if "proximal_logprobs" in part:  # and outside pi_prox's
            kept = kept & ~torch.isneginf(part["proximal_logprobs"])
        logprobs = torch.where(kept, logprobs, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device))
        inside = {**part, "completion_mask": part["completion_mask"] & kept}
        if "proximal_logprobs" in part:
            inside["proximal_logprobs"] = torch.where(kept, part["proximal_logprobs"], 0.0)
        loss, _ = compute_loss(config, logprobs, inside, advantages=adv, normalizer=normalizer, lengths=lengths)
        return loss, kept, logprobs

    def _clip_gradients(self, max_norm: float) -> Tensor | float:
        """Clip the gradients to ``max_norm`` by their global norm (``clip_grad_norm``); the norm before clipping."""
        return self.clip_grad_norm(self.model.parameters(), max_norm)

    def weights(self) -> dict[str, Tensor]:
        """The current weights by name, without copying (a transport copies them); tensors on ``device``."""
        return self._weights

    def load_weights(self, state: Mapping[str, Tensor]) -> None:
        """Copy ``state`` into the model in place (the optimizer and the version are left as they are)."""
        copy_weights(self._weights, state, owner=f"policy {self.name!r}")

    def state(self, *, copy: bool = True) -> dict[str, Any]:
        """A copy of everything a checkpoint needs: ``version``, ``model``, ``optimizer`` and the model config,
        every tensor on the CPU (``load_state`` moves them to ``device``). ``copy=False``: the live
        tensors, where they are (for a caller that copies them itself: ``checkpointing.background.stage``)."""
        model = dict(self._weights) if self.lora else dict(self.model.state_dict())  # LoRA: the adapters
        optimizer = self.optimizer.state_dict()
        return {
            "version": self.version,
            "model_config": msgspec.to_builtins(self.node.model),
            "model": cpu_copy(model) if copy else model,
            "optimizer": cpu_copy(optimizer) if copy else optimizer,
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state()`` returned (possibly through ``torch.save``/``torch.load(weights_only=True)``).

        Raises:
            CheckpointError: when the state is incomplete or was saved from a model of another shape.
        """
        missing = [k for k in ("version", "model", "optimizer") if k not in state]
        if missing:
            raise CheckpointError(f"policy {self.name!r}: trainer state lacks {missing}")
        saved = state.get("model_config")
        mine = msgspec.to_builtins(self.node.model)
        if saved is not None:
            saved = {"family": "builtin", **dict(saved)}  # checkpoints from before the family tag
        if saved is not None and saved != mine:
            diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
            raise CheckpointError(
                f"policy {self.name!r}: the checkpoint holds a model with a different config (saved, now): {diff}"
            )
        if self.lora:  # the base weights are the description's own; the checkpoint holds the adapters
            copy_weights(self._weights, state["model"], owner=f"policy {self.name!r} (checkpoint)")
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
