"""Weight-only int8/float8 quantization: the per-channel scheme by hand, its error bound, and a
quantized generator whose recorded log-probs are those of the quantized model, re-quantized after
every weight delivery (built-in and Hugging Face models)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.errors import ConfigError, GraphError
from flowrl.examples.llamarl import build_llamarl
from flowrl.graph.configs import SamplingConfig
from flowrl.graph.serialize import from_json, to_json
from flowrl.models.causal_lm import weight_dict
from flowrl.models.quantize import QMAX, QuantizedLinear, dequantize, quant_dtype, quantize_linears_, quantize_per_channel
from flowrl.models.registry import build_model
from flowrl.operators.generation import Generator
from flowrl.operators.logprobs import completion_logprobs
from flowrl.runtime.transports.inprocess import InProcessTransport
from tests.models.helpers import hf_generator_node
from tests.operators.helpers import TINY, prompts_of, tiny_generator_node

PROMPTS = prompts_of([[1, 4, 14, 5], [3, 4, 5], [7, 8, 9, 10, 11]])


def _rollout_logprobs(model, rollout: dict[str, torch.Tensor]) -> torch.Tensor:
    """log p of the rollout's completions under ``model``, one full forward pass (no cache)."""
    with torch.no_grad():
        return completion_logprobs(model, rollout["sample_prompt_ids"], rollout["sample_prompt_lens"],
                                   rollout["completion_ids"], rollout["completion_mask"], temperature=1.0)  # fmt: skip


def _fake_quantized(config, precision: str):
    """A float model of ``config`` whose linear weights are replaced by their dequantized values: what the
    quantized model stands for, computed without ``QuantizedLinear``."""
    model = build_model(config).eval()
    with torch.no_grad():
        for module in model.modules():
            for child in module.children():
                if isinstance(child, torch.nn.Linear) and child.weight is not getattr(model, "tok_embeddings", None):
                    child.weight.copy_(dequantize(*quantize_per_channel(child.weight, precision)))
    return model


@pytest.mark.parametrize(
    ("weight", "q", "scale"),
    [
        ([[1.0, -0.5, 0.25]], [[127, -64, 32]], [1 / 127]),  # -63.5 rounds half to even: -64
        ([[0.0, 0.0]], [[0, 0]], [1.0]),  # an all-zero row gets scale 1, never a division by zero
        ([[-2.54, 0.01, 1.27]], [[-127, 0, 64]], [0.02]),  # 0.5 -> 0 and 63.5 -> 64 (half to even)
    ],
    ids=["row-max", "zero-row", "negative-max"],
)
def test_int8_by_hand(weight, q, scale):
    got_q, got_scale = quantize_per_channel(torch.tensor(weight), "int8")
    assert got_q.dtype == torch.int8 and got_q.tolist() == q
    torch.testing.assert_close(got_scale, torch.tensor(scale))
    torch.testing.assert_close(dequantize(got_q, got_scale), torch.tensor(q, dtype=torch.float32) * torch.tensor(scale)[:, None])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["int8", "float8"]), st.floats(1e-3, 1e3))
def test_the_error_is_bounded_per_channel(seed, precision, magnitude):
    """int8: |W - W~| <= scale / 2 per row; float8 (e4m3, 3 mantissa bits): <= |W| 2^-4 + scale 2^-10."""
    w = torch.randn(6, 40, generator=torch.Generator().manual_seed(seed)) * magnitude
    w[2] *= 1e-3  # rows of very different ranges get their own scales
    q, scale = quantize_per_channel(w, precision)
    assert q.dtype == quant_dtype(precision) and scale.shape == (6,)
    torch.testing.assert_close(scale, w.abs().amax(1) / QMAX[precision])
    err = (w - dequantize(q, scale)).abs()
    if precision == "int8":
        bound = scale[:, None] / 2 * (1 + 1e-5)
    else:
        bound = w.abs() * 2**-4 + scale[:, None] * 2**-10
    assert (err <= bound).all(), float((err - bound).max())
    assert q.float().abs().max() <= QMAX[precision]


