"""Models and tokenizers behind a node: the built-in transformer or a Hugging Face causal LM.

A node's model description (``flowrl.graph.configs.ModelConfig`` or ``HFModelConfig``) is plain
data; this package turns it into what the operators need. ``transformers`` is an optional extra
(``pip install 'flowrl[hf]'``), imported only when a Hugging Face model is built.

Modules: ``causal_lm`` (the interface the operators use), ``family`` (what a family is: its record
and its adapter's functions), ``families/`` (one module or folder per family and ``FAMILIES``, the
table of them: the built-in transformer and its tokenizer live in ``families/builtin/``),
``registry`` (``build_model`` and the other entry points over the table), ``hf`` (the Hugging Face
``CausalLM`` wrapper and directory checks), ``local`` and ``tokenizer`` (directory and tokenizer
checks), ``export`` (a checkpoint's policy as a Hugging Face directory), ``quantize`` (weight-only
int8/float8 linear layers for a quantized generator).
"""

from flowrl.models.causal_lm import CausalLM, weight_dict
from flowrl.models.families import FAMILIES
from flowrl.models.local import require_transformers, resolve_local_dir
from flowrl.models.registry import build_model, family_of, model_tokens
from flowrl.models.tokenizer import load_tokenizer

__all__ = [
    "CausalLM",
    "FAMILIES",
    "build_model",
    "family_of",
    "load_tokenizer",
    "model_tokens",
    "require_transformers",
    "resolve_local_dir",
    "weight_dict",
]
