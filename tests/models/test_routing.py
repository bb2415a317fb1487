"""``flowrl.models.routing``: recording a MoE forward's experts and forcing given ones, on both MoE families."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.graph.configs import HFModelConfig, ModelConfig
from flowrl.models.registry import build_model
from flowrl.models.routing import RoutingRecorder, RoutingReplay, expert_dtype, moe_routers, moe_shape, unrecorded
from tests.hf_fixtures import make_hf_dir

pytest.importorskip("transformers")

MOE = ("qwen3_moe", "qwen2_moe")


@pytest.fixture(scope="module", params=MOE)
def moe_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    family = request.param
    path = make_hf_dir(tmp_path_factory.mktemp("routing") / family, family, weights=False)
    model = build_model(HFModelConfig(path=str(path), init="random", seed=5)).eval()
    with torch.no_grad():  # routers as a trained model has them (an initial router's std 0.02 routes near-uniformly)
        for router in moe_routers(model):
            router.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(7))
    return model


def _tokens(seed: int, shape: tuple[int, int] = (3, 7)) -> torch.Tensor:
    return torch.randint(3, 90, shape, generator=torch.Generator().manual_seed(seed))


def _random_experts(n: int, layers: int, experts: int, k: int, seed: int) -> torch.Tensor:
    """``[n, layers, k]`` distinct experts per token-layer, drawn at random."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.rand(n, experts, generator=g).topk(k, dim=-1).indices for _ in range(layers)], dim=1)


def test_shape_and_dtype(moe_model: torch.nn.Module) -> None:
    shape = moe_shape(moe_model)
    assert (shape.layers, shape.experts, shape.top_k) == (2, 8, 2)
    assert expert_dtype(shape.experts) == torch.uint8 and expert_dtype(300) == torch.int16


def test_record_then_replay_is_bit_identical(moe_model: torch.nn.Module) -> None:
    tokens = _tokens(0)
    with torch.no_grad(), RoutingRecorder(moe_model, owner="test") as rec:
        logits = moe_model(tokens)
        experts = rec.take()
    assert experts.shape == (tokens.numel(), 2, 2)
    with torch.no_grad(), RoutingReplay(moe_model, experts, owner="test") as replay:
        again = moe_model(tokens)
    assert torch.equal(logits, again)
    assert replay.agree == replay.total == tokens.numel() * 2
    with torch.no_grad():  # after the block the routers choose again
        assert torch.equal(moe_model(tokens), logits)


def test_replay_uses_exactly_the_given_experts(moe_model: torch.nn.Module) -> None:
    tokens = _tokens(1)
    shape = moe_shape(moe_model)
    given = _random_experts(tokens.numel(), shape.layers, shape.experts, shape.top_k, seed=2)
    with torch.no_grad(), RoutingRecorder(moe_model, owner="test") as own_rec:
        own_logits = moe_model(tokens)
        own = own_rec.take()
    with torch.no_grad(), RoutingReplay(moe_model, given, owner="test") as replay, RoutingRecorder(moe_model, owner="test") as rec:
        forced_logits = moe_model(tokens)
        used = rec.take()  # hooks run in order: the recorder sees the replay's output
    assert torch.equal(used, given)
    assert not torch.equal(own, given) and not torch.equal(own_logits, forced_logits)
    same = (own.sort(-1).values == given.sort(-1).values).all(-1)
    assert (replay.agree, replay.total) == (int(same.sum()), given.shape[0] * given.shape[1])
    # an unrecorded entry keeps the router's own choice
    partial = given.clone()
    partial[::2] = unrecorded(shape.experts)
    with torch.no_grad(), RoutingReplay(moe_model, partial, owner="test") as replay, RoutingRecorder(moe_model, owner="test") as rec:
        moe_model(tokens)
        used = rec.take()
    # (layer 0's own choice: deeper layers see other tokens' forced experts through attention)
    assert torch.equal(used[::2, 0], own[::2, 0]) and torch.equal(used[1::2], given[1::2])
    assert replay.total == given[1::2].shape[0] * shape.layers


@pytest.mark.parametrize("norm", [True, False])
def test_gate_weights_are_the_routers_own_at_the_given_experts(moe_model: torch.nn.Module, norm: bool) -> None:
    """The weights the experts receive: softmax of the router's logits (float32) at the given experts,
    renormalised over them when norm_topk_prob, computed here by hand in float64."""
    routers = moe_routers(moe_model)
    tokens = _tokens(2, (2, 5))
    shape = moe_shape(moe_model)
    given = _random_experts(tokens.numel(), shape.layers, shape.experts, shape.top_k, seed=3)
    seen: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    handles = []
    for layer, router in enumerate(routers):
        experts = dict(moe_model.named_modules())[[n for n, m in moe_model.named_modules() if m is router][0].rsplit(".", 1)[0] + ".experts"]

        def grab(module, args, layer=layer, router=router):  # noqa: ANN001
            h, idx, w = args
            seen[layer] = (h.detach().clone(), idx.clone(), w.detach().clone())

        handles.append(experts.register_forward_pre_hook(grab))
    old = [r.norm_topk_prob for r in routers]
    try:
        for r in routers:
            r.norm_topk_prob = norm
        with torch.no_grad(), RoutingReplay(moe_model, given, owner="test"):
            moe_model(tokens)
    finally:
        for r, o in zip(routers, old):
            r.norm_topk_prob = o
        for h in handles:
            h.remove()
    for layer, router in enumerate(routers):
        h, idx, w = seen[layer]
        assert torch.equal(idx, given[:, layer])
        logits = h.double() @ router.weight.detach().double().T
        p = torch.softmax(logits, dim=-1).gather(-1, given[:, layer])
        want = p / p.sum(-1, keepdim=True) if norm else p
        # float32 logits (a dot of `hidden` terms) and softmax: a few units of float32 rounding
        eps = torch.finfo(torch.float32).eps
        tol = eps * (h.shape[-1] * float((h.abs() @ router.weight.detach().abs().T).max()) + shape.experts + 4)
        assert torch.allclose(w.double(), want, atol=tol, rtol=0), (w, want, tol)


def test_dense_models_have_no_routers(hf_llama_dir: Path) -> None:
    for model in (build_model(ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=1)), build_model(HFModelConfig(path=str(hf_llama_dir)))):
        assert moe_routers(model) == []
        with pytest.raises(ConfigError, match="dense"):
            RoutingRecorder(model, owner="generator 'gen'")


def test_replay_refuses_routing_of_another_shape(moe_model: torch.nn.Module) -> None:
    tokens = _tokens(3)
    with pytest.raises(ConfigError, match=r"must be \[tokens, 2, 2\]"):
        RoutingReplay(moe_model, torch.zeros(tokens.numel(), 3, 2, dtype=torch.int64), owner="policy 'policy'")
    with torch.no_grad(), RoutingRecorder(moe_model, owner="test") as rec:
        moe_model(tokens)
        own = rec.take()
    with pytest.raises(ConfigError, match="routes 21 tokens but routed_experts holds 4"):
        with torch.no_grad(), RoutingReplay(moe_model, torch.zeros(4, 2, 2, dtype=torch.int64), owner="policy 'policy'"):
            moe_model(tokens)
    with torch.no_grad(), RoutingRecorder(moe_model, owner="test") as rec:  # the failed block forces nothing after it
        moe_model(tokens)
        assert torch.equal(rec.take(), own)
