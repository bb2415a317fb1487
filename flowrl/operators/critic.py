"""The critic node's operator: a causal LM with a scalar value head, its AdamW, and PPO's clipped value loss.

The value model is the critic's model (``flowrl.models``: built-in or Hugging Face; with ``lora``,
adapters on the frozen base) whose output head is replaced by a linear layer to one number
(``attach_value_head``, zero-initialised: every value starts at 0). ``completion_values`` lays the
tokens out as ``flowrl.operators.logprobs`` does, so ``values[:, t]`` is ``V(x, y_<t)``, read at the
position whose logits give log pi(y_t).

One ``train_step(batch)``:

1. computes ``V_old`` of the whole batch with the weights it starts with (no gradient,
   micro-batched): the ``values`` it writes, of version ``version``;
2. shapes the batch and combines its rewards as its loss does (``flowrl.operators.shaping``), and
   computes GAE returns ``G`` from ``V_old`` (``flowrl.operators.gae``, the loss's ``gamma``, ``lam``);
3. takes ``num_iterations`` optimizer steps on the batch, each over micro-batches of
   ``micro_batch_size`` samples, minimising PPO's clipped value loss (``value_loss``), clipping the
   gradient norm, at the scheduled learning rate; ``version`` counts those steps.

Value loss (Schulman et al. 2017; verl's ``compute_value_loss``), over the masked tokens, with
``V_clip = V_old + clip(V - V_old, -eps, eps)``::

    loss = 0.5 * sum_{i,t} max((V - G)^2, (V_clip - G)^2) / N_tokens

State (``state()`` / ``load_state``): the trainable weights (all of them; with LoRA the adapters and
the value head), the optimizer and the version, as tensors and plain values on the CPU
(``torch.load(weights_only=True)`` reads it).

Example:
    >>> from flowrl.graph.critic import CriticNode
    >>> from flowrl.graph.configs import LossConfig, ModelConfig
    >>> critic = Critic(CriticNode(name="critic", model=ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=1)), LossConfig(objective="ppo"))
    >>> critic.version
    0
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import torch
from torch import Tensor, nn

from flowrl.errors import CheckpointError, ConfigError
from flowrl.graph.configs import LossConfig
from flowrl.graph.critic import CriticNode
from flowrl.operators.batch import split
from flowrl.operators.gae import explained_variance, gae
from flowrl.operators.generation import DTYPES
from flowrl.operators.logprobs import prompt_valid, routed_columns
from flowrl.operators.losses import masked_mean
from flowrl.operators.shaping import shape_batch
from flowrl.operators.trainer import cpu_copy, learning_rate
from flowrl.models.lora import add_adapters
from flowrl.models.registry import build_model
from flowrl.models.routing import replaying

__all__ = ["Critic", "attach_value_head", "completion_values", "value_loss"]


def attach_value_head(model: nn.Module, *, owner: str = "critic") -> str:
    """Replace ``model``'s output projection with a zero-initialised ``Linear(dim, 1)``, in place, so
    its "logits" are ``[B, T, 1]`` values; returns the head's module name.

    Raises:
        ConfigError: for a model whose output projection flowrl cannot find.
    """
    hf = model.__dict__.get("hf")
    if hf is not None:  # flowrl.models.hf.HFCausalLM: its children are the HF model's
        old = hf.get_output_embeddings()
        names = [n for n, m in model.named_children() if m is old]
        if old is None or not names:
            raise ConfigError(f"{owner}: {type(hf).__name__} has no output projection flowrl can replace with a value head")
        head = nn.Linear(old.in_features, 1, bias=True, device=old.weight.device)
        hf.set_output_embeddings(head)
        setattr(model, names[0], head)
    elif hasattr(model, "output") and isinstance(embeddings := getattr(model, "tok_embeddings", None), nn.Embedding):  # the built-in transformer (output None: tied)
        weight = embeddings.weight
        head = nn.Linear(weight.shape[1], 1, bias=True, device=weight.device)
        model.output = head
        names = ["output"]
    else:
        raise ConfigError(f"{owner}: {type(model).__name__} is neither the built-in transformer nor a Hugging Face causal LM; no value head")
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
    return names[0]


def completion_values(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """``V(x, y_<t)`` ``[S, C]`` float32 of ``batch``'s completions (0 off ``completion_mask``), with
    gradients unless called under ``no_grad``; the layout of ``completion_logprobs``, and its routing
    replay where ``batch`` carries ``routed_experts``."""
    prompt_ids, prompt_lens = batch["sample_prompt_ids"], batch["sample_prompt_lens"]
    completion_ids, mask = batch["completion_ids"], batch["completion_mask"]
    S, Tp = prompt_ids.shape
    C = completion_ids.shape[1]
    attended = mask
    if "completion_lens" in batch:  # multi-turn: every token up to the extent is attended
        attended = torch.arange(C, device=mask.device)[None, :] < batch["completion_lens"].to(mask.device)[:, None]
    used = int(attended.sum(1).max()) if S and C else 0
    out = torch.zeros(S, C, dtype=torch.float32, device=completion_ids.device)
    if used == 0:
        return out
    skip = int(Tp - prompt_lens.max())
    prompt_ids = prompt_ids[:, skip:]
    valid = torch.cat([prompt_valid(prompt_ids, prompt_lens), attended[:, :used]], dim=1)[:, :-1]
    tokens = torch.cat([prompt_ids, completion_ids[:, :used]], dim=1)[:, :-1]
    routed = batch.get("routed_experts")  # a generator's routing_replay: a MoE critic routes as the engine did
    if routed is not None:
        routed = routed_columns(routed, Tp, C)[:, skip : skip + tokens.shape[1]]
    with replaying(model, routed, owner="critic"):
        values = model(tokens, valid=valid, keep=used).float()[..., 0]  # [S, used]: the state before each y_t
    values = torch.cat([values, out[:, used:]], dim=1) if used < C else values
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float | None, normalizer: float | None = None
) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped value loss (module docstring) and its metrics ``critic/value_loss``, ``critic/clip_frac``.

    Args:
        values: ``[S, C]`` V with gradients.
        old_values: ``[S, C]`` V_old, the values computed before the step.
        returns: ``[S, C]`` G, the GAE returns.
        mask: ``[S, C]`` bool.
        clip: ``eps``; None: the unclipped squared error.
        normalizer: the whole batch's token count (micro-batches accumulate to its gradient); default: this batch's.
    """
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    err = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err_clipped = (clipped - returns) ** 2
        clip_frac = float(masked_mean((err_clipped > err).float(), mask))
        err = torch.max(err, err_clipped)
    else:
        clip_frac = 0.0
    n = float(max(int(mask.sum()), 1)) if normalizer is None else normalizer
    loss = 0.5 * torch.where(mask, err, zero).sum() / n
    return loss, {"critic/value_loss": float(loss.detach()), "critic/clip_frac": clip_frac}


