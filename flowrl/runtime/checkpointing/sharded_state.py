"""A sharded policy's checkpoint state as torch.distributed.checkpoint (DCP) shards: written per rank, read on any dp size.

An FSDP2 policy (``flowrl.runtime.parallel.fsdp``) saves ``policy-<node>.dcp/`` in a checkpoint's ``step-*``
directory (``flowrl.runtime.checkpointing.store``) instead of the one-file ``policy-<node>.pt``::

    policy-<node>.dcp/
        __<i>_0.distcp   what dp rank i held: its rows of every parameter and AdamW moment (DCP's file)
        .metadata        DCP's index: each tensor's global shape and the file and offset of each chunk
                         (written by the policy's lead, through a rename, once every rank's file is written)
        policy.json      ShardedStateInfo: format, version, model_config, the dp size that wrote it
                         (written last, by the lead)

What is saved is ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` as
``{"model": ..., "optimizer": ...}``: parameter names (FQNs) to DTensors, and AdamW's state by
parameter name with its param groups (a LoRA policy: its adapters only, ``ignore_frozen_params``).
Nothing is gathered: each rank writes the rows it holds, so while saving no rank holds more than its
own shards and DCP's write buffers (DCP's per-rank write plan is its local chunks; replicated scalars
such as AdamW's ``step`` are written once). ``benches/sharded_checkpoint.py`` measures it: a few MB
above the resident memory before the save, against 1.2x the full state on the lead of a gathered save.

- ``save_sharded(trainer, path, group)``: collective over the policy's ranks (every rank calls it).
- ``check_complete(path)``: the info of a whole state with every rank's file (``CheckpointWriter.commit``).
- ``check_sharded(path, trainer)``: before any work, the error that names the fix for a checkpoint that
  cannot be loaded into ``trainer`` (incomplete, a shard file missing, not on this host, another
  model or shapes).
- ``load_sharded(trainer, path, group)``: each rank reads its rows of the saved chunks, whatever dp
  size wrote them (DCP reshards by chunk overlap), then ``set_state_dict``.
- ``read_state(path)``: a checkpoint's policy state in the one-file format (``Trainer.state()``: full
  tensors, the optimizer's state by index), from a ``.pt`` file or a ``.dcp`` directory consolidated
  in this process without a process group: what ``flowrl export``, ``flowrl sample`` / ``eval``, the
  evaluator and the resume of a one-process or replicated policy read. It holds the whole state, as
  the one-file format does.

DCP's ``.metadata`` is a pickle: it is read with an unpickler that allows only DCP's metadata
classes and torch's dtypes (``_MetadataUnpickler``), as the one-file format is read with
``weights_only=True``: a poisoned checkpoint raises, it does not run code.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import torch

from flowrl.errors import CheckpointError

__all__ = [
    "SHARDED_SUFFIX",
    "INFO_FILE",
    "ShardedStateInfo",
    "is_sharded",
    "written",
    "save_sharded",
    "check_complete",
    "check_sharded",
    "load_sharded",
    "read_state",
]

#: The suffix of a sharded policy state's directory (``policy-<node>.dcp``).
SHARDED_SUFFIX = ".dcp"
#: What a sharded state holds besides tensors, in its directory.
INFO_FILE = "policy.json"
_METADATA = ".metadata"  # DCP's index (torch.distributed.checkpoint.filesystem)


class ShardedStateInfo(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a sharded state holds besides tensors (``policy.json``).

    Attributes:
        version: the policy version (completed optimizer steps).
        model_config: the policy's model description (``msgspec.to_builtins``), as the one-file format.
        dp: the number of ranks that wrote it, whatever their layout (``__<rank>_0.distcp`` files;
            any dp size reads it).
        lora: whether ``model`` holds a LoRA policy's adapters only.
        mesh: the writer's mesh, axis -> size (``{"dp": 2}``, ``{"tp": 2, "pp": 2}``); informative only
            (readers need none of it: the index has every tensor's global shape). Empty in states
            written before it was recorded.
        format: this layout's version.
    """

    version: int
    model_config: dict[str, Any]
    dp: int
    lora: bool = False
    mesh: dict[str, int] = msgspec.field(default_factory=dict)
    format: int = 1


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a sharded state (a directory), not a one-file state."""
    return Path(path).is_dir()


def written(path: str | Path) -> bool:
    """Whether a policy state at ``path`` is whole: a file, or a directory with its info and DCP's
    index (written last, so a kill during the save leaves it without one)."""
    p = Path(path)
    return p.is_file() or (p.is_dir() and (p / INFO_FILE).is_file() and (p / _METADATA).is_file())


# -- saving --------------------------------------------------------------------------------------------
def _options(trainer: Any) -> Any:
    """LoRA: not strict (the frozen base is the description's own, and ``check_sharded`` has checked
    that the adapters are all there); ``_stored`` keeps the adapters of what ``get_state_dict`` gives."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    lora = bool(trainer.lora)
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def _trainable(model: Any) -> set[str]:
    """Every name of every parameter the optimizer trains (a tied parameter under each of its names)."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}


def _stored(trainer: Any, model: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint stores of ``get_state_dict``'s ``model``: all of it, or a LoRA policy's trained
    adapters only. ``ignore_frozen_params`` alone is not enough: it drops the frozen parameters by
    ``named_parameters()``' names, which name a tied parameter once, so a tied head's second name
    (``lm_head.weight``, the embedding) stayed, and with it any persistent buffer."""
    if not trainer.lora:
        return model
    keep = _trainable(trainer.model)
    return {k: v for k, v in model.items() if k in keep}


