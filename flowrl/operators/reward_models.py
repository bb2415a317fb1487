"""The reward_model node's operator: rewards from a Hugging Face model reading prompt + completion text.

Each sample's prompt and completion are decoded as a text scorer's are
(``flowrl.operators.text_inputs``: the policy's tokenizer, the completion cut before its stop
token) and encoded again with the reward model's own tokenizer:

- a **sequence classifier** (``RewardModelNode.judge`` None): ``AutoModelForSequenceClassification``
  with ``num_labels == 1``. With a chat template, the text is the conversation ``[user: prompt,
  assistant: completion]`` rendered by it (TRL's reward models are trained on that form); without
  one, the prompt and completion ids decoded together (the text the policy produced). The reward is
  the model's one logit, which HF reads at the last real token. Right-padded batches, so a text's
  positions do not depend on the batch it is in.
- a **generative judge** (``judge=JudgeConfig``): ``AutoModelForCausalLM`` prompted with
  ``template.format(prompt=..., completion=...)``, sent as the user message through the chat
  template when the tokenizer has one (with the generation prompt). Its verdict
  (``flowrl.graph.judges``): ``"logprob"``, ``sigmoid(z_yes - z_no)`` at the answer's first position
  (left-padded, explicit position ids, only the last position's logits computed); or ``"regex"``, a
  greedy answer parsed with the pattern, where an answer that does not parse scores 0 and is
  counted (``judge/unparsed/<node>``) and logged.

A text longer than the model's context (``HFModelConfig.max_seq_len``, else the config's
``max_position_embeddings``) keeps its last tokens, where the classifier reads and the judge
answers, and is counted (``reward_model/truncated/<node>``).

Everything that can be checked before a step is checked when the operator is built, each a
``ConfigError`` naming the directory and the fix: the directory's files (``flowrl.models.hf.check_hf_dir``),
a classifier without a classification head (a causal LM saved as is) or with ``num_labels != 1``,
a judge that is not a causal LM, a ``yes``/``no`` answer that is not one token of its tokenizer,
a tokenizer larger than the model's embedding.

Example (the model's directory made with ``transformers``' ``save_pretrained``)::

    rm = RewardModel(node, TextInputs(graph, node.name))
    rewards, info = rm.score(rollout)      # {node.output: float32[sample]}, {"reward_model/truncated/rm": 0}
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flowrl.errors import ConfigError
from flowrl.graph.nodes import RewardModelNode
from flowrl.models.hf import check_hf_dir, load_auto
from flowrl.models.tokenizer import check_vocab, load_tokenizer
from flowrl.operators.scoring import unpad
from flowrl.operators.text_inputs import TextInputs

__all__ = ["RewardModel", "parse_verdict", "pad_batch"]

log = logging.getLogger(__name__)


def parse_verdict(pattern: str, answer: str) -> float | None:
    """The reward in a judge's ``answer``: the first match of ``pattern`` (its first group, or the
    whole match without groups) read as a finite number; None when there is none.

    Example:
        >>> parse_verdict(r"Score: (\\d+)", "I think... Score: 7/10"), parse_verdict(r"Score: (\\d+)", "no idea")
        (7.0, None)
    """
    match = re.search(pattern, answer)
    if match is None:
        return None
    text = match.group(1) if match.re.groups else match.group(0)
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def pad_batch(rows: Sequence[Sequence[int]], pad_id: int, *, left: bool) -> tuple[Tensor, Tensor]:
    """``rows`` padded to one width: (ids int64[B, T], attention mask int64[B, T]).

    Example:
        >>> ids, mask = pad_batch([[5, 6], [7]], 0, left=True)
        >>> ids.tolist(), mask.tolist()
        ([[5, 6], [0, 7]], [[1, 1], [0, 1]])
    """
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span] = torch.tensor(list(row), dtype=torch.int64)
        mask[i, span] = 1
    return ids, mask


class RewardModel:
    """Scores rollouts with the reward model of ``node`` into the field ``node.output`` (module docstring).

    Args:
        node: the reward-model node.
        text: how its rollouts decode (``TextInputs(graph, node.name)``).
        device: the torch device its model lives on.

    Raises:
        ConfigError: for anything wrong with the directory, the model or the judge's answer tokens
            (see the module docstring), before any batch is scored.
    """

    def __init__(self, node: RewardModelNode, text: TextInputs, *, device: str = "cpu") -> None:
        self.node, self.text, self.device = node, text, device
        self.name = node.name
        owner = f"reward_model {node.name!r}"
        raw = check_hf_dir(node.model, owner=owner)
        directory = str(Path(node.model.path).expanduser())
        archs = [str(a) for a in raw.get("architectures") or []]
        judge = node.judge
        if judge is None:
            if not any(a.endswith("ForSequenceClassification") for a in archs):
                raise ConfigError(
                    f"{owner}: {directory!r} holds {archs or 'a model of no named architecture'}, not a sequence classifier: "
                    "its reward head would be random. Save a reward model (AutoModelForSequenceClassification with "
                    "num_labels=1, trained) in the directory, or pass judge=JudgeConfig(template=...) to prompt this "
                    "causal LM as a judge"
                )
            labels = _num_labels(raw)
            if labels != 1:
                raise ConfigError(
                    f"{owner}: {directory!r} is a classifier with num_labels={labels}; a reward model has one label, "
                    "whose logit is the reward: use one saved with num_labels=1"
                )
        elif not any(a.endswith("ForCausalLM") for a in archs):
            raise ConfigError(
                f"{owner}: {directory!r} holds {archs or 'a model of no named architecture'}, not a causal LM; "
                "a judge answers with text: point judge= at a causal LM, or drop judge= for a sequence classifier"
            )
        self.tokenizer = load_tokenizer(node.model.tokenizer_path, owner=owner)
        self.model = load_auto(node.model, "AutoModelForCausalLM" if judge else "AutoModelForSequenceClassification", owner=owner)
        self.model.requires_grad_(False)
        self.model.eval()
        self.model.to(device)
        check_vocab(self.tokenizer, int(self.model.config.vocab_size), owner=owner)
        self.pad_id = int(self.tokenizer.pad_token_id)
        if judge is None and self.model.config.pad_token_id is None:  # HF finds the last real token by it
            self.model.config.pad_token_id = self.pad_id
        self.max_len = node.model.max_seq_len or int(raw.get("max_position_embeddings") or 0) or 10**9
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))
        self.answer_ids: tuple[int, int] | None = None
        if judge is not None and judge.verdict == "logprob":
            self.answer_ids = (self._one_token(judge.yes, "yes", owner), self._one_token(judge.no, "no", owner))

    def _one_token(self, word: str, field: str, owner: str) -> int:
        ids = self.tokenizer.encode(word, add_special_tokens=False)
        if len(ids) != 1:
            pieces = self.tokenizer.convert_ids_to_tokens(ids)
            raise ConfigError(
                f"{owner}: the judge's {field}={word!r} is {len(ids)} tokens {pieces} of its tokenizer, not one; its "
                "probability would not be one next-token probability: pick a word that is one token (a BPE tokenizer "
                f"may need a leading space, {' ' + word.strip()!r}) or use verdict='regex'"
            )
        return int(ids[0])

    # -- text -------------------------------------------------------------------------------------
    def texts(self, rollout: Mapping[str, Tensor]) -> list[str]:
        """What the reward model reads for each sample, before its tokenizer encodes it."""
        prompts, completions = unpad(rollout)
        out = []
        for prompt, completion in zip(prompts, completions):
            p, c = self.text.prompt_text(prompt), self.text.completion_text(completion)
            if self.node.judge is not None:
                filled = self.node.judge.template.format(prompt=p, completion=c)
                out.append(self._render([{"role": "user", "content": filled}], generation=True) if self.chat else filled)
            elif self.chat:
                out.append(self._render([{"role": "user", "content": p}, {"role": "assistant", "content": c}], generation=False))
            else:  # decoded together: the joint text the policy produced, spaces between tokens as its tokenizer puts them
                out.append(self.text.tokenizer.decode([*prompt, *self.text.completion_cut(completion)], skip_special_tokens=True))
        return out

    def _render(self, messages: list[dict[str, str]], *, generation: bool) -> str:
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation))

    def encode(self, texts: Sequence[str]) -> tuple[list[list[int]], int]:
        """Token ids of each text (a rendered chat template already holds its special tokens), each
        cut to its last ``max_len`` tokens; and how many were cut."""
        rows = [list(self.tokenizer(t, add_special_tokens=not self.chat)["input_ids"]) for t in texts]
        cut = sum(len(r) > self.max_len for r in rows)
        return [r[-self.max_len :] for r in rows], cut

    # -- scoring ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def _classify(self, rows: list[list[int]]) -> list[float]:
        ids, mask = pad_batch(rows, self.pad_id, left=False)
        logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits  # [B, 1]
        return logits[:, 0].float().cpu().tolist()

    @torch.inference_mode()
    def _judge_logprob(self, rows: list[list[int]]) -> list[float]:
        assert self.answer_ids is not None
        ids, mask = pad_batch(rows, self.pad_id, left=True)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # each row's own positions, whatever its padding
        out = self.model(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), position_ids=positions.to(self.device), logits_to_keep=1
        )
        z = out.logits[:, -1].float()  # [B, V]: the answer's first token
        yes, no = self.answer_ids
        return torch.sigmoid(z[:, yes] - z[:, no]).cpu().tolist()  # p(yes) / (p(yes) + p(no))

    @torch.inference_mode()
    def _judge_answers(self, rows: list[list[int]]) -> list[str]:
        assert self.node.judge is not None
        ids, mask = pad_batch(rows, self.pad_id, left=True)
        out = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), max_new_tokens=self.node.judge.max_new_tokens,
            do_sample=False, pad_token_id=self.pad_id, eos_token_id=self.tokenizer.eos_token_id,
        )
        return [self.tokenizer.decode(row, skip_special_tokens=True) for row in out[:, ids.shape[1] :].tolist()]

    def score(self, rollout: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, float]]:
        """``({node.output: float32[sample]}, metrics)`` for ``rollout``, in chunks of ``node.batch_size``.

        The metrics hold ``reward_model/truncated/<node>`` and, for a regex judge,
        ``judge/unparsed/<node>``: the counts of this batch.
        """
        rows, cut = self.encode(self.texts(rollout))
        size = self.node.batch_size or max(len(rows), 1)
        judge = self.node.judge
        rewards: list[float] = []
        unparsed = 0
        for start in range(0, len(rows), size):
            chunk = rows[start : start + size]
            if judge is None:
                rewards += self._classify(chunk)
            elif judge.verdict == "logprob":
                rewards += self._judge_logprob(chunk)
            else:
                for i, answer in enumerate(self._judge_answers(chunk)):
                    value = parse_verdict(judge.pattern, answer)
                    if value is None:
                        unparsed += 1
                        log.warning("reward_model %r: sample %d's answer %r has no number matching %r; its reward is 0", self.name, start + i, answer[:200], judge.pattern)
                    rewards.append(0.0 if value is None else value)
        metrics = {f"reward_model/truncated/{self.name}": float(cut)}
        if judge is not None and judge.verdict == "regex":
            metrics[f"judge/unparsed/{self.name}"] = float(unparsed)
        return {self.node.output: torch.tensor(rewards, dtype=torch.float32)}, metrics


def _num_labels(raw: dict[str, Any]) -> int:
    """``num_labels`` as transformers reads a ``config.json``: ``id2label``'s size, else ``num_labels``, else 2."""
    if isinstance(raw.get("id2label"), dict):
        return len(raw["id2label"])
    return int(raw.get("num_labels", 2))
