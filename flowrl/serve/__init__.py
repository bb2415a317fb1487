"""An OpenAI-compatible chat endpoint served from a generator, so that agent programs written against an
OpenAI client can be trained.

- ``conversation``: a chat conversation as token ids: the first request's messages rendered once
  (the prompt), then each sampled reply's ids as sampled and each later message's ids appended
  (chat template applied incrementally): never re-tokenised text.
- ``openai_server``: the HTTP endpoint (the standard library's ``http.server``: it runs without vLLM
  or any web framework installed), one base URL per episode, OpenAI's chat-completions form plus
  the sampled token ids and log-probs; bad requests get OpenAI-style errors, never the run.
- ``agents``: ``AgentRollouts``, a generator's episodes driven by an agent program
  ``program(session, row) -> reward``: a batch's programs run in threads against the endpoint, the
  engine samples their requests in batches, and each episode becomes a multi-turn sample.
"""

__all__: list[str] = []
