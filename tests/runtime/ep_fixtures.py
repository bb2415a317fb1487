"""A session fixture (a ``pytest_plugins`` entry of ``tests/conftest.py``): one ``flowrl run`` under torchrun of a
tiny Qwen3-MoE policy at ep = 2, shared by ``tests/runtime/test_expert_parallel.py`` (it trains, its checkpoint
exports) and ``tests/test_mesh_support.py`` (the policy's ``ep`` row runs as planned)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

__all__ = ["EP_PLACEMENT", "ep_graph", "moe_ep_run"]

#: The generator on both ranks beside the policy's, which splits the 8 experts over its 2 dp ranks.
EP_PLACEMENT = {"gen": [0, 1], "policy": {"ranks": [0, 1], "mesh": {"dp": 2, "ep": 2}}}


def ep_graph(model_dir: str) -> Any:
    """prompts -> gen (recording its routing) -> reward -> grpo -> policy (FSDP2, ep from the placement,
    replaying the generator's experts) on ``model_dir``, k = 0."""
    from flowrl.graph.builder import GraphBuilder
    from flowrl.graph.configs import HFModelConfig

    b = GraphBuilder("moe_ep", model=HFModelConfig(path=model_dir))
    prompts = b.source("prompts", task="copy", batch_size=4)
    gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=4, temperature=1.0, routing_replay=True)
    reward = b.scorer("reward", gen, fn="tests.operators.userfns:mean_id_reward")
    loss = b.loss("grpo", gen, reward, objective="grpo")
    policy = b.policy("policy", loss, lr=1e-2, sharding="fsdp")
    b.weights(policy, gen, max_staleness=0)
    return b.build()


@pytest.fixture(scope="session")
def moe_ep_run(hf_qwen3_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """2 GRPO steps at ep = 2 (``EP_PLACEMENT``) with a checkpoint: the graph, the placement, the rows, the folder."""
    from flowrl.graph.serialize import to_json
    from flowrl.placement.forms import decode_placement
    from tests.runtime.test_torchrun import _rows, _torchrun

    root = tmp_path_factory.mktemp("moe_ep")
    graph = ep_graph(str(hf_qwen3_moe_dir))
    (root / "graph.json").write_text(to_json(graph))
    (root / "place.json").write_text(json.dumps(EP_PLACEMENT))
    proc = _torchrun(2, ["-m", "flowrl", "run", "graph.json", "--backend", "torchrun", "--plan", "place.json", "--steps", "2",
                         "--quiet", "--metrics", "m.jsonl", "--checkpoint-dir", "ck"], root, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    placement = decode_placement((root / "place.json").read_bytes(), graph, where="place.json")
    return {"graph": graph, "placement": placement, "rows": _rows(root / "m.jsonl"), "root": root, "model_dir": hf_qwen3_moe_dir}