def _writer(path: Path) -> Any:
    """DCP's file writer at ``path``, refusing (inside DCP's planning, so that every rank of the group
    raises, none waits in a collective) a ``path`` whose folder this rank's host does not have."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def prepare_local_plan(self, plan: Any) -> Any:
            if not path.parent.is_dir():
                raise CheckpointError(
                    f"the checkpoint folder {str(path.parent)!r} does not exist on this rank's host: every rank of a "
                    "sharded policy writes its own shards there, so on several hosts --checkpoint-dir must be a "
                    "directory every rank sees (a shared filesystem)"
                )
            return super().prepare_local_plan(plan)  # makes ``path``

    return Writer(str(path))


def _collective(what: str, path: Path, call: Any) -> Any:
    """Run DCP's ``call``; its ``CheckpointException`` (a ``BaseException``, which the rank's serve loop
    and the run's checkpoint cleanup would not catch) as a ``CheckpointError`` naming the ranks that
    failed and the first one's error, raised on every rank alike."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return call()
    except CheckpointException as exc:
        ranks = sorted(exc.failures)
        first = exc.failures[ranks[0]][0]
        message = str(first) if isinstance(first, CheckpointError) else f"{type(first).__name__}: {first}"
        raise CheckpointError(f"{what} {str(path)!r} failed on the policy's rank(s) {ranks} (ranks of its group): {message}") from None


