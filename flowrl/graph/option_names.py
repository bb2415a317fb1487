"""Option names users bring from elsewhere (TRL's ``GRPOConfig``), and where flowrl keeps each option.

``GraphBuilder`` reports a keyword argument that no field of a node's config takes; this module
says what the user most likely meant: flowrl's name for a TRL option (``num_generations`` ->
``n_samples``), the node method that takes an option given to the wrong one (``temperature`` on
``b.loss`` -> ``b.generator``), or a close spelling. The "Coming from TRL" table (docs/trl.md) is the
same mapping, for reading.

Example:
    >>> option_hint("loss", "num_generations")
    "'num_generations' is TRL's name: did you mean n_samples? It is an option of b.generator(...)"
    >>> option_hint("generator", "n_smaples")
    "did you mean 'n_samples'?"
"""

from __future__ import annotations

import difflib

import msgspec

from flowrl.graph.configs import LossConfig, OptimizerConfig, ReferenceConfig, SamplingConfig, SourceConfig
from flowrl.graph.engines import VLLMConfig

__all__ = [
    "TRL_OPTIONS", "TRL_NOTES", "OPTION_OWNERS", "REFERENCE_SYNC_OPTIONS", "option_fields", "option_hint", "leftover_message",
    "reference_options",
]  # fmt: skip

#: Which builder method takes the fields of which configs (a generator: its sampling, and vLLM's settings).
OPTION_OWNERS: dict[str, tuple[type[msgspec.Struct], ...]] = {
    "source": (SourceConfig,),
    "generator": (SamplingConfig, VLLMConfig),
    "loss": (LossConfig,),
    "policy": (OptimizerConfig,),
    "reference": (ReferenceConfig,),
    "critic": (OptimizerConfig,),
}


def option_fields(kind: str) -> tuple[str, ...]:
    """The option names builder method ``kind`` takes from its configs (none for a method without one).

    Example:
        >>> "gpu_memory_utilization" in option_fields("generator"), option_fields("nope")
        (True, ())
    """
    return tuple(f for cls in OPTION_OWNERS.get(kind, ()) for f in cls.__struct_fields__)

#: TRL ``GRPOConfig`` option -> flowrl's option (a field of one of ``OPTION_OWNERS``' configs), or a
#: sentence where flowrl has no such option or keeps it elsewhere (a run flag, a node of its own).
TRL_OPTIONS: dict[str, str] = {
    "num_generations": "n_samples",
    "beta": "kl_coef",
    "max_completion_length": "max_new_tokens",
    "epsilon": "clip_eps",
    "learning_rate": "lr",
    "max_prompt_length": "max_prompt_len",
    "loss_type": "loss_agg",
    "epsilon_high": "clip_eps_high",
    "mask_truncated_completions": "mask_truncated_completions",
    "importance_sampling_level": "objective",
    "vllm_importance_sampling_cap": "correction",
    "vllm_gpu_memory_utilization": "gpu_memory_utilization",
    "vllm_tensor_parallel_size": (
        "a tp axis on the generator's torchrun mesh (a --plan) is vLLM's tensor_parallel_size: one engine per replica"
    ),
    "vllm_enable_sleep_mode": "flowrl run --offload (auto by default): a colocated vLLM generator sleeps while its trainer runs, on CUDA",
    "scale_rewards": "normalize_std",
    "max_grad_norm": "grad_clip",
    "lr_scheduler_type": "schedule",
    "per_device_train_batch_size": "micro_batch_size",
    "padding_free": "packing",  # SFTConfig's and DPOConfig's (flattened rows, per-sequence position ids)
    "generation_batch_size": "batch_size",
    "warmup_ratio": "warmup_steps",
    "adam_beta1": "betas",
    "adam_beta2": "betas",
    "gradient_accumulation_steps": (
        "flowrl accumulates gradients over the whole batch by itself: set micro_batch_size on b.policy(...)"
    ),
    "bf16": "set autocast='bfloat16' on b.policy(...) and precision='bfloat16' on b.generator(...)",
    "peft_config": "LoRA is lora=dict(r=, alpha=, target_modules=) on b.policy(...) (a Hugging Face model; pip install 'flowrl[lora]')",
    "max_steps": "the number of steps is the run's: flowrl run --steps N (RunConfig.steps)",
    "num_train_epochs": "the number of steps is the run's: flowrl run --steps N (RunConfig.steps); a prompt file repeats in new seeded orders",
    "save_steps": "checkpoints are the run's: flowrl run --checkpoint-every N",
    "save_total_limit": "checkpoints are the run's: flowrl run --keep-checkpoints N",
    "reward_funcs": "declare one b.scorer(...) per reward function and pass them all to b.loss(...)",
    "num_iterations": "num_iterations",
    "steps_per_generation": "num_mini_batches",
    "sync_ref_model": (
        "a reference syncs when given sync_steps=N (> 0) on b.reference(...) (TRL's ref_model_sync_steps; "
        "sync_alpha is ref_model_mixup_alpha), fed the policy's weights by b.weights(policy, ref)"
    ),
    "ref_model_sync_steps": "sync_steps",
    "ref_model_mixup_alpha": "sync_alpha",
    "lora_dropout": "LoRA's dropout is lora=dict(..., dropout=) on b.policy(...)",
}

