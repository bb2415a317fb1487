"""The built-in decoder-only transformer: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention, KV cache.

Llama-shaped and small enough for a laptop CPU (a few hundred thousand parameters in tests, up to
~100M in benches). Attention goes through ``torch.nn.functional.scaled_dot_product_attention``.

Padding and positions: a batch may hold sequences of different lengths, left-padded. Callers pass
``positions`` (the rotary position of each token, counted from the sequence's first real token) and
a boolean ``attn_mask`` (True where a query may attend a key); ``positions_from_valid`` and
``attention_mask`` build both from a ``[B, S]`` "real token" mask, so that a padded sequence gets
exactly the computation it would get alone. Every query may always attend itself, so pad rows stay
finite (their outputs are never used).

KV cache: ``KVCache`` holds, per layer, keys and values ``[B, n_kv_heads, max_len, head_dim]`` and
``length``, the number of slots filled. ``forward(..., cache=c)`` writes the new keys/values at slots
``[c.length, c.length + T)``, attends over slots ``[0, c.length + T)`` and advances ``c.length``.
``splice_cache`` copies another cache's keys/values into some rows of filled slots (continuous
batching's refills, ``flowrl.operators.slots``).

Initialisation is seeded by ``ModelConfig.seed`` through a private ``torch.Generator``: two models
built from the same config have identical weights, whatever the global RNG state.

Example:
    >>> from flowrl.graph.configs import ModelConfig
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=1))
    >>> model(torch.tensor([[1, 4, 5]])).shape
    torch.Size([1, 3, 16])
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from flowrl.errors import ConfigError
from flowrl.graph.configs import ModelConfig

__all__ = [
    "initial_weights",
    "Transformer",
    "KVCache",
    "count_parameters",
    "positions_from_valid",
    "attention_mask",
    "packed_attention_mask",
]


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding, half-split layout. x: [B, H, T, D]; cos, sin: [B, 1, T, D/2] float32."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class KVCache:
    """Keys and values of the tokens decoded so far, per layer (see the module docstring).

    Attributes:
        k, v: per layer, ``[B, n_kv_heads, max_len, head_dim]``.
        length: number of slots filled.
    """

    def __init__(self, config: ModelConfig, batch: int, max_len: int, *, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (batch, config.n_kv_heads, max_len, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.max_len = max_len
        self.length = 0


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache: KVCache | None, layer: int
    ) -> Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if cache is not None:
            start = cache.length
            cache.k[layer][:, :, start : start + T] = k
            cache.v[layer][:, :, start : start + T] = v
            k = cache.k[layer][:, :, : start + T]
            v = cache.v[layer][:, :, : start + T]
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if mask is None and cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.hidden_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache: KVCache | None, layer: int) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, cache, layer)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """A decoder-only language model built from a ``ModelConfig`` (see the module docstring).

    Args:
        config: the shape and the seed of the initialisation. A ``preset`` shape is for planner
            dry-runs only and is refused here.

    Raises:
        ConfigError: for a preset config.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.preset is not None:
            raise ConfigError(
                f"ModelConfig(preset={config.preset!r}) describes a published shape for planner dry-runs; "
                "the built-in transformer builds only explicit shapes (set preset=None and the dims)"
            )
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        self.gradient_checkpointing = False
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Every parameter set to its ``initial_weights`` value."""
        params = dict(self.named_parameters())
        for name, value in initial_weights(self):
            params[name].copy_(value)

    def forward(
        self,
        tokens: Tensor,
        *,
        positions: Tensor | None = None,
        attn_mask: Tensor | None = None,
        cache: KVCache | None = None,
        valid: Tensor | None = None,
        keep: int = 0,
        packed_positions: Tensor | None = None,
    ) -> Tensor:
        """Logits of the next token at every position.

        Args:
            tokens: ``[B, T]`` token ids.
            positions: ``[B, T]`` rotary positions; default ``cache.length + arange(T)`` (or ``arange(T)``).
            attn_mask: bool, ``[B, T, S]`` or ``[B, 1, T, S]`` with ``S = cache.length + T`` (or ``T``),
                True where a query may attend a key; default causal (over the whole cache when decoding).
            cache: KV cache to read and extend (see the module docstring).
            valid: instead of ``positions`` and ``attn_mask`` (the ``flowrl.models.CausalLM``
                interface): bool ``[B, S]``, True on real tokens of the cached past and the new tokens;
                both are then ``positions_from_valid`` and ``attention_mask`` of it.
            keep: return the logits of the last ``keep`` positions only (0: all).
            packed_positions: instead of ``valid``, packed rows (``flowrl.models.CausalLM``): ``[B, T]``
                positions restarting at 0 with each sequence; the mask is ``packed_attention_mask`` of them.

        Returns:
            ``[B, T, vocab_size]`` logits (``[B, keep, vocab_size]`` with ``keep``), in the model's dtype.

        Raises:
            ConfigError: when a position or a cache slot would exceed ``max_seq_len`` or the cache size,
                or ``valid`` disagrees with the cache.
        """
        B, T = tokens.shape
        start = cache.length if cache is not None else 0
        if cache is not None and start + T > cache.max_len:
            raise ConfigError(f"KV cache holds {cache.max_len} slots; {start} filled + {T} new tokens do not fit")
        if packed_positions is not None:
            if valid is not None or positions is not None or attn_mask is not None or cache is not None:
                raise ConfigError("packed_positions takes no valid, positions, attn_mask or cache")
            positions, attn_mask = packed_positions, packed_attention_mask(packed_positions)
        if valid is not None:
            if positions is not None or attn_mask is not None:
                raise ConfigError("pass either valid or positions/attn_mask, not both")
            if valid.shape != (B, start + T):
                raise ConfigError(f"valid has shape {tuple(valid.shape)}; the cache holds {start} tokens and {T} are new, so it must be {(B, start + T)}")
            positions = positions_from_valid(valid)[:, start:]
            attn_mask = attention_mask(valid, start, T)
        if positions is None:
            positions = torch.arange(start, start + T, device=tokens.device).expand(B, T)
        max_pos = int(positions.max()) if positions.numel() else 0
        if max_pos >= self.config.max_seq_len:
            raise ConfigError(
                f"position {max_pos} >= ModelConfig.max_seq_len={self.config.max_seq_len}: "
                "shorten prompts or max_new_tokens, or raise max_seq_len"
            )
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask[:, None]
        elif attn_mask is None and cache is not None and T > 1:
            attn_mask = torch.ones(T, start + T, dtype=torch.bool, device=tokens.device).tril(start)
        head_dim = self.config.head_dim
        inv_freq = self.config.rope_theta ** (
            -torch.arange(0, head_dim, 2, dtype=torch.float32, device=tokens.device) / head_dim
        )
        angles = positions.to(torch.float32)[:, None, :, None] * inv_freq  # [B, 1, T, D/2]
        cos, sin = angles.cos(), angles.sin()
        x = self.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers):
            if self.gradient_checkpointing and self.training and cache is None:
                x = checkpoint(layer, x, cos, sin, attn_mask, cache, i, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attn_mask, cache, i)
        if cache is not None:
            cache.length = start + T
        x = self.norm(x)
        logits = F.linear(x, self.tok_embeddings.weight) if self.output is None else self.output(x)
        return logits[:, -keep:] if keep else logits

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding (``ModelConfig.vocab_size``)."""
        return self.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        """Longest prompt + completion (``ModelConfig.max_seq_len``)."""
        return self.config.max_seq_len

    def enable_gradient_checkpointing(self) -> None:
        """Recompute each block's activations in the backward pass (``torch.utils.checkpoint``)."""
        self.gradient_checkpointing = True

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache for ``batch`` sequences of up to ``max_len`` tokens, in the model's dtype."""
        weight = self.tok_embeddings.weight
        return KVCache(self.config, batch, max_len, dtype=weight.dtype, device=weight.device)

    @torch.no_grad()
    def splice_cache(self, cache: KVCache, part: KVCache, source: Tensor, rows: Tensor, start: int) -> bool:
        """Copy every layer's keys and values of sequences ``source`` of ``part`` into rows ``rows``, slots ``[start, start + part.length)`` of ``cache``.

        The slots must be filled already (``cache.length`` does not change); what they held for those
        rows is overwritten, the other rows are untouched. Keys carry their rotary positions, so the
        caller's ``valid`` must give the spliced tokens the positions they had in ``part``.

        Args:
            cache: the cache written into.
            part: the cache read from (same model).
            source: ``[N]`` int64 sequence indices of ``part``.
            rows: ``[N]`` int64 row indices of ``cache`` (``source[i]`` goes to ``rows[i]``).
            start: first slot written.

        Returns:
            True (this cache layout always takes a splice; see ``flowrl.models.CausalLM``).

        Raises:
            ConfigError: when the slots are not all filled or ``source`` and ``rows`` differ in length.
        """
        T = part.length
        if start < 0 or start + T > cache.length or source.shape != rows.shape:
            raise ConfigError(
                f"splice of sequences {source.tolist()} x {T} tokens into rows {rows.tolist()}, slots [{start}, {start + T}) "
                f"does not fit a cache with {cache.length} filled slots"
            )
        for layer in range(len(cache.k)):
            cache.k[layer][rows, :, start : start + T] = part.k[layer][source, :, :T]
            cache.v[layer][rows, :, start : start + T] = part.v[layer][source, :, :T]
        return True


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())


