"""LoRA policies against peft itself: gradients, the generator's merged weights, what a sync moves,
checkpoints, export, and the refusals of bad adapter settings."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.graph.configs import HFModelConfig, LoraConfig, LossConfig, ModelConfig, OptimizerConfig, SamplingConfig
from flowrl.graph.nodes import GeneratorNode, LossNode, PolicyNode
from flowrl.operators.generation import Generator
from flowrl.operators.trainer import Trainer
from flowrl.runtime.transports.weight_transport import layout_of
from flowrl.runtime.transports.inprocess import InProcessTransport
from tests.models.helpers import hf_reference_model, left_padded, reference_logprobs
from tests.tolerances import GradientMagnitudes, assert_within, logit_atol, rollout_logprob_atol

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

PROMPTS = [[1, 5, 6, 7], [1, 12], [1, 20, 21, 22, 23]]
LORA = LoraConfig(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


def _model(directory, lora: LoraConfig | None = LORA) -> HFModelConfig:
    return HFModelConfig(path=str(directory), lora=lora)


def _policy(directory, **optimizer) -> Trainer:
    optimizer.setdefault("grad_clip", 0.0)
    return Trainer(PolicyNode(name="policy", model=_model(directory), optimizer=OptimizerConfig(**optimizer)), LossNode(name="pg", loss=LossConfig(objective="pg")))


def _generator(directory, **sampling) -> Generator:
    sampling.setdefault("n_samples", 2)
    sampling.setdefault("max_new_tokens", 6)
    return Generator(GeneratorNode(name="gen", model=_model(directory), sampling=SamplingConfig(**sampling)), seed=0)


def _random_adapters(trainer: Trainer, seed: int = 1) -> dict[str, torch.Tensor]:
    """Nonzero adapters (B starts at zero, which would give A no gradient), loaded into the trainer."""
    gen = torch.Generator().manual_seed(seed)
    state = {n: 0.2 * torch.randn(t.shape, generator=gen) for n, t in trainer.weights().items()}
    trainer.load_weights(state)
    return state


def _peft_model(directory, adapters: dict[str, torch.Tensor], lora: LoraConfig = LORA):
    """The directory's model wrapped by peft itself with ``adapters`` (flowrl's names) loaded."""
    base = hf_reference_model(directory)
    config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=0.0, target_modules=list(lora.target_modules))
    model = peft.get_peft_model(base, config)
    state = {"base_model.model." + n: t for n, t in adapters.items()}
    result = peft.set_peft_model_state_dict(model, state)
    assert not [k for k in result.unexpected_keys if "lora" in k]
    return model


@pytest.fixture(scope="module")
def batch(hf_qwen2_dir) -> dict[str, torch.Tensor]:
    """One rollout of the base model with rewards, shared by the module's training tests."""
    return _batch(hf_qwen2_dir)


def _batch(directory) -> dict[str, torch.Tensor]:
    out = Generator(GeneratorNode(name="g", model=_model(directory, None), sampling=SamplingConfig(n_samples=2, max_new_tokens=6)), seed=0).generate(left_padded(PROMPTS))
    return {**out, "rewards": torch.tensor([1.0, -0.5, 0.3, 0.9, -1.0, 0.2])}


