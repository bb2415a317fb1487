"""A mixture-of-experts policy's router metrics and load-balancing loss against a hand count.

The hand count calls the transformers model itself on each sample alone (its real tokens only: the
prompt and the attended completion less the last token, as the trainer's forward lays them out),
with ``output_router_logits=True``, and counts each token's top-k experts per layer; the
load-balancing loss is transformers' ``load_balancing_loss_func`` of those logits.
"""

from __future__ import annotations

import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.graph.configs import HFModelConfig
from flowrl.graph.nodes import LossNode
from flowrl.operators.generation import Generator
from flowrl.operators.router_load import load_ratios
from flowrl.operators.trainer import Trainer
from tests.models.helpers import hf_generator_node, hf_policy_node, left_padded
from tests.tolerances import U32, assert_within, reductions

transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11, 13, 14], [1, 12], [1, 20]]  # lengths far apart: left padding, and rows that packing shortens


def _batch(directory, *, rewards: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    out = Generator(hf_generator_node(directory, n_samples=2, max_new_tokens=5), seed=1).generate(left_padded(PROMPTS))
    return {**out, "rewards": torch.linspace(-1, 1, 6) if rewards is None else rewards}


def _alone(batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each sample's real tokens of the trainer's forward: its prompt, its attended completion less the last token."""
    ids, lens, comp, mask = batch["sample_prompt_ids"], batch["sample_prompt_lens"], batch["completion_ids"], batch["completion_mask"]
    W = ids.shape[1]
    return [torch.cat([ids[s, W - int(lens[s]) :], comp[s, : int(mask[s].sum())]])[:-1] for s in range(ids.shape[0])]


def _hand(model, batch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, the router logits of every real token (the samples alone, concatenated) and the routers' inputs."""
    inputs: dict[int, list[torch.Tensor]] = {}
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    hooks = [r.register_forward_hook(lambda mod, a, o, i=i: inputs.setdefault(i, []).append(a[0].detach())) for i, r in enumerate(routers)]
    per_sample = [model(input_ids=seq[None], output_router_logits=True).router_logits for seq in _alone(batch)]
    for h in hooks:
        h.remove()
    layers = len(per_sample[0])
    return [torch.cat([p[l] for p in per_sample]) for l in range(layers)], [torch.cat(inputs[l]) for l in range(layers)]


def _counts(logits: list[torch.Tensor], top_k: int, experts: int) -> torch.Tensor:
    return torch.stack([torch.bincount(torch.topk(torch.softmax(z.float(), -1), top_k, -1).indices.reshape(-1), minlength=experts) for z in logits]).double()


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_the_experts_load_is_the_hand_count_over_real_tokens(hf_qwen3_moe_dir, packing):
    batch = _batch(hf_qwen3_moe_dir)
    trainer = Trainer(hf_policy_node(hf_qwen3_moe_dir, packing=packing), LossNode(name="aipo"))
    spy = []
    trainer.model.register_forward_pre_hook(lambda m, a, kw: spy.append("packed" if kw.get("packed_positions") is not None else "padded"), with_kwargs=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_qwen3_moe_dir), local_files_only=True, dtype=torch.float32)
    with torch.no_grad():
        logits, _ = _hand(model, batch)
    config = model.config
    counts = _counts(logits, config.num_experts_per_tok, config.num_experts)
    metrics = trainer.train_step(batch)
    assert spy == ["packed" if packing else "padded"]  # one forward, laid out as asked
    real = sum(len(s) for s in _alone(batch))
    assert counts.sum(1).tolist() == [config.num_experts_per_tok * real] * 2  # k per real token per layer (the check below counts only these)
    ratios = load_ratios(counts)
    assert metrics["moe/load_max_over_mean"] == pytest.approx(float(ratios.mean()), rel=1e-12)
    assert metrics["moe/load_max_over_mean_max"] == pytest.approx(float(ratios.max()), rel=1e-12)


def test_load_ratios_by_hand():
    counts = torch.tensor([[4.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    assert load_ratios(counts).tolist() == [4.0, 1.0, 1.0]  # all on one expert: E; even: 1; no tokens: 1


def test_the_load_balancing_loss_is_coef_times_transformers_aux_and_off_by_default(hf_qwen3_moe_dir):
    """Equal rewards (zero advantages): the objective's gradient is exactly 0, so the routers' gradient
    is ``coef`` times the gradient of transformers' ``load_balancing_loss_func`` over the real tokens
    (one micro-batch), within the rounding of two summation orders of the same float32 terms."""
    batch = _batch(hf_qwen3_moe_dir, rewards=torch.zeros(6))
    coef = 0.5
    off = Trainer(hf_policy_node(hf_qwen3_moe_dir, grad_clip=0.0, packing=False), LossNode(name="aipo"))
    on = Trainer(hf_policy_node(hf_qwen3_moe_dir, grad_clip=0.0, packing=False, router_aux_loss_coef=coef), LossNode(name="aipo"))
    m_off, m_on = off.train_step(dict(batch)), on.train_step(dict(batch))
    assert all(p.grad is None or not p.grad.any() for p in off.model.parameters())  # off by default: nothing from the routers
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_qwen3_moe_dir), local_files_only=True, dtype=torch.float32)
    logits, inputs = _hand(model, batch)
    for z in logits:
        z.retain_grad()
    loss_fn = transformers.models.qwen3_moe.modeling_qwen3_moe.load_balancing_loss_func
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    aux = loss_fn(tuple(logits), E, k)
    (coef * aux).backward()
    # Bounds (tests/tolerances.py's reasoning): the trainer's padded forward and each sample alone differ by
    # float32 rounding along the path (``depth``: the reductions' lengths), so a router logit by at most
    # dz = 2 u depth max|x|.|W_router| and its input x relatively by u depth. aux = E sum_e f_e P_e moves
    # by at most E k 2 dz (f: fixed top-k counts summing to k; P: softmax means, 2 dz each) plus two
    # summation orders over its n x layers terms. A router gradient element sum_t g_te x_th moves by at
    # most sum_t |g_te| |x_th| (2 dz + u depth + 2 n u): g by softmax's 2 dz, x by its rounding, the sum's order.
    seqs = _alone(batch)
    n, depth = sum(len(q) for q in seqs), sum(reductions(model, max(len(q) for q in seqs)))
    dz_max = 0.0
    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    for layer, (x, z, router) in enumerate(zip(inputs, logits, routers)):
        dz = 2 * U32 * depth * float((x.abs() @ router.weight.detach().abs().T).max())
        dz_max = max(dz_max, dz)
        terms = (coef * z.grad).abs().T @ x.abs()  # [E, H]: sum_t |g_te| |x_th|, the gradient's contributions
        mine = dict(on.model.named_parameters())[f"model.layers.{layer}.mlp.gate.weight"].grad
        assert_within(mine, router.weight.grad, terms * (2 * dz + U32 * depth + 2 * n * U32), msg=f"layer {layer} router")
        assert float(router.weight.grad.abs().max()) > 10 * float((terms * (2 * dz + U32 * depth + 2 * n * U32)).max())  # checked, not swamped
    aux_bound = E * k * 2 * dz_max + 2 * n * len(logits) * U32 * float(aux)
    assert abs(m_on["moe/aux_loss"] - float(aux)) <= aux_bound and m_off["moe/aux_loss"] == m_on["moe/aux_loss"]


def test_router_aux_loss_is_refused_where_nothing_would_add_it(hf_llama_dir, hf_qwen3_moe_dir):
    from flowrl.graph.configs import OptimizerConfig
    from flowrl.graph.critic import CriticNode
    from flowrl.operators.critic import Critic

    with pytest.raises(ConfigError, match=r"policy 'policy': router_aux_loss_coef=0.01 is a mixture of experts' load-balancing loss, and its model family 'llama' is dense \(the families with routers: \['qwen3_moe', 'qwen2_moe'\]\)"):
        Trainer(hf_policy_node(hf_llama_dir, router_aux_loss_coef=0.01), LossNode(name="aipo"))
    assert Trainer(hf_policy_node(hf_llama_dir), LossNode(name="aipo")).router is None  # a dense row reports no moe/*
    with pytest.raises(ConfigError, match=r"critic 'critic': router_aux_loss_coef=0.01 .* a critic does not add it"):
        Critic(CriticNode(name="critic", model=HFModelConfig(path=str(hf_qwen3_moe_dir)), optimizer=OptimizerConfig(router_aux_loss_coef=0.01)), LossNode(name="ppo").loss)
    with pytest.raises(ConfigError, match=r"router_aux_loss_coef=-1.0 must be >= 0"):
        OptimizerConfig(router_aux_loss_coef=-1.0)
