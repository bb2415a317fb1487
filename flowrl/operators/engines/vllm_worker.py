"""The vLLM worker extension flowrl's vLLM engine installs: named methods vLLM's workers run on request.

vLLM mixes ``FlowrlWorkerExtension`` into each of its workers (``LLM(worker_extension_cls=...)``),
in the worker's own process; ``LLM.collective_rpc("flowrl_receive_weights", args=(plan,))`` calls
the method there by name. Arguments cross the process boundary as plain data (addresses, names,
shapes, dtype names, a path), never as pickled callables (which vLLM allows only with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``) or tensors (which its message encoding turns into lists).

Weights reach the workers one of two ways (``flowrl.operators.engines.vllm_sync`` is the sender):

- over the **weight-sync group**: a process group outside both default worlds, formed once by
  ``flowrl_join_weight_group`` between the sender (rank 0: the generator's process, or on the direct
  route the policy's sending rank, ``vllm_direct``) and every worker (rank ``1 + worker rank``; on
  the direct route into several engines, engine ``i``'s workers from its own first rank on), with
  vLLM's ``stateless_init_torch_distributed_process_group``. ``flowrl_receive_weights``
  then takes the buckets the sender broadcasts, tensor by tensor, into views of buffers the worker
  keeps (``bucket_views``, ``_BufferPool``), a receiving thread handing each tensor to vLLM as it
  arrives, so vLLM loads one layer while the next ones arrive;
- from a **safetensors file** (``flowrl_load_weights``), when the weight edge's transport is ``file``.

Either way vLLM's ``reload_weights`` loads them: it runs the model's own ``load_weights`` (fusing
q/k/v and gate/up, sharding over vLLM's tensor-parallel workers) and then the post-load processing
(on a CPU the repacking into kernel layouts), which a direct ``load_weights`` would skip. Layer by
layer it copies the tensors into fresh parameters and, on a CPU, packs each linear layer's weight
into a new oneDNN handle: the packed weights are the kernel's own copy, so an in-place copy into
vLLM's parameters would leave the kernels computing with the old ones (the parameters are empty
after packing); that repacking is most of a group update's time on a CPU (benches/RESULTS.md).
A mixture of experts' fused experts are packed likewise on a CPU, but vLLM (0.32) skips their
packing on a reload; ``_CpuMoePrepack`` has each reload pack them as the first load did.

This module is imported inside vLLM's worker process: it imports nothing of flowrl and no
torch or vLLM at the top.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["FlowrlWorkerExtension", "WORKER_EXTENSION", "BucketPlan", "bucket_views", "bucket_nbytes"]

#: What ``LLM(worker_extension_cls=...)`` is given (vLLM resolves a dotted qualified name).
WORKER_EXTENSION = "flowrl.operators.engines.vllm_worker.FlowrlWorkerExtension"

#: A sync's plan as plain data: per bucket, its tensors in order as ``(name, shape, dtype name)``;
#: each tensor is one broadcast (no packing copy at the sender), received into a view of one buffer
#: per bucket (``bucket_views``).
BucketPlan = list[list[tuple[str, list[int], str]]]

#: Buckets in flight on a worker: the one vLLM is loading and the one being received.
_AHEAD = 2

#: Each tensor of a received bucket starts at a multiple of this many bytes (a cache line; any dtype's size).
_ALIGN = 64


class FlowrlWorkerExtension:
    """Methods mixed into a vLLM worker (``self`` is the worker: ``reload_weights``, ``model_runner``, ``rank``)."""

    def flowrl_join_weight_group(self: Any, host: str, port: int, world: int, backend: str, timeout_s: float, first: int = 1) -> int:
        """Join the weight-sync group as rank ``first + self.rank`` (the sender is rank 0; ``first``:
        this engine's first rank, 1 unless several engines share the group); blocks until every member
        has joined. Returns this worker's rank in the group."""
        from datetime import timedelta

        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        rank = int(first) + int(self.rank)
        self._flowrl_group = stateless_init_torch_distributed_process_group(
            host, port, rank, world, backend, timeout=timedelta(seconds=timeout_s)
        )
        self._flowrl_group_device = self.device if backend == "nccl" else "cpu"  # gloo moves CPU tensors
        return rank

    def flowrl_receive_weights(self: Any, plan: BucketPlan) -> dict[str, float]:
        """Receive the buckets of ``plan`` from rank 0 of the weight-sync group and load them in place.

        A receiving thread takes each bucket into one buffer (``bucket_views``: every tensor a view
        of it) and hands each tensor to vLLM's ``reload_weights`` as soon as its broadcast completes:
        vLLM loads (and on a CPU repacks) a layer while the next tensors arrive, from the first tensor
        on, and at most ``_AHEAD`` buckets are in flight. The buffers are the worker's own, kept from
        one bucket and one update to the next (``_BufferPool``): memory received into is memory
        touched before (a fresh buffer's every page is a page fault, about as costly here as the
        receive itself).

        Returns:
            ``loaded``: the number of tensors loaded; ``seconds``: the whole call; ``waited_s``: of
            it, the time vLLM's reload waited for a tensor to arrive (near ``seconds``: the wire is
            the bottleneck; near 0: the reload is); ``wire_s``: until the last tensor had arrived;
            ``reload_s``: vLLM's ``reload_weights``; ``faults``: the worker's minor page faults in the
            call (memory touched for the first time: vLLM's repacking, and any new buffer);
            ``new_buffers``: bucket buffers allocated (0 once the kept ones are reused).
        """
        import resource
        import time

        start = time.perf_counter()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buffers = self.__dict__.get("_flowrl_buffers")
        if buffers is None or buffers.device != self._flowrl_group_device:  # kept while the group's device stays
            buffers = self._flowrl_buffers = _BufferPool(self._flowrl_group_device)
        allocated = buffers.allocated
        stream = _BucketStream(self._flowrl_group, buffers, plan)
        model = self.model_runner.get_model()
        _quiet_expected_reload_warnings(model)
        stream.start()
        try:
            t0 = time.perf_counter()
            with _CpuMoePrepack(model):
                self.reload_weights(weights_iterator=stream.tensors())
            reload_s = time.perf_counter() - t0
        finally:  # after a failure keep receiving what the sender sends, so that it is not left blocked
            stream.drain()
        _refresh_tied_lm_head(self.model_runner.get_model())
        return {
            "loaded": stream.loaded, "seconds": time.perf_counter() - start, "waited_s": stream.waited_s,
            "wire_s": stream.wire_s, "reload_s": reload_s, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
            "new_buffers": buffers.allocated - allocated,
        }

    def flowrl_load_weights(self: Any, path: str) -> int:
        """Load the safetensors file at ``path`` (Hugging Face names, the whole model) in place.

        Returns:
            The number of tensors loaded.
        """
        from safetensors.torch import load_file

        weights = load_file(path)
        model = self.model_runner.get_model()
        _quiet_expected_reload_warnings(model)
        with _CpuMoePrepack(model):
            self.reload_weights(weights_iterator=iter(weights.items()))
        _refresh_tied_lm_head(self.model_runner.get_model())
        return len(weights)

    def flowrl_leave_weight_group(self: Any) -> bool:
        """Shut the weight-sync group down (idempotent)."""
        group = self.__dict__.pop("_flowrl_group", None)
        self.__dict__.pop("_flowrl_buffers", None)
        if group is not None:
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

            stateless_destroy_torch_distributed_process_group(group)
        return group is not None


    def flowrl_weight_digests(self: Any) -> dict[str, Any]:
        """SHA-256 of every weight vLLM computes with, by vLLM's names (fused ``qkv_proj`` and
        ``gate_up_proj``, ``lm_head`` even when tied), in the worker's dtype: what a test or a bench
        compares with the policy's tensors (``expected_digests``), bit for bit.

        A linear layer's weight is read back through its kernel, not its parameter (on a CPU vLLM
        repacks it into the kernel's layout and leaves the parameter empty): ``quant_method.apply``
        on the identity matrix gives ``W^T`` exactly, every output one product by 1 plus zeros. A
        mixture of experts' fused ``w13_weight`` / ``w2_weight``, which vLLM's CPU kernel holds
        prepacked (a permutation) and padded, is read with the packing undone (``_unpacked_experts``).
        Other parameters (norms, embeddings, biases) are read as they are.

        With vLLM's tensor parallelism each worker reports its own shards (``tp_rank`` of ``tp_size``:
        its rows of column-parallel and vocabulary-parallel layers, its columns of row-parallel ones).

        Returns:
            ``{"digests": {name: sha256 hex}, "packed": the model's packed_modules_mapping,
            "tp_rank": int, "tp_size": int}`` (``packed``: which checkpoint projections each fused one
            concatenates, e.g. ``qkv_proj``).
        """
        import torch

        model = self.model_runner.get_model()
        out: dict[str, str] = {}
        with torch.no_grad():
            for name, module in model.named_modules():
                method = getattr(module, "quant_method", None)
                weight = getattr(module, "weight", None)
                if method is None or not hasattr(method, "apply") or weight is None or name.endswith("embed_tokens"):
                    continue
                cols = int(  # a replicated layer (a MoE router's GateLinear) has only input_size; its repacked weight may be empty
                    getattr(module, "input_size_per_partition", 0) or getattr(module, "input_size", 0) or getattr(module, "embedding_dim", 0) or weight.shape[-1]
                )
                eye = torch.eye(cols, dtype=weight.dtype, device=weight.device)
                w = method.apply(module, eye, bias=None).T  # [out, in]
                out[f"{name}.weight"] = _digest(w[: _vocab_rows(module, w)])
            orders: dict[tuple[Any, ...], Any] = {}  # _prepack_order's, by shape, dtype and ISA: every layer's experts share them
            for name, p in model.named_parameters():
                if p.numel() and name not in out:
                    path, _, leaf = name.rpartition(".")
                    owner = model.get_submodule(path)
                    t = _unpacked_experts(owner, leaf, p, orders)  # a CPU MoE kernel's experts as the checkpoint holds them
                    out[name] = _digest(t[: _vocab_rows(owner, t)])
        packed = {k: list(v) for k, v in dict(getattr(model, "packed_modules_mapping", {}) or {}).items()}
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return {"digests": out, "packed": packed, "tp_rank": int(get_tensor_model_parallel_rank()), "tp_size": int(get_tensor_model_parallel_world_size())}


def bucket_views(buffer: Any, bucket: list[tuple[str, list[int], str]]) -> list[tuple[str, Any]]:
    """The tensors of ``bucket`` (``(name, shape, dtype name)``) as views of ``buffer``, a flat uint8
    tensor of at least ``bucket_nbytes(bucket)`` bytes: each view contiguous, starting at a multiple of
    ``_ALIGN`` bytes, none overlapping another, in the bucket's order.

    Example:
        >>> import torch
        >>> b = [("a", [2], "float32"), ("b", [3], "bfloat16")]
        >>> [(n, t.dtype, t.data_ptr() % _ALIGN) for n, t in bucket_views(torch.empty(bucket_nbytes(b), dtype=torch.uint8), b)]
        [('a', torch.float32, 0), ('b', torch.bfloat16, 0)]
    """
    import torch

    out, offset = [], 0
    base = -buffer.data_ptr() % _ALIGN  # the first aligned byte of the buffer
    for name, shape, dtype in bucket:
        dt = getattr(torch, dtype)
        n = _nbytes(shape, dt)
        out.append((name, buffer[base + offset : base + offset + n].view(dt).view(shape)))
        offset += -(-n // _ALIGN) * _ALIGN
    return out


def bucket_nbytes(bucket: list[tuple[str, list[int], str]]) -> int:
    """Bytes of a buffer that holds ``bucket``'s tensors as ``bucket_views`` lays them out (each
    rounded up to ``_ALIGN``, plus room to align the first)."""
    import torch

    return _ALIGN + sum(-(-_nbytes(shape, getattr(torch, dtype)) // _ALIGN) * _ALIGN for _, shape, dtype in bucket)


def _nbytes(shape: list[int], dtype: Any) -> int:
    import math

    return math.prod(shape) * dtype.itemsize


class _BucketStream:
    """The receiving side of one sync: a thread that receives each bucket of ``plan`` into a buffer
    of ``buffers`` (``bucket_views``) and hands each tensor on as its broadcast completes.

    State: ``_items``, the tensors received and not yet taken (``None`` after a bucket's last; an
    exception if receiving failed); ``_slots``, buckets that may still be allocated (``_AHEAD`` at
    first: the thread takes one per bucket, ``tensors`` gives it back when it has handed on a
    bucket's last tensor), so at most ``_AHEAD`` buckets are being received or loaded at once (a view
    vLLM keeps for a layer not yet complete keeps its buffer from reuse a little longer).
    """

    def __init__(self, group: Any, buffers: _BufferPool, plan: BucketPlan) -> None:
        self.group, self.buffers, self.plan = group, buffers, plan
        self.loaded, self.waited_s, self.wire_s = 0, 0.0, 0.0
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._slots = threading.Semaphore(_AHEAD)
        self._thread = threading.Thread(target=self._receive, name="flowrl-weight-receive", daemon=True)

    def start(self) -> None:
        import time

        self._start = time.perf_counter()
        self._thread.start()

    def _receive(self) -> None:  # the group's own broadcast: the group is not in torch's world map
        import time

        try:
            for bucket in self.plan:
                self._slots.acquire()
                views = bucket_views(self.buffers.take(bucket_nbytes(bucket)), bucket)
                works = [self.group.broadcast(t, 0) for _, t in views]  # all posted: gloo receives them in order
                for work in works:
                    work.wait()
                    self._items.put(views.pop(0))
                self._items.put(None)
            self.wire_s = time.perf_counter() - self._start
        except BaseException as exc:  # handed to the loading thread, which raises it
            self._items.put(exc)

    def tensors(self) -> Iterator[tuple[str, Any]]:
        """Each received ``(name, tensor)`` in the plan's order, as it arrives."""
        import time

        for _ in self.plan:
            while True:
                t0 = time.perf_counter()
                item = self._items.get()
                self.waited_s += time.perf_counter() - t0
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    self._slots.release()
                    break
                self.loaded += 1
                yield item
                del item

    def drain(self) -> None:
        """Take (and drop) what is still arriving until the thread ends: after a failed load the
        sender's broadcasts still complete, so the sender is not left blocked."""
        while self._thread.is_alive():
            try:
                if self._items.get(timeout=0.05) is None:
                    self._slots.release()
            except queue.Empty:
                pass
        self._thread.join()


class _BufferPool:
    """Flat uint8 buffers on ``device`` that buckets are received into, kept from one update to the next.

    ``take(nbytes)`` gives a kept buffer that holds ``nbytes`` and that nothing else refers to: no
    view of it is alive (its storage's use count is the one it had alone), so neither the receiving
    thread nor vLLM still reads a bucket in it; vLLM keeps a layer's tensors until the layer is complete
    (a layer whose tensors straddle two buckets) or, for a layer it never fills, until the reload ends.
    Otherwise it allocates one, kept in place of an unused smaller one while ``_AHEAD + 1`` are
    kept: the bucket vLLM loads, the one being received, and the one before, which a layer straddling
    two buckets still holds when the next is taken (memory: ``_AHEAD + 1`` buckets beside the model,
    from one update to the next; a buffer taken beyond those is freed when its views die).
    """

    def __init__(self, device: Any) -> None:
        self.device = device
        self.allocated = 0  # buffers allocated so far (kept or not)
        self._kept: list[tuple[Any, int]] = []  # (buffer, its storage's use count with no view alive)

    def take(self, nbytes: int) -> Any:
        import torch

        for buffer, alone in self._kept:
            if buffer.numel() >= nbytes and _unused(buffer, alone):
                return buffer
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.allocated += 1
        entry = (buffer, _use_count(buffer))
        unused = [i for i, (b, alone) in enumerate(self._kept) if _unused(b, alone)]
        if len(self._kept) < _AHEAD + 1:
            self._kept.append(entry)
        elif unused:
            self._kept[unused[0]] = entry
        return buffer


def _unused(buffer: Any, alone: int) -> bool:
    """Whether no view of ``buffer`` is alive (never, where torch cannot count: then nothing is reused)."""
    return alone > 0 and _use_count(buffer) == alone


def _use_count(t: Any) -> int:
    """How many tensors (views included) share ``t``'s storage, plus one for the storage object asked;
    -1 where this torch has no such count."""
    import torch

    count = getattr(torch._C, "_storage_Use_Count", None)
    return -1 if count is None else int(count(t.untyped_storage()._cdata))


class _ExpectedReloadWarnings:
    """A filter for vLLM's layer-wise reload logger: drops "<Layer>: Failed to load weights" for the
    layers a reload never carries weights for, where vLLM then keeps the layer's kernel tensors as it
    should: ``RotaryEmbedding`` (its cos/sin table is computed, not a checkpoint tensor) and, with tied
    embeddings, ``ParallelLMHead`` (the embedding carries the weight; ``_refresh_tied_lm_head`` packs
    it again). Any other layer's warning still shows: that one means a weight did not arrive."""

    def __init__(self, layers: frozenset[str]) -> None:
        self.layers = layers

    def filter(self, record: Any) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == "%s: Failed to load weights" and args and args[0] in self.layers)


def _quiet_expected_reload_warnings(model: Any) -> None:
    import logging

    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if any(isinstance(f, _ExpectedReloadWarnings) for f in log.filters):
        return
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    tied = head is not None and embed is not None and getattr(head, "weight", None) is getattr(embed, "weight", None)
    log.addFilter(_ExpectedReloadWarnings(frozenset({"RotaryEmbedding", *(("ParallelLMHead",) if tied else ())})))


def _vocab_rows(module: Any, t: Any) -> int:
    """Rows of ``t`` that are the model's: vLLM pads a vocabulary-parallel embedding or head to a
    multiple of its tile, per tensor-parallel shard (the shard's first ``num_org_elements`` rows are
    the checkpoint's; without tensor parallelism that is ``org_vocab_size``)."""
    indices = getattr(module, "shard_indices", None)
    if indices is not None:
        return int(indices.num_org_elements)
    return int(getattr(module, "org_vocab_size", 0) or t.shape[0])


def _digest(t: Any) -> str:
    import hashlib

    import torch

    return hashlib.sha256(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _refresh_tied_lm_head(model: Any) -> None:
    """Rebuild a tied LM head's kernel from the embedding it shares.

    With tied embeddings the model's ``load_weights`` skips ``lm_head.weight`` (the embedding holds
    it), so the layer-wise reload loads nothing into the LM head and puts its old kernel tensors back;
    on a CPU the head's GEMM is a closure over a packed copy (oneDNN / sgl) of the weight made at
    load time, so logits kept coming from the first weights while the embedding moved on (mu !=
    pi: aipo/kl 0.023 at k = 0). Re-running the head's post-load processing packs the shared,
    updated weight again. Untied heads are reloaded (and repacked) like every other layer.
    """
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


def _cpu_prepacking_experts(layer: Any) -> Any:
    """The experts object of vLLM's CPU mixture-of-experts kernel that prepacks ``layer``'s fused experts
    (``w13_weight``, ``w2_weight``) into its grouped-GEMM layout (vLLM's ``CPUUnquantizedExperts`` and
    its per-ISA subclasses), or None: not a MoE layer, not on a CPU (a GPU's kernels are left as vLLM
    builds them), or a kernel that computes from the weights as loaded (ZenTorch's)."""
    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None:
        return None
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
        return None
    return experts


class _CpuMoePrepack:
    """While a reload runs, prepack each of vLLM's CPU mixture-of-experts layers as its first load did.

    vLLM (0.32) builds a MoE layer's kernel once: on its first load ``UnquantizedFusedMoEMethod._setup_kernel``
    hands the layer to the kernel's ``fused_experts.process_weights_after_loading``, which on a CPU
    (``experts/cpu_moe.py``, ``CPUUnquantizedExperts``) pads the experts' width to the kernel's tile and
    repacks ``w13_weight`` / ``w2_weight`` into its grouped-GEMM layout (``cpu_prepack_moe_weight``, a
    permutation of the elements). On a reload ``_setup_kernel`` sees the kernel built (``is_weight_update``)
    and skips that step, so the layer-wise reload copies the checkpoint-layout experts into tensors the
    kernel reads as packed: the samples came from scrambled experts (``|mu - log pi|`` up to 1.69).

    Inside this context each such layer's quant method, after vLLM's own post-load processing of the
    materialised layer, runs the kernel's ``process_weights_after_loading`` unless vLLM ran it itself (a
    vLLM that fixes this is left alone) or the weights came pre-processed; the layer-wise reload then
    copies the padded, packed experts into the kernel's tensors, as for any layer. Only the methods'
    instance attributes are set, and removed on exit.
    """

    def __init__(self, model: Any) -> None:
        self.layers = [(layer.quant_method, experts) for layer in model.modules() if (experts := _cpu_prepacking_experts(layer)) is not None]

    def __enter__(self) -> _CpuMoePrepack:
        if self.layers:
            from vllm.model_executor.utils import is_weights_pre_processed

            for method, experts in self.layers:
                method.process_weights_after_loading = _prepacking(method.process_weights_after_loading, experts, is_weights_pre_processed)
        return self

    def __exit__(self, *exc: object) -> None:
        for method, experts in self.layers:
            method.__dict__.pop("process_weights_after_loading", None)
            experts.__dict__.pop("process_weights_after_loading", None)


def _prepacking(process: Callable[[Any], None], experts: Any, pre_processed: Callable[[], bool]) -> Callable[[Any], None]:
    """``process`` (a MoE quant method's ``process_weights_after_loading``), then ``experts``' prepacking
    of the layer unless ``process`` ran it or the weights came in the kernel's format (``pre_processed()``)."""
    prepack = type(experts).process_weights_after_loading.__get__(experts)
    ran: list[Any] = []

    def counted(layer: Any) -> None:
        ran.append(layer)
        prepack(layer)

    def process_and_prepack(layer: Any) -> None:
        ran.clear()
        experts.process_weights_after_loading = counted
        try:
            process(layer)
        finally:
            experts.__dict__.pop("process_weights_after_loading", None)
        if not ran and not pre_processed():
            prepack(layer)

    return process_and_prepack


def _unpacked_experts(layer: Any, name: str, t: Any, orders: dict[tuple[Any, ...], Any]) -> Any:
    """``t``, the parameter ``name`` of ``layer``, in the checkpoint's layout: for the fused experts of a
    layer vLLM's CPU kernel prepacked (``_cpu_prepacking_experts``), the prepacking undone (the
    permutation read off the same op applied to the elements' indices; kept in ``orders`` for the next
    layer of the same shape) and the kernel's padding of the experts' width dropped; any other tensor as
    it is."""
    experts = _cpu_prepacking_experts(layer)
    if experts is None or name not in ("w13_weight", "w2_weight"):
        return t
    import torch

    key = (tuple(t.shape), t.dtype, experts.isa)
    if key not in orders:
        orders[key] = _prepack_order(t, experts.isa)
    order = orders[key]
    flat = torch.empty_like(t).reshape(-1)
    flat[order] = t.reshape(-1)
    w = flat.view(t.shape)
    width = int(experts.moe_config.intermediate_size_per_partition)
    if name == "w2_weight":
        return w[:, :, :width]
    padded = w.shape[1] // 2  # gate rows, then up rows, each padded to the kernel's tile
    return torch.cat([w[:, :width], w[:, padded : padded + width]], dim=1) if padded != width else w


def _prepack_order(t: Any, isa: str) -> Any:
    """Where vLLM's ``cpu_prepack_moe_weight`` (``isa``) takes each element of a tensor shaped and typed
    as ``t`` from: ``packed.reshape(-1) == weight.reshape(-1)[order]``. The op moves elements without
    computing on them, so packing the elements' indices gives the order; the indices go in base-256
    digits, which every float dtype holds exactly (bfloat16 up to 256)."""
    import torch
    from vllm._custom_ops import cpu_prepack_moe_weight

    n = t.numel()
    index = torch.arange(n, dtype=torch.int64)
    order = torch.zeros(n, dtype=torch.int64)
    scale = 1
    while scale < max(n, 2):
        digit = ((index // scale) % 256).to(t.dtype).view(t.shape)
        order += cpu_prepack_moe_weight(digit, isa).reshape(-1).to(torch.int64) * scale
        scale *= 256
    return order
