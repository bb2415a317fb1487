"""Routing replay end to end in one process: the built-in engine records each token's experts while it
decodes with the KV cache, and the trainer's, the reference's and the critic's forwards route by them."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.graph.configs import HFModelConfig, ModelConfig, SamplingConfig
from flowrl.graph.critic import CriticNode
from flowrl.graph.nodes import GeneratorNode, LossNode, ReferenceNode
from flowrl.models.routing import RoutingAgreement, RoutingRecorder, moe_routers, unrecorded
from flowrl.operators.critic import completion_values
from flowrl.operators.engines import check_routing_replay
from flowrl.operators.generation import Generator
from flowrl.operators.logprobs import completion_logprobs
from flowrl.operators.packing import packed_logits
from flowrl.operators.reference import Reference
from flowrl.operators.trainer import Trainer
from tests.hf_fixtures import make_hf_dir
from tests.models.helpers import hf_policy_node, left_padded
from tests.tolerances import rollout_logprob_atol

pytest.importorskip("transformers")

PROMPTS = [[1, 5, 6, 7], [1, 12], [1, 20, 21, 22, 23]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE whose routing matters: routers of std 1 (a freshly initialised one, std 0.02,
    routes near-uniformly) and experts 5x their initial scale (else the residual stream drowns them)."""
    import transformers

    path = make_hf_dir(tmp_path_factory.mktemp("replay") / "qwen3_moe", "qwen3_moe")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0, generator=g)
            elif ".experts." in name:
                p.mul_(5.0)
    model.save_pretrained(str(path))
    return path


def _generator(directory: Path, **sampling: object) -> GeneratorNode:
    sampling.setdefault("n_samples", 2)
    sampling.setdefault("max_new_tokens", 6)
    return GeneratorNode(name="gen", model=HFModelConfig(path=str(directory)), sampling=SamplingConfig(**sampling), routing_replay=True)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def rollout(moe_dir: Path) -> dict[str, torch.Tensor]:
    out = Generator(_generator(moe_dir), seed=0).generate(left_padded(PROMPTS))
    return {**out, "rewards": torch.linspace(-1, 1, out["completion_ids"].shape[0])}


def test_generator_records_every_fed_token_with_the_kv_cache(moe_dir: Path, rollout: dict[str, torch.Tensor]) -> None:
    routed = rollout["routed_experts"]
    S, Tp = rollout["sample_prompt_ids"].shape
    C = rollout["completion_ids"].shape[1]
    assert routed.dtype == torch.uint8 and routed.shape == (S, Tp + C, 2, 2)
    # what a full forward of the same sequences routes (a trainer's forward, no cache) at every recorded token
    gen = Generator(_generator(moe_dir, use_kv_cache=False), seed=0)
    tokens = torch.cat([rollout["sample_prompt_ids"], rollout["completion_ids"]], dim=1)
    prompt_real = torch.arange(Tp)[None, :] >= (Tp - rollout["sample_prompt_lens"])[:, None]
    lens = rollout["completion_mask"].sum(1)
    fed = torch.arange(C)[None, :] < (lens - 1)[:, None]  # a completion's last token is never fed back
    recorded = torch.cat([prompt_real, fed], dim=1)  # [S, Tp + C]
    assert torch.equal((routed != unrecorded(8)).all(-1).all(-1), recorded)
    valid = torch.cat([prompt_real, rollout["completion_mask"]], dim=1)
    with torch.no_grad(), RoutingRecorder(gen.model, owner="test") as rec:
        gen.model(tokens, valid=valid)
        full = rec.take().view(S, Tp + C, 2, 2)
    same = (full.sort(-1).values == routed.long().sort(-1).values).all(-1)[recorded]
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} choices differ between the cached decode and a full forward"
    # the uncached engine records the same routing
    assert torch.equal(gen.generate(left_padded(PROMPTS))["routed_experts"], routed)


def test_trainer_at_k0_agrees_fully_and_replays(moe_dir: Path, rollout: dict[str, torch.Tensor]) -> None:
    trainer = Trainer(hf_policy_node(moe_dir, packing=False), LossNode(name="aipo"))
    metrics = trainer.train_step(rollout)
    assert metrics["routing/agreement"] == 1.0
    assert metrics["routing/tokens"] > 0
    assert metrics["mismatch/abs_logp_max"] < rollout_logprob_atol(Generator(_generator(moe_dir)).model, rollout)


def test_gradient_checkpointing_recomputes_with_the_replayed_experts(moe_dir: Path, rollout: dict[str, torch.Tensor]) -> None:
    """Activation checkpointing recomputes each layer's forward in the backward pass, after the replay's
    block ended: the routers must route that recomputation as the forward was (else torch refuses the
    recomputation, or the gradient is another routing's). Forced experts other than the model's own
    make the difference visible: the same step with and without checkpointing."""
    forced = rollout["routed_experts"].clone()
    recorded = forced != unrecorded(8)
    forced[..., 0] = torch.where(recorded[..., 0], 3, forced[..., 0])
    forced[..., 1] = torch.where(recorded[..., 1], 5, forced[..., 1])
    rows = []
    for checkpointing in (False, True):
        trainer = Trainer(hf_policy_node(moe_dir, packing=False, gradient_checkpointing=checkpointing, grad_clip=0.0), LossNode(name="aipo"))
        rows.append(trainer.train_step({**rollout, "routed_experts": forced}))
    assert rows[0]["routing/agreement"] < 0.5 and rows[0]["routing/tokens"] == rows[1]["routing/tokens"]  # counted once each
    assert rows[0]["loss"] == pytest.approx(rows[1]["loss"], rel=1e-5) and rows[0]["policy/grad_norm"] == pytest.approx(rows[1]["policy/grad_norm"], rel=1e-5)


