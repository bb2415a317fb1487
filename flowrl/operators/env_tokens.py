"""An environment's observation as tokens, encoded once and appended: never a re-tokenised conversation.

A multi-turn sample is ``prompt, model turn, observation, model turn, ...``; the model's tokens stay
exactly as sampled, and each observation is turned into tokens on its own here:

- the built-in model (``ModelConfig``): its tokenizer's ``encode`` of the text (the digit tokenizer:
  an observation holding another character fails its sample);
- a Hugging Face model without a chat template: ``tokenizer.encode(text, add_special_tokens=False)``;
- a Hugging Face model with a chat template: the template applied **incrementally**, for the new
  message only. The text it adds after the model's turn is that of
  ``template([user, assistant, new], add_generation_prompt=True)`` past ``template([user, assistant])``
  (the model's own end-of-turn marker left out when the model emitted it, kept when its turn was cut
  short). ``chat_encoder`` checks at build that the template renders earlier messages the same
  whatever follows (a template that rewrites earlier turns, e.g. one dropping an assistant's
  reasoning once a later message exists, cannot be applied incrementally and is refused).

Example:
    >>> enc = TextEncoder()
    >>> enc.encode("12=", model_stopped=True)
    [4, 5, 14]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from flowrl.errors import ConfigError
from flowrl.graph.configs import AnyModelConfig, ModelConfig

__all__ = ["ObservationEncoder", "TextEncoder", "ChatEncoder", "observation_encoder"]


class ObservationEncoder(Protocol):
    def encode(self, text: str, *, model_stopped: bool) -> list[int]:
        """The tokens appended after a model turn for the observation ``text``; ``model_stopped`` says
        whether the model's turn ended with its stop token (False: cut at ``max_new_tokens``)."""
        ...


class TextEncoder:
    """The text as it is, through ``encode`` (the built-in digit tokenizer by default)."""

    def __init__(self, encode: Callable[[str], list[int]] | None = None) -> None:
        if encode is None:
            from flowrl.models.families.builtin.tokenizer import DEFAULT_TOKENIZER

            encode = DEFAULT_TOKENIZER.encode
        self._encode = encode

    def encode(self, text: str, *, model_stopped: bool) -> list[int]:
        return list(self._encode(text))


_Q, _A = "flowrl-question", "flowrl-answer"


class ChatEncoder:
    """A chat template applied for the new message only (see the module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        role: the role observations are sent as (``"user"``, ``"tool"``).
        end_text: the text of the model's end-of-turn token (what ends its turn in the template).

    Raises:
        ConfigError: when the template fails for the role or cannot be applied incrementally.
    """

    def __init__(self, tokenizer: Any, *, role: str, end_text: str, owner: str = "generator") -> None:
        self.tok, self.role, self.end_text = tokenizer, role, end_text
        base = [{"role": "user", "content": _Q}, {"role": "assistant", "content": _A}]
        try:
            self._base = tokenizer.apply_chat_template(base, tokenize=False)
            probe = self._render("flowrl-observation")
            probe2 = self._render("another observation")
        except Exception as exc:
            raise ConfigError(
                f"{owner}: the chat template cannot render an observation as a {role!r} message after an assistant turn "
                f"({type(exc).__name__}: {exc}); set the environment's role (EnvConfig.role) to one the template knows"
            ) from exc
        cut = self._base.rfind(_A)
        if cut < 0 or not probe.startswith(self._base) or not probe2.startswith(self._base):
            raise ConfigError(
                f"{owner}: the chat template cannot be applied incrementally: rendering a conversation with one more "
                f"{role!r} message changes how the earlier messages render ({self._base!r} is not a prefix of {probe!r}); "
                "multi-turn rollouts append each observation's tokens without re-tokenising earlier turns, so they "
                "need a template that renders earlier messages the same whatever follows"
            )
        self._after = cut + len(_A)  # where the model's own text ends in a rendering

    def _render(self, content: str) -> str:
        messages = [{"role": "user", "content": _Q}, {"role": "assistant", "content": _A}, {"role": self.role, "content": content}]
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def text(self, content: str, *, model_stopped: bool) -> str:
        """The text appended after a model turn for the observation ``content``."""
        added = self._render(content)[self._after :]
        if model_stopped and self.end_text and added.startswith(self.end_text):
            added = added[len(self.end_text) :]  # the model emitted its end marker: it is in its tokens
        return added

    def encode(self, text: str, *, model_stopped: bool) -> list[int]:
        return list(self.tok.encode(self.text(text, model_stopped=model_stopped), add_special_tokens=False))


def observation_encoder(model: AnyModelConfig, *, role: str, owner: str) -> ObservationEncoder:
    """The encoder for ``model``'s tokenizer (see the module docstring); chat templates are checked here.

    Raises:
        ConfigError: for a chat template that cannot be applied incrementally or for ``role``.
    """
    if isinstance(model, ModelConfig):
        return TextEncoder()
    from flowrl.models.tokenizer import load_tokenizer

    tok = load_tokenizer(model.tokenizer_path, owner=owner)
    if not getattr(tok, "chat_template", None):
        return TextEncoder(lambda text: tok.encode(text, add_special_tokens=False))
    end_text = tok.eos_token or ""
    return ChatEncoder(tok, role=role, end_text=end_text, owner=owner)