def positions_from_valid(valid: Tensor) -> Tensor:
    """Rotary positions ``[B, S]`` counted from each row's first real token (pads get 0).

    Example:
        >>> positions_from_valid(torch.tensor([[False, True, True]])).tolist()
        [[0, 0, 1]]
    """
    return (valid.long().cumsum(-1) - 1).clamp(min=0)


def attention_mask(valid: Tensor, q_start: int, q_len: int) -> Tensor:
    """Bool ``[B, 1, q_len, q_start + q_len]``: query ``q_start + i`` may attend key j iff j <= q_start + i
    and key j is real, or j is the query itself (so that pad rows stay finite).

    Args:
        valid: ``[B, S]`` True on real tokens, ``S >= q_start + q_len``.
        q_start: slot of the first query.
        q_len: number of queries.
    """
    S = q_start + q_len
    q = torch.arange(q_start, S, device=valid.device)[:, None]
    k = torch.arange(S, device=valid.device)[None, :]
    causal = k <= q  # [q_len, S]
    mask = causal[None] & valid[:, None, :S]
    mask = mask | (k == q)[None]
    return mask[:, None]


def packed_attention_mask(positions: Tensor) -> Tensor:
    """Bool ``[B, 1, T, T]`` of packed rows: query i may attend key j iff j <= i and both are in one
    sequence; a sequence starts wherever a position does not follow the previous one by 1.

    Example:
        >>> packed_attention_mask(torch.tensor([[0, 1, 0, 1]]))[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    """
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    seq = starts.long().cumsum(-1)  # [B, T]: which sequence of its row each token is in
    T = positions.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()
    return ((seq[:, :, None] == seq[:, None, :]) & causal)[:, None]


def initial_weights(model: Transformer) -> Iterator[tuple[str, Tensor]]:
    """``model``'s initial parameters, one whole float32 CPU tensor at a time in ``named_parameters``
    order: Normal(0, 0.02) (residual projections scaled by 1/sqrt(2 * n_layers)) drawn from a
    ``torch.Generator`` seeded by ``ModelConfig.seed``, unit norms. ``model`` may be on the meta
    device (only its names and shapes are read): an FSDP rank keeps its rows of each
    (``flowrl.runtime.parallel.fsdp_init``) and never holds the whole model.
    """
    gen = torch.Generator().manual_seed(model.config.seed)
    residual_std = 0.02 / math.sqrt(2 * model.config.n_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            yield name, torch.ones(param.shape)
        else:
            std = residual_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
            yield name, torch.randn(param.shape, generator=gen) * std