def _whole_groups(optimizer: dict[str, Any], group: Any, device: Any, path: Path) -> dict[str, Any]:
    """``optimizer`` with each param group's ``params`` the names of every rank's, in rank order without
    repeats: the whole model's, whether each rank's optimizer holds them all (dp, tp) or its own stage's
    (pp: DCP keeps one rank's copy of a non-tensor value, so each rank must write the same). The names go
    as JSON bytes in tensors over ``group`` (one all-gather of sizes, one of the bytes), not pickled."""
    import json

    import torch.distributed as dist

    groups = list(optimizer.get("param_groups", []))
    mine = json.dumps([list(g["params"]) for g in groups]).encode()
    n = dist.get_world_size(group)
    size = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    padded = torch.zeros(int(max(int(x) for x in sizes)), dtype=torch.uint8, device=device)
    padded[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
    every = [torch.zeros_like(padded) for _ in range(n)]
    dist.all_gather(every, padded, group=group)
    lists = [json.loads(bytes(b[: int(k)].cpu().tolist())) for b, k in zip(every, sizes)]
    if len({len(x) for x in lists}) > 1:
        raise CheckpointError(
            f"saving the sharded checkpoint {str(path)!r}: the policy's ranks hold {[len(x) for x in lists]} optimizer param "
            "groups; every rank must build its optimizer with the same groups (this is a flowrl bug)"
        )
    merged = [list(dict.fromkeys(name for ranks in lists for name in ranks[i])) for i in range(len(groups))]
    return {**optimizer, "param_groups": [{**g, "params": names} for g, names in zip(groups, merged)]}


def save_sharded(trainer: Any, path: str | Path, *, group: Any, mesh: Mapping[str, int] | None = None) -> None:
    """Write ``trainer``'s shards at ``path`` (a directory in an existing folder). Every rank of the
    policy's ``group`` calls it; each writes only its own shards, the group's first rank DCP's index
    and then the info (the state is whole, ``written``, once both are there). ``trainer.model``'s
    parameter names must be the whole model's (the module docstring's format); ``mesh``: the policy's
    axes, recorded in the info (default ``{"dp": ranks}``).

    Raises:
        CheckpointError: on every rank when one failed (naming it and its error, e.g. a folder its
            host lacks).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    untouched = not trainer.optimizer.state  # before the first step (get_state_dict fills it: an AdamW step at lr 0)
    model, optimizer = get_state_dict(trainer.model, trainer.optimizer, options=_options(trainer))  # DTensors: no gather
    device = next(iter(trainer.model.parameters())).device
    state = {"model": _stored(trainer, model), "optimizer": _whole_groups(optimizer, group, device, path)}
    _collective("saving the sharded checkpoint", path, lambda: dcp.save(state, storage_writer=_writer(path), process_group=group))
    if untouched:  # the next step must start AdamW afresh, as it would have without this save
        trainer.optimizer.state.clear()
    if dist.get_rank(group) == 0:
        ranks = dist.get_world_size(group)
        info = ShardedStateInfo(
            version=trainer.version, model_config=msgspec.to_builtins(trainer.node.model), dp=ranks, lora=bool(trainer.lora),
            mesh={str(k): int(v) for k, v in (mesh or {"dp": ranks}).items()},
        )
        (path / INFO_FILE).write_bytes(msgspec.json.encode(info))


# -- reading: the checks ---------------------------------------------------------------------------------
class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` pickle with DCP's metadata dataclasses and enums, torch's dtypes and layouts
    and a few plain containers only: nothing it names can run code (no function of those modules)."""

    _MODULES = ("torch.distributed.checkpoint.", "torch.distributed._shard.")  # their dataclasses and enums only
    _ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout by its name (torch.strided)
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if module.startswith(self._MODULES):
            value = super().find_class(module, name)
            if isinstance(value, type) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's index")


def _reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = _read_metadata(path)
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(str(path))


def _read_metadata(path: Path) -> Any:
    from torch.distributed.checkpoint.metadata import StorageMeta

    try:
        metadata = _MetadataUnpickler(io.BytesIO((path / _METADATA).read_bytes())).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
        raise CheckpointError(
            f"sharded checkpoint {str(path)!r} has an unreadable index {_METADATA} ({type(exc).__name__}: {exc}); "
            "resume from an intact checkpoint (remove this one and point LATEST at an older step-*)"
        ) from None
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


_INTACT = "resume from an intact checkpoint (remove this one and point LATEST at an older step-*; flowrl export takes a step-* directory)"


def _info(path: Path) -> tuple[ShardedStateInfo, Any]:
    """The info and DCP's index of a whole sharded state whose shard files are all there, each as long
    as its index says."""
    if not written(path):
        lacks = " and ".join(f for f in (INFO_FILE, _METADATA) if not (path / f).is_file())
        raise CheckpointError(
            f"sharded checkpoint {str(path)!r} is incomplete (no {lacks}: its save did not finish); {_INTACT}"
        )
    try:
        info = msgspec.json.decode((path / INFO_FILE).read_bytes(), type=ShardedStateInfo)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"sharded checkpoint {str(path)!r} has an unreadable {INFO_FILE}: {exc}") from None
    if info.format != 1:
        raise CheckpointError(f"sharded checkpoint {str(path)!r} has format {info.format}; this flowrl reads format 1: read it with the flowrl that wrote it")
    metadata = _read_metadata(path)
    _check_files(path, info, metadata)
    return info, metadata


def _layout(info: ShardedStateInfo) -> str:
    """The writer's mesh as ``dp=2`` / ``tp=2, pp=2`` (states written before ``mesh``: their dp size)."""
    return ", ".join(f"{a}={n}" for a, n in info.mesh.items()) if info.mesh else f"dp={info.dp}"


