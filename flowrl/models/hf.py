"""The Hugging Face adapter: a local ``AutoModelForCausalLM`` directory as a ``CausalLM``.

``check_hf_dir`` reads ``config.json`` and refuses, before any work, what cannot run: a missing
directory or hub id, no ``config.json``, a ``model_type`` of no family in ``flowrl.models.families``,
a key of its family's ``fixed_keys`` at another value (a mixture of experts with dense blocks), ``init="pretrained"`` without weight files, a missing ``transformers``. ``load_hf`` builds the model (pretrained weights,
or seeded random ones under ``torch.random.fork_rng`` so that every node built from one config gets
the same weights) and wraps it in ``HFCausalLM``.

``HFCausalLM`` registers the Hugging Face model's children as its own, so its ``state_dict()`` names
are the Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``): weights travel
keyed by them and ``save_pretrained`` writes them back. Its forward passes a 2-D ``attention_mask``
(the ``valid`` mask), explicit ``position_ids`` (real tokens before each token) and a transformers
``DynamicCache``. Packed rows (``packed_positions``) pass no ``attention_mask`` and the packed
``position_ids``: transformers then finds the sequences from the positions and keeps attention within
each (``masking_utils.find_packed_sequence_indices``; flash-attention's varlen path reads the same).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.errors import ConfigError
from flowrl.graph.configs import HFModelConfig
from flowrl.models.families import FAMILIES, hf_family_names
from flowrl.models.local import require_transformers, resolve_local_dir

__all__ = ["HFCausalLM", "check_hf_dir", "load_hf", "load_auto", "hf_eos_ids"]

_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")


def _positions(valid: Tensor) -> Tensor:
    return (valid.long().cumsum(-1) - 1).clamp(min=0)


def check_hf_dir(config: HFModelConfig, *, owner: str = "model") -> dict[str, Any]:
    """The directory's ``config.json`` as a dict, after every check that needs no model built.

    Raises:
        ConfigError: for a missing directory or hub id, no ``config.json``, an unsupported
            ``model_type``, a ``fixed_keys`` value the family does not read, ``init="pretrained"`` without
            weight files, or no ``transformers``.
    """
    directory = resolve_local_dir(config.path, owner=owner)
    cfg_file = directory / "config.json"
    if not cfg_file.is_file():
        present = sorted(p.name for p in directory.iterdir())[:12]
        raise ConfigError(
            f"{owner}: {str(directory)!r} has no config.json (files there: {present}); "
            "pass the directory that model.save_pretrained(DIR) wrote"
        )
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{owner}: {str(cfg_file)!r} is not valid JSON: {exc}") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in hf_family_names():
        raise ConfigError(
            f"{owner}: {str(cfg_file)!r} has model_type {model_type!r}; flowrl trains the families {hf_family_names()}"
        )
    family = FAMILIES[model_type]
    for key, value in family.fixed_keys:
        if raw.get(key, value) not in (value, None):
            raise ConfigError(
                f"{owner}: {str(cfg_file)!r} has {key}={raw[key]!r}; flowrl reads a {model_type} ({family.hf_architecture}) "
                f"directory only with {key}={value!r} (every decoder block a mixture of experts): write the config with {key}={value!r}"
            )
    if config.init == "pretrained" and not any(next(directory.glob(g), None) for g in _WEIGHT_GLOBS):
        raise ConfigError(
            f"{owner}: {str(directory)!r} holds no weights (*.safetensors or pytorch_model*.bin); "
            "point the graph at a directory that has them ('flowrl run GRAPH --model DIR'), save them with "
            'model.save_pretrained(DIR), or use init="random" for seeded random weights'
        )
    require_transformers(f"{owner} (a Hugging Face model)")
    return raw


def hf_eos_ids(directory: str | Path, config_json: dict[str, Any]) -> tuple[int, ...]:
    """End-of-sequence ids the model's ``config.json`` and ``generation_config.json`` name (may be empty)."""
    ids: list[int] = []
    sources = [config_json]
    gen_file = Path(directory).expanduser() / "generation_config.json"
    if gen_file.is_file():
        try:
            sources.append(json.loads(gen_file.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, json.JSONDecodeError):
            pass
    for src in sources:
        value = src.get("eos_token_id") if isinstance(src, dict) else None
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return tuple(ids)


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM behind flowrl's ``CausalLM`` interface (see the module docstring).

    Args:
        hf: a ``PreTrainedModel`` for causal LM (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...).
        max_seq_len: longest prompt + completion accepted.

    Attributes:
        hf: the wrapped model (its children are this module's children, so names agree).
        vocab_size: rows of the input embedding.
        max_seq_len: as given.
    """

    hf: Any  # a transformers ``PreTrainedModel``: the checker does not follow transformers (pyproject's [tool.mypy])

    def __init__(self, hf: nn.Module, *, max_seq_len: int) -> None:
        super().__init__()
        own = [n for n, _ in hf.named_parameters(recurse=False)] + [n for n, _ in hf.named_buffers(recurse=False)]
        if own:
            raise ConfigError(f"{type(hf).__name__} holds tensors outside its submodules; flowrl cannot adapt it")
        for name, child in hf.named_children():
            self.add_module(name, child)
        self.__dict__["hf"] = hf  # not a submodule: its children are already ours (state-dict names = HF names)
        self.vocab_size = int(self.hf.get_input_embeddings().num_embeddings)
        self.max_seq_len = int(max_seq_len)

    def train(self, mode: bool = True) -> HFCausalLM:
        super().train(mode)
        self.hf.training = mode
        return self

    def forward(
        self, tokens: Tensor, *, valid: Tensor | None = None, cache: Any = None, keep: int = 0, packed_positions: Tensor | None = None
    ) -> Tensor:
        """Logits ``[B, T or keep, V]`` of the next token (see ``flowrl.models.causal_lm``).

        Raises:
            ConfigError: when a position exceeds ``max_seq_len``, ``valid`` disagrees with the cache,
                or ``packed_positions`` comes with ``valid`` or a cache.
        """
        if packed_positions is not None:
            if valid is not None or cache is not None:
                raise ConfigError("packed_positions takes no valid or cache")
            if packed_positions.numel() and int(packed_positions.max()) >= self.max_seq_len:
                raise ConfigError(f"position {int(packed_positions.max())} >= max_seq_len={self.max_seq_len}: shorten prompts or max_new_tokens")
            return self.hf(input_ids=tokens, position_ids=packed_positions, use_cache=False, logits_to_keep=keep).logits
        B, T = tokens.shape
        past = cache.get_seq_length() if cache is not None else 0
        if valid is None:
            valid = torch.ones(B, past + T, dtype=torch.bool, device=tokens.device)
        if valid.shape != (B, past + T):
            raise ConfigError(f"valid has shape {tuple(valid.shape)}; the cache holds {past} tokens and {T} are new, so it must be {(B, past + T)}")
        positions = _positions(valid)[:, past:]
        if positions.numel() and int(positions.max()) >= self.max_seq_len:
            raise ConfigError(
                f"position {int(positions.max())} >= max_seq_len={self.max_seq_len}: shorten prompts or max_new_tokens"
            )
        out = self.hf(
            input_ids=tokens,
            attention_mask=valid.long(),
            position_ids=positions,
            past_key_values=cache,
            use_cache=cache is not None,
            logits_to_keep=keep,
        )
        return out.logits

    def new_cache(self, batch: int, max_len: int) -> Any:
        """An empty transformers ``DynamicCache`` (it grows as ``forward`` extends it; ``max_len`` unused)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.hf.config)

    @torch.no_grad()
    def splice_cache(self, cache: Any, part: Any, source: Tensor, rows: Tensor, start: int) -> bool:
        """Copy sequences ``source`` of ``part`` into rows ``rows``, positions ``[start, start + T)`` of ``cache``
        (both ``DynamicCache``s; ``T`` tokens in ``part``), as ``flowrl.models.families.builtin.model.Transformer.splice_cache`` does.

        Returns:
            False, changing nothing, unless every layer of both caches is a full-attention
            ``DynamicLayer`` holding ``[B, heads, length, head_dim]`` tensors (a sliding-window
            layer drops old positions, so its slots are not addressable): the caller then fills
            the rows another way.

        Raises:
            ConfigError: when the positions are not all filled or ``source`` and ``rows`` differ in length.
        """
        from transformers.cache_utils import DynamicLayer

        pairs = list(zip(cache.layers, part.layers, strict=True))
        if not all(type(a) is DynamicLayer and type(b) is DynamicLayer and a.is_initialized and b.is_initialized for a, b in pairs):
            return False
        T, filled = part.get_seq_length(), cache.get_seq_length()
        if start < 0 or start + T > filled or source.shape != rows.shape:
            raise ConfigError(
                f"splice of sequences {source.tolist()} x {T} tokens into rows {rows.tolist()}, positions "
                f"[{start}, {start + T}) does not fit a cache with {filled} filled positions"
            )
        for a, b in pairs:
            a.keys[rows, :, start : start + T] = b.keys[source]
            a.values[rows, :, start : start + T] = b.values[source]
        return True

    def enable_gradient_checkpointing(self) -> None:
        """Recompute each decoder layer's activations in the backward pass (transformers' own mechanism)."""
        enable = getattr(self.hf, "activation_checkpointing_enable", None)  # transformers >= 5.x; the old name warns
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_auto(config: HFModelConfig, auto: str, *, owner: str = "model") -> Any:
    """The ``transformers`` model of ``config``'s directory built by the auto class named ``auto``
    (``"AutoModelForCausalLM"``, ``"AutoModelForSequenceClassification"``), in float32 on the CPU:
    its weights, or with ``init="random"`` seeded random ones drawn inside ``torch.random.fork_rng``.

    Raises:
        ConfigError: when transformers cannot load the directory (after ``check_hf_dir``'s checks, which the caller makes).
    """
    transformers = require_transformers("a Hugging Face model")
    directory = str(Path(config.path).expanduser())
    transformers.utils.logging.disable_progress_bar()  # a bar per node would tear flowrl's own progress bar
    cls = getattr(transformers, auto)
    try:
        if config.init == "pretrained":
            return cls.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
        hf_config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            return cls.from_config(hf_config, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{owner}: transformers could not load {directory!r}: {exc}") from None


def load_hf(config: HFModelConfig, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> HFCausalLM:
    """Build the model of ``config`` (after ``check_hf_dir``), in ``dtype`` on ``device``.

    Random weights are drawn in float32 under ``torch.manual_seed(config.seed)`` inside
    ``torch.random.fork_rng`` (the caller's RNG is untouched), then cast: a bf16 generator and an fp32
    policy of one config start from the same weights, rounded.

    Raises:
        ConfigError: see ``check_hf_dir``; also when transformers cannot load the directory.
    """
    raw = check_hf_dir(config)
    directory = str(Path(config.path).expanduser())
    hf = load_auto(config, "AutoModelForCausalLM")
    max_len = config.max_seq_len or int(raw.get("max_position_embeddings") or 0)
    if max_len < 1:
        raise ConfigError(f"model: {directory!r}: config.json has no max_position_embeddings; set HFModelConfig.max_seq_len")
    return HFCausalLM(hf, max_seq_len=max_len).to(device=device, dtype=dtype)
