"""The OpenAI-compatible chat endpoint: one base URL per episode, replies sampled by a generator's engine.

Routes (``http://HOST:PORT/episodes/<episode>/v1`` is an episode's base URL, what an OpenAI client's
``base_url`` is set to):

- ``GET  .../v1/models``: the one model served (``model``, by default the generator's name);
- ``POST .../v1/chat/completions``: ``{"model", "messages": [{"role", "content"}, ...]}`` -> OpenAI's
  ``chat.completion`` object, one choice, with its ``logprobs.content`` (each sampled token's
  log-prob under mu, its ``token_id``) and, outside OpenAI's schema, ``choices[0].token_ids`` (the
  reply's ids as sampled) and ``prompt_token_ids`` (the ids the reply was sampled after).

The first request of an episode sets its prompt; each later one repeats the conversation and adds
messages (``flowrl.serve.conversation``). Sampling is the generator's ``SamplingConfig`` (what mu
is recorded with): a request's ``temperature``, ``top_p``, ``max_tokens``, ``stop`` ... are ignored.

Bad input gets an OpenAI-style error (``{"error": {"message", "type", "code"}}``) and the run goes
on: another model name (404 ``model_not_found``), an unknown or finished episode (404), a body that
is not JSON or messages of the wrong form or that rewrite the conversation (400), a conversation
that would exceed the model's context (400 ``context_length_exceeded``; the episode ends there,
truncated, not failed), ``n`` other than 1 or ``stream`` (400).

Requests from many episodes are sampled together: a sampler thread takes every request waiting
(after ``batch_window_s``) and hands them to ``sample(sequences, seeds)`` in one call. Served by the
standard library's ``ThreadingHTTPServer`` on a daemon thread per connection, so the endpoint needs
neither vLLM nor a web framework (fastapi/uvicorn come with vLLM only), and stops with ``close``.

A burst of first requests (every program of a batch connecting at once) is held, not refused: the
server listens with the largest queue the kernel allows (``listen_backlog()``, the kernel's
``net.core.somaxconn``, 4096 on current Linux, instead of the standard library's 5), so connections
wait until the accept loop takes them. ``AgentRollouts`` warns when a batch runs more programs than
that queue holds.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from flowrl.serve.conversation import Conversation, ConversationError, Renderer, check_messages

__all__ = ["ChatEndpoint", "EndpointEpisode", "Sampler", "listen_backlog"]

log = logging.getLogger("flowrl.serve")

#: ``sample(sequences, seeds) -> [(ids, logprobs), ...]``: one reply per token sequence.
Sampler = Callable[[list[list[int]], list[int]], list[tuple[list[int], list[float]]]]

_ROUTE = re.compile(r"^/episodes/([A-Za-z0-9_-]+)/v1(/.*)$")


def listen_backlog() -> int:
    """The longest listen queue the kernel grants (``net.core.somaxconn``; ``socket.SOMAXCONN`` where it
    cannot be read): connections beyond it may be reset before the server accepts them."""
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return max(int(f.read().strip()), socket.SOMAXCONN)
    except (OSError, ValueError):
        return socket.SOMAXCONN


class _Server(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with the kernel's longest listen queue (the standard library asks for 5)."""

    daemon_threads = True
    request_queue_size = listen_backlog()