def test_adapter_gradient_equals_autograd_through_peft(hf_qwen2_dir, batch):
    """The trainer's gradient on A and B is plain autograd through peft's model on the same batch and loss."""
    trainer = _policy(hf_qwen2_dir)
    adapters = _random_adapters(trainer)
    trainer.train_step(batch)
    ref = _peft_model(hf_qwen2_dir, adapters)
    with GradientMagnitudes(ref) as mags:  # peft's |delta|.|x| sums on A and B (tests/tolerances.py)
        logprobs = reference_logprobs(ref, batch)  # each row alone through peft's model: no flowrl code
        # REINFORCE written out: group-mean baseline, -sum(adv * log pi) over real tokens / their count
        mask, rewards, groups = batch["completion_mask"], batch["rewards"], batch["group_ids"].tolist()
        adv = [float(rewards[s]) - sum(float(rewards[j]) for j, g2 in enumerate(groups) if g2 == g) / groups.count(g) for s, g in enumerate(groups)]
        loss = -sum(adv[s] * logprobs[s, : int(mask[s].sum())].sum() for s in range(len(adv))) / int(mask.sum())
        loss.backward()
    width = batch["sample_prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
    tolerances = mags.tolerances(  # the trainer's padded batch against rows alone; A then B: r more per adapted layer
        seq_len=width, positions=batch["completion_ids"].shape[0] * width, extra=[LORA.r] * 2 * len(LORA.target_modules),
        named=[(n.removeprefix("base_model.model.").replace(".default.weight", ".weight"), p) for n, p in ref.named_parameters() if p.requires_grad],
    )
    mine = {n.replace(".default.weight", ".weight"): p for n, p in trainer.model.named_parameters() if p.requires_grad}
    theirs = {n.removeprefix("base_model.model.").replace(".default.weight", ".weight"): p for n, p in ref.named_parameters() if p.requires_grad}
    assert sorted(mine) == sorted(theirs) and len(mine) == 2 * 3 * 2  # A and B x 3 targets x 2 layers
    for name, param in theirs.items():  # float32 through the same ops: within the bound of two sums of the same contributions
        assert_within(mine[name].grad, param.grad, tolerances[name], msg=name)
    assert all(p.grad is None for n, p in trainer.model.named_parameters() if "lora_" not in n)


def test_only_adapters_train_and_base_weights_stay_as_loaded(hf_qwen2_dir, batch):
    trainer = _policy(hf_qwen2_dir, lr=1e-2)
    _random_adapters(trainer)
    before = {n: t.clone() for n, t in trainer.weights().items()}
    for _ in range(2):
        trainer.train_step(batch)
    optimized = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == {id(p) for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert all(not torch.equal(before[n], t) for n, t in trainer.weights().items() if "lora_B" in n)
    base = hf_reference_model(hf_qwen2_dir).state_dict()
    state = {n.replace(".base_layer.", "."): t for n, t in trainer.model.state_dict().items() if "lora_" not in n}
    assert sorted(state) == sorted(base)
    for name, tensor in base.items():
        assert torch.equal(state[name], tensor), name


def test_a_sync_moves_only_the_adapters_and_the_generator_equals_peft_merged(hf_qwen2_dir):
    trainer = _policy(hf_qwen2_dir)
    adapters = _random_adapters(trainer)
    gen = _generator(hf_qwen2_dir)
    transport = InProcessTransport()
    transport.publish(trainer.weights(), 1)
    got = transport.fetch_into(gen.weight_targets(), newer_than=gen.version)
    gen.version = got
    # bytes by hand: hidden 48, kv heads 2 of head_dim 12 (v_proj out 24), intermediate 96; float32
    hidden, kv, inter, r = 48, 24, 96, LORA.r
    per_layer = r * (hidden + hidden) + r * (hidden + kv) + r * (inter + hidden)
    assert layout_of(trainer.weights()).nbytes == sum(-(-4 * n // 64) * 64 for n in [r * hidden, hidden * r, r * hidden, kv * r, r * inter, hidden * r] * 2)
    assert sum(t.numel() for t in gen.weight_targets().values()) == 2 * per_layer
    full = sum(p.numel() for p in hf_reference_model(hf_qwen2_dir).parameters())
    assert 2 * per_layer * 20 < full  # a sync moves under 5% of the model
    out = gen.generate(left_padded(PROMPTS))
    merged = _peft_model(hf_qwen2_dir, adapters).merge_and_unload()
    expected = reference_logprobs(merged, out)  # transformers' forward of peft's merged weights
    mask = out["completion_mask"]
    # float32 rounding at these logits' magnitudes; LoraMerge's W0 + scale B A sums r products per weight
    atol = rollout_logprob_atol(merged, out, extra=[LORA.r] * 2 * len(LORA.target_modules))
    torch.testing.assert_close(out["behaviour_logprobs"][mask], expected[mask], rtol=0, atol=atol)
    assert gen.version == 1


def test_a_resumed_lora_policy_continues_exactly(hf_qwen2_dir, batch, tmp_path):
    batches = [batch, {**batch, "rewards": -batch["rewards"]}, batch]  # AdamW's moments make each step differ
    straight = _policy(hf_qwen2_dir, lr=1e-2)
    _random_adapters(straight)
    stopped = _policy(hf_qwen2_dir, lr=1e-2)
    _random_adapters(stopped)
    for b in batches:
        straight.train_step(b)
    stopped.train_step(batches[0])
    torch.save(stopped.state(), tmp_path / "policy.pt")
    state = torch.load(tmp_path / "policy.pt", weights_only=True)
    assert all("lora_" in n for n in state["model"]) and len(state["model"]) == 12  # adapters only, no base weights
    resumed = _policy(hf_qwen2_dir, lr=1e-2)
    resumed.load_state(state)
    for b in batches[1:]:
        resumed.train_step(b)
    for name, tensor in straight.weights().items():
        assert torch.equal(resumed.weights()[name], tensor), name
    other = Trainer(PolicyNode(name="policy", model=_model(hf_qwen2_dir, LoraConfig(r=2, target_modules=("q_proj",)))), LossNode(name="aipo"))
    with pytest.raises(Exception, match="different config"):
        other.load_state(state)


def test_export_merged_loads_in_transformers_and_adapter_loads_in_peft(hf_qwen2_dir, tmp_path, capsys):
    from flowrl.cli.main import main

    trainer = _policy(hf_qwen2_dir)
    adapters = _random_adapters(trainer)
    step = tmp_path / "ckpt" / "step-1"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    torch.save(trainer.state(), step / "policy-policy.pt")
    assert main(["export", str(step), "-o", str(tmp_path / "merged")]) == 0
    assert main(["export", str(step), "-o", str(tmp_path / "adapter"), "--adapter"]) == 0
    tokens = torch.tensor([[1, 5, 6, 7, 8, 9]])
    expected = _peft_model(hf_qwen2_dir, adapters)(input_ids=tokens).logits
    merged = hf_reference_model(tmp_path / "merged")
    assert not any("lora" in n for n in merged.state_dict())
    atol = logit_atol(merged, tokens, extra=[LORA.r] * 2 * len(LORA.target_modules))  # merged: W0 + scale B A, r products a weight
    torch.testing.assert_close(merged(input_ids=tokens).logits, expected, rtol=0, atol=atol)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == LORA.r
    loaded = peft.PeftModel.from_pretrained(hf_reference_model(hf_qwen2_dir), str(tmp_path / "adapter"))
    torch.testing.assert_close(loaded(input_ids=tokens).logits, expected, rtol=0, atol=atol)
    assert main(["export", str(step), "-o", str(tmp_path / "adapter")]) == 2  # not empty: refused
    plain = tmp_path / "plain" / "step-1"
    plain.mkdir(parents=True)
    (plain / "meta.json").write_text("{}")
    torch.save(Trainer(PolicyNode(name="policy", model=_model(hf_qwen2_dir, None)), LossNode(name="aipo")).state(), plain / "policy-policy.pt")
    capsys.readouterr()
    assert main(["export", str(plain), "-o", str(tmp_path / "none"), "--adapter"]) == 2
    err = capsys.readouterr().err
    assert "has no lora; drop --adapter" in err and "Traceback" not in err and not (tmp_path / "none").exists()


@pytest.mark.parametrize(
    ("lora", "match"),
    [
        (dict(target_modules=("q_proj", "qkv")), r"\['qkv'\] match no module.*'down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj'"),
        (dict(target_modules=("input_layernorm",)), r"input_layernorm \(Qwen2RMSNorm\)'\], which are not linear layers"),
    ],
    ids=["no-module", "not-linear"],
)
def test_bad_target_modules_are_refused_naming_the_layers_present(hf_qwen2_dir, lora, match):
    for build in (lambda: _policy_with(hf_qwen2_dir, lora), lambda: _generator_with(hf_qwen2_dir, lora)):
        with pytest.raises(ConfigError, match=match):
            build()


def _policy_with(directory, lora):
    return Trainer(PolicyNode(name="policy", model=_model(directory, LoraConfig(**lora))), LossNode(name="aipo"))


def _generator_with(directory, lora):
    return Generator(GeneratorNode(name="gen", model=_model(directory, LoraConfig(**lora))), seed=0)


@pytest.mark.parametrize(
    ("lora", "match"),
    [(dict(r=0), r"r=0 must be an integer >= 1"), (dict(alpha=-1.0), r"alpha=-1.0 must be > 0"),
     (dict(target_modules=()), r"target_modules=\[\] must name"), (dict(rank=8), r"unknown field `rank`"),
     (dict(dropout=1.0), r"dropout=1.0 must be in \[0, 1\) \(peft's lora_dropout"),
     (dict(dropout=-0.1), r"dropout=-0.1 must be in \[0, 1\)"),
     (dict(dropout=float("nan")), r"dropout=nan must be a finite number"),
     (dict(lora_dropout=0.05), r"peft's names: lora_dropout is dropout="),
     (dict(lora_alpha=16), r"peft's names: lora_alpha is alpha=")],
    ids=["r0", "alpha", "no-targets", "typo", "dropout-1", "dropout-negative", "dropout-nan", "peft-dropout-name", "peft-alpha-name"],
)
def test_bad_lora_settings_are_refused_before_any_work(lora, match):
    with pytest.raises(ConfigError, match=match):
        HFModelConfig(path="/nowhere", lora=lora)


def test_the_builder_puts_lora_on_the_policy_and_the_generator_it_feeds_and_refuses_the_builtin_family(hf_qwen2_dir):
    from flowrl.graph.builder import GraphBuilder
    from flowrl.graph.serialize import from_json, to_json

    b = GraphBuilder("lora", model=HFModelConfig(path=str(hf_qwen2_dir)))
    prompts = b.source("prompts", task="add", batch_size=2)
    gen = b.generator("gen", prompts)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    ref = b.reference("ref", gen)
    loss = b.loss("loss", gen, reward, ref, kl_coef=0.1)
    policy = b.policy("policy", loss, lora=dict(r=8, alpha=16, target_modules=["q_proj", "v_proj"]))
    b.weights(policy, gen)
    graph = b.build()
    lora = LoraConfig(r=8, alpha=16.0, target_modules=("q_proj", "v_proj"))
    assert graph.node("policy").model.lora == lora and graph.node("gen").model.lora == lora
    assert graph.node("ref").model.lora is None  # the reference is the base model
    assert from_json(to_json(graph)).node("gen").model.lora == lora
    with pytest.raises(ConfigError, match="lora= adapts a Hugging Face model"):
        GraphBuilder("builtin", model=ModelConfig()).policy("policy", "x", lora=dict(r=8))
    with pytest.raises(ConfigError, match=r"peft_config.*lora=dict\(r=, alpha=, target_modules=\) on b.policy"):
        b.policy("policy2", loss, peft_config={"r": 8})
    # LoRA with FSDP is allowed (tests/runtime/test_lora_torchrun.py, test_fsdp.py's lora family)
    assert PolicyNode(name="p", model=HFModelConfig(path="x", lora=lora), optimizer=OptimizerConfig(sharding="fsdp")).model.lora == lora


def test_a_lora_run_sends_only_adapter_bytes_and_checkpoints_only_adapters(tmp_path):
    """The HF example with LoRA, 3 steps: each metrics row's ``sync/bytes`` is the adapters' size by
    hand, and the run's checkpoint holds the adapters and their optimizer state only."""
    from flowrl.examples.hf_copy import build_hf_copy
    from flowrl.runtime.checkpointing.store import read_policy_state
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    graph = build_hf_copy(lora=dict(r=2, alpha=4, target_modules=["q_proj", "v_proj"]), lr=1e-2)
    result = run_graph(graph, RunConfig(steps=3, progress=False, checkpoint_dir=str(tmp_path / "ckpt")))
    # width 64, 2 layers, q_proj and v_proj 64 -> 64: A [2, 64] and B [64, 2] each, float32
    adapter_bytes = 2 * 2 * (2 * 64 + 64 * 2) * 4
    assert [r["sync/bytes"] for r in result.rows] == [adapter_bytes] * 3
    assert all(0 <= r["staleness"] <= 1 for r in result.rows)
    state = read_policy_state(tmp_path / "ckpt")
    assert sorted(state["model"]) == sorted(
        f"model.layers.{i}.self_attn.{m}.lora_{ab}.weight" for i in range(2) for m in ("q_proj", "v_proj") for ab in "AB"
    )
    assert len(state["optimizer"]["state"]) == 8 and state["version"] == 3


def test_lora_dropout_reaches_peft_in_the_trainer_and_the_adapter_directory(hf_qwen2_dir, tmp_path):
    """``LoraConfig.dropout`` is peft's ``lora_dropout`` on every adapted layer of the policy (in train
    mode, as TRL trains), recorded in the exported adapter's config; 0 is peft's identity."""
    from flowrl.models.lora import save_adapter

    lora = LoraConfig(r=4, alpha=8.0, target_modules=("q_proj", "v_proj"), dropout=0.1)
    trainer = Trainer(PolicyNode(name="policy", model=_model(hf_qwen2_dir, lora)), LossNode(name="pg", loss=LossConfig(objective="pg")))
    dropouts = [m.lora_dropout["default"] for m in trainer.model.modules() if hasattr(m, "lora_dropout")]
    assert dropouts and all(isinstance(d, torch.nn.Dropout) and d.p == 0.1 and d.training for d in dropouts)
    save_adapter(trainer.weights(), lora, tmp_path / "adapter", base_model=str(hf_qwen2_dir))
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["lora_dropout"] == 0.1
    plain = Trainer(PolicyNode(name="policy", model=_model(hf_qwen2_dir)), LossNode(name="pg", loss=LossConfig(objective="pg")))
    assert all(isinstance(m.lora_dropout["default"], torch.nn.Identity) for m in plain.model.modules() if hasattr(m, "lora_dropout"))


MOE_LORA = {"qwen3_moe": ("q_proj", "v_proj"), "qwen2_moe": ("q_proj", "gate_proj", "up_proj", "down_proj")}


@pytest.mark.parametrize("family", list(MOE_LORA))
def test_lora_on_a_moe_family_adapts_attention_and_the_shared_expert_and_trains_them_alone(request, family):
    """Qwen3-MoE: the attention's projections; Qwen2-MoE: ``gate_proj``/``up_proj``/``down_proj`` are its
    shared expert's (the routed experts are stacked tensors): one step moves the adapters only and the
    generator's merged model equals peft's."""
    directory = request.getfixturevalue(f"hf_{family}_dir")
    lora = LoraConfig(r=2, alpha=4.0, target_modules=MOE_LORA[family])
    trainer = Trainer(PolicyNode(name="policy", model=_model(directory, lora), optimizer=OptimizerConfig(lr=1e-2)), LossNode(name="pg", loss=LossConfig(objective="pg")))
    adapted = sorted({n.rsplit(".lora_", 1)[0] for n in trainer.weights()})
    want = [f"model.layers.{i}.{m}" for i in range(2) for m in (("self_attn.q_proj", "self_attn.v_proj") if family == "qwen3_moe" else
            ("self_attn.q_proj", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj"))]  # fmt: skip
    assert adapted == sorted(want)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    adapters = _random_adapters(trainer)
    trainer.train_step(_batch(directory))
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.model.named_parameters() if "lora_" not in n)  # experts and router untouched
    assert any(not torch.equal(t, adapters[n]) for n, t in trainer.weights().items())
    gen = Generator(GeneratorNode(name="gen", model=_model(directory, lora)), seed=0)
    gen.load_weights(trainer.weights(), version=1)
    reference = _peft_model(directory, trainer.weights(), lora)
    ids = torch.tensor([[1, 5, 6, 7, 8], [1, 12, 30, 4, 3]])
    with torch.no_grad():
        torch.testing.assert_close(gen.model(ids), reference(input_ids=ids).logits, rtol=0, atol=logit_atol(reference, list(ids), extra=[2] * len(want)))


@pytest.mark.parametrize(
    ("family", "targets", "match"),
    [
        ("qwen3_moe", ("q_proj", "gate"), r"'gate' matches 'model.layers.0.mlp.gate', the router of the qwen3_moe family \(Qwen3MoeForCausalLM; 2 such modules\); LoRA adapts its linear layers only: pick among \['k_proj', 'lm_head', 'o_proj', 'q_proj', 'v_proj'\]"),
        ("qwen2_moe", ("experts",), r"'experts' matches 'model.layers.0.mlp.experts', the routed experts, stacked over experts in 3-D tensors of the qwen2_moe family \(Qwen2MoeForCausalLM"),
        ("qwen3_moe", ("gate_proj",), r"\['gate_proj'\] match no module .*; the qwen3_moe family's routed experts are stacked 3-D tensors, which LoRA does not adapt"),
    ],
    ids=["router", "experts", "expert-projection"],
)
def test_lora_on_a_moe_router_or_its_experts_is_refused_naming_the_module_and_family(request, family, targets, match):
    directory = request.getfixturevalue(f"hf_{family}_dir")
    lora = dict(r=2, target_modules=targets)
    for build in (lambda: _policy_with(directory, lora), lambda: _generator_with(directory, lora)):
        with pytest.raises(ConfigError, match=match):
            build()
