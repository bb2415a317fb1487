"""Hypothesis strategies for random valid graphs, built through ``GraphBuilder`` as a user would."""

from __future__ import annotations

import string
import warnings

from hypothesis import strategies as st

from flowrl.errors import GraphWarning
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import LossConfig, ModelConfig, OptimizerConfig, SamplingConfig, SourceConfig
from flowrl.graph.ir import Graph
from flowrl.runtime.transports.registry import transport_names

__all__ = ["identifiers", "references", "model_configs", "valid_graphs", "finite_floats"]

_FIRST = string.ascii_letters + "_"
_REST = string.ascii_letters + string.digits + "_"

#: Node names: identifiers of 1..64 characters (the rule in ``flowrl.graph.validate.NAME_RE``).
identifiers = st.builds(
    lambda first, rest: first + rest,
    st.sampled_from(_FIRST),
    st.text(alphabet=_REST, max_size=63),
)

_short_identifiers = st.builds(lambda first, rest: first + rest, st.sampled_from(_FIRST), st.text(alphabet=_REST, max_size=8))

#: ``module:qualname`` references (never imported by the tests); built from parts, as
#: ``st.from_regex(REF_RE)`` is ten times slower.
references = st.builds(
    lambda module, qualname: f"{'.'.join(module)}:{'.'.join(qualname)}",
    st.lists(_short_identifiers, min_size=1, max_size=3),
    st.lists(_short_identifiers, min_size=1, max_size=2),
)


def finite_floats(min_value: float | None = None, max_value: float | None = None, **kwargs: object) -> st.SearchStrategy[float]:
    return st.floats(min_value=min_value, max_value=max_value, allow_nan=False, allow_infinity=False, **kwargs)  # type: ignore[arg-type]


@st.composite
def model_configs(draw: st.DrawFn) -> ModelConfig:
    n_heads = draw(st.sampled_from([1, 2, 4, 8]))
    head_dim = draw(st.sampled_from([2, 4, 8, 16]))
    return ModelConfig(
        vocab_size=draw(st.integers(1, 200_000)),
        dim=n_heads * head_dim,
        n_layers=draw(st.integers(1, 128)),
        n_heads=n_heads,
        n_kv_heads=draw(st.sampled_from([d for d in (1, 2, 4, 8) if n_heads % d == 0])),
        ffn_dim=draw(st.integers(0, 1 << 16)),
        max_seq_len=draw(st.integers(1, 1 << 17)),
        rope_theta=draw(finite_floats(1e-3, 1e9)),
        norm_eps=draw(finite_floats(1e-12, 1.0)),
        tie_embeddings=draw(st.booleans()),
        seed=draw(st.integers(-(2**63), 2**63 - 1)),
        preset=draw(st.none() | st.sampled_from(["llama3-8b", "llama3-70b", "llama3-405b"])),
    )


_sampling = st.builds(
    SamplingConfig,
    n_samples=st.integers(1, 256),
    max_new_tokens=st.integers(1, 1 << 15),
    temperature=finite_floats(0.0, 100.0, exclude_min=True),
    top_k=st.integers(0, 1000),
    top_p=finite_floats(0.0, 1.0, exclude_min=True),
    stop_tokens=st.lists(st.integers(0, 1 << 20), max_size=4).map(tuple),
    precision=st.sampled_from(["float32", "bfloat16", "float16"]),
    use_kv_cache=st.booleans(),
)

_optimizer = st.builds(
    OptimizerConfig,
    lr=finite_floats(0.0, 10.0, exclude_min=True),
    betas=st.tuples(finite_floats(0.0, 1.0, exclude_max=True), finite_floats(0.0, 1.0, exclude_max=True)),
    weight_decay=finite_floats(0.0, 1.0),
    grad_clip=finite_floats(0.0, 100.0),
    schedule=st.sampled_from(["constant", "cosine", "linear"]),
    warmup_steps=st.integers(0, 10_000),
    total_steps=st.integers(0, 1_000_000),
    micro_batch_size=st.integers(0, 4096),
    seed=st.integers(0, 2**32),
)


@st.composite
def valid_graphs(draw: st.DrawFn, *, max_pipelines: int = 2, max_scorers: int = 3) -> Graph:
    """A random valid graph of 1..``max_pipelines`` independent RL loops (source -> generator ->
    1..``max_scorers`` scorers [+ reference] -> loss -> policy, weights policy ~> generator),
    varying names, batch sizes, samples, staleness, transports and every config value."""
    n_pipelines = draw(st.integers(1, max_pipelines))
    scorers_per = [draw(st.integers(1, max_scorers)) for _ in range(n_pipelines)]
    with_ref = [draw(st.booleans()) for _ in range(n_pipelines)]
    n_names = sum(5 + s + int(r) for s, r in zip(scorers_per, with_ref))
    names = iter(draw(st.lists(identifiers, min_size=n_names, max_size=n_names, unique=True)))
    b = GraphBuilder(draw(st.text(max_size=40)), model=draw(model_configs()))
    transports = transport_names()
    for scorers, ref in zip(scorers_per, with_ref):
        model = draw(st.none() | model_configs())  # None: the builder's shared model
        prompts = b.source(
            next(names),
            config=SourceConfig(
                task=draw(st.sampled_from(["copy", "add"]) | references),
                batch_size=draw(st.integers(1, 1 << 16)),
                seed=draw(st.integers(0, 2**40)),
            ),
        )
        gen = b.generator(next(names), prompts, model=model, sampling=draw(_sampling))
        outputs = draw(st.lists(identifiers, min_size=scorers, max_size=scorers, unique=True))
        scorer_nodes = [
            b.scorer(next(names), gen, fn=draw(references), batched=draw(st.booleans()), output=out) for out in outputs
        ]
        inputs = [gen, *scorer_nodes]
        if ref:
            inputs.append(b.reference(next(names), gen, model=model))
        loss_cfg = LossConfig(
            objective=draw(st.sampled_from(["aipo", "grpo", "ppo_clip"])),
            rho=draw(finite_floats(1.0, 1e6)),
            clip_eps=draw(finite_floats(0.0, 1.0, exclude_min=True, exclude_max=True)),
            baseline=draw(st.sampled_from(["group_mean", "leave_one_out"])),
            normalize_std=draw(st.booleans()),
            kl_coef=draw(finite_floats(0.0, 10.0, exclude_min=True)) if ref else 0.0,
            reward_weights={o: draw(finite_floats(-1e3, 1e3)) for o in outputs},
        )
        loss = b.loss(next(names), *inputs, config=loss_cfg)
        policy = b.policy(next(names), loss, model=model, optimizer=draw(_optimizer))
        b.weights(policy, gen, transport=draw(st.sampled_from(transports)), max_staleness=draw(st.integers(0, 1000)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphWarning)  # n_samples=1 is a legal graph: the advice is not what these tests study
        return b.build()
