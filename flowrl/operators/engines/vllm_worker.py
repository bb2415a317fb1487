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
        return len(weights)