@pytest.mark.parametrize("precision", ["int8", "int8-bf16", "float8"])
@pytest.mark.parametrize("use_kv_cache", [True, False], ids=["cache", "no-cache"])
def test_behaviour_logprobs_are_the_quantized_models(precision, use_kv_cache):
    """mu's recorded log-probs equal a forward pass of the quantized model, and of a float model holding
    the dequantized weights (float rounding apart), and differ from the float model's."""
    gen = Generator(tiny_generator_node(precision=precision, n_samples=4, max_new_tokens=6, use_kv_cache=use_kv_cache), seed=0)
    rollout = gen.generate(PROMPTS)
    mask, mu = rollout["completion_mask"], rollout["behaviour_logprobs"]
    torch.testing.assert_close(torch.where(mask, _rollout_logprobs(gen.model, rollout), 0.0), mu, rtol=0, atol=2e-6)
    # int8-bf16 rounds each quantized layer's input to bfloat16 (measured 3e-4 here): a looser match
    reference = torch.where(mask, _rollout_logprobs(_fake_quantized(TINY, precision.removesuffix("-bf16")), rollout), 0.0)
    torch.testing.assert_close(reference, mu, rtol=0, atol=2e-3 if precision == "int8-bf16" else 5e-5)
    float_lp = torch.where(mask, _rollout_logprobs(build_model(TINY).eval(), rollout), 0.0)
    assert float((float_lp - mu).abs().max()) > 1e-4  # the quantization is visible in mu


