"""The agent endpoint under a burst: 256 agent programs send their first request at the same moment
(a barrier), each with a client that never retries (``http.client``); every one is answered and
trained on (no ``Connection reset by peer``, no failed sample). The built-in engine samples."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
from typing import Any

import torch

from flowrl.graph.configs import ModelConfig, SamplingConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.operators.generation import Generator

MODEL = ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=32)
PROGRAMS = 256
#: every program waits here, so their first requests reach the endpoint together
BARRIER = threading.Barrier(PROGRAMS, timeout=60)


def burst_agent(session: Any, row: dict[str, Any]) -> float:
    """One request, sent when all programs are ready, over a fresh connection with no retry."""
    url = urllib.parse.urlsplit(session.base_url)
    body = json.dumps({"model": session.model, "messages": [{"role": "user", "content": row["prompt"]}]})
    BARRIER.wait()
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.request("POST", url.path + "/chat/completions", body=body, headers={"Content-Type": "application/json"})
        reply = json.loads(conn.getresponse().read())
    finally:
        conn.close()
    return float(len(reply["choices"][0]["token_ids"]))


def test_256_first_requests_at_once_are_all_answered():
    from flowrl.serve.agents import AgentRollouts

    gen = Generator(GeneratorNode(name="gen", model=MODEL, sampling=SamplingConfig(n_samples=2, max_new_tokens=2)), seed=0)
    agents = AgentRollouts(gen, burst_agent, model=MODEL, max_turns=1, episode_timeout_s=60)
    prompts = PROGRAMS // 2
    try:
        out, metrics = agents.generate({"prompt_ids": torch.full((prompts, 2), 5), "prompt_lens": torch.full((prompts,), 2),
                                        "prompt_index": torch.arange(prompts)})  # fmt: skip
    finally:
        agents.close()
    assert metrics["env/failed"] == 0, {k: v for k, v in metrics.items() if k.startswith("env/failed")}
    assert not out["env_failed"].any() and out["completion_mask"].any(1).all()
    assert agents.endpoint.errors == 0
