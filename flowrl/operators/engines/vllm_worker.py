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
  then takes the buckets the sender broadcasts, tensor by tensor, a receiving thread filling bucket
  ``i + 1`` while vLLM loads bucket ``i``;
- from a **safetensors file** (``flowrl_load_weights``), when the weight edge's transport is ``file``.

Either way vLLM's ``reload_weights`` loads them: it runs the model's own ``load_weights`` (fusing
q/k/v and gate/up, sharding over vLLM's tensor-parallel workers) and then the post-load processing
(on a CPU the repacking into kernel layouts), which a direct ``load_weights`` would skip.

This module is imported inside vLLM's worker process: it imports nothing of flowrl and no
torch or vLLM at the top.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["FlowrlWorkerExtension", "WORKER_EXTENSION", "BucketPlan"]

#: What ``LLM(worker_extension_cls=...)`` is given (vLLM resolves a dotted qualified name).
WORKER_EXTENSION = "flowrl.operators.engines.vllm_worker.FlowrlWorkerExtension"

#: A sync's plan as plain data: per bucket, its tensors in order as ``(name, shape, dtype name)``;
#: each tensor is one broadcast, received into a tensor of its own (no packing on either side).
BucketPlan = list[list[tuple[str, list[int], str]]]

#: Buckets received ahead of the one vLLM is loading (memory: this many buckets at most in flight).
_AHEAD = 2


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

        Returns:
            ``loaded``: the number of tensors loaded; ``seconds``: the whole call; ``waited_s``: of
            it, the time vLLM's reload waited for a bucket to arrive (near ``seconds``: the wire is
            the bottleneck; near 0: the reload is).
        """
        import time

        import torch

        start = time.perf_counter()
        group = self._flowrl_group
        device = self._flowrl_group_device
        arrived: queue.Queue[Any] = queue.Queue(maxsize=_AHEAD)

        def receive() -> None:  # the group's own broadcast: the group is not in torch's world map
            try:
                for bucket in plan:
                    tensors = [(name, torch.empty(shape, dtype=getattr(torch, dtype), device=device)) for name, shape, dtype in bucket]
                    for work in [group.broadcast(t, 0) for _, t in tensors]:
                        work.wait()
                    arrived.put(tensors)
            except BaseException as exc:  # handed to the loading thread, which raises it
                arrived.put(exc)

        loaded, waited = 0, 0.0

        def tensors() -> Iterator[tuple[str, Any]]:
            nonlocal loaded, waited
            for _ in plan:
                t0 = time.perf_counter()
                bucket = arrived.get()
                waited += time.perf_counter() - t0
                if isinstance(bucket, BaseException):
                    raise bucket
                for item in bucket:
                    loaded += 1
                    yield item

        thread = threading.Thread(target=receive, name="flowrl-weight-receive", daemon=True)
        thread.start()
        _quiet_expected_reload_warnings(self.model_runner.get_model())
        try:
            self.reload_weights(weights_iterator=tensors())
        finally:  # after a failure keep receiving what the sender sends, so that it is not left blocked
            while thread.is_alive():
                try:
                    arrived.get(timeout=0.05)
                except queue.Empty:
                    pass
            thread.join()
        _refresh_tied_lm_head(self.model_runner.get_model())
        return {"loaded": loaded, "seconds": time.perf_counter() - start, "waited_s": waited}

    def flowrl_load_weights(self: Any, path: str) -> int:
        """Load the safetensors file at ``path`` (Hugging Face names, the whole model) in place.

        Returns:
            The number of tensors loaded.
        """
        from safetensors.torch import load_file

        weights = load_file(path)
        _quiet_expected_reload_warnings(self.model_runner.get_model())
        self.reload_weights(weights_iterator=iter(weights.items()))
        _refresh_tied_lm_head(self.model_runner.get_model())
        return len(weights)

    def flowrl_leave_weight_group(self: Any) -> bool:
        """Shut the weight-sync group down (idempotent)."""
        group = self.__dict__.pop("_flowrl_group", None)
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
        on the identity matrix gives ``W^T`` exactly, every output one product by 1 plus zeros. Other
        parameters (norms, embeddings, biases) are read as they are.

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
                cols = int(getattr(module, "input_size_per_partition", 0) or getattr(module, "embedding_dim", 0) or weight.shape[-1])
                eye = torch.eye(cols, dtype=weight.dtype, device=weight.device)
                w = method.apply(module, eye, bias=None).T  # [out, in]
                out[f"{name}.weight"] = _digest(w[: _vocab_rows(module, w)])
            for name, p in model.named_parameters():
                if p.numel() and name not in out:
                    owner = model.get_submodule(name.rpartition(".")[0])
                    out[name] = _digest(p[: _vocab_rows(owner, p)])
        packed = {k: list(v) for k, v in dict(getattr(model, "packed_modules_mapping", {}) or {}).items()}
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return {"digests": out, "packed": packed, "tp_rank": int(get_tensor_model_parallel_rank()), "tp_size": int(get_tensor_model_parallel_world_size())}


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