def _check_files(path: Path, info: ShardedStateInfo, metadata: Any) -> None:
    """Refuse a state whose index names a shard file that is not there, or is shorter than the
    chunks the index places in it (a copy cut short), naming the files, their ranks and a tensor each held."""
    import re

    ends: dict[str, int] = {}
    held: dict[str, list[str]] = {}
    for index, where in metadata.storage_data.items():
        ends[where.relative_path] = max(ends.get(where.relative_path, 0), int(where.offset) + int(where.length))
        held.setdefault(where.relative_path, []).append(index.fqn)
    layout = f"{_layout(info)}; " if info.mesh else ""

    def ranks(files: list[str]) -> str:
        numbers = [m.group(1) for f in files if (m := re.match(r"__(\d+)_", f))]
        tensors = sorted({t for f in files for t in held[f]})
        return f"{layout}rank(s) {', '.join(numbers) or '?'}'s, holding chunks of {len(tensors)} tensors such as {tensors[0]!r}"

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for key, meta in metadata.state_dict_metadata.items():  # a reader fills each tensor from its chunks: all of it
        if isinstance(meta, TensorStorageMetadata):
            covered = sum(torch.Size(c.sizes).numel() for c in meta.chunks)
            if covered != meta.size.numel():
                raise CheckpointError(
                    f"sharded checkpoint {str(path)!r}: the chunks of {key!r} hold {covered} of its {meta.size.numel()} elements "
                    f"(shape {tuple(meta.size)}): its writers did not save each element exactly once; {_INTACT}"
                )
    missing = sorted(f for f in ends if not (path / f).is_file())
    if missing:
        raise CheckpointError(
            f"sharded checkpoint {str(path)!r} lacks shard files {missing} of the {info.dp} ranks that wrote it ({ranks(missing)}); "
            "on several hosts --checkpoint-dir must be a directory every rank sees (a shared filesystem); copy the "
            f"missing files in, or {_INTACT}"
        )
    short = {f: (path / f).stat().st_size for f in sorted(ends) if (path / f).stat().st_size < ends[f]}
    if short:
        sizes = ", ".join(f"{f} has {n} bytes of {ends[f]}" for f, n in short.items())
        raise CheckpointError(
            f"sharded checkpoint {str(path)!r} has shard files cut short ({sizes}; {ranks(list(short))}) of the "
            f"{info.dp} ranks that wrote it: a copy that did not finish; copy them again, or {_INTACT}"
        )


def _plain(value: Any) -> Any:
    """``value`` as JSON reads it back (tuples become lists), so that policy.json compares with a live config."""
    return msgspec.json.decode(msgspec.json.encode(value))


def _model_config(saved: dict[str, Any]) -> dict[str, Any]:
    """policy.json's model config as ``Trainer.state()`` writes it (``msgspec.to_builtins`` of the
    model description: tuples where its fields are tuples); as read when it is no description."""
    from flowrl.graph.configs import AnyModelConfig

    try:
        return msgspec.to_builtins(msgspec.convert({"family": "builtin", **saved}, AnyModelConfig))
    except msgspec.ValidationError:
        return saved


def _expected(trainer: Any) -> dict[str, tuple[int, ...]]:
    """``model.<name>`` -> global shape of what ``save_sharded`` writes for ``trainer``'s model."""
    params = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad] if trainer.lora else list(trainer.model.state_dict().items())
    return {f"model.{n}": tuple(p.shape) for n, p in params}


def _whole(trainer: Any) -> set[str]:
    """``model.<name>`` of every tensor a checkpoint of ``trainer``'s model description may hold: the whole
    model's (``meta_model``: a pipeline stage's trainer holds some of them only), its base weights too
    for a LoRA policy (a state written before ``_stored`` holds the tied head) and the adapters under
    peft's names."""
    from flowrl.errors import FlowrlError
    from flowrl.models.lora import adapter_shapes
    from flowrl.models.registry import meta_model

    names = {f"model.{n}" for n in trainer.model.state_dict()}
    try:
        names |= {f"model.{n}" for n in meta_model(trainer.node.model).state_dict()}
        if trainer.lora:
            names |= {f"model.{n.removesuffix('.weight')}.default.weight" for n in adapter_shapes(trainer.node.model)}
    except FlowrlError:  # no description to build (a test's bare trainer): this rank's names only
        pass
    return names