def _perturbed(directory: Path, scale: float) -> torch.nn.Module:
    """The policy's model with its routers moved by seeded noise of ``scale`` (what another precision's
    rounding or a few optimizer steps do to near-tied choices)."""
    model = Trainer(hf_policy_node(directory, packing=False), LossNode(name="aipo")).model.eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.add_(torch.randn(router.weight.shape, generator=g) * scale)
    return model


def test_a_perturbed_trainer_disagrees_and_replay_brings_its_logprobs_closer(moe_dir: Path, rollout: dict[str, torch.Tensor]) -> None:
    model = _perturbed(moe_dir, 0.1)
    args = [rollout[k] for k in ("sample_prompt_ids", "sample_prompt_lens", "completion_ids", "completion_mask")]
    mask, mu = rollout["completion_mask"], rollout["behaviour_logprobs"]
    agreement = RoutingAgreement()
    with torch.no_grad():
        own = completion_logprobs(model, *args)
        replayed = completion_logprobs(model, *args, routed_experts=rollout["routed_experts"], agreement=agreement)
    assert 0 < agreement.agree < agreement.total
    off, on = float((own - mu)[mask].abs().mean()), float((replayed - mu)[mask].abs().mean())
    assert on < off, (on, off)


def test_packed_replay_equals_padded_replay(moe_dir: Path) -> None:
    prompts = [list(range(1, 13)), [1], [1, 2]]  # lengths 12, 1, 2: the short sequences share a packed row
    rollout = Generator(_generator(moe_dir, max_new_tokens=3), seed=0).generate(left_padded(prompts))
    model = _perturbed(moe_dir, 0.1)
    args = [rollout[k] for k in ("sample_prompt_ids", "sample_prompt_lens", "completion_ids", "completion_mask")]
    assert packed_logits(model, *args[:3], rollout["completion_mask"]) is not None  # this batch packs
    padded_count, packed_count = RoutingAgreement(), RoutingAgreement()
    with torch.no_grad():
        padded = completion_logprobs(model, *args, routed_experts=rollout["routed_experts"], agreement=padded_count)
        packed = completion_logprobs(model, *args, routed_experts=rollout["routed_experts"], agreement=packed_count, packing=True)
    assert packed_count.total == padded_count.total  # every recorded token forwarded once in either layout
    assert packed_count.agree == padded_count.agree < padded_count.total  # choices the perturbed routers flip: replay decides
    tol = rollout_logprob_atol(model, rollout)
    assert float((padded - packed).abs().max()) < tol


def test_reference_and_critic_route_by_the_rollout(moe_dir: Path, rollout: dict[str, torch.Tensor]) -> None:
    model = HFModelConfig(path=str(moe_dir))
    reference = Reference(ReferenceNode(name="ref", model=model))
    forced = rollout["routed_experts"].clone()
    forced[..., 0], forced[..., 1] = 3, 5  # other experts everywhere (recorded entries only change what is routed)
    with_own = reference.logprobs(rollout)["ref_logprobs"]
    with_forced = reference.logprobs({**rollout, "routed_experts": forced})["ref_logprobs"]
    assert not torch.equal(with_own, with_forced)
    assert float((with_own - rollout["behaviour_logprobs"])[rollout["completion_mask"]].abs().max()) < rollout_logprob_atol(reference.model, rollout)
    critic = CriticNode(name="critic", model=model)
    from flowrl.operators.critic import Critic

    values = Critic(critic, LossNode(name="ppo").loss).model
    with torch.no_grad():
        values.hf.get_output_embeddings().weight.normal_(generator=torch.Generator().manual_seed(0))  # the head starts at zero
        a = completion_values(values, rollout)
        b = completion_values(values, {**rollout, "routed_experts": forced})
    assert not torch.equal(a, b)


def test_routing_replay_refused_before_any_work(hf_llama_dir: Path, moe_dir: Path) -> None:
    with pytest.raises(ConfigError, match="built-in ModelConfig .* a dense transformer without routers"):
        GeneratorNode(name="gen", model=ModelConfig(), routing_replay=True)
    with pytest.raises(ConfigError, match="batching='continuous' refills rows"):
        _generator(moe_dir, batching="continuous")
    dense = msgspec.structs.replace(_generator(moe_dir), model=HFModelConfig(path=str(hf_llama_dir)))
    with pytest.raises(ConfigError, match=r"generator 'gen': routing_replay=True: its model \('llama'\) is dense"):
        Generator(dense)
    with pytest.raises(ConfigError, match=r"\('llama'\) is dense, without routers; drop routing_replay"):
        check_routing_replay(dense, device="cpu")
    vllm = msgspec.structs.replace(_generator(moe_dir), engine="vllm")
    with pytest.raises(ConfigError, match="Model Runner V2, which needs Triton"):
        check_routing_replay(vllm, device="cpu")
    check_routing_replay(_generator(moe_dir), device="cpu")  # the built-in engine records on a CPU
