"""Model shapes without weights: parameter counts, FLOPs and KV-cache bytes of decoder-only transformers.

The planner reasons about models far too large for this machine, so it needs only their shape:
layers, width, heads, KV heads, head width, MLP width, vocabulary. A shape comes from a published
preset (``MODEL_PRESETS``: Llama 3, Qwen2.5 0.5B-72B, Qwen3 0.6B-32B), from a Hugging Face
``config.json``, or from the built-in model's ``ModelConfig`` (whose ``preset`` field, when set,
names a published shape). Shared by the planner (its estimates) and the runtime (the memory check
before a run, ``runtime/preflight.py``); pure: it reads JSON and imports no torch.

Counting (Llama architecture: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU; q is
``heads * hd`` wide, which Qwen3 sets apart from h)::

    attention params per layer = h*q (q) + 2*h*(kv*hd) (k, v) + q*h (o)
    mlp params per layer       = 3*h*f
    params = L*(attention + mlp + 2h) + V*h (embedding) + h (final norm) + V*h (unless tied)
    forward FLOPs per token    = 2 * matmul_params + 4 * L * h * ctx     (ctx: keys attended to)
    KV-cache bytes per token   = 2 * L * kv * hd * bytes

where ``matmul_params`` counts every weight matrix a token goes through (layers and output head,
not the embedding lookup). Example: Llama-3 8B has 8.03e9 parameters.

A mixture of experts (``n_experts`` > 0: DeepSeek-V3's shape) replaces the MLP of every block after
its first ``dense_layers`` by ``n_experts`` routed SwiGLU experts of width ``expert_ffn_dim``, of
which each token goes through ``experts_per_token``, beside ``shared_experts`` every token goes
through, and a router (``h * E``)::

    moe mlp params      = 3*h*fe*(E + shared) + h*E       (held: memory, optimizer state, weight sync)
    moe active params   = 3*h*fe*(k + shared) + h*E       (computed: FLOPs)

so ``params`` counts every expert and ``matmul_params`` (hence the FLOPs) only the active ones. A
decode step of ``b`` sequences reads the experts its tokens route to: with uniform routing a given
expert is untouched by all ``b * k`` choices with probability ``(1 - k/E)^b``, so the step reads
``expert_read_fraction(b) = 1 - (1 - k/E)^b`` of the routed experts' weights (assumed uniform;
DeepSeek-V3 balances its routing without an auxiliary loss). A trainer splits the routed experts
over data-parallel ranks (expert parallelism, ``flowrl.planners.estimate.train``); a generator shards
them as any weight, over tp and pp. Not modelled: routing imbalance.

Attention other than grouped-query (DeepSeek's multi-head latent attention) is given by its size:
``attention_params`` per block and ``kv_dim``, the KV-cache elements one token holds per layer (MLA
caches a latent of ``kv_lora_rank + qk_rope_head_dim`` = 576 values, the same on every tensor-parallel
rank). Its score FLOPs keep the ``4 * L * h * ctx`` term (DeepSeek-V3's 128 heads of 192 + 128 wide
compute 2.9x that: about 3% of a token's FLOPs at 750 tokens of context).

Example:
    >>> spec = model_preset("llama3-8b")
    >>> round(spec.params / 1e9, 2)
    8.03
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from flowrl.errors import PlanError

if TYPE_CHECKING:
    from flowrl.graph.configs import AnyModelConfig, HFModelConfig

__all__ = [
    "ModelSpec",
    "MODEL_PRESETS",
    "DEFAULT_CONTEXT",
    "model_preset",
    "model_from_config",
    "model_from_hf_config",
    "reward_model_spec",
    "lora_adapter_params",
    "resolve_model",
]


#: The context assumed for a model whose spec does not say it (an old GPT-2-sized window).
DEFAULT_CONTEXT = 2048


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The shape of a decoder-only transformer; enough to count parameters, FLOPs and bytes.

    Attributes:
        name: a short name (preset name, HF ``model_type`` or ``"2L64d"``).
        n_layers: transformer blocks (L).
        dim: residual width (h).
        n_heads: query heads.
        n_kv_heads: key/value heads (grouped-query attention).
        head_dim: width of one attention head (hd); 0 means ``dim // n_heads``. Qwen3's
            ``config.json`` sets it apart (128 with ``dim`` 1024 and 16 heads, say).
        ffn_dim: SwiGLU hidden width (f).
        vocab_size: vocabulary (V).
        tie_embeddings: the output head shares the embedding matrix.
        max_seq_len: the context: the most tokens (prompt + completion) one sequence may hold.
            Presets: as published; a HF ``config.json``: its ``max_position_embeddings``; a
            ``ModelConfig``: its ``max_seq_len``. Unknown: ``DEFAULT_CONTEXT``, a conservative 2048.
        head_rows: rows of the output head: 0 means the vocabulary (a causal LM's LM head); a sequence
            classifier's ``num_labels`` (its score head, a reward model's 1), which holds, computes and
            writes that many logits per token instead of V.
        adapter_params: a LoRA policy's adapter parameters (``lora_adapter_params``): they alone
            have gradients and optimizer state and travel over weight edges, in float32; 0: the
            whole model trains.
        n_experts: routed experts of each mixture-of-experts block (E); 0: a dense model.
        experts_per_token: routed experts each token goes through (k, top-k routing).
        expert_ffn_dim: SwiGLU width of one routed or shared expert (fe).
        shared_experts: experts every token goes through, beside the routed ones.
        dense_layers: leading blocks whose MLP is the dense one of ``ffn_dim`` (DeepSeek-V3: 3).
        attention_params: parameters of one block's attention when it is not grouped-query (MLA);
            0: counted from the heads (``2*h*q + 2*h*kv``).
        kv_dim: KV-cache elements one token holds per layer when they are not ``2 * kv_heads *
            head_dim`` (MLA's latent, replicated on every tensor-parallel rank); 0: from the heads.
    """

    name: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    tie_embeddings: bool = False
    max_seq_len: int = DEFAULT_CONTEXT
    head_dim: int = 0
    head_rows: int = 0
    adapter_params: int = 0
    n_experts: int = 0
    experts_per_token: int = 0
    expert_ffn_dim: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    attention_params: int = 0
    kv_dim: int = 0

    def __post_init__(self) -> None:
        for field in ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, field) < 1:
                raise PlanError(f"model {self.name!r}: {field}={getattr(self, field)} must be >= 1")
        if self.head_rows < 0:
            raise PlanError(f"model {self.name!r}: head_rows={self.head_rows} must be >= 0 (0: the vocabulary)")
        if self.head_dim < 0:
            raise PlanError(f"model {self.name!r}: head_dim={self.head_dim} must be >= 1 (0: dim // n_heads)")
        if not self.head_dim and self.dim % self.n_heads:
            raise PlanError(f"model {self.name!r}: n_heads={self.n_heads} must divide dim={self.dim} (or give head_dim)")
        if self.n_heads % self.n_kv_heads:
            raise PlanError(f"model {self.name!r}: n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        for field in ("n_experts", "experts_per_token", "expert_ffn_dim", "shared_experts", "dense_layers", "attention_params", "kv_dim"):
            if getattr(self, field) < 0:
                raise PlanError(f"model {self.name!r}: {field}={getattr(self, field)} must be >= 0")
        if self.n_experts and not (1 <= self.experts_per_token <= self.n_experts and self.expert_ffn_dim >= 1 and self.dense_layers < self.n_layers):
            raise PlanError(
                f"model {self.name!r}: a mixture of experts needs 1 <= experts_per_token <= n_experts "
                f"(got {self.experts_per_token} of {self.n_experts}), expert_ffn_dim >= 1 (got {self.expert_ffn_dim}) "
                f"and dense_layers < n_layers (got {self.dense_layers} of {self.n_layers})"
            )
        if not self.n_experts and (self.experts_per_token or self.shared_experts or self.dense_layers):
            raise PlanError(f"model {self.name!r}: experts_per_token, shared_experts and dense_layers need n_experts >= 1 (a mixture of experts)")
        if not self.head_dim:
            msgspec.structs.force_setattr(self, "head_dim", self.dim // self.n_heads)

    @property
    def q_dim(self) -> int:
        """Width of the attention's queries (and of ``o``'s input): heads x head width."""
        return self.n_heads * self.head_dim

    @property
    def attn_params(self) -> int:
        """Parameters of one block's attention: ``attention_params``, else q, k, v and o by the heads."""
        return self.attention_params or 2 * self.dim * self.q_dim + 2 * self.dim * self.n_kv_heads * self.head_dim

    @property
    def moe_layers(self) -> int:
        """Blocks whose MLP is a mixture of experts (every block after ``dense_layers``; 0 when dense)."""
        return self.n_layers - self.dense_layers if self.n_experts else 0

    def _moe_mlp_params(self, experts: int) -> int:
        """One mixture-of-experts MLP through ``experts`` routed experts, the shared ones and the router."""
        return 3 * self.dim * self.expert_ffn_dim * (experts + self.shared_experts) + self.dim * self.n_experts

    @property
    def mlp_params(self) -> int:
        """MLP parameters of all blocks: dense blocks' ``3*h*f``, every expert of the others."""
        dense = (self.n_layers - self.moe_layers) * 3 * self.dim * self.ffn_dim
        return dense + self.moe_layers * self._moe_mlp_params(self.n_experts)

    @property
    def active_mlp_params(self) -> int:
        """MLP parameters one token goes through, over all blocks (``mlp_params`` when dense)."""
        dense = (self.n_layers - self.moe_layers) * 3 * self.dim * self.ffn_dim
        return dense + self.moe_layers * self._moe_mlp_params(self.experts_per_token)

    @property
    def routed_expert_params(self) -> int:
        """Parameters of the routed experts, all blocks: what a decode step reads only in part."""
        return self.moe_layers * 3 * self.dim * self.expert_ffn_dim * self.n_experts

    @property
    def active_ffn_dim(self) -> float:
        """The MLP width a token's activations span, averaged over blocks (``ffn_dim`` when dense)."""
        return self.active_mlp_params / (3 * self.dim * self.n_layers)

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer block (attention, MLP, two norms); a mean over blocks for a
        mixture of experts whose first ``dense_layers`` differ."""
        return self.attn_params + self.mlp_params // self.n_layers + 2 * self.dim

    def expert_read_fraction(self, batch: float) -> float:
        """Of the routed experts' weights, the share one decode step of ``batch`` tokens reads:
        ``1 - (1 - k/E)^batch`` (uniform routing, module docstring); 1.0 for a dense model."""
        if not self.n_experts:
            return 1.0
        return 1.0 - (1.0 - self.experts_per_token / self.n_experts) ** max(batch, 1.0)

    @property
    def output_rows(self) -> int:
        """Logits per token: ``head_rows``, else the vocabulary."""
        return self.head_rows or self.vocab_size

    @property
    def embedding_params(self) -> int:
        """Input embedding plus output head: untied, or a classifier's score head."""
        if self.head_rows:
            return (self.vocab_size + self.head_rows) * self.dim
        return self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)

    @property
    def params(self) -> int:
        """Every parameter: blocks (every expert), embeddings, output head, final norm."""
        return self.n_layers * (self.attn_params + 2 * self.dim) + self.mlp_params + self.embedding_params + self.dim

    @property
    def trained_params(self) -> int:
        """Parameters with gradients and optimizer state: a LoRA policy's adapters, else every one."""
        return self.adapter_params or self.params

    @property
    def matmul_params(self) -> int:
        """Weights a token multiplies through in a forward pass: every block's matrices (a mixture of
        experts: the experts it is routed to) and the output head."""
        return self.n_layers * self.attn_params + self.active_mlp_params + self.output_rows * self.dim

    def forward_flops_per_token(self, ctx: float) -> float:
        """FLOPs of one token's forward pass when it attends to ``ctx`` keys (see module docstring)."""
        return 2.0 * self.matmul_params + 4.0 * self.n_layers * self.dim * ctx

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """KV-cache bytes one token occupies across all layers."""
        return float(self.n_layers * self.kv_elems_per_layer(1) * dtype_bytes)

    def kv_elems_per_layer(self, tp: int) -> int:
        """KV-cache elements one token holds in one layer on one of ``tp`` tensor-parallel ranks: its
        share of the KV heads (replicated when tp > kv heads), or all of ``kv_dim`` (an MLA latent)."""
        if self.kv_dim:
            return self.kv_dim
        return 2 * -(-self.n_kv_heads // tp) * self.head_dim

    def short(self) -> str:
        return self.name


def _qwen(name: str, layers: int, dim: int, heads: int, kv: int, ffn: int, vocab: int, tie: bool, context: int, head_dim: int = 0) -> ModelSpec:
    return ModelSpec(
        name=name, n_layers=layers, dim=dim, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn, vocab_size=vocab,
        tie_embeddings=tie, max_seq_len=context, head_dim=head_dim,
    )


def _mla_params(h: int, heads: int, *, q_rank: int, kv_rank: int, nope: int, rope: int, v: int) -> int:
    """One block's multi-head latent attention (DeepSeek-V2/V3): q down and up projections, the
    joint kv down projection with the rope key, kv up projection, output, and the two latent norms."""
    return h * q_rank + q_rank * heads * (nope + rope) + h * (kv_rank + rope) + kv_rank * heads * (nope + v) + heads * v * h + q_rank + kv_rank


#: Published shapes. Llama 3 / 3.1 model cards: Llama 3 8B and 70B have an 8k context; 405B exists
#: only as Llama 3.1, with 128k. Qwen2.5 and Qwen3: the ``config.json`` of each model on the
#: Hugging Face hub (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
#: ``num_key_value_heads``, ``head_dim`` (Qwen3), ``intermediate_size``, ``vocab_size``,
#: ``tie_word_embeddings``: the small ones tie); context: Qwen2.5's Instruct configs say 32,768
#: (the base 1.5B/7B-72B configs say 131,072, reached with YaRN), Qwen3's 40,960. The counts leave
#: out Qwen2.5's q/k/v biases and Qwen3's q/k norms (< 0.1% of the parameters). DeepSeek-V3: its
#: ``config.json`` (``n_routed_experts`` 256, ``num_experts_per_tok`` 8, ``moe_intermediate_size`` 2048,
#: ``n_shared_experts`` 1, ``first_k_dense_replace`` 3, ``q_lora_rank`` 1536, ``kv_lora_rank`` 512,
#: ``qk_nope_head_dim`` 128, ``qk_rope_head_dim`` 64, ``v_head_dim`` 128), without its multi-token
#: prediction module (not used by RL): 671.0e9 parameters, 37.5e9 active per token (the card: 671B, 37B).
#: Qwen3-30B-A3B: its ``config.json`` on the Hugging Face hub (``num_hidden_layers`` 48, ``hidden_size``
#: 2048, ``num_attention_heads`` 32, ``num_key_value_heads`` 4, ``head_dim`` 128, ``num_experts`` 128,
#: ``num_experts_per_tok`` 8, ``moe_intermediate_size`` 768, ``decoder_sparse_step`` 1 and no
#: ``mlp_only_layers``: every block a mixture of experts, ``intermediate_size`` 6144 unused,
#: ``vocab_size`` 151936, ``tie_word_embeddings`` false, ``max_position_embeddings`` 40960): 30.5e9
#: parameters, 3.3e9 active per token (the card: 30.5B, 3.3B).
MODEL_PRESETS: dict[str, ModelSpec] = {
    "llama3-8b": ModelSpec(name="llama3-8b", n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256, max_seq_len=8192),
    "llama3-70b": ModelSpec(name="llama3-70b", n_layers=80, dim=8192, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256, max_seq_len=8192),
    "llama3-405b": ModelSpec(
        name="llama3-405b", n_layers=126, dim=16384, n_heads=128, n_kv_heads=8, ffn_dim=53248, vocab_size=128256, max_seq_len=131072
    ),
    #                        name            layers  dim  heads kv  ffn    vocab   tie    context
    "qwen2.5-0.5b": _qwen("qwen2.5-0.5b", 24, 896, 14, 2, 4864, 151936, True, 32768),
    "qwen2.5-1.5b": _qwen("qwen2.5-1.5b", 28, 1536, 12, 2, 8960, 151936, True, 32768),
    "qwen2.5-3b": _qwen("qwen2.5-3b", 36, 2048, 16, 2, 11008, 151936, True, 32768),
    "qwen2.5-7b": _qwen("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, False, 32768),
    "qwen2.5-14b": _qwen("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064, False, 32768),
    "qwen2.5-32b": _qwen("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, False, 32768),
    "qwen2.5-72b": _qwen("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, False, 32768),
    #                        name            layers  dim  heads kv  ffn    vocab   tie    context head_dim
    "qwen3-0.6b": _qwen("qwen3-0.6b", 28, 1024, 16, 8, 3072, 151936, True, 40960, head_dim=128),
    "qwen3-1.7b": _qwen("qwen3-1.7b", 28, 2048, 16, 8, 6144, 151936, True, 40960, head_dim=128),
    "qwen3-4b": _qwen("qwen3-4b", 36, 2560, 32, 8, 9728, 151936, True, 40960, head_dim=128),
    "qwen3-8b": _qwen("qwen3-8b", 36, 4096, 32, 8, 12288, 151936, False, 40960, head_dim=128),
    "qwen3-14b": _qwen("qwen3-14b", 40, 5120, 40, 8, 17408, 151936, False, 40960, head_dim=128),
    "qwen3-32b": _qwen("qwen3-32b", 64, 5120, 64, 8, 25600, 151936, False, 40960, head_dim=128),
    "qwen3-30b-a3b": ModelSpec(
        name="qwen3-30b-a3b", n_layers=48, dim=2048, n_heads=32, n_kv_heads=4, head_dim=128, ffn_dim=6144, vocab_size=151936,
        max_seq_len=40960, n_experts=128, experts_per_token=8, expert_ffn_dim=768,
    ),
    "deepseek-v3": ModelSpec(
        name="deepseek-v3", n_layers=61, dim=7168, n_heads=128, n_kv_heads=128, head_dim=128, ffn_dim=18432, vocab_size=129280,
        max_seq_len=163840, n_experts=256, experts_per_token=8, expert_ffn_dim=2048, shared_experts=1, dense_layers=3,
        attention_params=_mla_params(7168, 128, q_rank=1536, kv_rank=512, nope=128, rope=64, v=128), kv_dim=512 + 64,
    ),
}


def model_preset(name: str) -> ModelSpec:
    """The published shape called ``name``; ``PlanError`` listing the presets if there is none."""
    key = name.strip().lower()
    if key not in MODEL_PRESETS:
        raise PlanError(f"unknown model preset {name!r}; presets: {', '.join(MODEL_PRESETS)}, or a Hugging Face config.json path")
    return MODEL_PRESETS[key]


def model_from_config(config: AnyModelConfig) -> ModelSpec:
    """The shape of a graph node's model: a ``ModelConfig``'s ``preset`` when set, else its own dims;
    an ``HFModelConfig``'s directory's ``config.json`` (read as JSON, nothing imported or built), so
    the planner's dry-run and the run read the same description."""
    from flowrl.graph.configs import HFModelConfig

    if isinstance(config, HFModelConfig):
        spec = model_from_hf_config(Path(config.path).expanduser() / "config.json", name=config.short())
        if config.max_seq_len:
            spec = msgspec.structs.replace(spec, max_seq_len=config.max_seq_len)
        if config.lora is not None:
            spec = msgspec.structs.replace(spec, adapter_params=lora_adapter_params(spec, config.lora.r, config.lora.target_modules))
        return spec
    if config.preset:
        return model_preset(config.preset)
    return ModelSpec(
        name=config.short(),
        n_layers=config.n_layers,
        dim=config.dim,
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        ffn_dim=config.hidden_dim,
        vocab_size=config.vocab_size,
        tie_embeddings=config.tie_embeddings,
        max_seq_len=config.max_seq_len,
    )


def lora_adapter_params(spec: ModelSpec, r: int, targets: tuple[str, ...] | list[str]) -> int:
    """Parameters of rank-``r`` LoRA adapters (``A`` ``[r, in]`` and ``B`` ``[out, r]``) on the linear
    layers of a Llama-style model that ``targets`` match, by peft's rule (a module path equal to a
    target or ending with ``"." + target``), as ``flowrl.models.lora`` puts them.

    Example:
        >>> spec = model_preset("qwen2.5-0.5b")
        >>> lora_adapter_params(spec, 8, ("q_proj", "v_proj"))  # 24 layers x 8 x ((896 + 896) + (896 + 128))
        540672
    """
    h, q, kv, f = spec.dim, spec.q_dim, spec.n_kv_heads * spec.head_dim, spec.ffn_dim
    shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv), "self_attn.o_proj": (q, h),
              "mlp.gate_proj": (h, f), "mlp.up_proj": (h, f), "mlp.down_proj": (f, h)}  # fmt: skip
    matches = lambda path: any(path == t or path.endswith("." + t) for t in targets)  # noqa: E731
    total = sum(r * (i + o) for layer in range(spec.n_layers) for name, (i, o) in shapes.items() if matches(f"model.layers.{layer}.{name}"))
    return total + (r * (h + spec.output_rows) if matches("lm_head") else 0)


def reward_model_spec(config: HFModelConfig, *, judge: bool) -> ModelSpec:
    """The shape of a reward-model node's model (``flowrl.graph.nodes.RewardModelNode``): a judge is
    the causal LM of its ``config.json``; a sequence classifier has its score head of ``num_labels``
    rows (``id2label``'s size) instead of the LM head.

    Raises:
        PlanError: as ``model_from_hf_config``.
    """
    spec = model_from_config(config)
    if judge:
        return spec
    raw = json.loads((Path(config.path).expanduser() / "config.json").read_text(encoding="utf-8"))
    labels = len(raw["id2label"]) if isinstance(raw.get("id2label"), dict) else int(raw.get("num_labels", 2))
    return msgspec.structs.replace(spec, head_rows=max(labels, 1))


_HF_KEYS = {
    "n_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "dim": ("hidden_size", "n_embd", "d_model"),
    "n_heads": ("num_attention_heads", "n_head"),
    "ffn_dim": ("intermediate_size", "n_inner", "ffn_dim"),
    "vocab_size": ("vocab_size",),
}
_HF_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def model_from_hf_config(source: str | Path | dict, *, name: str | None = None) -> ModelSpec:
    """The shape in a Hugging Face ``config.json`` (a path or the parsed dict); reads JSON, runs nothing.

    Reads ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``
    (default: the attention heads), ``head_dim`` (default: ``hidden_size / num_attention_heads``),
    ``intermediate_size``, ``vocab_size`` and
    ``tie_word_embeddings`` (GPT-2-style names are accepted too), and the context from
    ``max_position_embeddings`` (or ``n_positions``; ``DEFAULT_CONTEXT`` when there is none); a
    mixture of experts' and MLA's keys too (``_hf_moe``).

    Raises:
        PlanError: naming the file and the missing or malformed key.
    """
    where = "config dict"
    if not isinstance(source, dict):
        where = str(source)
        path = Path(source)
        if not path.is_file():
            raise PlanError(f"model config {where!r} does not exist; give a preset ({', '.join(MODEL_PRESETS)}) or a config.json path")
        try:
            source = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PlanError(f"model config {where!r} is not readable JSON: {exc}") from None
        if not isinstance(source, dict):
            raise PlanError(f"model config {where!r} holds a {type(source).__name__}, not a JSON object")
        name = name or path.parent.name or path.stem
    values: dict[str, int] = {}
    for field, keys in _HF_KEYS.items():
        found = next((source[k] for k in keys if k in source), None)
        if not isinstance(found, int) or isinstance(found, bool):
            raise PlanError(f"model config {where!r}: missing or non-integer {keys[0]!r} (got {found!r})")
        values[field] = found
    kv = source.get("num_key_value_heads") or values["n_heads"]
    if not isinstance(kv, int) or isinstance(kv, bool):
        raise PlanError(f"model config {where!r}: num_key_value_heads={kv!r} must be an integer")
    head_dim = source.get("head_dim") or 0
    if not isinstance(head_dim, int) or isinstance(head_dim, bool):
        raise PlanError(f"model config {where!r}: head_dim={head_dim!r} must be an integer")
    tie = bool(source.get("tie_word_embeddings", False))
    context = next((source[k] for k in _HF_CONTEXT_KEYS if k in source), DEFAULT_CONTEXT)
    if not isinstance(context, int) or isinstance(context, bool):
        raise PlanError(f"model config {where!r}: max_position_embeddings={context!r} must be an integer")
    label = name or str(source.get("_name_or_path") or source.get("model_type") or "hf-model")
    return ModelSpec(name=label, n_kv_heads=kv, tie_embeddings=tie, max_seq_len=context, head_dim=head_dim, **values, **_hf_moe(source, where, values))


def _hf_int(source: dict, key: str, where: str, default: int = 0) -> int:
    value = source.get(key, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise PlanError(f"model config {where!r}: {key}={value!r} must be an integer")
    return value


def _hf_moe(source: dict, where: str, values: dict[str, int]) -> dict[str, int]:
    """The mixture-of-experts and MLA fields of a Hugging Face config (empty for a dense one): Mixtral
    (``num_local_experts``; an expert is ``intermediate_size`` wide), Qwen3-MoE (``num_experts``,
    ``moe_intermediate_size``), DeepSeek-V2/V3 (``n_routed_experts``, ``n_shared_experts``,
    ``first_k_dense_replace``, and MLA's ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``,
    ``qk_rope_head_dim``, ``v_head_dim``), Qwen2-MoE (``shared_expert_intermediate_size``, a multiple of
    the expert width: that many shared experts; its sigmoid gate, ``dim`` weights a block, is left out).
    A layout it cannot count (a shared expert width no multiple of the routed one, experts on every
    other layer) is refused, naming the key, rather than read as dense."""
    experts = next((_hf_int(source, k, where) for k in ("num_local_experts", "n_routed_experts", "num_experts") if source.get(k)), 0)
    moe: dict[str, int] = {}
    if experts:
        width = _hf_int(source, "moe_intermediate_size", where) or values["ffn_dim"]  # Mixtral: an expert is intermediate_size wide
        shared_width = _hf_int(source, "shared_expert_intermediate_size", where)  # Qwen2-MoE: one shared expert this wide
        for key, fine in (("decoder_sparse_step", 1), ("moe_layer_freq", 1)):
            if source.get(key, fine) not in (fine, None):
                raise PlanError(f"model config {where!r}: {key}={source[key]!r} is a mixture-of-experts layout the planner does not count; "
                                "it counts a routed expert width, shared experts of that width and leading dense blocks")  # fmt: skip
        if shared_width % width:
            raise PlanError(f"model config {where!r}: shared_expert_intermediate_size={shared_width} is not a multiple of the expert width "
                            f"{width}; the planner counts shared experts of the routed experts' width")  # fmt: skip
        if source.get("mlp_only_layers"):
            raise PlanError(f"model config {where!r}: mlp_only_layers={source['mlp_only_layers']!r} (dense blocks among the experts) is not counted")
        moe = {
            "n_experts": experts, "experts_per_token": _hf_int(source, "num_experts_per_tok", where), "expert_ffn_dim": width,
            "shared_experts": _hf_int(source, "n_shared_experts", where) or shared_width // width,
            "dense_layers": _hf_int(source, "first_k_dense_replace", where),
        }  # fmt: skip
    if source.get("kv_lora_rank"):
        kv_rank, rope = _hf_int(source, "kv_lora_rank", where), _hf_int(source, "qk_rope_head_dim", where)
        nope, v, q_rank = _hf_int(source, "qk_nope_head_dim", where), _hf_int(source, "v_head_dim", where), _hf_int(source, "q_lora_rank", where)
        h, heads = values["dim"], values["n_heads"]
        if q_rank:
            attention = _mla_params(h, heads, q_rank=q_rank, kv_rank=kv_rank, nope=nope, rope=rope, v=v)
        else:  # DeepSeek-V2-Lite: q projected directly, no q latent and no q norm
            attention = h * heads * (nope + rope) + h * (kv_rank + rope) + kv_rank * heads * (nope + v) + heads * v * h + kv_rank
        moe |= {"attention_params": attention, "kv_dim": kv_rank + rope}
    return moe


def resolve_model(text: str) -> ModelSpec:
    """A model named on the command line: a preset name, a path to a HF ``config.json``, or a model
    directory holding one."""
    if text.strip().lower() in MODEL_PRESETS:
        return model_preset(text)
    if Path(text).expanduser().is_dir():
        return model_from_hf_config(Path(text).expanduser() / "config.json")
    if text.endswith(".json") or Path(text).is_file():
        return model_from_hf_config(text)
    return model_preset(text)  # raises, listing the presets