class Critic:
    """A critic's value model, optimizer and version (module docstring).

    Args:
        node: the critic node.
        loss: the config of the loss it feeds (its reward weights, shaping, ``gamma`` and ``lam``).
        device: where the model and optimizer live; batches arrive on the CPU and are moved there.
    """

    def __init__(self, node: CriticNode, loss: LossConfig, *, device: str | torch.device = "cpu") -> None:
        self.name = node.name
        self.node = node
        self.loss = loss
        self.device = torch.device(device)
        owner = f"critic {node.name!r}"
        if node.optimizer.router_aux_loss_coef:
            raise ConfigError(
                f"{owner}: router_aux_loss_coef={node.optimizer.router_aux_loss_coef} is a mixture-of-experts policy's load-balancing "
                "loss; a critic does not add it: remove it from the critic's options"
            )
        self.model = build_model(node.model, device=self.device).train()
        add_adapters(self.model, node.model, owner=owner)  # LoRA: freezes the base; the head below trains in full
        self.head = attach_value_head(self.model, owner=owner)
        if node.optimizer.gradient_checkpointing:
            self.model.enable_gradient_checkpointing()
        self.trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        opt = node.optimizer
        self.optimizer = torch.optim.AdamW(list(self.trainable.values()), lr=learning_rate(opt, 0), betas=opt.betas, weight_decay=opt.weight_decay)
        self.clip_grad_norm = torch.nn.utils.clip_grad_norm_  # (params, max_norm) -> norm; a tensor-parallel critic counts shards once
        self.version = 0

    def _values(self, part: Mapping[str, Tensor]) -> Tensor:
        precision = self.node.optimizer.autocast
        with torch.autocast(self.device.type, dtype=DTYPES[precision], enabled=precision != "float32"):
            return completion_values(self.model, part)

    def values(self, batch: Mapping[str, Tensor]) -> Tensor:
        """V ``[S, C]`` of ``batch`` under the current weights, without gradients, micro-batched."""
        batch = {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in batch.items()}
        size = self.node.optimizer.micro_batch_size or max(int(batch["completion_mask"].shape[0]), 1)
        with torch.no_grad():
            pieces = [self._values(p) for p in split(batch, size)]
        return torch.cat(pieces) if pieces else torch.zeros(batch["completion_mask"].shape, device=self.device)

    def train_step(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        """Values of ``batch`` by the current weights (on the CPU), then ``num_iterations`` optimizer steps
        on it (module docstring); the values and the ``critic/*`` metrics.

        Metrics: ``critic/value_loss`` and ``critic/clip_frac`` (means over the steps),
        ``critic/explained_variance`` (of the returns by the values written, before the steps),
        ``critic/value_mean``, ``critic/return_mean``, ``critic/grad_norm`` (the last step's, before
        clipping), ``critic/lr``, ``critic/version`` (the version that computed the values).

        Raises:
            ConfigError: naming a field the batch lacks.
        """
        needed = ("sample_prompt_ids", "sample_prompt_lens", "completion_ids", "completion_mask", "group_ids", *self.loss.reward_weights)
        missing = [f for f in needed if f not in batch]
        if missing:
            raise ConfigError(f"critic {self.name!r}: the batch lacks {missing} (it has {sorted(batch)})")
        batch = {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in batch.items()}
        start_version = self.version
        old = self.values(batch)  # [S, C], what this step writes
        shaped, rewards, _ = shape_batch(self.loss, {**batch, "values": old})
        mask = shaped["completion_mask"]
        _, returns = gae(rewards, shaped["values"], mask, gamma=self.loss.gamma, lam=self.loss.lam)
        metrics: dict[str, float] = {
            "critic/explained_variance": explained_variance(shaped["values"], returns, mask),
            "critic/value_mean": float(masked_mean(shaped["values"], mask)),
            "critic/return_mean": float(masked_mean(returns, mask)),
            "critic/version": float(start_version),
        }
        train = {**shaped, "returns": returns}
        opt = self.node.optimizer
        n = int(mask.shape[0])
        size = opt.micro_batch_size or max(n, 1)
        normalizer = float(max(int(mask.sum()), 1))
        losses, clips, norm, lr = [], [], 0.0, learning_rate(opt, self.version)
        for _ in range(opt.num_iterations):
            lr = learning_rate(opt, self.version)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.zero_grad(set_to_none=True)
            loss_sum, clip_sum = 0.0, 0.0
            for part in split(train, size):
                v = self._values(part)
                loss, m = value_loss(v, part["values"], part["returns"], part["completion_mask"], clip=self.node.value_clip, normalizer=normalizer)
                if loss.requires_grad:
                    loss.backward()
                loss_sum += float(loss.detach())
                clip_sum += m["critic/clip_frac"] * float(part["completion_mask"].sum())
            norm = float(self.clip_grad_norm(list(self.trainable.values()), opt.grad_clip or float("inf")))
            self.optimizer.step()
            self.version += 1
            losses.append(loss_sum)
            clips.append(clip_sum / normalizer)
        metrics.update({
            "critic/value_loss": sum(losses) / len(losses),
            "critic/clip_frac": sum(clips) / len(clips),
            "critic/grad_norm": norm,
            "critic/lr": lr,
        })  # fmt: skip
        return old.cpu(), metrics

    def state(self) -> dict[str, Any]:
        """A CPU copy of what a checkpoint needs: ``version``, the trainable ``weights``, the ``optimizer`` and the model config."""
        return {
            "version": self.version,
            "model_config": msgspec.to_builtins(self.node.model),
            "weights": cpu_copy(dict(self.trainable)),
            "optimizer": cpu_copy(self.optimizer.state_dict()),
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state()`` returned.

        Raises:
            CheckpointError: an incomplete state, or one saved from another model.
        """
        missing = [k for k in ("version", "weights", "optimizer") if k not in state]
        if missing:
            raise CheckpointError(f"critic {self.name!r}: its checkpointed state lacks {missing}")
        mine = msgspec.to_builtins(self.node.model)
        if state.get("model_config", mine) != mine:
            raise CheckpointError(f"critic {self.name!r}: the checkpoint holds a model of another config ({state['model_config']}, now {mine})")
        weights = state["weights"]
        if sorted(weights) != sorted(self.trainable):
            raise CheckpointError(f"critic {self.name!r}: the checkpoint's weights {sorted(weights)[:4]}... are not this critic's {sorted(self.trainable)[:4]}...")
        with torch.no_grad():
            for name, p in self.trainable.items():
                p.copy_(weights[name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
