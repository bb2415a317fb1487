"""The trainer of one pipeline stage: the policy's optimizer steps run through ``torch.distributed.pipelining``.

``PipelineTrainer`` is a ``flowrl.operators.trainer.Trainer`` over one ``StageModule``
(``flowrl.runtime.parallel.pipeline``); every rank of a pipeline (one per stage, the ranks of a ``pp``
group) calls ``train_step`` on the same batch, and the trainer's own steps run unchanged (shaping,
advantages, mini-batches, passes, the learning rate, metrics) but for three parts:

- **forward and backward** (``_accumulate``): the mini-batch (this dp rank's part of it) is laid out
  once, padded (``flowrl.operators.logprobs.padded_layout``: every micro-batch has one shape, which is
  what the stages' static metadata says, so no shape is ever exchanged, and nothing is pickled) and
  cut into ``ceil(S / micro_batch_size)`` micro-batches of ``micro_batch_size`` samples (0: one), the
  last filled up with copies of the first row that the loss never reads. A ``PipelineStage`` per rank
  runs them under ``Schedule1F1B`` (``ScheduleGPipe`` when there are fewer micro-batches than stages,
  which 1F1B cannot schedule). The first stage takes the token ids, every stage the ``valid`` mask as
  a keyword input (each builds its positions and attention mask from it).
- **the RL loss on the last stage**: the schedule's ``target`` is each padded row's index into the
  mini-batch; ``loss_fn(logits, rows)`` (a closure over the mini-batch) takes the micro-batch's real
  rows of every per-sample field (advantages, behaviour and proximal log-probs, masks, sampling
  temperature and truncation, ...), computes pi's log-probs from the stage's logits as one process
  does (``completion_logprobs_and_entropy`` on the same layout) and the objective's loss
  (``Trainer._micro_loss``: term sums over the whole mini-batch's count), and records the log-probs,
  kept set and entropy the step's metrics are computed from afterwards. ``scale_grads=False``: the
  loss is already normalised. Only the last stage's metrics mean anything; the program shares them.
- **gradients** (``_clip_gradients``): each gradient is weighted by this dp rank's token share and
  summed over the stage's dp group (``dp_token_share``, as ``make_data_parallel``); a tied head's
  gradient is summed over the pp group (first and last stage hold a copy each; the middle ones add
  zeros), so both copies take the same AdamW step; the global norm is the square root of the squares
  summed over the stages (the tied matrix counted once) and clips every stage alike.

The proximal log-probs of a batch that takes several optimizer steps (``_logprobs`` without gradient)
run forward only (``ScheduleGPipe`` without a loss); the last stage computes them from the merged
logits, the other stages hold zeros in their place (they never read them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from flowrl.errors import ConfigError
from flowrl.graph.nodes import LossNode, PolicyNode
from flowrl.operators.batch import leading_dim
from flowrl.operators.generation import DTYPES
from flowrl.operators.logprobs import attended_mask, completion_logprobs, completion_logprobs_and_entropy, padded_layout
from flowrl.operators.trainer import Trainer
from flowrl.runtime.parallel.pipeline import StageModule
from flowrl.runtime.parallel.tp_train import grad_squares

__all__ = ["PipelineTrainer"]


class _Logits:
    """A stand-in model returning logits a stage computed: ``completion_logprobs`` asks it for the logits
    of the completion's first ``keep`` tokens, which are the first ``keep`` columns of the padded
    layout's (``padded_layout``: column ``j`` predicts completion token ``j`` in any micro-batch of it)."""

    def __init__(self, logits: Tensor) -> None:
        self.logits = logits

    def __call__(self, tokens: Tensor, *, keep: int = 0, **kwargs: Any) -> Tensor:
        assert tokens.shape[0] == self.logits.shape[0] and keep <= self.logits.shape[1], (tuple(tokens.shape), keep, tuple(self.logits.shape))
        return self.logits[:, :keep]


def _rows(batch: Mapping[str, Tensor], index: Tensor) -> dict[str, Tensor]:
    """The samples ``index`` of every per-sample field of ``batch`` (the others as they are)."""
    return {k: v.index_select(0, index) if isinstance(v, Tensor) and leading_dim(k) == "sample" else v for k, v in batch.items()}


