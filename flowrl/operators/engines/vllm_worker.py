"""The vLLM worker extension flowrl's vLLM engine installs: named methods vLLM's workers run on request.

vLLM mixes ``FlowrlWorkerExtension`` into each of its workers (``LLM(worker_extension_cls=...)``),
in the worker's own process; ``LLM.collective_rpc("flowrl_load_weights", args=(path,))`` calls the
method there by name. Arguments cross the process boundary as plain data (a path), never as
pickled callables (which vLLM allows only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``) or
tensors (which its message encoding turns into lists).

This module is imported inside vLLM's worker process: it imports nothing of flowrl and no
torch or vLLM at the top.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FlowrlWorkerExtension", "WORKER_EXTENSION"]

#: What ``LLM(worker_extension_cls=...)`` is given (vLLM resolves a dotted qualified name).
WORKER_EXTENSION = "flowrl.operators.engines.vllm_worker.FlowrlWorkerExtension"


class FlowrlWorkerExtension:
    """Methods mixed into a vLLM worker (``self`` is the worker: ``reload_weights``, ``model_runner``)."""

    def flowrl_load_weights(self: Any, path: str) -> int:
        """Load the safetensors file at ``path`` (Hugging Face names, the whole model) into the
        worker's model in place, through vLLM's ``reload_weights``: it runs the model's own
        ``load_weights`` (fusing q/k/v and gate/up, sharding) and then the post-load processing
        (on a CPU the repacking into kernel layouts), which a direct ``load_weights`` would skip.

        Returns:
            The number of tensors loaded.
        """
        from safetensors.torch import load_file

        weights = load_file(path)
        self.reload_weights(weights_iterator=iter(weights.items()))
        _refresh_tied_lm_head(self.model_runner.get_model())
        return len(weights)


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
