"""An FSDP2 policy's model built on the meta device and materialised shard by shard: no rank holds it whole.

``meta_build(config)`` gives the policy's model with every parameter on the meta device and every
buffer real (rotary tables as the constructor computed them), and a ``RowSource``: what each
parameter's rows ``[start, stop)`` are, read or drawn one parameter at a time. ``materialise_``
then, after ``fully_shard`` (``flowrl.runtime.parallel.fsdp.shard_trainer_``), allocates each rank's shards
on its device (``to_empty``, buffers put back) and fills them from the source. The result is, bit
for bit, what building the whole model and keeping ``torch.chunk(p, dp)[rank]`` gives
(``tests/runtime/test_fsdp_init.py``), with no broadcast:

- the built-in model: ``flowrl.models.families.builtin.model.initial_weights`` draws each whole
  parameter from the seeded generator in order; the rank keeps its rows (peak: one parameter);
- a Hugging Face directory with weights (``init="pretrained"``): each rank reads only its rows of
  each tensor from the safetensors files (their byte range, read into a tensor of their size;
  ``safe_open(...).get_slice(name)[start:stop]`` for a dtype other than float 16/32/64), cast to
  float32 as ``from_pretrained(dtype=float32)`` does; a mixture of experts' stacked weights
  (``[experts, ...]``, rows = experts) from the files' per-expert tensors of this rank's experts
  (``ModelFamily.stacked``: ``save_pretrained`` writes ``mlp.experts.{e}.gate_proj.weight``, ...);
- ``init="random"``: transformers draws its weights from the global generator in module order (a
  module's constructor, then ``_init_weights`` per module in ``initialize_weights``' order), so the
  build runs that same code under the same seed with one module's parameters real at a time
  (``_OneModuleAtATime``: the constructor's draws advance the generator as they always do, then the
  parameters go to the meta device), recording the generator's state before each module's
  ``_init_weights``; the source replays it per module (state restored, parameters real, the rows
  kept). A parameter that ``_init_weights`` leaves unwritten (its value would be the constructor's)
  is refused (``FlowrlError``). The one assumption: a module's constructor draws only into its own
  parameters before the next module registers one (true of ``torch.nn``'s layers and of every
  family in ``FAMILIES``; ``tests/runtime/test_fsdp_init.py`` checks each against the whole build).

A LoRA policy (``HFModelConfig.lora``) is its base built as above plus peft's adapters (``_lora``):
peft injects them into the meta model with each target's weight swapped for an empty real tensor
(peft puts an adapter on its base weight's device, and reads the shapes from ``in_features`` /
``out_features``), so ``A`` is drawn under the LoRA seed as ``flowrl.models.lora.add_adapters`` draws
it; the adapters (``r * (in + out)`` numbers per target) are kept aside whole and go to the meta
device with the rest. The source gives the base's rows under peft's names (``<target>.base_layer.weight``)
and the adapters' rows from those copies: the shards equal the whole LoRA model's, bit for bit.
"""

from __future__ import annotations

import copy
import json
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec
import torch
from torch import Tensor, nn

from flowrl.errors import ConfigError, FlowrlError
from flowrl.host import release_freed_memory
from flowrl.graph.configs import AnyModelConfig, HFModelConfig, ModelConfig
from flowrl.models.family import ModelFamily
from flowrl.models.registry import family_of

__all__ = ["RowSource", "meta_build", "materialise_", "row_range"]

#: ``wanted`` (parameter name -> its rows ``(start, stop)``) -> each of them once, as ``(name, rows)``
#: float32 CPU tensors of ``stop - start`` rows; one whole parameter in memory at most.
RowSource = Callable[[Mapping[str, tuple[int, int]]], Iterator[tuple[str, Tensor]]]