def _fields(part: Mapping[str, Tensor]) -> tuple[tuple[Tensor, ...], dict[str, Any]]:
    """``completion_logprobs``' arguments for ``part`` (as ``Trainer._forward`` passes them).

    Raises:
        ConfigError: for a rollout with ``routed_experts``: the stages' forwards do not replay routing.
    """
    if "routed_experts" in part:
        raise ConfigError(
            "a pipeline-parallel policy does not replay a generator's routing (routed_experts): its stages run the "
            "forward; drop routing_replay on the generator, or train the MoE policy without a pp axis"
        )
    args = (part["sample_prompt_ids"], part["sample_prompt_lens"], part["completion_ids"], part["completion_mask"])
    kwargs = {
        "temperature": part.get("sampling_temperature", 1.0),
        "top_k": part.get("sampling_top_k", 0),
        "top_p": part.get("sampling_top_p", 1.0),
        "completion_lens": part.get("completion_lens"),
        "packing": False,
    }
    return args, kwargs


class PipelineTrainer(Trainer):
    """One stage's trainer (see the module docstring).

    Args:
        node, loss: the policy and its loss node.
        stage: this rank's ``StageModule``.
        pp_group: the process group of this pipeline's stages (group rank = stage index).
        dp_group: the group of this stage's dp ranks (None: dp = 1).
        device: this rank's device.

    Attributes:
        dp_token_share: this dp rank's share of the mini-batch's loss divisor (set per step by the program).
        grad_norms: the global gradient norm of every optimizer step (the program reads and clears them).
    """

    def __init__(self, node: PolicyNode, loss: LossNode, *, stage: StageModule, pp_group: Any, dp_group: Any, device: torch.device) -> None:
        if node.optimizer.router_aux_loss_coef:  # its stages' micro-batch losses see the last stage's logits only
            raise ConfigError(
                f"policy {node.name!r}: router_aux_loss_coef={node.optimizer.router_aux_loss_coef} is not added by a pipeline-parallel "
                "policy (its routers sit on every stage); run it without a pp axis or remove router_aux_loss_coef"
            )
        super().__init__(node, loss, device=device, model=stage)
        self.packing = False  # fixed-shape micro-batches (pipeline.check_pipeline refuses packing=True)
        self.stage = stage
        self.pp_group, self.dp_group = pp_group, dp_group
        precision = node.optimizer.autocast
        stage.autocast = None if precision == "float32" else DTYPES[precision]
        self._weights = {stage.names[k]: v for k, v in self._weights.items()}  # the whole model's names
        self.dp_token_share = 1.0
        self.grad_norms: list[float] = []

    # -- the schedule ------------------------------------------------------------------------------
    def _layout(self, batch: Mapping[str, Tensor], size: int) -> tuple[Tensor, Tensor, int, int, int]:
        """(tokens, valid, used, micro-batches, their size) of ``batch`` padded to whole micro-batches."""
        n = int(batch["completion_mask"].shape[0])
        attended = attended_mask(batch["completion_mask"], batch.get("completion_lens"))
        tokens, valid, used = padded_layout(batch["sample_prompt_ids"], batch["sample_prompt_lens"], batch["completion_ids"], attended)
        size = min(size, n)
        chunks = math.ceil(n / size)
        fill = torch.zeros(chunks * size - n, dtype=torch.int64, device=tokens.device)  # copies of row 0, never read
        index = torch.cat([torch.arange(n, device=tokens.device), fill])
        return tokens.index_select(0, index), valid.index_select(0, index), used, chunks, size

    def _run(self, tokens: Tensor, valid: Tensor, used: int, chunks: int, size: int, loss_fn: Any) -> Any:
        """One pass of the schedule over the padded rows (forward and backward with ``loss_fn``, else forward only)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stage = self.stage
        W, D = int(tokens.shape[1]), stage.hidden_size()
        hidden = torch.empty(size, W, D, dtype=torch.float32, device="meta", requires_grad=loss_fn is not None)  # gradients flow back
        given = torch.empty(size, W, dtype=tokens.dtype, device="meta") if stage.first else hidden
        out = torch.empty(size, used, stage.vocab_rows(), dtype=torch.float32, device="meta") if stage.last else hidden
        stage.keep = used
        pipe = PipelineStage(stage, stage.index, stage.count, self.device, input_args=given, output_args=out, group=self.pp_group)
        kind = Schedule1F1B if loss_fn is not None and chunks >= stage.count else ScheduleGPipe
        schedule = kind(pipe, chunks, loss_fn=loss_fn, scale_grads=False)
        rows = torch.arange(chunks * size, device=tokens.device)
        args = (tokens,) if stage.first else ()
        return schedule.step(*args, target=rows, valid=valid)

    def _accumulate(
        self, batch: dict[str, Tensor], adv: Tensor, normalizer: float, lengths: Tensor, size: int
    ) -> tuple[list[Tensor], list[Tensor], Tensor]:
        n = int(batch["completion_mask"].shape[0])
        mask = batch["completion_mask"]
        entropy = torch.zeros((), dtype=torch.float64, device=self.device)
        nothing = ([torch.zeros(mask.shape, dtype=torch.float32, device=self.device)], [torch.ones_like(mask)], entropy)
        if n == 0:  # an empty dp part: every stage of this pipeline has it, none runs the schedule
            return [], [], entropy
        tokens, valid, used, chunks, size = self._layout(batch, size)
        if used == 0:  # no completion token anywhere: no gradient (every stage sees the same batch)
            return nothing
        pieces: list[Tensor] = []
        kept_pieces: list[Tensor] = []
        entropies: list[Tensor] = []

        def loss_fn(logits: Tensor, rows: Tensor) -> Tensor:
            real = rows[rows < n]  # the micro-batch's samples (fill rows come last)
            if real.numel() == 0:
                return logits.sum() * 0.0
            part = _rows(batch, real)
            args, kwargs = _fields(part)
            logprobs, ent = completion_logprobs_and_entropy(_Logits(logits[: real.numel()]), *args, **kwargs)  # type: ignore[arg-type]  # a stand-in: it is only called
            loss, kept, logprobs = self._micro_loss(part, logprobs, adv.index_select(0, real), normalizer, lengths.index_select(0, real))
            pieces.append(logprobs.detach())
            kept_pieces.append(kept)
            entropies.append(ent.sum(dtype=torch.float64))
            return loss * self.loss_scale if loss.requires_grad else logits.sum() * 0.0

        self._run(tokens, valid, used, chunks, size, loss_fn)
        if not self.stage.last:
            return nothing
        return pieces, kept_pieces, torch.stack(entropies).sum() if entropies else entropy

    def _logprobs(self, part: Mapping[str, Tensor], *, grad: bool) -> Tensor:
        """log pi ``[S, C]`` of ``part`` without gradient (the proximal log-probs): forward only, on the
        last stage from the merged logits; zeros on the other stages (they never read them)."""
        assert not grad, "a pipeline stage computes log-probs with gradients only inside its schedule"
        n = int(part["completion_mask"].shape[0])
        out = torch.zeros(part["completion_mask"].shape, dtype=torch.float32, device=self.device)
        size = self.node.optimizer.micro_batch_size or max(n, 1)
        if n == 0:
            return out
        tokens, valid, used, chunks, size = self._layout(part, size)
        if used == 0:
            return out
        with torch.no_grad():
            logits = self._run(tokens, valid, used, chunks, size, None)
            if not self.stage.last:
                return out
            pieces = []
            for start in range(0, n, size):
                rows = torch.arange(start, min(start + size, n), device=self.device)
                args, kwargs = _fields(_rows(part, rows))
                pieces.append(completion_logprobs(_Logits(logits[start : start + rows.numel()]), *args, **kwargs))  # type: ignore[arg-type]  # a stand-in: it is only called
        return torch.cat(pieces)

    # -- gradients across dp ranks and stages ------------------------------------------------------
    def _clip_gradients(self, max_norm: float) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads: list[Tensor] = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            flat = torch.cat([g.reshape(-1) for g in grads]).mul_(float(self.dp_token_share))
            dist.all_reduce(flat, group=self.dp_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        tied = self.stage.tied_parameter()
        if self.stage.count > 1 and self.stage.tied_head is not None:
            grad = tied.grad if tied is not None else torch.zeros(self.stage.tied_head[1], device=self.device)
            dist.all_reduce(grad, group=self.pp_group)  # the first and the last stage's copies (the middle ones: zeros)
        squares = sum((grad_squares(g) for p, g in zip(params, grads) if p is not tied or self.stage.first), torch.zeros((), dtype=torch.float64))
        total = squares.reshape(1).to(self.device)
        if self.stage.count > 1:
            dist.all_reduce(total, group=self.pp_group)
        norm = float(total.sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:  # as torch.nn.utils.clip_grad_norm_
            for g in grads:
                g.mul_(coef)
        self.grad_norms.append(norm)
        return norm
