"""Typed configuration structs of the node kinds: model shape, sampling, loss, optimizer, data.

Every struct is a frozen, keyword-only msgspec Struct that rejects unknown fields, so a typo in a
graph file is an error rather than a silently ignored setting. Range checks live in ``__post_init__``
and raise ``ConfigError`` with the field, the value and the allowed range.

The model descriptions are ``ModelConfig`` (the built-in transformer) and ``HFModelConfig`` (a
Hugging Face directory); ``HFModelConfig.lora`` is a description's adapters (``LoraConfig``): the
builder's ``policy(lora=)`` sets it, and a weight edge gives it to the generator it feeds
(``GraphBuilder._adopt_lora``); under FSDP2 the adapters shard beside the frozen base.

Example:
    >>> ModelConfig(dim=64, n_layers=2, n_heads=4).head_dim
    16
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import msgspec

from flowrl.errors import ConfigError
from flowrl.graph.corrections import CorrectionConfig, check_correction, correction_of
from flowrl.graph.objectives import BUILTIN_OBJECTIVES, OBJECTIVES, ObjectiveRow

__all__ = [
    "ModelConfig",
    "HFModelConfig",
    "LoraConfig",
    "AnyModelConfig",
    "SamplingConfig",
    "LossConfig",
    "LOSS_AGGREGATIONS",
    "ReferenceConfig",
    "OptimizerConfig",
    "SourceConfig",
    "DATA_EXTENSIONS",
    "Precision",
    "GeneratorPrecision",
]

Precision = Literal["float32", "bfloat16", "float16"]
#: A generator's precision: a float dtype, or weight-only quantized linear layers (``flowrl.models.quantize``).
GeneratorPrecision = Literal["float32", "bfloat16", "float16", "int8", "int8-bf16", "float8"]

_STRUCT = dict(frozen=True, kw_only=True, forbid_unknown_fields=True)


def _check(ok: bool, owner: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{owner}: {message}")


def _finite(owner: str, **values: float) -> None:
    """Reject inf and nan: JSON cannot carry them, so a graph holding one would not round-trip."""
    for name, value in values.items():
        _check(math.isfinite(value), owner, f"{name}={value} must be a finite number (JSON has no inf or nan)")


class ModelConfig(msgspec.Struct, tag="builtin", tag_field="family", **_STRUCT):
    """Shape of the built-in decoder-only transformer (RMSNorm, rotary embeddings, SwiGLU).

    In JSON it carries ``"family": "builtin"``; ``HFModelConfig`` (``"family": "hf"``) is the other
    model description a node may hold.

    Attributes:
        vocab_size: number of token ids; must cover the task tokenizer's vocabulary.
        dim: width of the residual stream.
        n_layers: transformer blocks.
        n_heads: attention (query) heads; must divide ``dim``.
        n_kv_heads: key/value heads (grouped-query attention); must divide ``n_heads``.
        ffn_dim: hidden width of the SwiGLU MLP; 0 picks ``round_up(8/3 * dim, 8)``.
        max_seq_len: longest prompt + completion the model accepts.
        rope_theta: base of the rotary embedding frequencies.
        norm_eps: epsilon of RMSNorm.
        tie_embeddings: share the input embedding with the output projection.
        seed: seed of the weight initialisation.
        preset: optional name of a published shape (``"llama3-8b"``, ``"llama3-70b"``, ``"llama3-405b"``,
            ``"qwen2.5-7b"``, ``"qwen3-8b"``, ...: ``flowrl.modelspec.MODEL_PRESETS``)
            that the planner uses instead of the fields above for dry-runs; the runtime refuses to
            build a preset it cannot fit.
    """

    vocab_size: int = 32
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 4
    ffn_dim: int = 0
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    seed: int = 0
    preset: str | None = None

    def __post_init__(self) -> None:
        o = "ModelConfig"
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len"):
            _check(getattr(self, name) >= 1, o, f"{name}={getattr(self, name)} must be >= 1")
        _check(self.ffn_dim >= 0, o, f"ffn_dim={self.ffn_dim} must be >= 0 (0 picks 8/3 * dim)")
        _check(self.dim % self.n_heads == 0, o, f"n_heads={self.n_heads} must divide dim={self.dim}")
        _check(
            self.n_heads % self.n_kv_heads == 0,
            o,
            f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}",
        )
        _check((self.dim // self.n_heads) % 2 == 0, o, f"head_dim={self.dim // self.n_heads} must be even for rotary embeddings")
        _finite(o, rope_theta=self.rope_theta, norm_eps=self.norm_eps)
        _check(self.rope_theta > 0, o, f"rope_theta={self.rope_theta} must be > 0")
        _check(self.norm_eps > 0, o, f"norm_eps={self.norm_eps} must be > 0")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """The SwiGLU hidden width actually used."""
        if self.ffn_dim:
            return self.ffn_dim
        return ((8 * self.dim // 3) + 7) // 8 * 8

    def short(self) -> str:
        """A compact form for printing: ``"2L64d"`` or the preset name."""
        return self.preset or f"{self.n_layers}L{self.dim}d"


class LoraConfig(msgspec.Struct, **_STRUCT):
    """Low-rank adapters (LoRA, Hu et al. 2021) on some linear layers of a Hugging Face model.

    Each target layer ``W0`` (``[out, in]``) gets ``A`` (``[r, in]``, random) and ``B`` (``[out, r]``,
    zeros), and computes ``W0 x + (alpha / r) * B A x``; only ``A`` and ``B`` train and travel over
    weight edges (``flowrl.models.lora``). peft's ``LoraConfig`` with ``bias="none"``.

    Attributes:
        r: the rank of ``B A``.
        alpha: the scale numerator (peft's ``lora_alpha``): the update is ``(alpha / r) * B A``.
        target_modules: which linear layers get adapters: a name matches a module whose dotted path
            equals it or ends with ``"." + name`` (peft's rule), e.g. ``("q_proj", "v_proj")``.
        seed: seed of ``A``'s initialisation.
        dropout: peft's ``lora_dropout``, in [0, 1): dropout on the adapters' input in the trainer's
            forward passes (as TRL trains with it; the built-in and vLLM generators sample without
            it). 0 (the default) keeps the trainer's pi and the generator's mu one function, so the
            on-policy ratio pi/mu is exactly 1; above 0 pi is a dropped-out function of the weights.

    Example:
        >>> LoraConfig(r=8, alpha=16, target_modules=("q_proj", "v_proj")).scale
        2.0
    """

    r: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    seed: int = 0
    dropout: float = 0.0

    def __post_init__(self) -> None:
        o = "LoraConfig"
        _check(isinstance(self.r, int) and self.r >= 1, o, f"r={self.r!r} must be an integer >= 1 (the adapters' rank)")
        _finite(o, alpha=self.alpha, dropout=self.dropout)
        _check(
            0 <= self.dropout < 1, o,
            f"dropout={self.dropout} must be in [0, 1) (peft's lora_dropout: the probability of zeroing an adapter input; 0: none)",
        )  # fmt: skip
        _check(self.alpha > 0, o, f"alpha={self.alpha} must be > 0 (the update is alpha / r * B A)")
        _check(
            len(self.target_modules) >= 1 and all(isinstance(t, str) and t for t in self.target_modules), o,
            f"target_modules={list(self.target_modules)} must name at least one linear layer, e.g. ('q_proj', 'v_proj')",
        )  # fmt: skip

    @property
    def scale(self) -> float:
        """``alpha / r``, the factor on ``B A``."""
        return self.alpha / self.r


class HFModelConfig(msgspec.Struct, tag="hf", tag_field="family", **_STRUCT):
    """A Hugging Face causal LM in a local directory, as ``save_pretrained`` writes it.

    Nothing is ever downloaded: ``path`` must be a local directory holding ``config.json`` (and, for
    ``init="pretrained"``, ``*.safetensors`` weights). The tokenizer is read from ``tokenizer`` (or
    ``path`` when empty). Checked against the files only when a node is built (``flowrl.models``),
    so a graph naming a model on another machine still loads, prints and plans.

    Attributes:
        path: the model directory (``~`` is expanded).
        init: ``"pretrained"`` loads the weights; ``"random"`` builds the architecture from
            ``config.json`` alone with seeded random weights (tests, dry-runs, from-scratch runs).
        seed: seed of the random initialisation (every node built from this config gets the same
            weights, so a generator and its policy start equal).
        tokenizer: directory of the tokenizer files; empty means ``path``.
        max_seq_len: longest prompt + completion; 0 means the config's ``max_position_embeddings``.
        lora: low-rank adapters on the base model (``LoraConfig``; a dict of its fields is
            accepted): the policy trains only them, and they are what its weight edges carry; a
            generator holding the same description applies them to its copy of the base weights.
            None: the whole model, as it is.
    """

    path: str
    init: Literal["pretrained", "random"] = "pretrained"
    seed: int = 0
    tokenizer: str = ""
    max_seq_len: int = 0
    lora: LoraConfig | None = None

    def __post_init__(self) -> None:
        o = "HFModelConfig"
        if isinstance(self.lora, dict):  # HFModelConfig(lora=dict(r=8, ...)): the builder's spelling
            peft_names = {"lora_alpha": "alpha", "lora_dropout": "dropout"}  # peft's LoraConfig spelling
            renamed = [f"{k} is {v}=" for k, v in peft_names.items() if k in self.lora]
            if renamed:
                raise ConfigError(f"{o}: lora={self.lora!r}: peft's names: {'; '.join(renamed)} (fields: {list(LoraConfig.__struct_fields__)})")
            try:
                msgspec.structs.force_setattr(self, "lora", msgspec.convert(self.lora, LoraConfig))
            except msgspec.ValidationError as exc:
                raise ConfigError(f"{o}: lora={self.lora!r}: {exc} (fields: {list(LoraConfig.__struct_fields__)})") from None
        _check(self.lora is None or isinstance(self.lora, LoraConfig), o, f"lora={self.lora!r} must be a LoraConfig, a dict of its fields, or None")
        _check(bool(self.path.strip()), o, "path must name a local model directory")
        _check(self.max_seq_len >= 0, o, f"max_seq_len={self.max_seq_len} must be >= 0 (0: the model's own)")

    @property
    def tokenizer_path(self) -> str:
        """Where the tokenizer files are: ``tokenizer`` or else ``path``."""
        return self.tokenizer or self.path

    def short(self) -> str:
        """A compact form for printing: the directory's last component (and the adapters' rank)."""
        lora = f"+lora{self.lora.r}" if self.lora is not None else ""
        return "hf:" + (self.path.rstrip("/").rsplit("/", 1)[-1] or self.path) + lora


AnyModelConfig = ModelConfig | HFModelConfig


class SamplingConfig(msgspec.Struct, **_STRUCT):
    """How the generator samples completions from the behaviour policy mu.

    Attributes:
        n_samples: completions drawn per prompt (the group of LlamaRL's baseline).
        max_new_tokens: longest completion.
        temperature: softmax temperature; must be > 0 (use a small value for near-greedy).
        top_k: keep the k most likely tokens; 0 disables.
        top_p: nucleus sampling mass; 1.0 disables. Both travel in the rollout, and the trainer
            evaluates pi truncated by its own kept set the same way
            (``flowrl.operators.logprobs.kept_logprobs``), so the on-policy AIPO ratio stays 1.
        stop_tokens: ids that end a completion (kept in it). Built-in model: empty means the
            tokenizer's end token. Hugging Face model: added to the tokenizer's end ids.
        stop_strings: texts that end a completion once its decoded text contains one (the token
            that completes it is kept).
        precision: dtype of the generator's weights (LlamaRL samples with lower-precision weights):
            ``float32``, ``bfloat16``, ``float16``, or ``int8`` / ``float8`` (weight-only, per output
            channel, float32 activations; re-quantized after every weight fetch; see
            ``flowrl.models.quantize``), or ``int8-bf16`` (the same int8 weights with bfloat16
            activations in the quantized layers: aten's fast int8 kernel on a CPU).
        use_kv_cache: decode with the KV cache (off only to measure what the cache saves).
        batching: ``"lockstep"`` (the default) samples each batch's rows together until the
            longest stops; ``"continuous"`` keeps ``slots`` sequences decoding and gives a freed
            slot the next waiting sample at once, across batches (``flowrl.operators.slots``).
        slots: sequences decoded at once in continuous batching; 0 means ``batch_size * n_samples``.
    """

    n_samples: int = 4
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    precision: GeneratorPrecision = "float32"
    use_kv_cache: bool = True
    batching: Literal["lockstep", "continuous"] = "lockstep"
    slots: int = 0

    def __post_init__(self) -> None:
        o = "SamplingConfig"
        _check(self.slots >= 0, o, f"slots={self.slots} must be >= 0 (0: one slot per sample of a batch)")
        _check(self.batching == "continuous" or self.slots == 0, o,
               f"slots={self.slots} applies to batching='continuous' only; set batching='continuous' or drop slots")
        _check(self.batching == "lockstep" or self.use_kv_cache, o, "batching='continuous' needs use_kv_cache=True")
        _finite(o, temperature=self.temperature, top_p=self.top_p)
        _check(self.n_samples >= 1, o, f"n_samples={self.n_samples} must be >= 1")
        _check(self.max_new_tokens >= 1, o, f"max_new_tokens={self.max_new_tokens} must be >= 1")
        _check(self.temperature > 0, o, f"temperature={self.temperature} must be > 0")
        _check(self.top_k >= 0, o, f"top_k={self.top_k} must be >= 0 (0 disables)")
        _check(0 < self.top_p <= 1, o, f"top_p={self.top_p} must be in (0, 1]")
        _check(all(self.stop_strings), o, f"stop_strings={self.stop_strings} must not hold an empty string")
        choices = get_args(GeneratorPrecision)
        _check(self.precision in choices, o, f"precision={self.precision!r} is not one of {list(choices)}")


#: ``LossConfig.loss_agg``'s choices (how per-token terms are reduced to the loss).
LOSS_AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean", "dr_grpo")


class LossConfig(msgspec.Struct, **_STRUCT):
    """Hyper-parameters of the RL objective.

    Attributes:
        objective: ``"aipo"`` (LlamaRL), ``"pg"`` (plain policy gradient that ignores mu),
            ``"grpo"`` (PPO-clip ratio with group advantages) or ``"ppo_clip"`` (an alias kept for
            readers of the PPO paper), ``"gspo"`` (sequence-level ratio), ``"cispo"`` (clipped IS
            weight on log pi), ``"tis"`` / ``"mis"`` (truncated / masked importance sampling),
            ``"decoupled_ppo"`` (AReaL: PPO-clip against the proximal policy, the trainer's weights
            at the batch's start, weighted by pi_prox/mu; the others' ratios are to mu), ``"ppo"`` (PPO-clip
            with token-level GAE advantages from a critic node's values, ``flowrl.operators.gae``: the
            loss lists the critic); checked by ``flowrl.operators.losses`` (formulas there).
        rho: AIPO's one-sided cap on the importance ratio pi/mu; the cap C of ``tis``, the upper
            bound of ``mis``, and ``decoupled_ppo``'s cap on pi_prox/mu (a token above it is dropped,
            as AReaL's ``behav_imp_weight_cap``).
        rho_low: ``mis``'s lower bound on pi/mu (a token or sequence below it is dropped); None:
            ``1 / rho``.
        is_level: ``tis`` / ``mis``: the ratio per ``"token"`` or per ``"sequence"`` (the product
            of its tokens' ratios).
        clip_eps: PPO/GRPO clip range (both sides unless ``clip_eps_low`` / ``clip_eps_high`` say).
        clip_eps_low: lower clip range ``1 - clip_eps_low`` of ``grpo``/``ppo_clip``/``gspo``/``cispo``;
            None: ``clip_eps``. In (0, 1] (1: no lower bound, as CISPO uses it).
        clip_eps_high: upper clip range ``1 + clip_eps_high`` (DAPO's clip-higher: 0.28); None: ``clip_eps``.
        loss_agg: how token terms become the loss (TRL's ``loss_type``): ``"token_mean"`` (sum over
            the batch's real tokens / their count: TRL's ``dapo``, and ``bnpo`` over the whole batch),
            ``"seq_mean"`` (mean over each sequence's tokens, then over sequences: TRL's ``grpo``),
            ``"dr_grpo"`` (sum / (sequences * completion width, i.e. ``max_new_tokens``)). The counts
            are the whole batch's, across micro-batches and data-parallel ranks.
        mask_truncated_completions: completions that reached ``max_new_tokens`` without a stop get
            no loss (their tokens masked; they still count as sequences in ``seq_mean``/``dr_grpo``).
        overlong_buffer: DAPO's soft overlong punishment: a completion of length L in the last
            ``overlong_buffer`` tokens before ``max_new_tokens`` (Lmax) gets
            ``-overlong_penalty * (L - (Lmax - overlong_buffer)) / overlong_buffer`` added to its
            reward (0 turns it off).
        overlong_penalty: the penalty at Lmax (DAPO: 1.0).
        dynamic_sampling: DAPO's dynamic sampling: drop the groups whose rewards are all equal
            (their advantage is 0) from the step, counted in ``shaping/dropped_groups``.
        dynamic_sampling_groups: with ``dynamic_sampling``, train on the first this many groups
            whose rewards differ and discard the rest (``shaping/surplus_groups``): DAPO's refill
            done by over-sampling, the source's ``batch_size`` set to a few times this; 0 keeps
            every group with a signal.
        baseline: ``"group_mean"`` (LlamaRL) or ``"leave_one_out"``.
        normalize_std: divide advantages by the group's reward std (GRPO style).
        kl_coef: weight of a KL(pi || reference) penalty; needs a ``ref_logprobs`` input.
        reward_weights: reward fields the loss reads and their weights (one per scorer output).
        gamma: ``"ppo"``'s GAE discount per completion token, in [0, 1].
        lam: ``"ppo"``'s GAE lambda (bias-variance trade-off of the advantage), in [0, 1].
        correction: a rollout correction layered on the objective (``flowrl.graph.corrections``:
            ``tis``, ``icepop``, ``seq_mask``); None: none.
        options: the objective's own options (``ObjectiveRow.options``: ``dppo``'s ``mask_low``,
            ``mask_high``, ``adv_tau``, ``kl_tau``; ``sapo``'s ``tau_pos``, ``tau_neg``; a user's row's).
        row: a user's objective row (``flowrl.graph.objectives.register_objective``), carried so that a
            graph file runs in a process that did not register it; None for a built-in.
        distill_coef: ``"opd"``'s weight of the teacher's per-token advantage, ``-distill_coef * (log mu -
            log teacher)``, added to the reward's (``reward_weights``; weight 0: distillation alone).
    """

    objective: str = "aipo"
    rho: float = 4.0
    clip_eps: float = 0.2
    clip_eps_low: float | None = None
    clip_eps_high: float | None = None
    rho_low: float | None = None
    is_level: Literal["token", "sequence"] = "token"
    loss_agg: Literal["token_mean", "seq_mean", "dr_grpo"] = "token_mean"
    mask_truncated_completions: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    dynamic_sampling: bool = False
    dynamic_sampling_groups: int = 0
    baseline: Literal["group_mean", "leave_one_out"] = "group_mean"
    normalize_std: bool = False
    kl_coef: float = 0.0
    reward_weights: dict[str, float] = msgspec.field(default_factory=lambda: {"rewards": 1.0})
    gamma: float = 1.0
    lam: float = 0.95
    correction: CorrectionConfig | None = None
    options: dict[str, float] = msgspec.field(default_factory=dict)
    row: ObjectiveRow | None = None
    distill_coef: float = 1.0

    def __post_init__(self) -> None:
        o = "LossConfig"
        if self.correction is not None and not isinstance(self.correction, CorrectionConfig):  # a name or a dict, in Python
            msgspec.structs.force_setattr(self, "correction", correction_of(self.correction, owner=o))
        self._check_row(o)
        _finite(o, distill_coef=self.distill_coef)
        _check(self.distill_coef >= 0, o, f"distill_coef={self.distill_coef} must be >= 0 (the weight of opd's reverse-KL advantage)")
        _finite(o, gamma=self.gamma, lam=self.lam)
        _check(0 <= self.gamma <= 1, o, f"gamma={self.gamma} must be in [0, 1] (GAE's discount per token; 1: undiscounted)")
        _check(0 <= self.lam <= 1, o, f"lam={self.lam} must be in [0, 1] (GAE's lambda; 1: Monte-Carlo returns, 0: one-step TD)")
        _finite(o, rho=self.rho, clip_eps=self.clip_eps, kl_coef=self.kl_coef)
        _finite(o, **{f"reward_weights[{k!r}]": v for k, v in self.reward_weights.items()})
        _check(self.rho >= 1.0, o, f"rho={self.rho} must be >= 1 (it caps pi/mu from above)")
        _check(0 < self.clip_eps < 1, o, f"clip_eps={self.clip_eps} must be in (0, 1)")
        _check(self.kl_coef >= 0, o, f"kl_coef={self.kl_coef} must be >= 0")
        _check(len(self.reward_weights) >= 1, o, "reward_weights must name at least one reward field")
        for name in ("clip_eps_low", "clip_eps_high", "rho_low"):
            if getattr(self, name) is not None:
                _finite(o, **{name: getattr(self, name)})
        low, high = self.clip_range()
        _check(0 < low <= 1, o, f"clip_eps_low={low} must be in (0, 1] (the lower clip bound 1 - clip_eps_low is in [0, 1))")
        _check(high > 0, o, f"clip_eps_high={high} must be > 0 (the upper clip bound is 1 + clip_eps_high)")
        _check(
            self.rho_low is None or 0 <= self.rho_low < self.rho, o,
            f"rho_low={self.rho_low} must be in [0, rho={self.rho}) (mis keeps ratios in [rho_low, rho])",
        )  # fmt: skip
        _check(self.is_level in ("token", "sequence"), o, f"unknown is_level {self.is_level!r}: use 'token' or 'sequence'")
        _check(
            self.loss_agg in LOSS_AGGREGATIONS, o,
            f"unknown loss_agg {self.loss_agg!r}: use one of {', '.join(LOSS_AGGREGATIONS)} "
            "(TRL's loss_type grpo -> seq_mean, bnpo/dapo -> token_mean, dr_grpo -> dr_grpo)",
        )  # fmt: skip
        _finite(o, overlong_penalty=self.overlong_penalty)
        _check(self.overlong_buffer >= 0, o, f"overlong_buffer={self.overlong_buffer} must be >= 0 (0: no overlong penalty)")
        _check(self.overlong_penalty >= 0, o, f"overlong_penalty={self.overlong_penalty} must be >= 0 (it is subtracted)")
        _check(self.dynamic_sampling_groups >= 0, o, f"dynamic_sampling_groups={self.dynamic_sampling_groups} must be >= 0 (0: keep every group with a signal)")
        _check(
            not self.dynamic_sampling_groups or self.dynamic_sampling, o,
            f"dynamic_sampling_groups={self.dynamic_sampling_groups} needs dynamic_sampling=True (it caps the groups dynamic sampling keeps)",
        )

    def _check_row(self, o: str) -> None:
        """The carried row names this objective and no built-in; the options are the row's; a correction
        is refused on an objective that corrects already. An objective no table knows is checked where
        the run starts (``flowrl.runtime.names``)."""
        if self.row is not None:
            _check(self.row.name == self.objective, o, f"row {self.row.name!r} is carried for objective {self.objective!r}: they must name the same objective")
            _check(self.objective not in BUILTIN_OBJECTIVES, o, f"objective {self.objective!r} is built in: it carries no row")
            _check(bool(self.row.fn), o, f"objective {self.objective!r}'s row names no function: set fn='package.module:function'")
        row = self.row or OBJECTIVES.get(self.objective)
        if row is None:
            return
        _finite(o, **{f"options[{k!r}]": v for k, v in self.options.items()})
        unknown = sorted(set(self.options) - set(row.options))
        _check(
            not unknown, o,
            f"options {unknown} are not options of objective {self.objective!r} (its options: {sorted(row.options) or 'none'}): drop them",
        )  # fmt: skip
        if row.name in BUILTIN_OBJECTIVES:  # the built-ins' options are weights, bands and temperatures
            o_ = self.objective_options()
            bad = {k: v for k, v in o_.items() if v < 0 or (k.startswith("tau") and v <= 0)}
            _check(not bad, o, f"options {bad} of objective {self.objective!r} must be >= 0 (temperatures tau_* > 0)")
        problem = check_correction(self.correction, self.objective, row.corrects)
        _check(problem is None, o, problem or "")
        gae = {k: v for k, v in (("gamma", self.gamma), ("lam", self.lam)) if v != {"gamma": 1.0, "lam": 0.95}[k]}
        _check(
            not gae or row.advantages == "gae", o,
            f"{gae} discount a critic's GAE advantages, which objective {self.objective!r} does not take (its advantages: "
            f"{row.advantages}): drop them, or use objective='ppo' with a critic node",
        )  # fmt: skip
        _check(
            self.distill_coef == 1.0 or "teacher" in row.reads, o,
            f"distill_coef={self.distill_coef} weighs a teacher's advantage, which objective {self.objective!r} does not read "
            "(reads: {}): drop it, or use objective='opd' with a teacher node".format(", ".join(row.reads)),
        )  # fmt: skip

    def objective_options(self) -> dict[str, float]:
        """The objective's options: its row's defaults, overridden by ``options``."""
        row = self.row or OBJECTIVES.get(self.objective)
        return {**(row.options if row is not None else {}), **self.options}

    def clip_range(self) -> tuple[float, float]:
        """``(clip_eps_low, clip_eps_high)``, each defaulting to ``clip_eps``: the clip interval is
        ``[1 - low, 1 + high]``."""
        low = self.clip_eps if self.clip_eps_low is None else self.clip_eps_low
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        return low, high

    def mis_range(self) -> tuple[float, float]:
        """``mis``'s kept interval of pi/mu: ``(rho_low, rho)``, ``rho_low`` defaulting to ``1 / rho``."""
        return (1.0 / self.rho if self.rho_low is None else self.rho_low), self.rho


class ReferenceConfig(msgspec.Struct, **_STRUCT):
    """How a reference node follows the policy (TRL's ``sync_ref_model``; Gorbatovski et al. 2024, TR-DPO).

    With ``sync_steps = N > 0``, after every N trainer steps (batches, whatever the updates per
    batch) the reference becomes ``sync_alpha * policy + (1 - sync_alpha) * reference``, weight by
    weight in float32, from the policy's weights after that step, which reach it over a weight edge
    (``b.weights(policy, ref)``); the reference's log-probs of batch ``s`` are those of the reference
    after every sync at a step ``<= s``. With 0 it stays the initial policy.

    Attributes:
        sync_steps: trainer steps between syncs (TRL's ``ref_model_sync_steps``, which counts
            optimizer steps: with U updates per batch, TRL's N is N / U trainer steps here);
            0: never, a frozen reference.
        sync_alpha: the policy's share of the mix (TRL's ``ref_model_mixup_alpha``), in (0, 1];
            1 copies the policy.
        packing: compute its log-probs over packed rows (``OptimizerConfig.packing``'s layout,
            families and default): the same log-probs to float rounding, fewer positions on mixed
            lengths.

    Example:
        >>> ReferenceConfig(sync_steps=64, sync_alpha=0.6).syncs_at(128), ReferenceConfig().syncs_at(128)
        (True, False)
    """

    sync_steps: int = 0
    sync_alpha: float = 0.6
    packing: bool | None = None

    def __post_init__(self) -> None:
        o = "ReferenceConfig"
        _check(isinstance(self.sync_steps, int) and self.sync_steps >= 0, o,
               f"sync_steps={self.sync_steps!r} must be an integer >= 0 (trainer steps between syncs; 0: a frozen reference)")
        _finite(o, sync_alpha=self.sync_alpha)
        _check(0 < self.sync_alpha <= 1, o, f"sync_alpha={self.sync_alpha} must be in (0, 1] (the policy's share of the mix; 1 copies it)")
        _check(
            self.sync_steps > 0 or self.sync_alpha == ReferenceConfig.__struct_defaults__[1], o,
            f"sync_alpha={self.sync_alpha} applies when the reference syncs: set sync_steps=N (> 0) too, or drop sync_alpha",
        )  # fmt: skip

    def syncs_at(self, step: int) -> bool:
        """Whether the reference mixes the policy in after trainer step ``step`` (counted from 1)."""
        return self.sync_steps > 0 and step > 0 and step % self.sync_steps == 0


class OptimizerConfig(msgspec.Struct, **_STRUCT):
    """AdamW and the step around it.

    Attributes:
        lr: peak learning rate.
        betas: AdamW betas.
        weight_decay: decoupled weight decay.
        grad_clip: max global grad norm; 0 disables clipping.
        schedule: learning-rate schedule after warm-up.
        warmup_steps: linear warm-up steps.
        total_steps: horizon of the cosine/linear decay (0: no decay).
        micro_batch_size: samples per forward/backward; gradients accumulate over the mini-batch
            (0: the whole mini-batch at once).
        num_iterations: optimizer passes over one rollout batch (TRL's ``num_iterations``, PPO's
            epochs); each pass visits every mini-batch once, in a new seeded order.
        num_mini_batches: mini-batches each pass splits the batch into, each one optimizer step
            (TRL's ``steps_per_generation``, AReaL's ``ppo_n_minibatches``). A mini-batch holds whole
            prompt groups, so it must divide the source's ``batch_size`` (checked when the graph is
            built). A batch thus takes ``num_iterations * num_mini_batches`` optimizer steps and the
            policy's version advances by as many (``updates_per_batch``).
        seed: seed of the trainer's own randomness.
        gradient_checkpointing: recompute block activations in the backward pass (less memory,
            about one more forward pass of time).
        autocast: run the forward pass under ``torch.autocast`` in this dtype (``"float32"``: off);
            the weights and the optimizer stay float32.
        sharding: how a policy on several ranks (torchrun) holds its state: ``"replicate"``, full
            data-parallel replicas whose gradients are summed; ``"fsdp"``, FSDP2 (``fully_shard`` per
            transformer block, then the root) over the policy's dp ranks: parameters, gradients and
            AdamW state each split on dim 0 across them, the planner's ZeRO stage 3
            (``Tuning.zero_stage``). Needs the torchrun backend and at least 2 ranks for the policy.
        param_dtype: with ``sharding="fsdp"``, the dtype FSDP2 gathers parameters in and runs the
            forward and backward passes in (its ``MixedPrecisionPolicy``); the sharded master
            weights and the optimizer stay float32.
        reduce_dtype: with ``sharding="fsdp"``, the dtype gradients are reduce-scattered in.
        packing: run each micro-batch's sequences concatenated into rows (first-fit, rows as long as
            its longest sequence) instead of padding every sequence to the longest: positions restart
            per sequence and attention stays within each (``flowrl.operators.packing``); the same
            loss and gradients to float rounding, fewer tokens computed on mixed lengths. A
            micro-batch that packing would not shorten runs padded. ``None`` (the default): pack
            when the model's family takes packed rows (``ModelFamily.packing``: the built-in one,
            llama, qwen2, qwen3 and the MoE families), pad otherwise; ``True``: pack, and refuse another family;
            ``False``: pad (``flowrl.operators.packing.packs``).
        router_aux_loss_coef: a mixture-of-experts policy's load-balancing loss weight (transformers'
            ``router_aux_loss_coef``): the trainer adds ``coef * aux`` to each micro-batch's loss, ``aux``
            being transformers' ``load_balancing_loss_func`` (Switch Transformer's) over the routers' logits
            of its real tokens (``flowrl.operators.router_load``); 0 (the default): off. Refused on a
            dense model, a critic and a pipeline-parallel policy.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    micro_batch_size: int = 0
    num_iterations: int = 1
    num_mini_batches: int = 1
    seed: int = 0
    gradient_checkpointing: bool = False
    autocast: Precision = "float32"
    sharding: Literal["replicate", "fsdp"] = "replicate"
    param_dtype: Precision = "float32"
    reduce_dtype: Precision = "float32"
    packing: bool | None = None
    router_aux_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        o = "OptimizerConfig"
        _finite(o, lr=self.lr, weight_decay=self.weight_decay, grad_clip=self.grad_clip, router_aux_loss_coef=self.router_aux_loss_coef)
        _check(self.router_aux_loss_coef >= 0, o, f"router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0 (0: off)")
        _finite(o, **{f"betas[{i}]": b for i, b in enumerate(self.betas)})
        _check(self.weight_decay >= 0, o, f"weight_decay={self.weight_decay} must be >= 0")
        _check(self.lr > 0, o, f"lr={self.lr} must be > 0")
        _check(all(0 <= b < 1 for b in self.betas), o, f"betas={self.betas} must be in [0, 1)")
        _check(self.grad_clip >= 0, o, f"grad_clip={self.grad_clip} must be >= 0 (0 disables)")
        _check(self.warmup_steps >= 0, o, f"warmup_steps={self.warmup_steps} must be >= 0")
        _check(self.total_steps >= 0, o, f"total_steps={self.total_steps} must be >= 0")
        _check(self.micro_batch_size >= 0, o, f"micro_batch_size={self.micro_batch_size} must be >= 0")
        _check(self.num_iterations >= 1, o, f"num_iterations={self.num_iterations} must be >= 1 (1: one pass over each batch)")
        _check(self.num_mini_batches >= 1, o, f"num_mini_batches={self.num_mini_batches} must be >= 1 (1: the whole batch per optimizer step)")
        for field in ("param_dtype", "reduce_dtype"):
            value = getattr(self, field)
            _check(
                self.sharding == "fsdp" or value == "float32", o,
                f"{field}={value!r} is FSDP2's mixed precision and needs sharding='fsdp' (it is {self.sharding!r}); "
                "for a replicated policy use autocast= instead",
            )

    @property
    def updates_per_batch(self) -> int:
        """Optimizer steps (policy versions) per rollout batch: ``num_iterations * num_mini_batches``.

        Example:
            >>> OptimizerConfig(num_iterations=2, num_mini_batches=3).updates_per_batch
            6
        """
        return self.num_iterations * self.num_mini_batches


#: Extensions of the prompt files a source reads (``flowrl.data.files``).
DATA_EXTENSIONS: tuple[str, ...] = (".jsonl", ".json", ".csv", ".parquet")


class SourceConfig(msgspec.Struct, **_STRUCT):
    """Where prompts come from: a built-in task, or the user's prompt file (``data``).

    With neither ``task`` nor ``data`` given, the source serves the built-in ``add`` task. The file
    is read when the run starts (``flowrl.data``), never when a graph is loaded, so a graph naming a
    file on another machine still loads, prints and plans.

    Attributes:
        task: a built-in task name (``flowrl examples`` and ``flowrl.operators.tasks.TASKS``) or a
            ``module:qualname`` reference to a user task factory. Exclusive with ``data``.
        batch_size: prompts per trainer step.
        seed: seed of the endless prompt stream (the per-epoch shuffle of a file).
        data: a prompt file: ``.jsonl``, ``.json`` (a list of objects), ``.csv`` or ``.parquet``.
        prompt_field: the field of each row holding the prompt (text or chat messages); every other
            field goes to the scorers.
        tokenizer: a local tokenizer directory; empty means the tokenizer of the Hugging Face model
            of the generator the source feeds (``GraphBuilder`` fills it in).
        chat_template: render prompts with the tokenizer's chat template (text becomes one user message).
        max_prompt_len: longest prompt in tokens; 0 means the generator model's ``max_seq_len``
            minus ``max_new_tokens`` (where the model states it).
        overlong: a longer prompt is dropped from the stream (``"drop"``) or cut to its last
            ``max_prompt_len`` tokens (``"truncate"``); counted and reported once at start.
        shuffle: visit the rows in a new seeded order every epoch (else file order).
    """

    task: str = ""
    batch_size: int = 8
    seed: int = 0
    data: str = ""
    prompt_field: str = "prompt"
    tokenizer: str = ""
    chat_template: bool = False
    max_prompt_len: int = 0
    overlong: Literal["drop", "truncate"] = "drop"
    shuffle: bool = True

    def __post_init__(self) -> None:
        o = "SourceConfig"
        _check(self.batch_size >= 1, o, f"batch_size={self.batch_size} must be >= 1")
        if not self.task and not self.data:
            msgspec.structs.force_setattr(self, "task", "add")  # the built-in default
        if not self.data:
            return
        _check(not self.task, o, f"task={self.task!r} and data={self.data!r} are both set; a source reads one: drop one of them")
        suffix = "." + self.data.rsplit(".", 1)[-1].lower() if "." in self.data else ""
        _check(
            suffix in DATA_EXTENSIONS,
            o,
            f"data={self.data!r} has extension {suffix or '(none)'!r}; prompt files are {', '.join(DATA_EXTENSIONS)}",
        )
        _check(bool(self.prompt_field), o, "prompt_field must name the field holding the prompts")
        _check(self.max_prompt_len >= 0, o, f"max_prompt_len={self.max_prompt_len} must be >= 0 (0: the model's max_seq_len - max_new_tokens)")
        _check(self.overlong in ("drop", "truncate"), o, f"overlong={self.overlong!r} must be 'drop' or 'truncate'")