def test_only_the_linear_layers_are_quantized_and_targets_stay_float():
    gen = Generator(tiny_generator_node(precision="int8"), seed=0)
    quantized = {n for n, m in gen.model.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(quantized) == 7 * TINY.n_layers and "layers.0.attention.wq" in quantized
    assert not any(isinstance(m, torch.nn.Linear) for m in gen.model.modules())
    targets = gen.weight_targets()
    assert sorted(targets) == sorted(weight_dict(build_model(TINY)))
    assert {t.dtype for t in targets.values()} == {torch.float32}
    assert gen.model.tok_embeddings.weight.dtype == torch.float32  # tied output projection: the embedding, float


def test_a_weight_update_requantizes():
    """A transport's delivery (fetch into the float targets, then set the version, as
    ``GeneratorProgram._sync`` does) and ``load_weights`` both re-quantize every layer."""
    gen = Generator(tiny_generator_node(precision="int8", n_samples=4, max_new_tokens=6), seed=0)
    before = gen.generate(PROMPTS)
    q_before = gen.model.layers[0].attention.wq.qweight.clone()
    new = {n: t + 0.05 * torch.randn(t.shape, generator=torch.Generator().manual_seed(i)) for i, (n, t) in enumerate(weight_dict(build_model(TINY)).items())}
    transport = InProcessTransport()
    transport.publish(new, version=3)
    got = transport.fetch_into(gen.weight_targets(), newer_than=gen.version)
    gen.version = got
    assert gen.version == 3
    layer = gen.model.layers[0].attention.wq
    want_q, want_scale = quantize_per_channel(new["layers.0.attention.wq.weight"], "int8")
    assert torch.equal(layer.qweight, want_q) and torch.equal(layer.scale, want_scale)
    assert not torch.equal(layer.qweight, q_before)
    after = gen.generate(PROMPTS)
    assert int(after["rollout_version"]) == 3 and not torch.equal(after["behaviour_logprobs"], before["behaviour_logprobs"])
    torch.testing.assert_close(torch.where(after["completion_mask"], _rollout_logprobs(gen.model, after), 0.0),
                               after["behaviour_logprobs"], rtol=0, atol=2e-6)  # fmt: skip
    gen.load_weights(weight_dict(build_model(TINY)), version=0)  # back to the initial weights
    assert torch.equal(gen.model.layers[0].attention.wq.qweight, q_before) and gen.version == 0
    transport.close()


def test_quantize_linears_leaves_a_tied_output_projection_alone():
    hf = pytest.importorskip("transformers")
    from tests.hf_fixtures import hf_config

    model = hf.AutoModelForCausalLM.from_config(hf_config("llama", tie=False))
    layers = quantize_linears_(model, "int8")
    assert "lm_head" in layers.layers  # untied: quantized like any linear layer
    tied = hf.AutoModelForCausalLM.from_config(hf_config("llama", tie=True))
    assert "lm_head" not in quantize_linears_(tied, "int8").layers
    assert isinstance(tied.lm_head, torch.nn.Linear) and tied.lm_head.weight is tied.model.embed_tokens.weight
    with pytest.raises(ConfigError, match="no nn.Linear layer to quantize to int8"):
        quantize_linears_(torch.nn.Sequential(torch.nn.ReLU()), "int8")


def test_a_hugging_face_generator_samples_in_int8(hf_dir):
    """Llama and Qwen2 (whose q/k/v layers have biases, kept in float and still fed by the transports)."""
    gen = Generator(hf_generator_node(hf_dir, precision="int8", n_samples=3, max_new_tokens=6), seed=0)
    names = {n for n, m in gen.model.named_modules() if isinstance(m, QuantizedLinear)}
    assert "model.layers.0.self_attn.q_proj" in names and "model.layers.1.mlp.down_proj" in names
    rows = prompts_of([[5, 6, 7], [8, 9, 10, 11]])
    rollout = gen.generate(rows)
    mu = rollout["behaviour_logprobs"]
    torch.testing.assert_close(torch.where(rollout["completion_mask"], _rollout_logprobs(gen.model, rollout), 0.0), mu, rtol=0, atol=2e-6)
    float_gen = Generator(hf_generator_node(hf_dir, n_samples=3, max_new_tokens=6), seed=0)
    float_lp = torch.where(rollout["completion_mask"], _rollout_logprobs(float_gen.model, rollout), 0.0)
    assert float((float_lp - mu).abs().max()) > 1e-5
    state = {n: t * 1.5 for n, t in float_gen.weight_targets().items()}
    gen.load_weights(state, version=2)
    q = gen.model.model.layers[0].self_attn.q_proj
    assert torch.equal(q.qweight, quantize_per_channel(state["model.layers.0.self_attn.q_proj.weight"], "int8")[0])
    if "model.layers.0.self_attn.q_proj.bias" in state:
        assert torch.equal(q.bias, state["model.layers.0.self_attn.q_proj.bias"])


def _int8_graph():
    return build_llamarl(precision="int8")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: SamplingConfig(precision="int4"), r"precision='int4' is not one of \['float32', 'bfloat16', 'float16', 'int8', 'int8-bf16', 'float8'\]"),
        (lambda: from_json(to_json(_int8_graph()).replace('"int8"', '"fp8"')), r"Invalid enum value 'fp8' - at `\$\.nodes\[1\]\.sampling\.precision`"),
        (lambda: quant_dtype("bfloat16"), r"unknown quantized precision 'bfloat16': use one of \['int8', 'int8-bf16', 'float8'\]"),
    ],
    ids=["constructor", "graph-file", "quant-dtype"],
)
def test_a_bad_precision_is_a_clear_error(make, match):
    with pytest.raises((ConfigError, GraphError), match=match):
        make()


@pytest.mark.parametrize("width", [16, 48, 88], ids=["kernel-16", "kernel-48", "portable-88"])
def test_int8_bf16_layer_is_the_int8_weights_with_bfloat16_inputs(width):
    """Widths that are multiples of 16 take aten's int8 kernel, others the portable form: both compute
    (x rounded to bfloat16) @ Q.T * scale, up to bfloat16 accumulation."""
    from flowrl.models.quantize import _int8_bf16_linear

    g = torch.Generator().manual_seed(width)
    w, x = torch.randn(24, width, generator=g), torch.randn(2, 5, width, generator=g)
    q, scale = quantize_per_channel(w, "int8-bf16")
    assert q.dtype == torch.int8 and torch.equal(q, quantize_per_channel(w, "int8")[0])
    out = _int8_bf16_linear(x, q, scale)
    expected = (x.bfloat16().float() @ q.float().T) * scale
    assert out.shape == (2, 5, 24) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()))
