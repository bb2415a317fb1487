"""The planner prices a LoRA policy as what it is: its adapters alone have gradients, optimizer state
and weight syncs (``ModelSpec.adapter_params``), its frozen base is held but not trained."""

from __future__ import annotations

import json
import math

import msgspec
import pytest

from flowrl.graph.configs import HFModelConfig, LoraConfig
from flowrl.modelspec import lora_adapter_params, model_from_config, model_preset
from flowrl.planners.cluster import parse_cluster
from flowrl.planners.estimate.common import Context
from flowrl.planners.estimate.sync import estimate_sync
from flowrl.planners.estimate.train import estimate_train
from flowrl.planners.parallel import ParallelDims
from flowrl.planners.tuning import Tuning
from flowrl.planners.workload import Workload

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ALL_LINEAR, ("mlp.down_proj",), ("model.layers.1.self_attn.q_proj",)])
def test_the_counted_adapters_are_the_ones_peft_puts_in_the_model(tmp_path, targets):
    """By arithmetic from config.json against the adapters ``flowrl.models.lora`` builds (peft's own
    shapes), for a Qwen2 model with grouped-query attention (k/v narrower than q)."""
    from flowrl.models.lora import adapter_shapes
    from tests.hf_fixtures import make_hf_dir

    directory = make_hf_dir(tmp_path / "qwen2", "qwen2", tie=False, weights=False)
    config = HFModelConfig(path=str(directory), init="random", lora=LoraConfig(r=4, alpha=8, target_modules=targets))
    built = sum(math.prod(shape) for shape, _ in adapter_shapes(config).values())
    assert model_from_config(config).adapter_params == built > 0
    assert model_from_config(msgspec.structs.replace(config, lora=None)).adapter_params == 0


def _ctx(cluster: str) -> Context:
    return Context(cluster=parse_cluster(cluster), tuning=Tuning(),
                   workload=Workload(prompts_per_step=8, samples_per_prompt=4, prompt_len=256, gen_len=256))


def _lora_7b(tmp_path):
    """Qwen2.5-7B's published shape as a config.json (no weights: the planner reads JSON only)."""
    spec = model_preset("qwen2.5-7b")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": spec.dim, "num_hidden_layers": spec.n_layers, "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads, "intermediate_size": spec.ffn_dim, "vocab_size": spec.vocab_size,
        "tie_word_embeddings": spec.tie_embeddings, "max_position_embeddings": 4096,
    }))  # fmt: skip
    full = HFModelConfig(path=str(tmp_path))
    return model_from_config(full), model_from_config(msgspec.structs.replace(full, lora=LoraConfig(r=16, alpha=32, target_modules=ALL_LINEAR)))


def test_a_7b_lora_policy_fits_one_h100_where_the_full_policy_does_not(tmp_path):
    full, lora = _lora_7b(tmp_path)
    assert lora.params == full.params and 0 < lora.adapter_params < full.params / 100
    ctx = _ctx("1xH100")
    one = ParallelDims(dp=1, tp=1)
    f, l = estimate_train(full, one, [0], ctx), estimate_train(lora, one, [0], ctx)
    assert not f.feasible and l.feasible, (f.problem, l.memory)
    assert l.memory.weights == f.memory.weights  # the frozen base is still held
    tuning = ctx.tuning
    pb = tuning.param_bytes or ctx.cluster.device.dtype_bytes
    ob = tuning.optimizer_bytes or (12 if pb <= 2 else 8)
    assert l.memory.grads == int(lora.adapter_params * tuning.grad_bytes)
    assert l.memory.optimizer == int(lora.adapter_params * ob)


def test_a_lora_backward_costs_one_forward_not_two(tmp_path):
    """Compute of a step: passes 2 (forward + input-gradient backward) for LoRA, 3 for full training."""
    full, lora = _lora_7b(tmp_path)
    ctx = _ctx("8xH100")
    dims = ParallelDims(dp=1, tp=8)
    f, l = estimate_train(full, dims, range(8), ctx), estimate_train(lora, dims, range(8), ctx)
    assert f.feasible and l.feasible
    assert l.breakdown["compute"] / f.breakdown["compute"] == pytest.approx(2 / 3, rel=1e-6)


def test_a_lora_sync_moves_the_float32_adapters_to_every_replica(tmp_path):
    full, lora = _lora_7b(tmp_path)
    ctx = _ctx("8xH100")
    kw = dict(src="policy", dst="gen", transport="collective", src_devices=range(4), src_dims=ParallelDims(dp=4),
              dst_devices=range(4, 8), dst_dims=ParallelDims(dp=4), dst_bytes_per_param=2, src_bytes_per_param=4, ctx=ctx)
    s_full, s_lora = estimate_sync(full, **kw), estimate_sync(lora, **kw)
    assert s_lora.bytes == lora.adapter_params * 4 * 4 and "LoRA adapters only" in s_lora.note
    assert s_lora.time_s < s_full.time_s / 10


def test_model_override_keeps_the_graphs_lora():
    """``flowrl plan --model qwen2.5-7b`` of a LoRA graph plans the published shape with the graph's
    adapters: the policy trains and sends them alone (9.6 MiB of float32 for r=8 on q_proj, v_proj),
    not the 7B model's 15.2 GB. Fails where the override drops the node's ``lora``."""
    from flowrl.examples.hf_copy import build_hf_copy
    from flowrl.planners.plan import plan_graph

    graph = build_hf_copy(engine="vllm", lora=dict(r=8, alpha=16, target_modules=["q_proj", "v_proj"]))
    spec = model_preset("qwen2.5-7b")
    adapters = lora_adapter_params(spec, 8, ("q_proj", "v_proj"))
    plan = plan_graph(graph, "8xH100", model=spec, strategy="gen:d4@0-3 | policy:d4@4-7")
    assert plan.models["policy"].adapter_params == plan.models["gen"].adapter_params == adapters
    (sync,) = plan.weight_syncs
    assert sync.bytes == adapters * 4 * 4  # float32 adapters to each of the generator's 4 replicas
    assert "LoRA adapters only" in sync.note
    from flowrl.planners.report import format_plan

    assert f"model qwen2.5-7b + LoRA adapters ({adapters / 1e6:.3g}M trained)" in format_plan(plan)
    unadapted = plan_graph(build_hf_copy(engine="vllm"), "8xH100", model=spec, strategy="gen:d4@0-3 | policy:d4@4-7")
    assert unadapted.models["policy"].adapter_params == 0 and unadapted.weight_syncs[0].bytes > 100 * sync.bytes
