"""A checkpoint's policy as a Hugging Face directory that ``AutoModelForCausalLM.from_pretrained`` loads.

``export_hf(source, out_dir)`` reads the policy state a checkpoint holds (``Trainer.state()``:
``model_config`` and ``model``) and writes weights (safetensors), ``config.json`` and the tokenizer.

- A Hugging Face policy is written with its own architecture, its directory's config and tokenizer.
- The built-in transformer is written as ``LlamaForCausalLM``: the mapping is exact (same RMSNorm in
  float32 with ``norm_eps``, the half-split rotary layout of transformers' ``rotate_half`` with the
  same ``rope_theta`` frequencies, SwiGLU ``down(silu(gate x) * up x)``, grouped-query attention
  scaled by ``1/sqrt(head_dim)``, tied embeddings as ``tie_word_embeddings``), so the logits agree to
  float rounding. Its character tokenizer is written as a ``tokenizers`` word-level tokenizer over
  single characters with the same ids.

- A LoRA policy is written merged (peft's ``merge_and_unload`` over its base model), or with
  ``adapter=True`` as a peft adapter directory.

A non-empty ``out_dir`` is refused unless ``overwrite=True``.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import msgspec
import torch

from flowrl.errors import CheckpointError, ConfigError
from flowrl.graph.configs import AnyModelConfig, HFModelConfig, ModelConfig
from flowrl.models.local import require_transformers
from flowrl.models.lora import lora_of, merged_model, save_adapter

__all__ = ["export_hf", "read_policy_state", "builtin_to_llama"]

_BUILTIN_TO_LLAMA = [
    (r"^tok_embeddings\.weight$", "model.embed_tokens.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^output\.weight$", "lm_head.weight"),
    (r"^layers\.(\d+)\.attention\.wq\.weight$", r"model.layers.\1.self_attn.q_proj.weight"),
    (r"^layers\.(\d+)\.attention\.wk\.weight$", r"model.layers.\1.self_attn.k_proj.weight"),
    (r"^layers\.(\d+)\.attention\.wv\.weight$", r"model.layers.\1.self_attn.v_proj.weight"),
    (r"^layers\.(\d+)\.attention\.wo\.weight$", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"^layers\.(\d+)\.feed_forward\.w1\.weight$", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"^layers\.(\d+)\.feed_forward\.w3\.weight$", r"model.layers.\1.mlp.up_proj.weight"),
    (r"^layers\.(\d+)\.feed_forward\.w2\.weight$", r"model.layers.\1.mlp.down_proj.weight"),
    (r"^layers\.(\d+)\.attention_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (r"^layers\.(\d+)\.ffn_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
]


def read_policy_state(source: str | Path, *, node: str | None = None) -> dict[str, Any]:
    """The policy state saved in a checkpoint: a ``step-*`` directory, or a run's checkpoint
    directory (its ``LATEST``).

    Raises:
        CheckpointError: when there is no checkpoint, no policy file, or several and ``node`` is unset.
    """
    from flowrl.runtime.checkpoint import latest_checkpoint

    path = Path(source).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist (pass a run's --checkpoint-dir or one step-* directory in it)")
    if not (path / "meta.json").is_file():
        latest = latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"{str(path)!r} holds no checkpoint (no meta.json, no LATEST)")
        path = latest
    files = sorted(path.glob("policy-*.pt"))
    names = [f.name.removeprefix("policy-").removesuffix(".pt") for f in files]
    if node is not None:
        if node not in names:
            raise CheckpointError(f"checkpoint {str(path)!r} has no policy {node!r} (it has {names})")
        files = [path / f"policy-{node}.pt"]
    if len(files) != 1:
        raise CheckpointError(f"checkpoint {str(path)!r} holds policies {names}; name one (--node)")
    state = torch.load(files[0], map_location="cpu", weights_only=True)
    if "model" not in state or "model_config" not in state:
        raise CheckpointError(f"{str(files[0])!r} is not a policy state (no 'model' or 'model_config')")
    return state


def builtin_to_llama(config: ModelConfig, state: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    """The ``LlamaConfig`` and the state dict (Llama names) of a built-in model."""
    transformers = require_transformers("exporting as LlamaForCausalLM")
    llama = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.hidden_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        for pattern, repl in _BUILTIN_TO_LLAMA:
            if re.match(pattern, name):
                out[re.sub(pattern, repl, name)] = t
                break
        else:
            raise ConfigError(f"built-in weight {name!r} has no Llama counterpart")
    return llama, out


def _builtin_tokenizer(out: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from flowrl.operators.tokenizer import DEFAULT_TOKENIZER as tok

    transformers = require_transformers("exporting a tokenizer")
    vocab = {t: i for i, t in enumerate(tok.tokens)}
    inner = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    inner.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(out))


def export_hf(
    source: str | Path | dict[str, Any], out_dir: str | Path, *, node: str | None = None, overwrite: bool = False, adapter: bool = False
) -> Path:
    """Write the policy of ``source`` as a Hugging Face directory at ``out_dir``.

    A LoRA policy (its model description has ``lora``) is written merged by default: its base model
    with peft's ``merge_and_unload`` of the adapters, a plain model; with ``adapter=True`` as a peft
    adapter directory (``PeftModel.from_pretrained(base, out_dir)``), ``flowrl.models.lora.save_adapter``.

    Args:
        source: a checkpoint directory (see ``read_policy_state``) or a ``Trainer.state()`` dict.
        out_dir: where to write; created if missing.
        node: the policy node, when the checkpoint holds several.
        overwrite: allow writing into a non-empty ``out_dir`` (its files of the same names are replaced).
        adapter: write a LoRA policy's adapters only (refused for a policy without ``lora``).

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ConfigError: for a non-empty ``out_dir`` without ``overwrite``, or a model that cannot be exported.
        CheckpointError: for a missing or unreadable checkpoint.
    """
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ConfigError(f"export: {str(out)!r} exists and is not an empty directory; pick another -o or pass --overwrite")
    state = source if isinstance(source, dict) else read_policy_state(source, node=node)
    try:
        config = msgspec.convert({"family": "builtin", **dict(state["model_config"])}, AnyModelConfig)
    except msgspec.ValidationError as exc:
        raise CheckpointError(f"export: the checkpoint's model_config is not a model description: {exc}") from None
    weights = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state["model"].items()}
    lora = lora_of(config)
    if adapter and lora is None:
        raise ConfigError(f"export: --adapter writes a LoRA policy's adapters, and this policy ({config.short()}) has no lora; drop --adapter")
    if adapter:
        assert isinstance(config, HFModelConfig)  # lora_of is None for the built-in family
        return save_adapter(weights, lora, out, base_model=config.path)
    transformers = require_transformers("flowrl export")
    transformers.utils.logging.disable_progress_bar()  # one line of output, not a bar per shard
    if lora is not None:
        model = merged_model(config, weights)
        hf_config, hf_state = model.config, None
    elif isinstance(config, ModelConfig):
        hf_config, hf_state = builtin_to_llama(config, weights)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(hf_config)
    else:
        assert isinstance(config, HFModelConfig)  # the tagged union has two members
        from flowrl.models.hf import check_hf_dir

        check_hf_dir(msgspec.structs.replace(config, init="random"), owner="export")  # config.json and family only
        hf_config = transformers.AutoConfig.from_pretrained(str(Path(config.path).expanduser()), local_files_only=True)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf_config)
        hf_state = weights
    if hf_state is not None:
        model.load_state_dict(hf_state, strict=False, assign=True)
    if hf_config.tie_word_embeddings:
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise CheckpointError(f"export: the checkpoint lacks weights {missing[:5]}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    if isinstance(config, ModelConfig):
        _builtin_tokenizer(out)
    else:
        from flowrl.models.tokenizer import load_tokenizer

        load_tokenizer(config.tokenizer_path, owner="export").save_pretrained(str(out))
        gen_cfg = Path(config.path).expanduser() / "generation_config.json"
        if gen_cfg.is_file():
            shutil.copyfile(gen_cfg, out / "generation_config.json")
    return out
