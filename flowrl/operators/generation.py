"""The generator node's operator: batched sampling from the behaviour policy mu, recording its log-probs.

For a batch of P left-padded prompts it draws ``n_samples`` completions per prompt (S = P * n rows,
sample ``s`` answers prompt ``s // n``), one token per step for up to ``max_new_tokens`` steps, with
the KV cache (or, to measure what the cache saves, a full forward pass per step). A row stops after
it emits a stop token (kept in the completion) or once its decoded completion contains one of
``sampling.stop_strings``; the loop ends when every row has stopped.

Any model family works through ``flowrl.models`` (``build_model``, ``model_tokens``): the built-in
transformer with the digit tokenizer, or a Hugging Face causal LM with its own tokenizer, whose
pad id pads completions and whose end ids (tokenizer, ``config.json``, ``generation_config.json``)
stop them, besides ``sampling.stop_tokens``. For the built-in model ``stop_tokens`` replaces the
default end token ``</s>``, as before.

What it records is exactly what AIPO needs as mu: the log-prob of each sampled token under the
distribution it was drawn from, i.e. ``log_softmax(logits / temperature)`` after top-k and top-p
truncation, renormalised over the kept tokens (``flowrl.operators.logprobs.kept_logprobs``), computed
in float32 from the generator's own weights (in ``sampling.precision``). The rollout records the
temperature, top-k and top-p (``sampling_temperature``, ``sampling_top_k``, ``sampling_top_p``, per
sample); ``completion_logprobs(..., temperature=T, top_k=k, top_p=p)`` of the same weights, which
the trainer uses for pi, evaluates the same distribution, so on-policy ratios are 1 up to float
rounding, with or without truncation.

Randomness: tokens are drawn by Gumbel-max from a private ``torch.Generator`` seeded per batch from
``(seed, prompt_index[0])``, so the same prompts with the same weights give the same completions,
whatever was generated before (a resumed run re-draws what it would have drawn), and the cached and
uncached paths consume the same random numbers.

Device: the model lives on ``device`` (``"cpu"``, ``"cuda:0"``, ...; the runtime picks it,
``flowrl.runtime.control.executor_placement.node_devices``). Prompts arrive as CPU tensors and are moved there; every
tensor of the rollout comes back on the CPU (channels, the process wire and scorers carry CPU
tensors). The sampling RNG is a ``torch.Generator`` on the device: on the CPU results are exactly
those of a generator built without a device; on CUDA the draws differ from the CPU's (another RNG)
but are just as reproducible on that device.

Quantized generator: with ``sampling.precision`` ``"int8"`` or ``"float8"`` the model's linear layers
are weight-only quantized (``flowrl.models.quantize``); ``weight_targets()`` stay the float weights,
and setting ``version`` (what every weight delivery does) re-quantizes from them. mu's log-probs
are then the quantized model's, which is what AIPO's ratio must divide by.

LoRA: a model description with ``lora`` builds the base model; ``weight_targets()`` are then the
adapters, and setting ``version`` merges them into the base weights (``flowrl.models.lora.LoraMerge``).

Weight version: ``version`` starts at 0 because a generator and a policy built from the same
``ModelConfig`` start from the same seeded weights (the policy's version 0); ``load_weights`` and the
runtime's transports set it when they copy newer weights in.

Example:
    >>> from flowrl.graph.nodes import GeneratorNode
    >>> from flowrl.graph.configs import ModelConfig, SamplingConfig
    >>> node = GeneratorNode(name="gen", model=ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=1),
    ...                      sampling=SamplingConfig(n_samples=2, max_new_tokens=3))
    >>> gen = Generator(node, seed=0)
    >>> out = gen.generate({"prompt_ids": torch.tensor([[1, 4, 14]]), "prompt_lens": torch.tensor([3]),
    ...                     "prompt_index": torch.tensor([0])})
    >>> out["completion_ids"].shape, out["group_ids"].tolist(), int(out["rollout_version"])
    (torch.Size([2, 3]), [0, 0], 0)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from flowrl.errors import ConfigError
from flowrl.graph.configs import SamplingConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.operators.batch import Batch
from flowrl.graph.configs import ModelConfig
from flowrl.models.causal_lm import weight_dict
from flowrl.models.lora import LoraMerge, lora_of
from flowrl.models.quantize import QUANTIZED_PRECISIONS, quantize_linears_
from flowrl.models.registry import build_model, model_tokens
from flowrl.models.routing import MoeShape, RoutingRecorder, expert_dtype, moe_shape, unrecorded
from flowrl.operators.logprobs import prompt_valid, truncated_log_softmax

__all__ = ["Generator", "DTYPES", "sampling_logprobs", "copy_weights", "rollout_batch", "check_recorded_sampling"]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sampling_logprobs(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """``log_softmax`` of ``logits / temperature`` after top-k and top-p truncation (-inf outside).

    The kept set and its renormalisation are ``flowrl.operators.logprobs.truncated_log_softmax``'s,
    the function the trainer evaluates pi with, so both sides truncate by one rule.

    Args:
        logits: ``[N, V]`` float32.
        sampling: temperature, top_k, top_p.

    Returns:
        ``[N, V]`` float32 log-probs of the distribution a token is drawn from.
    """
    return truncated_log_softmax(logits / sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)


@torch.no_grad()
def copy_weights(targets: Mapping[str, Tensor], state: Mapping[str, Tensor], *, owner: str) -> None:
    """Copy ``state`` into ``targets`` in place (casting dtype); the names must match exactly.

    Raises:
        ConfigError: naming missing and unexpected names, or a shape mismatch.
    """
    missing, unexpected = sorted(set(targets) - set(state)), sorted(set(state) - set(targets))
    if missing or unexpected:
        raise ConfigError(
            f"{owner}: weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}; "
            "are both sides built from the same ModelConfig?"
        )
    for name, target in targets.items():
        source = state[name]
        if source.shape != target.shape:
            raise ConfigError(f"{owner}: weight {name!r} has shape {tuple(source.shape)}, the model wants {tuple(target.shape)}")
        target.copy_(source)


@contextlib.contextmanager
def _no_recorder() -> Iterator[None]:
    """What ``_sample`` records with when it records no routing."""
    yield None


def _mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64-style), stable across runs and machines."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def rollout_batch(
    sample_ids: Tensor,
    sample_lens: Tensor,
    tokens: Tensor,
    mask: Tensor,
    logprobs: Tensor,
    versions: Tensor,
    prompt_index: Tensor,
    *,
    n: int,
    temperature: float,
    version: int,
    top_k: int,
    top_p: float,
) -> Batch:
    """The rollout fields (``flowrl.graph.fields.ROLLOUT_FIELDS``) of ``P = len(prompt_index)`` groups of
    ``n`` samples, in group order: what a lock-step batch and a continuous generator's finished groups
    both deliver. ``rollout_version`` is the oldest token's version (``versions.min()``), or
    ``version`` (the generator's) for a batch without samples. ``temperature``, ``top_k`` and ``top_p``
    are the sampling settings ``logprobs`` were drawn with (per-sample fields, so replicas' rollouts
    concatenate), which the trainer evaluates pi with. They have no defaults: a caller that forgot
    them would record an untruncated distribution for a truncated mu, and every on-policy ratio would
    be off by the kept mass (``exp(-0.05)`` at top-p 0.95); every engine says what it sampled with.
    """
    S = tokens.shape[0]
    return {
        "sample_prompt_ids": sample_ids,
        "sample_prompt_lens": sample_lens,
        "completion_ids": tokens,
        "completion_mask": mask,
        "completion_lens": mask.sum(1),
        "behaviour_logprobs": logprobs,
        "sampling_temperature": torch.full((S,), temperature, dtype=torch.float32),
        "sampling_top_k": torch.full((S,), top_k, dtype=torch.int64),
        "sampling_top_p": torch.full((S,), top_p, dtype=torch.float32),
        "group_ids": torch.arange(len(prompt_index), dtype=torch.int64).repeat_interleave(n),
        "rollout_version": versions.min() if versions.numel() else torch.tensor(version, dtype=torch.int64),
        "prompt_index": prompt_index,
        "token_versions": versions,
    }


def check_recorded_sampling(rollout: Mapping[str, Tensor], sampling: SamplingConfig, *, owner: str) -> None:
    """Refuse a rollout whose recorded ``sampling_temperature`` / ``sampling_top_k`` / ``sampling_top_p``
    are not the settings its generator samples with: the trainer evaluates pi with the recorded ones,
    so an engine that drew with top-p 0.95 and recorded 1.0 would make every on-policy ratio the kept
    mass instead of 1, silently. The generator program checks every batch of every engine.

    Raises:
        ConfigError: naming the field, the recorded and the configured value.
    """
    want = {"sampling_temperature": sampling.temperature, "sampling_top_k": sampling.top_k, "sampling_top_p": sampling.top_p}
    for field, value in want.items():
        got = rollout.get(field)
        if got is None or (got.numel() and not bool((got == value).all())):
            seen = "nothing" if got is None else sorted({float(v) for v in got.tolist()})
            raise ConfigError(
                f"{owner}: its rollout records {field}={seen} but it samples with {field.removeprefix('sampling_')}={value}: "
                "the trainer would evaluate pi with another distribution than mu's; the engine must pass the settings it "
                "sampled with to rollout_batch (a bug in that engine)"
            )


class Generator:
    """Samples completions with the behaviour policy mu (see the module docstring).

    Args:
        node: the generator node (model shape, sampling settings).
        seed: seed of sampling (mixed with each batch's first prompt index).
        device: where the model runs and samples (``"cpu"``, ``"cuda:N"``); outputs return to the CPU.

    Attributes:
        model: the inference model (a ``flowrl.models.CausalLM``), in ``sampling.precision``, without
            gradients; for ``int8``/``float8`` its linear layers are ``flowrl.models.quantize.QuantizedLinear``.
        version: policy version of the weights it holds (0 = the shared initial weights).
        stop_tokens: ids that end a completion (see the module docstring).
        pad_id: id that pads completions (the tokenizer's).
        device: the model's device; ``weight_targets()`` are tensors there.
    """

    def __init__(self, node: GeneratorNode, *, seed: int = 0, device: str | torch.device = "cpu", transport: str = "inprocess") -> None:
        del transport  # the engine protocol's argument; a transport writes straight into this model's tensors
        self.name = node.name
        self.sampling = node.sampling
        self.seed = seed
        self.device = torch.device(device)
        tokens = model_tokens(node.model)  # checks the tokenizer before the model is built
        precision = node.sampling.precision
        self.model = build_model(node.model, dtype=DTYPES.get(precision, torch.float32), device=self.device).eval().requires_grad_(False)
        self._targets = weight_dict(self.model)  # float tensors: what transports and load_weights write into
        lora = lora_of(node.model)
        self._lora = LoraMerge(self.model, lora, owner=f"generator {node.name!r}") if lora is not None else None
        if self._lora is not None:  # a LoRA policy sends its adapters; they are merged into the base weights
            self._targets = self._lora.targets
        self._quantized = quantize_linears_(self.model, precision) if precision in QUANTIZED_PRECISIONS else None
        self._version = 0
        if isinstance(node.model, ModelConfig):
            self.stop_tokens: tuple[int, ...] = tuple(node.sampling.stop_tokens) or tokens.eos_ids
        else:
            self.stop_tokens = tuple(dict.fromkeys((*tokens.eos_ids, *node.sampling.stop_tokens)))
        self.pad_id = tokens.pad_id
        self._decode = tokens.decode
        self._stop = torch.tensor(self.stop_tokens, dtype=torch.int64, device=self.device)
        self._calls = 0
        #: the routing shape of a MoE model whose routing it records (``routing_replay``); None: it records none
        self.routing: MoeShape | None = moe_shape(self.model, owner=f"generator {node.name!r}: routing_replay=True") if node.routing_replay else None

    @property
    def max_seq_len(self) -> int:
        """The longest sequence its model holds (prompt and completion)."""
        return self.model.max_seq_len

    @property
    def version(self) -> int:
        """Policy version of the weights it holds (0 = the shared initial weights)."""
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        """Say that ``weight_targets()`` now hold the weights of version ``value``: whoever copied them
        in (a transport's fetch, ``load_weights``) sets it. A quantized generator re-quantizes its
        linear layers from the float targets here, so it never samples with stale quantized weights."""
        if self._lora is not None:
            self._lora.merge()
        if self._quantized is not None:
            self._quantized.requantize()
        self._version = int(value)

    def weight_targets(self) -> dict[str, Tensor]:
        """The model's parameters by name: tensors a transport may copy into in place (float ones,
        also for an ``int8``/``float8`` generator, which re-quantizes when ``version`` is set)."""
        return self._targets

    def refresh_weight_targets(self) -> dict[str, Tensor]:
        """Re-read the targets from the model after its parameters were replaced (e.g. by their
        tensor-parallel shards, ``flowrl.runtime.parallel.tensor_parallel``); returns them.

        Raises:
            ConfigError: for a quantized generator, whose layers cannot be re-read (or sharded).
        """
        if self._quantized is not None or self._lora is not None:
            kind = "LoRA" if self._lora is not None else self.sampling.precision
            raise ConfigError(f"generator {self.name!r}: a {kind} generator's weights cannot be re-read or sharded")
        self._targets = weight_dict(self.model)
        return self._targets

    def load_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        """Copy ``state`` (a trainer's ``weights()``) into the model, cast to its precision (re-quantized
        for ``int8``/``float8``); set ``version``."""
        copy_weights(self._targets, state, owner=f"generator {self.name!r}")
        self.version = int(version)

    def _check(self, prompts: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        for field in ("prompt_ids", "prompt_lens"):
            if field not in prompts:
                raise ConfigError(f"generator {self.name!r}: input batch lacks {field!r} (it has {sorted(prompts)})")
        ids, lens = prompts["prompt_ids"], prompts["prompt_lens"]
        if ids.dim() != 2 or lens.shape != ids.shape[:1]:
            raise ConfigError(f"generator {self.name!r}: prompt_ids {tuple(ids.shape)} and prompt_lens {tuple(lens.shape)} disagree")
        if len(lens) and (int(lens.min()) < 1 or int(lens.max()) > ids.shape[1]):
            raise ConfigError(f"generator {self.name!r}: prompt_lens must be in [1, {ids.shape[1]}], got {lens.tolist()}")
        vocab = self.model.vocab_size
        if ids.numel() and (int(ids.max()) >= vocab or int(ids.min()) < 0):
            raise ConfigError(
                f"generator {self.name!r}: prompt token ids span [{int(ids.min())}, {int(ids.max())}] but the model's "
                f"vocab_size is {vocab}; the prompts' tokenizer must fit the model's embeddings"
            )
        longest = (int(lens.max()) if len(lens) else 0) + self.sampling.max_new_tokens
        if longest > self.model.max_seq_len:
            raise ConfigError(
                f"generator {self.name!r}: longest prompt ({longest - self.sampling.max_new_tokens}) + "
                f"max_new_tokens ({self.sampling.max_new_tokens}) = {longest} > max_seq_len={self.model.max_seq_len}; "
                "set a smaller max_new_tokens= on the generator (a pretrained Hugging Face model's default is 256: "
                "flowrl.graph.defaults) or max_prompt_len= on the source"
            )
        return ids, lens

    def _batch_start(self, prompts: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, torch.Generator]:
        """A batch's checked ``prompt_ids`` and ``prompt_lens``, its ``prompt_index`` (0..P-1 when absent) and
        its random stream, seeded from ``(seed, first prompt index)`` (or the call count without an index)."""
        ids, lens = self._check(prompts)
        index = prompts.get("prompt_index")
        if index is None:
            index = torch.arange(ids.shape[0], dtype=torch.int64)
        first = int(index[0]) if len(index) else 0
        rng = torch.Generator(device=self.device).manual_seed(_mix(self.seed, first, self._calls if "prompt_index" not in prompts else 0))
        self._calls += 1
        return ids, lens, index, rng

    def generate(self, prompts: Mapping[str, Tensor]) -> Batch:
        """Sample ``n_samples`` completions for each prompt of ``prompts`` (``prompt_ids``, ``prompt_lens``).

        Returns:
            The rollout (every field of ``flowrl.graph.fields.ROLLOUT_FIELDS``): ``completion_ids``,
            ``completion_mask``, ``behaviour_logprobs`` are ``[S, max_new_tokens]``, right-padded
            (pad id, False, 0.0); ``sampling_temperature``, ``sampling_top_k``, ``sampling_top_p`` are
            ``[S]``; ``rollout_version`` is ``version``,
            and so is every entry of ``token_versions`` ``[S, max_new_tokens]`` (lock step never
            changes weights within a batch). With ``routing_replay``, ``routed_experts``
            ``[S, Tp + max_new_tokens, layers, k]`` (``Tp``: ``prompt_ids``' width): the experts each
            token was routed through, the prompt's then the completion's, ``unrecorded`` on padding
            and on each completion's last token (never fed back).
            Every tensor is on the CPU, whatever ``device`` is.

        Raises:
            ConfigError: for missing fields, bad lengths, or sequences longer than ``max_seq_len``.
        """
        ids, lens, index, rng = self._batch_start(prompts)
        n = self.sampling.n_samples
        sample_ids, sample_lens = ids.repeat_interleave(n, 0), lens.repeat_interleave(n, 0)
        shape = self.routing
        routed = None  # [S, Tp + C, layers, k]: what routing_replay records, unrecorded until a forward routes the token
        if shape is not None:
            width = sample_ids.shape[1] + self.sampling.max_new_tokens
            routed = torch.full((sample_ids.shape[0], width, shape.layers, shape.top_k), unrecorded(shape.experts), dtype=expert_dtype(shape.experts), device=self.device)
        with torch.no_grad():
            tokens, logprobs, mask = (t.cpu() for t in self._sample(sample_ids.to(self.device), sample_lens.to(self.device), rng, routed=routed))
        versions = torch.full(tokens.shape, self.version, dtype=torch.int64)
        sampling = self.sampling
        out = rollout_batch(
            sample_ids, sample_lens, tokens, mask, logprobs, versions, index,
            n=n, temperature=sampling.temperature, version=self.version, top_k=sampling.top_k, top_p=sampling.top_p,
        )  # fmt: skip
        if routed is not None:
            out["routed_experts"] = routed.cpu()
        return out

    def _sample(self, prompt_ids: Tensor, prompt_lens: Tensor, rng: torch.Generator, *, routed: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``(tokens, logprobs, mask)`` ``[S, C]`` of ``S`` left-padded prompts; with ``routed``
        (``[S, Tp + C, layers, k]``, ``routing_replay``), each fed token's experts written into it."""
        S, C, device = prompt_ids.shape[0], self.sampling.max_new_tokens, prompt_ids.device
        tokens = torch.full((S, C), self.pad_id, dtype=torch.int64, device=device)
        logprobs = torch.zeros(S, C, dtype=torch.float32, device=device)
        mask = torch.zeros(S, C, dtype=torch.bool, device=device)
        if S == 0:
            return tokens, logprobs, mask
        skip = prompt_ids.shape[1] - int(prompt_lens.max())
        prompt_ids = prompt_ids[:, skip:]  # drop all-pad columns
        Tp = prompt_ids.shape[1]
        valid = torch.cat([prompt_valid(prompt_ids, prompt_lens), torch.ones(S, C, dtype=torch.bool, device=device)], dim=1)
        cache = self.model.new_cache(S, Tp + C) if self.sampling.use_kv_cache else None
        with RoutingRecorder(self.model, owner=f"generator {self.name!r}") if routed is not None else _no_recorder() as recorder:
            self._decode_loop(prompt_ids, valid, cache, tokens, logprobs, mask, rng, recorder=recorder, routed=routed, skip=skip)
        return tokens, logprobs, mask

    def _decode_loop(
        self,
        prompt_ids: Tensor,
        valid: Tensor,
        cache: Any,
        tokens: Tensor,
        logprobs: Tensor,
        mask: Tensor,
        rng: torch.Generator,
        *,
        recorder: RoutingRecorder | None,
        routed: Tensor | None,
        skip: int,
    ) -> None:
        """Fill ``tokens``, ``logprobs`` and ``mask`` ``[S, C]`` in place, one token a step; with a
        ``recorder``, each fed token's experts into ``routed`` (column ``skip + j`` for input ``j``)."""
        S, Tp = prompt_ids.shape
        C, device = tokens.shape[1], prompt_ids.device
        logits = self.model(prompt_ids, valid=valid[:, :Tp], cache=cache, keep=1)[:, -1]
        if recorder is not None and routed is not None:  # the prompt's tokens; padding stays unrecorded
            fed = recorder.take().view(S, Tp, *routed.shape[2:])
            routed[:, skip : skip + Tp] = torch.where(valid[:, :Tp, None, None], fed.to(routed.dtype), routed[:, skip : skip + Tp])
        alive = torch.ones(S, dtype=torch.bool, device=device)
        stop_strings = self.sampling.stop_strings
        for t in range(C):
            logp = sampling_logprobs(logits.float(), self.sampling)  # [S, V]
            uniform = torch.rand(logp.shape, generator=rng, device=device).clamp_(min=1e-20)
            token = torch.argmax(logp - torch.log(-torch.log(uniform)), dim=-1)  # Gumbel-max draw from logp
            tokens[:, t] = torch.where(alive, token, self.pad_id)
            logprobs[:, t] = torch.where(alive, logp.gather(-1, token[:, None]).squeeze(-1), 0.0)
            mask[:, t] = alive
            alive = alive & ~torch.isin(token, self._stop)
            if stop_strings:
                for s in alive.nonzero().flatten().tolist():
                    text = self._decode(tokens[s, : t + 1].tolist())
                    alive[s] = not any(stop in text for stop in stop_strings)
            if t == C - 1 or not bool(alive.any()):
                break
            end = Tp + t + 1
            if cache is not None:
                logits = self.model(token[:, None], valid=valid[:, :end], cache=cache, keep=1)[:, -1]
            else:
                seq = torch.cat([prompt_ids, tokens[:, : t + 1]], dim=1)
                logits = self.model(seq, valid=valid[:, :end], keep=1)[:, -1]
            if recorder is not None and routed is not None:  # token t's experts (the last input of the forward), on real tokens
                fed = recorder.take().view(S, -1, *routed.shape[2:])[:, -1]
                column = skip + Tp + t
                routed[:, column] = torch.where(mask[:, t, None, None], fed.to(routed.dtype), routed[:, column])