#: The options, TRL's and flowrl's, that sync a reference node with its policy.
REFERENCE_SYNC_OPTIONS: frozenset[str] = frozenset(
    {"sync_ref_model", "ref_model_sync_steps", "ref_model_mixup_alpha", *ReferenceConfig.__struct_fields__}
)


#: What a TRL option's flowrl counterpart needs besides its name (appended to the hint).
TRL_NOTES: dict[str, str] = {
    "loss_type": (
        "TRL's grpo is loss_agg='seq_mean', bnpo and dapo are 'token_mean', dr_grpo is 'dr_grpo'; "
        "the objective itself (aipo, grpo, gspo, cispo, sapo, dppo, tis, mis, pg, ...) is objective="
    ),
    "importance_sampling_level": "'sequence' is objective='gspo' (or is_level='sequence' with objective='tis' / 'mis')",
    "vllm_importance_sampling_cap": (
        "TRL's truncated IS correction is correction={'kind': 'tis', 'cap': C} on b.loss, on any objective that does not "
        "correct already (objective='tis' with cap rho is the same on plain pg)"
    ),
    "steps_per_generation": "a batch of P prompts splits into num_mini_batches mini-batches of whole prompt groups, one optimizer step each",
    "ref_model_sync_steps": (
        "flowrl counts trainer steps (batches) where TRL counts optimizer steps: with U updates per batch, TRL's N is N / U here; "
        "the reference also needs the policy's weights: b.weights(policy, ref)"
    ),
}


def _owner_of(option: str) -> str | None:
    """The builder method whose config has a field called ``option``."""
    return next((kind for kind in OPTION_OWNERS if option in option_fields(kind)), None)


def _where(kind: str, option: str) -> str:
    owner = _owner_of(option)
    return "" if owner in (None, kind) else f" It is an option of b.{owner}(...)"


def option_hint(kind: str, option: str) -> str:
    """What ``option``, which no field of ``kind``'s config takes, most likely meant; "" when nothing fits."""
    if option in TRL_OPTIONS and TRL_OPTIONS[option] != option:  # the same name: only its owner can be wrong
        target = TRL_OPTIONS[option]
        if _owner_of(target) is None:  # a sentence, not a field
            return f"{option!r} is TRL's name: {target}"
        note = f" ({TRL_NOTES[option]})" if option in TRL_NOTES else ""
        return f"{option!r} is TRL's name: did you mean {target}?{note}{_where(kind, target)}"
    owner = _owner_of(option)
    if owner is not None:
        return f"{option!r} is an option of b.{owner}(...), not of b.{kind}(...)"
    fields = [f for kind in OPTION_OWNERS for f in option_fields(kind)]
    close = difflib.get_close_matches(option, fields, n=1)
    if close:
        return f"did you mean {close[0]!r}?{_where(kind, close[0])}"
    return ""


def reference_options(options: dict[str, object] | list[str]) -> list[str]:
    """The options among ``options`` that sync a reference node (``REFERENCE_SYNC_OPTIONS``), sorted."""
    return sorted(o for o in options if o in REFERENCE_SYNC_OPTIONS)


def leftover_message(kind: str, name: str, options: list[str]) -> str:
    """The error for keyword arguments ``options`` that node ``name`` of ``kind`` does not take."""
    known = sorted(option_fields(kind))
    hints = [h for h in (option_hint(kind, o) for o in sorted(options)) if h]
    text = f"{kind} {name!r}: unknown option(s) {sorted(options)}"
    if hints:
        text += "; " + "; ".join(hints)
    if known:
        text += f". b.{kind}(...) takes {', '.join(known)}"
    return text
