"""A chat conversation as token ids: rendered once per message, replies kept as sampled.

An episode's first request's messages are rendered to the prompt's ids (the chat template with its
generation prompt); each reply is the model's ids as sampled (mask 1); each later request must
repeat the conversation so far (every earlier message and every reply, as returned) and add
messages after it, whose ids are appended (mask 0), rendered **incrementally**: the text the
template adds for them after an assistant turn, as ``flowrl.operators.env_tokens.ChatEncoder`` does
for one observation (the model's end-of-turn marker left out when the model emitted it). A request
that rewrites earlier messages is refused: its tokens would not be the ones sampled.

Without a chat template (the built-in digit tokenizer, or a Hugging Face tokenizer without one)
each message's content is encoded as it is, one after another.

Example (the built-in digit tokenizer):
    >>> r = renderer_for(None)
    >>> c = Conversation(r, [{"role": "user", "content": "3="}])
    >>> c.prompt
    [6, 14]
    >>> c.add_reply([5, 4, 2], [-0.1, -0.2, -0.3], text="21", stopped=True)
    >>> c.extend([{"role": "user", "content": "3="}, {"role": "assistant", "content": "21"}, {"role": "user", "content": "1="}])
    >>> c.tokens, c.mask
    ([5, 4, 2, 4, 14], [True, True, True, False, False])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ConversationError", "Renderer", "Conversation", "renderer_for", "check_messages"]

_Q, _A = "flowrl-question", "flowrl-answer"


class ConversationError(ValueError):
    """A request whose messages cannot be taken (the client is told why; the run goes on)."""


def check_messages(messages: Any) -> list[dict[str, str]]:
    """``messages`` if it is a non-empty list of ``{"role": str, "content": str}`` (extra keys dropped).

    Raises:
        ConversationError: naming the first message that is not.
    """
    if not isinstance(messages, list) or not messages:
        raise ConversationError(f"'messages' must be a non-empty list of {{'role', 'content'}} objects, got {messages!r:.100}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConversationError(f"messages[{i}] must be an object with a string 'role' and a string 'content', got {m!r:.100}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


class Renderer:
    """Messages to token ids for one tokenizer (see the module docstring).

    Args:
        encode: text -> ids (no special tokens added).
        template: ``messages, add_generation_prompt -> text`` (a tokenizer's chat template), or None.
        end_text: the text of the model's end-of-turn token (its end of sequence).
    """

    def __init__(self, encode: Callable[[str], list[int]], template: Callable[[list[dict[str, str]], bool], str] | None, end_text: str = "") -> None:
        self.encode, self.template, self.end_text = encode, template, end_text
        if template is not None:
            self._base = template([{"role": "user", "content": _Q}, {"role": "assistant", "content": _A}], False)
            self._after = self._base.rfind(_A) + len(_A)

    def first(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt's ids: the whole conversation with the generation prompt."""
        if self.template is None:
            return [t for m in messages for t in self.encode(m["content"])]
        return list(self.encode(self.template(messages, True)))

    def added(self, messages: list[dict[str, str]], *, model_stopped: bool) -> list[int]:
        """The ids appended after a reply for the new ``messages`` (and the generation prompt).

        Raises:
            ConversationError: when the template renders earlier messages differently once these follow.
        """
        if self.template is None:
            return [t for m in messages for t in self.encode(m["content"])]
        base = [{"role": "user", "content": _Q}, {"role": "assistant", "content": _A}]
        text = self.template(base + messages, True)
        if not text.startswith(self._base[: self._after]):
            raise ConversationError(
                "the chat template renders the earlier messages differently once these messages follow; "
                "the conversation cannot grow without re-tokenising what was sampled"
            )
        added = text[self._after :]
        if model_stopped and self.end_text and added.startswith(self.end_text):
            added = added[len(self.end_text) :]  # the model emitted its end marker: it is in its tokens
        return list(self.encode(added))


def renderer_for(model: Any, *, owner: str = "endpoint") -> Renderer:
    """The ``Renderer`` of ``model``'s tokenizer: the built-in digit tokenizer for a ``ModelConfig``
    (or None), a Hugging Face tokenizer's (with its chat template if it has one) for an ``HFModelConfig``."""
    from flowrl.graph.configs import ModelConfig

    if model is None or isinstance(model, ModelConfig):
        from flowrl.models.families.builtin.tokenizer import DEFAULT_TOKENIZER

        return Renderer(DEFAULT_TOKENIZER.encode, None)
    from flowrl.models.tokenizer import load_tokenizer

    tok = load_tokenizer(model.tokenizer_path, owner=owner)
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    if not getattr(tok, "chat_template", None):
        return Renderer(encode, None)
    return Renderer(encode, lambda ms, gen: tok.apply_chat_template(ms, tokenize=False, add_generation_prompt=gen), tok.eos_token or "")


class Conversation:
    """One episode's conversation (see the module docstring).

    Attributes:
        prompt: the first request's ids.
        tokens, mask, logprobs: what followed the prompt: replies (mask True, mu's log-probs) and
            the client's later messages (mask False, 0.0).
        messages: the conversation as the client must repeat it (requests' messages and replies).
    """

    def __init__(self, renderer: Renderer, messages: list[dict[str, str]]) -> None:
        self.renderer = renderer
        self.messages = list(messages)
        self.prompt = renderer.first(self.messages)
        self.tokens: list[int] = []
        self.mask: list[bool] = []
        self.logprobs: list[float] = []
        self._stopped = True

    def add_reply(self, ids: list[int], logprobs: list[float], *, text: str, stopped: bool) -> None:
        """Record a reply as sampled; ``text`` is what the client gets (and must repeat)."""
        self.tokens += ids
        self.mask += [True] * len(ids)
        self.logprobs += logprobs
        self.messages.append({"role": "assistant", "content": text})
        self._stopped = stopped

    def extend(self, messages: list[dict[str, str]]) -> None:
        """Take a later request's ``messages``: the conversation so far, then new ones (appended, mask 0).

        Raises:
            ConversationError: when they do not repeat the conversation, or add nothing.
        """
        k = len(self.messages)
        for i, (seen, got) in enumerate(zip(self.messages, messages)):
            if seen["role"] != got["role"] or seen["content"].strip() != got["content"].strip():
                raise ConversationError(
                    f"messages[{i}] ({got['role']!r}: {got['content']!r:.60}) differs from the episode's conversation "
                    f"({seen['role']!r}: {seen['content']!r:.60}); a request repeats every earlier message and reply "
                    "as they were, then adds new messages (start a new episode for another conversation)"
                )
        new = messages[k:]
        if len(messages) < k or not new:
            raise ConversationError(
                f"the request has {len(messages)} messages; the episode's conversation has {k}, and a request adds at "
                "least one message after them"
            )
        ids = self.renderer.added(new, model_stopped=self._stopped)
        self.tokens += ids
        self.mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.messages += new

    @property
    def sequence(self) -> list[int]:
        """Everything the next reply is sampled after."""
        return self.prompt + self.tokens
