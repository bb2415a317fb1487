"""The policy node's operator: pi's weights, AdamW, the learning-rate schedule and the version clock.

One ``train_step(batch)``:

1. reads the rollout and its reward fields; advantages come from the whole batch (group baselines
   need every sample of a prompt);
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
3. clips the global gradient norm, sets the scheduled learning rate, steps AdamW;
4. measures the engine/trainer mismatch on the tokens drawn by its current weights
   (``flowrl.operators.mismatch``: ``mismatch/kl``, ``mismatch/abs_logp_max``, ``mismatch/tokens``,
   ``mismatch/outside_kept_frac``), from what every engine writes;
5. bumps ``version`` (completed optimizer steps, 0 before the first).

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
from collections.abc import Mapping
from typing import Any

import msgspec
import torch
from torch import Tensor

from flowrl.errors import CheckpointError, ConfigError
from flowrl.graph.configs import OptimizerConfig
from flowrl.graph.nodes import LossNode, PolicyNode
from flowrl.operators.batch import split
from flowrl.operators.generation import DTYPES, copy_weights
from flowrl.operators.logprobs import completion_logprobs
from flowrl.operators.losses import advantages, batch_normalizer, check_objective, combined_rewards, compute_loss
from flowrl.operators.shaping import shape_batch
from flowrl.operators.mismatch import mismatch_metrics
from flowrl.models.causal_lm import weight_dict
from flowrl.models.lora import adapter_weights, add_adapters, lora_of
from flowrl.models.registry import build_model

__all__ = ["Trainer", "learning_rate", "TRAIN_FIELDS"]

#: Rollout fields a training step reads (besides the reward fields of the loss).
TRAIN_FIELDS: tuple[str, ...] = (
    "sample_prompt_ids",
    "sample_prompt_lens",
    "completion_ids",
    "completion_mask",
    "behaviour_logprobs",
    "group_ids",
)


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


def _clone(value: Any) -> Any:
    """A deep copy of ``value`` with every tensor copied to the CPU (a checkpoint loads anywhere)."""
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


class Trainer:
    """Trains pi with the objective of ``loss`` (see the module docstring).

    Args:
        node: the policy node (model shape, optimizer).
        loss: the loss node its objective comes from.
        device: where the model and the optimizer live (``"cpu"``, ``"cuda:N"``).

    Attributes:
        model: pi (a ``flowrl.models.CausalLM``, float32, trainable), on ``device``.
        optimizer: AdamW over the model's parameters.
        version: completed optimizer steps.
        loss_scale: a factor on the loss before ``backward`` (1; an FSDP rank sets its token share,
            ``flowrl.runtime.fsdp.token_scale``).

    Raises:
        ConfigError: for an unknown objective.
    """

    def __init__(self, node: PolicyNode, loss: LossNode, *, device: str | torch.device = "cpu") -> None:
        check_objective(loss.loss.objective)
        self.name = node.name
        self.node, self.loss = node, loss
        self.device = torch.device(device)
        opt = node.optimizer
        self.model = build_model(node.model, device=self.device).train()
        self.lora = lora_of(node.model)  # LoRA: only the adapters train, travel and are checkpointed
        add_adapters(self.model, node.model, owner=f"policy {node.name!r}")
        if opt.gradient_checkpointing:
            self.model.enable_gradient_checkpointing()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=learning_rate(opt, 0), betas=opt.betas, weight_decay=opt.weight_decay
        )
        self.version = 0
        self._weights = adapter_weights(self.model) if self.lora else weight_dict(self.model)  # views of the parameters, updated in place
        self.loss_scale = 1.0  # a factor on the loss before backward, set per step by flowrl.runtime.fsdp

    def train_step(self, batch: Mapping[str, Tensor]) -> dict[str, float]:
        """One optimizer step on ``batch`` (a rollout plus its reward fields, and ``ref_logprobs`` for a KL term).

        Returns:
            Metrics: ``loss``, ``reward_mean``, ``reward/<field>`` per reward field, ``grad_norm``
            (before clipping), ``lr``, ``completion_len_mean``, ``staleness`` (version at this step
            minus ``rollout_version``, when the batch has it), the ``mismatch/*`` metrics, the
            ``shaping/*`` metrics of the shaping applied, and the loss's own metrics (over the tokens
            inside pi's kept set). ``reward_mean``, ``reward/<field>`` and ``completion_len_mean`` are
            the rollout's, before shaping.

        Raises:
            ConfigError: naming a field the batch lacks.
        """
        missing = [f for f in TRAIN_FIELDS if f not in batch]
        if missing:
            raise ConfigError(f"policy {self.name!r}: the training batch lacks {missing} (it has {sorted(batch)})")
        batch = {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in batch.items()}
        config = self.loss.loss
        raw_rewards = combined_rewards(config, batch)  # [S], before shaping: what reward_mean reports
        rollout = batch  # as it came, for the reward and length metrics
        batch, rewards, shaping = shape_batch(config, batch)  # dynamic sampling, overlong penalty, truncated masked
        adv = advantages(rewards, batch["group_ids"], baseline=config.baseline, normalize_std=config.normalize_std)
        mask = batch["completion_mask"]  # [S, C]
        normalizer = batch_normalizer(mask, config.loss_agg)  # the whole batch's tokens / sequences (loss_agg)
        lengths = mask.sum(1)  # [S], real tokens, those outside pi's kept set included
        n = int(mask.shape[0])
        size = self.node.optimizer.micro_batch_size or max(n, 1)
        lr = learning_rate(self.node.optimizer, self.version)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        pieces: list[Tensor] = []
        kept_pieces: list[Tensor] = []
        precision = self.node.optimizer.autocast
        device_type = self.device.type
        for start, part in zip(range(0, n, size), split(batch, size)):
            with torch.autocast(device_type, dtype=DTYPES[precision], enabled=precision != "float32"):
                logprobs = completion_logprobs(
                    self.model,
                    part["sample_prompt_ids"],
                    part["sample_prompt_lens"],
                    part["completion_ids"],
                    part["completion_mask"],
                    temperature=part.get("sampling_temperature", 1.0),
                    top_k=part.get("sampling_top_k", 0),
                    top_p=part.get("sampling_top_p", 1.0),
                    completion_lens=part.get("completion_lens"),  # the extent: a multi-turn sample's env tokens are attended, not trained
                )
            # pi = 0 (-inf) only for a sampled token outside pi's kept set: weight 0, never inf or nan
            kept = ~torch.isneginf(logprobs)  # [s, C]
            logprobs = torch.where(kept, logprobs, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device))
            inside = {**part, "completion_mask": part["completion_mask"] & kept}
            loss, _ = compute_loss(
                config, logprobs, inside, advantages=adv[start : start + size], normalizer=normalizer, lengths=lengths[start : start + size]
            )
            if loss.requires_grad:  # a micro-batch without a trainable token (e.g. multi-turn samples that all failed) adds nothing
                (loss * self.loss_scale).backward()
            pieces.append(logprobs.detach())
            kept_pieces.append(kept)
        with torch.no_grad():
            all_logprobs = torch.cat(pieces) if pieces else torch.zeros_like(batch["behaviour_logprobs"])
            all_kept = torch.cat(kept_pieces) if kept_pieces else torch.ones_like(mask)
            inside = {**batch, "completion_mask": mask & all_kept}
            loss, metrics = compute_loss(config, all_logprobs, inside, advantages=adv, normalizer=normalizer, lengths=lengths)
            metrics.update(shaping)
            versions = batch.get("token_versions", batch.get("rollout_version", torch.tensor(self.version)))
            metrics.update(
                mismatch_metrics(all_logprobs, batch["behaviour_logprobs"], mask, versions=versions, version=self.version, kept=all_kept)
            )
        max_norm = self.node.optimizer.grad_clip or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        metrics.update(
            {
                "loss": float(loss),
                "reward_mean": float(raw_rewards.mean()) if raw_rewards.numel() else 0.0,
                "grad_norm": float(grad_norm),
                "lr": lr,
                "completion_len_mean": float(rollout["completion_mask"].sum(1).float().mean()) if raw_rewards.numel() else 0.0,
            }
        )
        for name in config.reward_weights:
            metrics[f"reward/{name}"] = float(rollout[name].float().mean()) if raw_rewards.numel() else 0.0
        if "rollout_version" in batch:
            metrics["staleness"] = float(self.version - int(batch["rollout_version"]))
        self.version += 1
        return metrics

    def weights(self) -> dict[str, Tensor]:
        """The current weights by name, without copying (a transport copies them); tensors on ``device``."""
        return self._weights

    def load_weights(self, state: Mapping[str, Tensor]) -> None:
        """Copy ``state`` into the model in place (the optimizer and the version are left as they are)."""
        copy_weights(self._weights, state, owner=f"policy {self.name!r}")

    def state(self) -> dict[str, Any]:
        """A copy of everything a checkpoint needs: ``version``, ``model``, ``optimizer`` and the model config,
        every tensor on the CPU (``load_state`` moves them to ``device``)."""
        return {
            "version": self.version,
            "model_config": msgspec.to_builtins(self.node.model),
            "model": _clone(dict(self._weights) if self.lora else dict(self.model.state_dict())),  # LoRA: the adapters
            "optimizer": _clone(self.optimizer.state_dict()),
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
