"""A generator's episodes driven by agent programs through the OpenAI-compatible endpoint.

An agent program is a function (or async function) ``program(session, row) -> reward``: ``session``
(an ``AgentSession``) gives the episode's ``base_url``, ``model`` and ``api_key`` for an OpenAI
client (``session.client()`` makes one), ``row`` is the environment row (``prompt``, ``prompt_ids``,
``prompt_index``, ``sample``, a prompt file's other fields); it chats as it likes (tool calls,
retries of its own, several turns) and returns the episode's reward, a finite real number.

For each batch, ``AgentRollouts.generate`` opens one episode per sample on its ``ChatEndpoint``,
runs every program in a daemon thread under ``episode_timeout_s``, and, once all have returned or
timed out, builds the rollout from what the endpoint sampled (``MultiTurnGenerator.batch``: the
same fields as an environment's episodes, ``ENV_FIELDS`` included):

- the prompt is the episode's first request, rendered (not the source's prompt: the program
  chooses its system prompt and its framing); ``completion_ids`` are the replies' ids as sampled
  and the program's later messages' ids (``flowrl.serve.conversation``); the mask is True on the
  replies only: what the program added is never trained;
- ``env_rewards`` is what the program returned; ``env_turns`` its replies;
- a program that raises, returns no finite real, times out (the episode is closed at once: a later
  request gets 404 and a hung program's thread is abandoned, a daemon), or never sends a request
  fails its sample (reward 0, all-False mask), which is counted (``env/failed``, and by cause:
  ``env/failed/raised``, ``/timeout``, ``/no_request``, ``/protocol``) and logged; the run goes on. An episode cut at the context (``context_length_exceeded``) keeps its reward.

The engine samples each batch of waiting requests together (``ChatEndpoint``'s sampler thread):
``turn_sampler(generator)`` adapts the built-in engine (one padded decode) and vLLM (one
``LLM.generate`` call); both record mu as the engine's ``generate`` does, with the generator's
version on every token (weights change only between ``generate`` calls: lock step).
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from flowrl.envs.environment import start
from flowrl.operators.batch import Batch
from flowrl.operators.generation import _mix
from flowrl.operators.multiturn import Episode, MultiTurnGenerator
from flowrl.operators.source import pad_left
from flowrl.serve.conversation import renderer_for
from flowrl.serve.openai_server import ChatEndpoint, Sampler

__all__ = ["AgentSession", "AgentRollouts", "turn_sampler"]

log = logging.getLogger("flowrl.envs")

#: The API key clients send (the endpoint listens on localhost and checks none).
API_KEY = "flowrl"


@dataclass(frozen=True)
class AgentSession:
    """What an agent program needs to reach its episode's endpoint."""

    base_url: str
    model: str
    api_key: str = API_KEY

    def client(self, **options: Any) -> Any:
        """An ``openai.OpenAI`` client on the episode's base URL (needs the ``openai`` package)."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, **options)


def turn_sampler(gen: Any) -> Sampler:
    """``sample(sequences, seeds)`` for a generator engine: the built-in ``Generator`` (one left-padded
    decode of all sequences, seeded from the first seed) or a ``VLLMGenerator`` (one request each)."""
    if hasattr(gen, "llm"):  # vLLM
        def sample_vllm(sequences: list[list[int]], seeds: list[int]) -> list[tuple[list[int], list[float]]]:
            from vllm.inputs import TokensPrompt

            params = []
            for seed in seeds:
                p = gen.sampling_params(seed >> 1)
                p.n = 1
                params.append(p)
            adapter = gen._lora.request if gen._lora is not None else None
            outs = gen.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False, lora_request=adapter)
            replies = []
            for out in outs:
                (c,) = out.outputs
                drawn = list(c.token_ids)[: gen.sampling.max_new_tokens]
                replies.append(gen._cut_at_stop_string(drawn, [step[t].logprob for step, t in zip(c.logprobs, drawn)]))
            return replies

        return sample_vllm

    def sample_builtin(sequences: list[list[int]], seeds: list[int]) -> list[tuple[list[int], list[float]]]:
        batch, lens = pad_left(sequences, gen.pad_id)
        rng = torch.Generator(device=gen.device).manual_seed(_mix(*seeds))
        with torch.no_grad():
            tokens, logprobs, mask = (t.cpu() for t in gen._sample(batch.to(gen.device), lens.to(gen.device), rng))
        return [(tokens[i, :k].tolist(), logprobs[i, :k].tolist()) for i, k in enumerate(mask.sum(1).tolist())]

    return sample_builtin


class AgentRollouts:
    """Episodes of agent programs for a generator (see the module docstring).

    Args:
        generator: the node's engine (``Generator`` or ``VLLMGenerator``).
        program: the agent program, ``(session, row) -> reward``.
        model: the model description (its tokenizer renders messages).
        model_name: the name clients ask for (default: the generator's name).
        episode_timeout_s: longest a program may run.
        max_turns: replies per episode at most.
        rows: stream position -> a prompt file row's other fields.
        port: where the endpoint listens (0: a free port).
    """

    #: The rollout and its metrics are built as for an environment's episodes.
    batch: Callable[..., Batch] = MultiTurnGenerator.batch  # reads only self.gen, which this class has too
    metrics = staticmethod(MultiTurnGenerator.metrics)

    def __init__(
        self, generator: Any, program: Callable[..., Any], *, model: Any, model_name: str | None = None,
        episode_timeout_s: float = 60.0, max_turns: int = 8, rows: Callable[[int], dict[str, Any]] | None = None, port: int = 0,
    ) -> None:  # fmt: skip
        self.gen, self.program, self.rows = generator, program, rows
        self.episode_timeout_s = episode_timeout_s
        max_seq_len = getattr(generator, "max_seq_len", None) or generator.model.max_seq_len
        self.endpoint = ChatEndpoint(
            model=model_name or generator.name, renderer=renderer_for(model, owner=f"generator {generator.name!r}"),
            sample=turn_sampler(generator), decode=generator._decode, stop_tokens=tuple(generator.stop_tokens),
            max_new_tokens=generator.sampling.max_new_tokens, max_seq_len=max_seq_len, max_requests=max_turns, port=port,
        )  # fmt: skip

    def close(self) -> None:
        self.endpoint.close()

    def generate(self, prompts: Mapping[str, torch.Tensor], rows: list[dict[str, Any]] | None = None) -> tuple[Batch, dict[str, float]]:
        """Run one program per sample of ``prompts`` (``prompt_ids``, ``prompt_lens``, ``prompt_index``):
        the rollout with ``ENV_FIELDS`` and the ``env/*`` metrics."""
        gen, n = self.gen, self.gen.sampling.n_samples
        ids, lens = prompts["prompt_ids"], prompts["prompt_lens"]
        index = prompts.get("prompt_index", torch.arange(ids.shape[0], dtype=torch.int64))
        width = ids.shape[1]
        if ids.shape[0] * n > self.endpoint.backlog:
            log.warning("generator %r: %d agent programs start at once but the kernel queues at most %d connections "
                        "(net.core.somaxconn); a burst of first requests beyond it may be reset: raise net.core.somaxconn "
                        "or give the generator fewer prompts per batch", gen.name, ids.shape[0] * n, self.endpoint.backlog)  # fmt: skip
        runs = []
        for p in range(ids.shape[0]):
            prompt = ids[p, width - int(lens[p]) :].tolist()
            extra = rows[p] if rows else self.rows(int(index[p])) if self.rows is not None else {}
            for j in range(n):
                row = {"prompt": gen._decode(prompt), "prompt_ids": prompt, "prompt_index": int(index[p]), "sample": j, **extra}
                ep = self.endpoint.open(seed=_mix(gen.seed, int(index[p]), j))
                session = AgentSession(base_url=self.endpoint.base_url(ep), model=self.endpoint.model)
                runs.append((ep, int(index[p]), j, start(self.program, session, row, timeout_s=self.episode_timeout_s)))
        t0 = time.perf_counter()
        deadline = t0 + self.episode_timeout_s
        episodes = []
        for ep, i, j, pending in runs:
            result = pending(deadline)
            self.endpoint.finish(ep)  # a program past its time gets 404 from here on
            episodes.append(self._episode(ep, i, j, result))
        wall = time.perf_counter() - t0
        sample_ids, sample_lens = pad_left([e.prompt for e in episodes], gen.pad_id)
        return self.batch(episodes, sample_ids, sample_lens, index), self.metrics(episodes, wall)

    def _episode(self, ep: Any, index: int, sample: int, result: Any) -> Episode:
        """The sample of one program's run: its conversation as sampled, its reward, or its failure."""
        conv = ep.conversation
        out = Episode(index=index, sample=sample, turns=ep.requests, env_s=result.seconds, done=True)
        if conv is not None:
            out.prompt, out.tokens, out.mask, out.logprobs = conv.prompt, conv.tokens, conv.mask, conv.logprobs
            out.versions = [self.gen.version if m else -1 for m in conv.mask]
        reward = result.value
        if result.error:
            out.fail(f"agent program: {result.error}", "timeout" if result.timed_out else "raised")
        elif conv is None or not ep.requests:
            out.fail("agent program: returned without a reply from the endpoint", "no_request")
        elif isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
            out.fail(f"agent program: returned {reward!r:.100}; it returns the episode's reward, a finite real number", "protocol")
        else:
            out.reward = float(reward)
        if not out.prompt:  # a failed program that never asked: a one-token prompt keeps its row in the batch
            out.prompt = [self.gen.pad_id]
        return out