def check_complete(path: str | Path) -> ShardedStateInfo:
    """The info of a whole sharded state whose every shard file is there (``CheckpointWriter.commit``
    checks it before a checkpoint is committed).

    Raises:
        CheckpointError: incomplete, or missing a rank's shard file (naming the fix).
    """
    return _info(Path(path))[0]


def check_sharded(path: str | Path, trainer: Any) -> ShardedStateInfo:
    """Refuse, before any work, a sharded state that ``trainer`` cannot load on its dp size.

    Any dp size reads any other's (DCP reshards); what cannot be resharded is a state that is
    incomplete, lacks a rank's shard file, or was saved from another model.

    Raises:
        CheckpointError: naming the checkpoint, what differs and the fix.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"sharded checkpoint {str(path)!r} does not exist on this rank's host; every rank of a sharded policy reads "
            "its shards there, so on several hosts --checkpoint-dir must be a directory every rank sees (a shared filesystem)"
        )
    info, metadata = _info(path)
    saved = _plain({"family": "builtin", **info.model_config})
    mine = _plain(msgspec.to_builtins(trainer.node.model))
    if saved != mine:
        diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
        raise CheckpointError(
            f"policy {trainer.name!r}: sharded checkpoint {str(path)!r} holds a model with a different config (saved, now): {diff}; "
            "resume with the model description that wrote it (or export it with flowrl export and start a new run from that directory)"
        )
    have = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if k.startswith("model.") and hasattr(v, "size")}
    want = _expected(trainer)
    wrong = sorted(k for k in want if have.get(k) != want[k])
    extra = sorted(set(have) - set(want) - _whole(trainer))  # another rank's (a pipeline stage's), or a LoRA state's tied head
    if wrong or extra:
        shown = {k.removeprefix("model."): (have.get(k), want[k]) for k in wrong[:3]}
        more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
        lacks = f"; tensors this model lacks: {[k.removeprefix('model.') for k in extra[:3]]}" if extra else ""
        raise CheckpointError(
            f"policy {trainer.name!r}: sharded checkpoint {str(path)!r} ({_layout(info)}) cannot be resharded into this policy: "
            f"tensors (saved shape, now) {shown}{more}{lacks}; resume with the model that wrote it"
        )
    return info


def load_sharded(trainer: Any, path: str | Path, *, group: Any) -> None:
    """Load a sharded state into ``trainer`` sharded over ``group`` (any dp size). Every rank calls it;
    each reads only the saved chunks that overlap its rows.

    Raises:
        CheckpointError: see ``check_sharded``, before any tensor is read; on every rank, when any
            rank's check fails (one all-reduce of a flag first: a rank whose host lacks the
            checkpoint must not leave the others waiting in DCP's collectives).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    try:
        info, error = check_sharded(path, trainer), None
    except CheckpointError as exc:
        info, error = None, exc
    failed = torch.tensor([0.0 if error is None else 1.0], device=next(trainer.model.parameters()).device)
    dist.all_reduce(failed, group=group)  # how many of the policy's ranks cannot load it
    if error is not None:
        raise error
    if info is None or float(failed) > 0:
        raise CheckpointError(
            f"policy {trainer.name!r}: {int(failed)} other rank(s) of the policy cannot load sharded checkpoint {str(path)!r} "
            "(their errors say why; a folder on one host only: --checkpoint-dir must be a directory every rank sees)"
        )
    options = _options(trainer)
    model, optimizer = get_state_dict(trainer.model, trainer.optimizer, options=options)  # this rank's shards, to load into
    state = {"model": _stored(trainer, model), "optimizer": optimizer}
    own = [list(g["params"]) for g in optimizer.get("param_groups", [])]
    _collective("loading the sharded checkpoint", Path(path), lambda: dcp.load(state, storage_reader=_reader(Path(path)), process_group=group))
    for loaded, names in zip(state["optimizer"].get("param_groups", []), own):  # the saved groups name the whole model's (_whole_groups)
        loaded["params"] = names
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options)
    trainer.version = info.version
    if info.version == 0:  # saved before the first step: AdamW had no state (save_sharded), and has none now
        trainer.optimizer.state.clear()


