"""Models and tokenizers behind a node: the built-in transformer or a Hugging Face causal LM.

A node's model description (``flowrl.graph.configs.ModelConfig`` or ``HFModelConfig``) is plain
data; this package turns it into what the operators need. ``transformers`` is an optional extra
(``pip install 'flowrl[hf]'``), imported only when a Hugging Face model is built.
"""

from flowrl.models.local import require_transformers, resolve_local_dir
from flowrl.models.tokenizer import load_tokenizer

__all__ = ["load_tokenizer", "require_transformers", "resolve_local_dir"]