class _RequestError(Exception):
    def __init__(self, status: int, message: str, code: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind


@dataclass
class EndpointEpisode:
    """One episode's state on the endpoint.

    Attributes:
        id: what its base URL names.
        seed: mixed with the reply's number into each reply's sampling seed.
        conversation: None until the first request.
        requests: replies sampled.
        truncated: a request would have exceeded the context: the episode ends there.
        closed: no more requests are taken (the program returned, or failed).
    """

    id: str
    seed: int
    conversation: Conversation | None = None
    requests: int = 0
    truncated: bool = False
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class ChatEndpoint:
    """The endpoint (see the module docstring).

    Args:
        model: the model name clients must ask for.
        renderer: messages to ids for the model's tokenizer.
        sample: the engine's sampler (one reply per sequence).
        decode: ids -> text (the reply's content).
        stop_tokens: ids that end a reply (dropped from its text, kept in its ids).
        max_new_tokens: a reply's length at most (the generator's ``max_new_tokens``).
        max_seq_len: prompt + conversation + ``max_new_tokens`` at most.
        max_requests: replies per episode at most (more get 400).
        host, port: where to listen (``port=0``: a free port).
        batch_window_s: how long the sampler waits for more requests before sampling.
    """

    def __init__(
        self, *, model: str, renderer: Renderer, sample: Sampler, decode: Callable[[list[int]], str], stop_tokens: tuple[int, ...],
        max_new_tokens: int, max_seq_len: int, max_requests: int = 64, host: str = "127.0.0.1", port: int = 0, batch_window_s: float = 0.002,
    ) -> None:  # fmt: skip
        self.model, self.renderer, self._sample, self._decode = model, renderer, sample, decode
        self.stop_tokens, self.max_new_tokens, self.max_seq_len, self.max_requests = stop_tokens, max_new_tokens, max_seq_len, max_requests
        self.batch_window_s = batch_window_s
        self.episodes: dict[str, EndpointEpisode] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[list[int], int, queue.Queue] | None] = queue.Queue()
        self.errors = 0  # requests refused
        handler = type("Handler", (_Handler,), {"endpoint": self})
        self._server = _Server((host, port), handler)
        self.backlog = self._server.request_queue_size  # connections the kernel holds until accepted
        self.host, self.port = str(self._server.server_address[0]), self._server.server_address[1]  # AF_INET: a str host
        self._threads = [threading.Thread(target=self._server.serve_forever, name="flowrl-endpoint", daemon=True),
                         threading.Thread(target=self._sampler, name="flowrl-endpoint-sampler", daemon=True)]  # fmt: skip
        for t in self._threads:
            t.start()

    # -- episodes -----------------------------------------------------------------------------------
    def open(self, seed: int) -> EndpointEpisode:
        """A new episode; its base URL is ``base_url(ep)``."""
        ep = EndpointEpisode(id=uuid.uuid4().hex[:16], seed=seed)
        with self._lock:
            self.episodes[ep.id] = ep
        return ep

    def base_url(self, ep: EndpointEpisode) -> str:
        return f"http://{self.host}:{self.port}/episodes/{ep.id}/v1"

    def finish(self, ep: EndpointEpisode) -> None:
        """Take no more requests for ``ep`` (a request in flight completes) and forget it."""
        with ep.lock:
            ep.closed = True
        with self._lock:
            self.episodes.pop(ep.id, None)

    def close(self) -> None:
        """Stop serving and sampling (idempotent)."""
        if self._threads:
            self._server.shutdown()
            self._server.server_close()
            self._queue.put(None)
            for t in self._threads:
                t.join(timeout=10)
            self._threads = []

    # -- sampling -----------------------------------------------------------------------------------
    def _sampler(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            deadline = time.perf_counter() + self.batch_window_s
            while (left := deadline - time.perf_counter()) > 0:
                try:
                    nxt = self._queue.get(timeout=left)
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
            try:
                replies = self._sample([b[0] for b in batch], [b[1] for b in batch])
                for (_, _, box), reply in zip(batch, replies):
                    box.put(reply)
            except Exception as exc:  # the engine failed: every waiting request is told, the endpoint goes on
                log.exception("endpoint: sampling failed")
                for _, _, box in batch:
                    box.put(exc)

    def _reply(self, sequence: list[int], seed: int) -> tuple[list[int], list[float]]:
        box: queue.Queue = queue.Queue(maxsize=1)
        self._queue.put((sequence, seed, box))
        out = box.get()
        if isinstance(out, Exception):
            raise _RequestError(500, f"the engine failed to sample: {type(out).__name__}: {out}", "engine_error", "server_error")
        return out

    # -- a request ----------------------------------------------------------------------------------
    def chat(self, episode_id: str, body: Any) -> dict[str, Any]:
        """The ``chat.completion`` for ``body`` in episode ``episode_id``.

        Raises:
            _RequestError: for bad input (see the module docstring).
        """
        with self._lock:
            ep = self.episodes.get(episode_id)
        if ep is None:
            raise _RequestError(404, f"no open episode {episode_id!r} (finished, timed out, or never opened); use the base URL flowrl gave the program", "episode_not_found")
        if not isinstance(body, dict):
            raise _RequestError(400, "the request body must be a JSON object", "invalid_body")
        if body.get("model") != self.model:
            raise _RequestError(404, f"the model {body.get('model')!r} does not exist here; this endpoint serves {self.model!r}", "model_not_found")
        if body.get("n", 1) != 1:
            raise _RequestError(400, f"n={body.get('n')!r}: one choice per request (each reply is one sample of the episode)", "invalid_n")
        if body.get("stream"):
            raise _RequestError(400, "stream=true is not supported; ask without streaming", "stream_unsupported")
        try:
            messages = check_messages(body.get("messages"))
        except ConversationError as exc:
            raise _RequestError(400, str(exc), "invalid_messages") from exc
        with ep.lock:  # one request of an episode at a time: its conversation grows in order
            if ep.closed or ep.truncated:
                raise _RequestError(404, f"episode {episode_id!r} has ended" + (" (its context is full)" if ep.truncated else ""), "episode_not_found")
            if ep.requests >= self.max_requests:
                raise _RequestError(400, f"episode {episode_id!r} reached its {self.max_requests} replies (max_turns)", "too_many_requests")
            try:
                if ep.conversation is None:
                    ep.conversation = Conversation(self.renderer, messages)
                else:
                    ep.conversation.extend(messages)
            except ConversationError as exc:
                raise _RequestError(400, str(exc), "invalid_messages") from exc
            sequence = ep.conversation.sequence
            if len(sequence) + self.max_new_tokens > self.max_seq_len:
                ep.truncated = True
                raise _RequestError(
                    400, f"the conversation is {len(sequence)} tokens; with max_new_tokens={self.max_new_tokens} it exceeds the "
                    f"model's context of {self.max_seq_len}: the episode ends here", "context_length_exceeded",
                )  # fmt: skip
            ids, logprobs = self._reply(sequence, (ep.seed * 1_000_003 + ep.requests) & 0x3FFFFFFFFFFFFFFF)
            stopped = bool(ids) and ids[-1] in self.stop_tokens
            text = self._decode(ids[:-1] if stopped else ids)
            ep.conversation.add_reply(ids, logprobs, text=text, stopped=stopped)
            ep.requests += 1
        return {
            "id": f"chatcmpl-{ep.id}-{ep.requests}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop" if stopped else "length",
                "logprobs": {"content": [{"token": self._decode([t]), "token_id": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                                         for t, lp in zip(ids, logprobs)]},
                "token_ids": ids,
            }],
            "prompt_token_ids": sequence,
            "usage": {"prompt_tokens": len(sequence), "completion_tokens": len(ids), "total_tokens": len(sequence) + len(ids)},
        }  # fmt: skip

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "flowrl"}]}