# -- reading: the whole state in one process -------------------------------------------------------------
def _set_path(root: dict[str, Any], keys: tuple[Any, ...], value: Any) -> None:
    """``root[k0][k1]... = value``, making dicts, and lists where the next key is an int."""
    node: Any = root
    for key, after in zip(keys[:-1], keys[1:]):
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
        fresh: Any = [] if isinstance(after, int) else {}
        if (node[key] if isinstance(node, list) else node.get(key)) is None:
            node[key] = fresh
        node = node[key]
    if isinstance(node, list):
        while len(node) <= keys[-1]:
            node.append(None)
    node[keys[-1]] = value


def _consolidated(path: Path, *, parts: tuple[str, ...] = ("model", "optimizer")) -> dict[str, Any]:
    """Every tensor of a sharded state whole, in its saved structure (``{"model": ..., "optimizer": ...}``),
    of the top-level ``parts`` only (the others are not read)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _read_metadata(path)
    state: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        keys = tuple(metadata.planner_data.get(key, (key,)))
        if keys[0] not in parts:
            continue
        value = torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata) else None
        _set_path(state, keys, value)
    with warnings.catch_warnings():  # DCP warns that no process group is in use: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=_reader(path), no_dist=True)
    return state


def _one_file_optimizer(saved: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """``get_state_dict``'s optimizer state (by parameter name) as ``optimizer.state_dict()`` (by index:
    the parameters in their groups' order, as torch numbers them)."""
    groups = [dict(g) for g in saved.get("param_groups", [])]
    index: dict[str, int] = {}
    for group in groups:
        names = list(group["params"])
        group["params"] = [index.setdefault(n, len(index)) for n in names]
    state = dict(saved.get("state", {}))
    unnamed = sorted(set(state) - set(index))
    if unnamed:
        raise CheckpointError(
            f"sharded checkpoint {str(path)!r} holds optimizer state for {unnamed[:3]} ({len(unnamed)} parameters) that its "
            "param_groups do not list: its writer saved one rank's groups only (save_sharded writes the whole model's); "
            "it cannot be read as one optimizer"
        )
    return {"state": {index[name]: dict(entry) for name, entry in state.items()}, "param_groups": groups}


def read_state(path: str | Path, *, optimizer: bool = True) -> dict[str, Any]:
    """A policy state in the one-file format (``Trainer.state()``), from a ``.pt`` file or a sharded
    directory of any layout (consolidated here, in this process, with no process group; it holds the
    whole state). ``optimizer=False``: without the ``optimizer`` entry, whose tensors are then not read
    (an export needs the weights only: AdamW's moments are twice their size).

    Raises:
        CheckpointError: an incomplete sharded state, one missing a shard file or with one cut short, or
            one whose optimizer state its param groups do not name (any error reading a file propagates
            as torch raises it).
    """
    from flowrl.models.lora import adapter_name, is_adapter

    p = Path(path)
    if not p.is_dir():
        if optimizer:
            return torch.load(p, map_location="cpu", weights_only=True)
        state = torch.load(p, map_location="cpu", weights_only=True, mmap=True)  # mapped: the optimizer's tensors are never read
        if isinstance(state, dict):
            state.pop("optimizer", None)
        return state
    info, _ = _info(p)
    saved = _consolidated(p, parts=("model", "optimizer") if optimizer else ("model",))
    model = dict(saved.get("model", {}))
    if info.lora:  # the one-file format names a LoRA policy's adapters as adapter_weights does; a frozen
        model = {adapter_name(n): t for n, t in model.items() if is_adapter(n)}  # base weight (the tied head, before _stored) is the description's
    state = {"version": info.version, "model_config": _model_config(info.model_config), "model": model}
    if optimizer:
        state["optimizer"] = _one_file_optimizer(saved.get("optimizer", {}), p)
        if info.version == 0:  # saved before the first step: AdamW had no state (see save_sharded)
            state["optimizer"]["state"] = {}
    return state