def row_range(rows: int, dp: int, index: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` that rank ``index`` of ``dp`` holds of a tensor of ``rows`` rows under
    FSDP2's ``Shard(0)``: ``torch.chunk``'s chunks (``ceil(rows / dp)`` each, the last ones shorter or empty).

    Example:
        >>> [row_range(5, 2, i) for i in range(2)], [row_range(2, 3, i) for i in range(3)]
        ([(0, 3), (3, 5)], [(0, 1), (1, 2), (2, 2)])
    """
    size = -(-rows // dp) if rows else 0
    start = min(index * size, rows)
    return start, min(start + size, rows)


_release = release_freed_memory  # glibc's malloc_trim after each freed module (why: flowrl.host)


def _to_meta(p: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)


#: One meta build at a time in a process: the builds patch ``nn.Module.register_parameter`` (and
#: transformers' ``_initialize_weights``) class-wide, and a rank may build its nodes' programs in
#: threads (``runtime/backends/torchrun/backend.py``'s serve threads); the patches act in the building thread
#: only, every other thread gets the original behaviour.
_BUILD_LOCK = threading.Lock()


class _ParamsOnMeta:
    """Every parameter registered inside the block, by this thread, goes to the meta device (a
    constructor's value is dropped; buffers stay where they are made):
    ``accelerate.init_empty_weights(include_buffers=False)``."""

    def __enter__(self) -> _ParamsOnMeta:
        _BUILD_LOCK.acquire()
        self._original, owner = nn.Module.register_parameter, threading.get_ident()
        original = self._original

        def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            original(module, name, param)
            if param is not None and not param.is_meta and threading.get_ident() == owner:
                module._parameters[name] = _to_meta(param)

        setattr(nn.Module, "register_parameter", register)  # a patch for the block: setattr, as the checker types no patches
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(nn.Module, "register_parameter", self._original)
        _BUILD_LOCK.release()


class _OneModuleAtATime:
    """A transformers ``from_config`` whose draws from the global generator are the usual ones, with one
    module's parameters real at a time (see the module docstring). ``records`` gets, per module that
    ``_init_weights`` initialised: ``(module, a copy of it without children or parameters, its
    ``_init_weights``, the generator's state before it)``."""

    def __init__(self) -> None:
        self.records: list[tuple[nn.Module, nn.Module, Callable[[nn.Module], None], Tensor]] = []
        self._pending: list[tuple[nn.Module, str]] = []

    def _flush(self) -> None:
        for module, name in self._pending:
            p = module._parameters.get(name)
            if p is not None and not p.is_meta:
                module._parameters[name] = _to_meta(p)
        if self._pending:
            _release()
        self._pending.clear()

    def __enter__(self) -> _OneModuleAtATime:
        from transformers.modeling_utils import PreTrainedModel

        _BUILD_LOCK.acquire()
        self._register, self._initialize = nn.Module.register_parameter, PreTrainedModel._initialize_weights
        outer, owner = self, threading.get_ident()

        def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            if threading.get_ident() != owner:
                outer._register(module, name, param)
                return
            if outer._pending and outer._pending[-1][0] is not module:
                outer._flush()  # the previous module is built: its constructor's draws are done
            outer._register(module, name, param)
            if param is not None and not param.is_meta:
                outer._pending.append((module, name))

        def initialize(model: Any, module: nn.Module, is_custom_code: bool = False) -> None:
            if threading.get_ident() != owner:
                outer._initialize(model, module, is_custom_code)
                return
            outer._flush()
            own = {k: p for k, p in module._parameters.items() if p is not None}
            if getattr(module, "_is_hf_initialized", False) or not own:
                outer._initialize(model, module, is_custom_code)
                return
            template = copy.copy(module)
            template.__dict__.update(_parameters={}, _modules={}, _buffers=dict(module._buffers))
            outer.records.append((module, template, model._init_weights, torch.get_rng_state()))
            for k, p in own.items():
                module._parameters[k] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
            try:
                outer._initialize(model, module, is_custom_code)
            finally:
                for k, p in own.items():
                    module._parameters[k] = p
                _release()

        setattr(nn.Module, "register_parameter", register)  # patches for the block, as _ParamsOnMeta's
        setattr(PreTrainedModel, "_initialize_weights", initialize)
        return self

    def __exit__(self, *exc: object) -> None:
        from transformers.modeling_utils import PreTrainedModel

        setattr(nn.Module, "register_parameter", self._register)
        setattr(PreTrainedModel, "_initialize_weights", self._initialize)
        self._flush()
        _BUILD_LOCK.release()


def meta_build(config: AnyModelConfig) -> tuple[nn.Module, RowSource]:
    """``config``'s float32 model with its parameters on the meta device and its buffers real (CPU),
    and the source of its parameters' rows (see the module docstring).

    A LoRA description's model comes with its adapters (``flowrl.models.lora.add_adapters``' model).

    Raises:
        ConfigError: as ``flowrl.models.build_model`` and ``flowrl.models.lora.add_adapters``.
    """
    if isinstance(config, ModelConfig):
        return _builtin(config)
    if not isinstance(config, HFModelConfig):
        raise ConfigError(f"meta_build: no meta-device build for a {type(config).__name__}")
    if config.lora is not None:
        return _lora(config)
    return _hf(config)


def _builtin(config: ModelConfig) -> tuple[nn.Module, RowSource]:
    from flowrl.models.families.builtin.model import Transformer, initial_weights

    with _ParamsOnMeta():
        model = Transformer(config)

    def source(wanted: Mapping[str, tuple[int, int]]) -> Iterator[tuple[str, Tensor]]:
        for name, full in initial_weights(model):  # every parameter drawn in order: the generator's sequence
            if name in wanted:
                start, stop = wanted[name]
                yield name, full[start:stop]

    return model, source


def _hf(config: HFModelConfig) -> tuple[nn.Module, RowSource]:
    from flowrl.models.hf import HFCausalLM, check_hf_dir, load_auto

    raw = check_hf_dir(config)
    max_len = config.max_seq_len or int(raw.get("max_position_embeddings") or 0)
    if max_len < 1:
        raise ConfigError(f"model: {config.path!r}: config.json has no max_position_embeddings; set HFModelConfig.max_seq_len")
    if config.init == "pretrained":
        with _ParamsOnMeta():
            hf = load_auto(msgspec.structs.replace(config, init="random"), "AutoModelForCausalLM")  # the architecture; values from the files
        return HFCausalLM(hf, max_seq_len=max_len), _file_rows(Path(config.path).expanduser(), family_of(config))
    build = _OneModuleAtATime()
    with build:
        hf = load_auto(config, "AutoModelForCausalLM")  # seeded, inside fork_rng, as load_hf
    model = HFCausalLM(hf, max_seq_len=max_len)
    return model, _replayed_rows(model, build.records)


def _lora(config: HFModelConfig) -> tuple[nn.Module, RowSource]:
    """The meta base of ``config`` with peft's adapters, and the rows of both (module docstring)."""
    from flowrl.models.lora import inject_adapters, lora_modules

    lora = config.lora
    assert lora is not None  # the caller's branch
    model, base = _hf(msgspec.structs.replace(config, lora=None))
    inner = getattr(model, "hf", model)
    targets = lora_modules(inner, lora, owner="policy")
    modules = dict(inner.named_modules())
    metas = {name: modules[name]._parameters["weight"] for name in targets}
    for name in targets:  # peft puts each adapter where its base weight is: a real (empty) one, for real adapters
        modules[name]._parameters["weight"] = nn.Parameter(torch.empty(0), requires_grad=False)
    try:
        inject_adapters(model, lora, targets)
    finally:
        for name, weight in metas.items():  # the same module object, now the adapter layer's base_layer
            modules[name]._parameters["weight"] = weight.requires_grad_(False)
    by_name = {name: p.detach().clone() for name, p in model.named_parameters() if not p.is_meta}  # the adapters, whole
    for module in model.modules():
        for k, p in module._parameters.items():
            if p is not None and not p.is_meta:
                module._parameters[k] = _to_meta(p)

    def source(wanted: Mapping[str, tuple[int, int]]) -> Iterator[tuple[str, Tensor]]:
        renamed = {name.replace(".base_layer.", "."): name for name in wanted if name not in by_name}
        for name, rows in base({plain: wanted[peft] for plain, peft in renamed.items()}):
            yield renamed[name], rows
        for name in [n for n in wanted if n in by_name]:
            start, stop = wanted[name]
            yield name, by_name[name][start:stop]

    return model, source


#: safetensors dtype names -> torch dtypes ``_read_rows`` reads itself (others go through ``get_slice``)
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def _read_rows(f: Any, data_start: int, entry: Mapping[str, Any], start: int, stop: int) -> Tensor:
    """Rows ``[start, stop)`` of one safetensors tensor, read with ``readinto`` into a tensor of their
    size: a row-major tensor's rows are one contiguous byte range. Not ``safe_open``'s memory map,
    whose touched pages would count in this rank's RSS until the file is closed."""
    shape, dtype = list(entry["shape"]), _SAFETENSORS_DTYPES[entry["dtype"]]
    out = torch.empty([stop - start, *shape[1:]], dtype=dtype)
    row = math.prod(shape[1:]) * out.element_size()
    f.seek(data_start + int(entry["data_offsets"][0]) + start * row)
    buffer = out.view(torch.uint8).numpy().data.cast("B") if out.numel() else memoryview(bytearray())
    if f.readinto(buffer) != len(buffer):
        raise FlowrlError(f"{f.name!r}: a tensor's bytes end before its header says; the file is cut short")
    return out


def _file_rows(directory: Path, family: ModelFamily) -> RowSource:
    """Rows read from the directory's ``*.safetensors`` (or ``pytorch_model*.bin``, memory-mapped); a
    weight the family holds stacked over experts (``ModelFamily.stacked``) and the files hold per expert
    is this rank's experts' tensors, each concatenated as ``checkpoint_names`` says, stacked."""

    def tensors(wanted: Mapping[str, tuple[int, int | None]]) -> Iterator[tuple[str, Tensor]]:
        files = sorted(directory.glob("*.safetensors"))
        left = dict(wanted)
        if files:
            from safetensors import safe_open

            for path in files:
                with open(path, "rb") as f:
                    size = int.from_bytes(f.read(8), "little")
                    header = json.loads(f.read(size))
                    for name in [n for n in header if n in left]:
                        start, stop = left.pop(name)
                        entry = header[name]
                        if entry["dtype"] in _SAFETENSORS_DTYPES and entry["shape"]:
                            rows = _read_rows(f, 8 + size, entry, start, entry["shape"][0] if stop is None else stop)
                        else:
                            with safe_open(str(path), framework="pt") as handle:
                                rows = handle.get_slice(name)[start:stop]
                        yield name, rows.to(torch.float32)
        else:
            for bin_path in sorted(directory.glob("pytorch_model*.bin")):
                state = torch.load(bin_path, weights_only=True, map_location="cpu", mmap=True)
                for name in [n for n in state if n in left]:
                    start, stop = left.pop(name)
                    yield name, state[name][start:stop].to(torch.float32, copy=True)
                del state
        if left:
            raise FlowrlError(
                f"{str(directory)!r}: its weight files hold no tensor named {sorted(left)[:5]} (of {len(left)} missing); "
                "flowrl reads the Hugging Face parameter names as saved by save_pretrained"
            )

    def source(wanted: Mapping[str, tuple[int, int]]) -> Iterator[tuple[str, Tensor]]:
        stored = _stored_names(directory)
        parts = {n: [family.checkpoint_names(n, e) for e in range(*rows)] for n, rows in wanted.items() if n not in stored and family.checkpoint_names(n, 0)}
        plain: dict[str, tuple[int, int | None]] = {n: rows for n, rows in wanted.items() if n not in parts}
        whole: dict[str, Tensor] = {}
        for name, rows in tensors({**plain, **{p: (0, None) for experts in parts.values() for names in experts for p in names}}):
            if name in plain:
                yield name, rows
            else:
                whole[name] = rows
        for name, experts in parts.items():
            yield name, torch.stack([torch.cat([whole.pop(p) for p in names]) for names in experts])

    return source


def _stored_names(directory: Path) -> set[str]:
    """The tensor names of the directory's safetensors headers (empty for ``pytorch_model*.bin`` files)."""
    names: set[str] = set()
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as f:
            names |= set(json.loads(f.read(int.from_bytes(f.read(8), "little"))))
    return names


def _replayed_rows(model: nn.Module, records: list[tuple[nn.Module, nn.Module, Callable[[nn.Module], None], Tensor]]) -> RowSource:
    """Rows of a seeded transformers initialisation, replayed one module at a time (module docstring)."""
    prefixes = {id(m): name for name, m in model.named_modules()}

    def source(wanted: Mapping[str, tuple[int, int]]) -> Iterator[tuple[str, Tensor]]:
        from transformers import initialization

        for module, template, init, state in records:
            prefix = prefixes.get(id(module))
            names = {k: f"{prefix}.{k}" if prefix else k for k, p in module._parameters.items() if p is not None}
            if prefix is None or not any(n in wanted for n in names.values()):
                continue
            template._parameters = {  # None kept: a Linear without bias has ``bias = None``
                k: None if p is None else nn.Parameter(torch.full(p.shape, float("nan"), dtype=p.dtype), requires_grad=p.requires_grad)
                for k, p in module._parameters.items()
            }
            with torch.random.fork_rng(devices=[]), initialization.guard_torch_init_functions():
                torch.set_rng_state(state)
                init(template)
            for k, name in names.items():
                if name not in wanted:
                    continue
                param = template._parameters[k]
                assert param is not None  # names holds the parameters the template has
                full = param.detach()
                if torch.isnan(full).any():
                    raise FlowrlError(
                        f"{name}: transformers' _init_weights of {type(module).__name__} leaves it (partly) unset, so its value is "
                        "the constructor's, which a meta-device build does not replay: flowrl cannot start this family sharded "
                        "(a flowrl limit); train it with sharding='replicate'"
                    )
                start, stop = wanted[name]
                yield name, full[start:stop]
            template._parameters = {}
            _release()

    return source


def materialise_(model: nn.Module, source: RowSource, device: torch.device | str) -> None:
    """Allocate a ``fully_shard``-ed meta model's shards on ``device`` and fill them from ``source``
    (every rank of the mesh calls it; no communication). Buffers keep their values, moved to ``device``.

    Raises:
        FlowrlError: when the source misses a parameter or gives rows of the wrong shape.
    """
    from torch.distributed.tensor import DTensor

    buffers = [(m, k, b) for m in model.modules() for k, b in m._buffers.items() if b is not None]
    model.to_empty(device=device)
    for m, k, b in buffers:
        m._buffers[k] = b.to(device)
    locals_: dict[str, Tensor] = {}
    wanted: dict[str, tuple[int, int]] = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):  # FSDP2's sharded parameter
            mesh = p.device_mesh
            local = p.to_local()
            start, stop = row_range(p.shape[0], mesh.size(), mesh.get_local_rank())
        else:  # not sharded (a module fully_shard left out): the whole tensor
            local, (start, stop) = p, (0, p.shape[0])
        if stop - start != local.shape[0]:
            raise FlowrlError(f"{name}: this rank holds {local.shape[0]} rows, torch.chunk gives it {stop - start}; this is a flowrl bug")
        locals_[name], wanted[name] = local, (start, stop)
    with torch.no_grad():
        for name, rows in source(wanted):
            local = locals_.pop(name)
            if tuple(rows.shape) != tuple(local.shape):
                raise FlowrlError(f"{name}: the source gave rows of shape {tuple(rows.shape)} for a shard of {tuple(local.shape)}")
            local.copy_(rows)
            del rows
            _release()
    if locals_:
        raise FlowrlError(f"the model's parameters {sorted(locals_)[:5]} were not filled by its source; this is a flowrl bug")
