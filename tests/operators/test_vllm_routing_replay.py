"""Routing replay from the vLLM engine: the layout of vLLM's routed experts in the rollout (any machine),
and, on a CUDA GPU, a vLLM generator's recorded routing replayed by the trainer (skipped visibly elsewhere:
vLLM returns routed experts only from its Model Runner V2, which needs Triton)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.graph.configs import HFModelConfig, SamplingConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.models.routing import RoutingAgreement, unrecorded
from flowrl.operators.engines.vllm_routing import VLLMRouting
from tests.hf_fixtures import make_hf_dir

CONFIG = {"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [1]}


def test_routing_shape_counts_only_the_moe_layers() -> None:
    r = VLLMRouting.from_config(CONFIG, owner="generator 'gen'")
    assert (r.layers, r.experts, r.top_k) == (3, 8, 2)
    assert VLLMRouting.from_config({**CONFIG, "decoder_sparse_step": 2, "mlp_only_layers": []}, owner="g").layers == 2  # layers 1 and 3
    with pytest.raises(ConfigError, match="needs a mixture of experts; config.json has num_experts=0"):
        VLLMRouting.from_config({"num_hidden_layers": 2}, owner="generator 'gen'")


def test_a_completions_array_lands_after_the_left_padding() -> None:
    """A prompt of 3 real tokens in a width of 5 and 4 drawn tokens: vLLM's rows 0..5 (3 + 4 - 1 fed)
    go to columns 2..7; padding, the last drawn token and the unused completion columns stay unrecorded."""
    r = VLLMRouting.from_config(CONFIG, owner="generator 'gen'")
    routed = r.empty(2, 5 + 6)
    array = np.arange(7 * 3 * 2).reshape(7, 3, 2) % 8  # vLLM may return the last token's routing too: it is not fed
    r.place(routed, 1, 2, 6, array)
    assert torch.equal(routed[1, 2:8], torch.as_tensor(array[:6]).to(torch.uint8))
    free = torch.ones(11, dtype=torch.bool)
    free[2:8] = False
    assert bool((routed[1, free] == unrecorded(8)).all()) and bool((routed[0] == unrecorded(8)).all())
    with pytest.raises(ConfigError, match=r"must be \[>= 6, 3, 2\]"):
        r.place(routed, 0, 2, 6, array[:5])
    with pytest.raises(ConfigError, match="returned no routed_experts"):
        r.place(routed, 0, 2, 6, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM returns routed experts only from Model Runner V2, which needs Triton: a CUDA GPU")
def test_vllm_records_the_routing_the_trainer_replays(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from flowrl.graph.nodes import LossNode
    from flowrl.operators.engines.vllm_engine import VLLMGenerator
    from flowrl.operators.logprobs import completion_logprobs
    from flowrl.operators.trainer import Trainer
    from tests.models.helpers import hf_policy_node, left_padded
    from tests.tolerances import rollout_logprob_atol

    directory = make_hf_dir(tmp_path / "moe", "qwen3_moe", hidden=128)  # head_dim 32: GPU attention kernels take it
    node = GeneratorNode(
        name="gen", model=HFModelConfig(path=str(directory)), engine="vllm", routing_replay=True,
        sampling=SamplingConfig(n_samples=2, max_new_tokens=6),
    )  # fmt: skip
    gen = VLLMGenerator(node, seed=0, device="cuda:0")
    try:
        rollout = gen.generate(left_padded([[1, 5, 6, 7], [1, 12], [1, 20, 21, 22, 23]]))
    finally:
        gen.close()
    routed = rollout["routed_experts"]
    S, Tp = rollout["sample_prompt_ids"].shape
    assert routed.dtype == torch.uint8 and routed.shape == (S, Tp + 6, 2, 2)
    prompt_real = torch.arange(Tp)[None, :] >= (Tp - rollout["sample_prompt_lens"])[:, None]
    fed = torch.arange(6)[None, :] < (rollout["completion_mask"].sum(1) - 1)[:, None]
    assert torch.equal((routed != unrecorded(8)).all(-1).all(-1), torch.cat([prompt_real, fed], dim=1))
    trainer = Trainer(hf_policy_node(directory, packing=False), LossNode(name="aipo"))
    agreement = RoutingAgreement()
    args = [rollout[k] for k in ("sample_prompt_ids", "sample_prompt_lens", "completion_ids", "completion_mask")]
    with torch.no_grad():
        pi = completion_logprobs(trainer.model, *args, routed_experts=routed, agreement=agreement)
    assert agreement.total > 0 and agreement.agree / agreement.total > 0.95  # float32 both sides: near-ties only may differ
    diff = (pi - rollout["behaviour_logprobs"])[rollout["completion_mask"]].abs()
    assert float(diff.max()) < rollout_logprob_atol(trainer.model, rollout)


def test_vllm_on_a_cpu_is_refused_before_it_starts(tmp_path: Path) -> None:
    from flowrl.operators.engines import check_routing_replay

    directory = make_hf_dir(tmp_path / "moe", "qwen3_moe", weights=False)
    node = GeneratorNode(name="gen", model=HFModelConfig(path=str(directory), init="random"), engine="vllm", routing_replay=True)
    with pytest.raises(ConfigError, match=r"generator 'gen': routing_replay=True with engine='vllm' on 'cpu'.*Model Runner V2, which needs Triton"):
        check_routing_replay(node, device="cpu")
    check_routing_replay(msgspec.structs.replace(node, engine="builtin"), device="cpu")