class _Handler(BaseHTTPRequestHandler):
    endpoint: ChatEndpoint
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("endpoint: " + format, *args)

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, err: _RequestError) -> None:
        with self.endpoint._lock:
            self.endpoint.errors += 1
        log.info("endpoint: %s %s -> %d %s", self.command, self.path, err.status, err.message)
        self._send(err.status, {"error": {"message": err.message, "type": err.kind, "param": None, "code": err.code}})

    def _route(self) -> tuple[str, str]:
        match = _ROUTE.match(self.path.split("?", 1)[0])
        if match is None:
            raise _RequestError(404, f"no route {self.path!r}; an episode's base URL is http://HOST:PORT/episodes/<episode>/v1", "not_found")
        return match.group(1), match.group(2)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        try:
            _, rest = self._route()
            if rest != "/models":
                raise _RequestError(404, f"no route GET {rest!r}; try /models", "not_found")
            self._send(200, self.endpoint.models())
        except _RequestError as err:
            self._error(err)

    def do_POST(self) -> None:  # noqa: N802
        try:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            episode, rest = self._route()
            if rest != "/chat/completions":
                raise _RequestError(404, f"no route POST {rest!r}; this endpoint serves /chat/completions", "not_found")
            try:
                body = json.loads(raw or b"null")
            except json.JSONDecodeError as exc:
                raise _RequestError(400, f"the request body is not JSON ({exc.msg} at position {exc.pos})", "invalid_json") from exc
            self._send(200, self.endpoint.chat(episode, body))
        except _RequestError as err:
            self._error(err)
        except Exception as exc:  # noqa: BLE001 - a bug here must not kill the endpoint
            log.exception("endpoint: request failed")
            self._error(_RequestError(500, f"{type(exc).__name__}: {exc}", "internal_error", "server_error"))
