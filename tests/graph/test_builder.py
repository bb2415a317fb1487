"""The builder API and the IR's typed accessors: wiring by field name, errors a user can act on, configs."""

from __future__ import annotations

import pytest

from flowrl.errors import ConfigError, GraphError, GraphWarning
from flowrl.examples import build_example
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import LossConfig, ModelConfig, OptimizerConfig, SamplingConfig, SourceConfig
from flowrl.graph.fields import FIELDS, ROLLOUT_FIELDS, SOURCE_FIELDS, FieldType
from flowrl.graph.nodes import NODE_KINDS, GeneratorNode, ScorerNode, describe, signature


def module_level_reward(prompt_ids, completion_ids) -> float:
    return 0.0


def _canonical(**weights) -> GraphBuilder:
    b = GraphBuilder("t")
    prompts = b.source("prompts", task="copy", batch_size=4)
    gen = b.generator("gen", prompts, n_samples=2)
    reward = b.scorer("reward", gen, fn=module_level_reward)
    loss = b.loss("aipo", gen, reward)
    policy = b.policy("policy", loss, lr=1e-4)
    b.weights(policy, gen, **weights)
    return b


def test_canonical_pipeline_wires_fields_by_name() -> None:
    g = _canonical(transport="shm", max_staleness=3).build()
    assert [n.name for n in g.topological_order()] == ["prompts", "gen", "reward", "aipo", "policy"]
    edges = {(e.src, e.dst): set(e.fields) for e in g.edges}
    assert edges[("prompts", "gen")] == set(SOURCE_FIELDS)
    assert edges[("gen", "aipo")] == set(ROLLOUT_FIELDS)
    assert edges[("reward", "aipo")] == {"rewards"}
    assert edges[("aipo", "policy")] == {"objective"}
    assert all(t == FIELDS.get(f, t) for e in g.edges for f, t in e.fields.items())
    (w,) = g.weight_edges
    assert (w.src, w.dst, w.transport, w.max_staleness) == ("policy", "gen", "shm", 3)
    scorer = g.node("reward")
    assert isinstance(scorer, ScorerNode) and scorer.fn == f"{__name__}:module_level_reward"


def test_accessors() -> None:
    g = build_example("two_scorers")
    assert [n.name for n in g.producers("aipo")] == ["brief", "correct", "gen"]
    assert [n.name for n in g.users("gen")] == ["aipo", "brief", "correct"]
    assert [n.name for n in g.nodes_of_kind("scorer")] == ["correct", "brief"]
    assert g.loss_of("policy").name == "aipo"
    assert g.rl_loop(g.weight_edges[0]) == ["gen", "aipo", "policy"]
    assert g.weight_edges_into("gen") == list(g.weight_edges) == g.weight_edges_from("policy")
    assert [e.src for e in g.in_edges("aipo")] == ["gen", "correct", "brief"]
    assert "gen" in g and "nope" not in g and len(g) == 6
    assert repr(g) == "Graph('two_scorers', nodes=6, edges=7, weight_edges=1)"
    with pytest.raises(KeyError, match=r"no node 'nope' in graph 'two_scorers'; nodes: \['aipo', 'brief'"):
        g.node("nope")
    assert g.find_cycle() is None
    assert g != build_example("llamarl") and g == build_example("two_scorers")


def test_node_kinds_are_closed_and_documented() -> None:
    import flowrl.graph.nodes as nodes

    for kind in NODE_KINDS:
        assert f"``{kind}``" in nodes.__doc__
    assert "actor" not in NODE_KINDS  # the kinds are a closed set: an unknown kind is refused when a graph is read


def test_signature_and_describe() -> None:
    scorer = ScorerNode(name="r", fn="m:f", output="reward_x", batched=True)
    assert signature(scorer).outputs == {"reward_x": FieldType(dtype="float32", dims=("sample",))}
    assert describe(scorer) == "fn=m:f, batched"
    assert describe(GeneratorNode(name="g")) == "model=2L64d, n=4, max_new=8, T=1"


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda b: b.generator("gen2", "missing"), GraphError, r"node 'gen2' reads from 'missing', which is not declared yet"),
        (lambda b: b.scorer("r2", "gen", fn=lambda p, c: 0.0), GraphError, r"cannot reference .*lambda.*define it at module level"),
        (lambda b: b.scorer("r2", "gen", fn="not a reference"), GraphError, r"is not of the form 'package.module:function'"),
        (lambda b: b.loss("l2", "gen", "reward", "prompts"), GraphError, r"input field 'prompt_index' is produced by several of its inputs \(gen, prompts\)"),
        (lambda b: b.policy("p2", "gen"), GraphError, r"node 'p2' \(policy\) lists 'gen' \(generator\) as an input but reads none of its fields"),
        (lambda b: b.generator("gen2", "prompts", n_smaples=3), ConfigError, r"generator 'gen2': unknown option\(s\) \['n_smaples'\]"),
        (lambda b: b.generator("gen2", "prompts", n_samples=0), ConfigError, r"n_samples=0 must be >= 1"),
        (lambda b: b.source("s2", batch_size=-1), ConfigError, r"batch_size=-1 must be >= 1"),
        (lambda b: b.policy("p2", "aipo", lr=float("inf")), ConfigError, r"lr=inf must be a finite number"),
    ],
    ids=["undeclared-input", "lambda-scorer", "bad-reference", "ambiguous-field", "useless-input", "typo-option", "bad-value", "bad-batch", "inf-lr"],
)
def test_builder_errors(build, error, match: str) -> None:
    b = _canonical()
    with pytest.raises(error, match=match):
        build(b)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda b: b.generator("g2", "prompts", num_generations=8), r"'num_generations' is TRL's name: did you mean n_samples\?"),
        (lambda b: b.loss("l2", "gen", "reward", beta=0.04), r"'beta' is TRL's name: did you mean kl_coef\?"),
        (lambda b: b.generator("g2", "prompts", max_completion_length=256), r"'max_completion_length' is TRL's name: did you mean max_new_tokens\?"),
        (lambda b: b.loss("l2", "gen", "reward", objective="grpo", epsilon=0.2), r"'epsilon' is TRL's name: did you mean clip_eps\?"),
        (lambda b: b.policy("p2", "aipo", learning_rate=1e-6), r"'learning_rate' is TRL's name: did you mean lr\?"),
        (lambda b: b.source("s2", max_prompt_length=512), r"'max_prompt_length' is TRL's name: did you mean max_prompt_len\?"),
        (lambda b: b.loss("l2", "gen", "reward", num_generations=8), r"'num_generations' is TRL's name: did you mean n_samples\? It is an option of b.generator\(...\)"),
        (lambda b: b.loss("l2", "gen", "reward", temperature=0.7), r"'temperature' is an option of b.generator\(...\), not of b.loss\(...\)"),
        (lambda b: b.policy("p2", "aipo", sync_ref_model=True), r"'sync_ref_model' is TRL's name: a reference syncs when given sync_steps=N \(> 0\) on b.reference\(...\)"),
        (lambda b: b.policy("p2", "aipo", ref_model_mixup_alpha=0.6), r"'ref_model_mixup_alpha' is TRL's name: did you mean sync_alpha\? It is an option of b.reference\(...\)"),
        (lambda b: b.policy("p2", "aipo", save_total_limit=2), r"'save_total_limit' is TRL's name: checkpoints are the run's: flowrl run --keep-checkpoints N"),
        (lambda b: b.generator("g2", "prompts", n_smaples=3), r"did you mean 'n_samples'\?"),
        (lambda b: b.loss("l2", "gen", "reward", objective="grpo", epsilon_high=0.28), r"'epsilon_high' is TRL's name: did you mean clip_eps_high\?"),
        (lambda b: b.loss("l2", "gen", "reward", loss_type="dr_grpo"), r"'loss_type' is TRL's name: did you mean loss_agg\? \(TRL's grpo is loss_agg='seq_mean', bnpo and dapo are 'token_mean', dr_grpo is 'dr_grpo'"),
        (lambda b: b.generator("g2", "prompts", mask_truncated_completions=True), r"'mask_truncated_completions' is an option of b.loss\(...\), not of b.generator\(...\)"),
        (lambda b: b.loss("l2", "gen", "reward", importance_sampling_level="sequence"), r"'importance_sampling_level' is TRL's name: did you mean objective\? \('sequence' is objective='gspo'"),
    ],
    ids=["num_generations", "beta", "max_completion_length", "epsilon", "learning_rate", "max_prompt_length", "on-the-wrong-node",
         "temperature-on-the-loss", "sync_ref_model", "ref_model_mixup_alpha", "a-run-flag", "typo", "epsilon_high", "loss_type", "mask_truncated-on-the-generator",
         "importance_sampling_level"],
)
def test_options_named_as_in_trl_or_on_the_wrong_node_say_what_they_meant(build, match) -> None:
    b = _canonical()
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['\w+'\]; " + match):
        build(b)


def _loss_case(case: str) -> None:
    b = GraphBuilder("t")
    gen = b.generator("gen", b.source("prompts", task="copy"))
    reward = b.scorer("reward", gen, fn="m:f", output="reward_correct")
    brief = b.scorer("brief", gen, fn="m:g", output="reward_brief")
    loss = {
        "kl-without-reference": lambda: b.loss("aipo", gen, reward, brief, kl_coef=0.04),
        "weight-of-a-missing-field": lambda: b.loss("aipo", gen, reward, brief, reward_weights={"reward_correct": 1.0, "correct": 0.5}),
        "weights-and-no-scorer-listed": lambda: b.loss("aipo", gen, reward_weights={"correct": 1.0}),
    }[case]()
    b.weights(b.policy("policy", loss), gen)
    b.build()


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("kl-without-reference", r"loss 'aipo' has kl_coef=0.04, a KL penalty to a reference policy, but no reference node feeds it; "
         r"add one: ref = b.reference\('ref', 'gen'\), and list it: b.loss\('aipo', \.\.\., ref\) \(or set kl_coef=0\)"),
        ("weight-of-a-missing-field", r"loss 'aipo': reward_weights names 'correct', which none of its inputs produces; "
         r"the reward fields present are \['reward_brief', 'reward_correct'\]"),
        ("weights-and-no-scorer-listed", r"input field 'correct' of node 'aipo' \(loss\) is produced by no node; .*"
         r"the reward fields present are \['reward_brief', 'reward_correct'\] \(scorers brief, reward\)"),
    ],
    ids=["kl-without-reference", "weight-of-a-missing-field", "weights-and-no-scorer-listed"],
)
def test_loss_inputs_that_are_missing_say_what_to_add(case, match) -> None:
    with pytest.raises(GraphError, match=match):
        _loss_case(case)


@pytest.mark.parametrize("baseline", ["group_mean", "leave_one_out"])
def test_one_sample_per_prompt_warns_that_the_advantage_is_always_0(baseline) -> None:
    b = GraphBuilder("t")
    gen = b.generator("gen", b.source("prompts", task="copy"), n_samples=1)
    loss = b.loss("aipo", gen, b.scorer("reward", gen, fn="m:f"), baseline=baseline)
    b.weights(b.policy("policy", loss), gen)
    with pytest.warns(GraphWarning, match=rf"loss 'aipo': generator 'gen' draws n_samples=1 completion per prompt, so the group "
                      rf"baseline \({baseline}\) leaves every advantage 0 and nothing is learned; set n_samples >= 2"):
        b.build()


def test_two_samples_per_prompt_build_without_a_warning() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _canonical().build()  # n_samples=2


def test_nested_function_is_refused() -> None:
    def nested(p, c):
        return 0.0

    with pytest.raises(GraphError, match=r"not a lambda or a nested function"):
        GraphBuilder("t").scorer("r", "gen", fn=nested)


def test_build_reports_a_broken_rule_naming_the_node() -> None:
    b = GraphBuilder("t")
    prompts = b.source("prompts")
    gen = b.generator("gen", prompts)
    reward = b.scorer("reward", gen, fn="m:f")
    b.policy("policy", b.loss("aipo", gen, reward))
    with pytest.raises(GraphError, match=r"generator 'gen' receives no weights.*builder.weights\(policy, 'gen'\)"):
        b.build()


def test_loss_reward_weights_default_to_the_scorers() -> None:
    g = build_example("two_scorers")
    assert g.node("aipo").loss.reward_weights == {"reward_correct": 1.0, "reward_brief": 0.1}
    b = GraphBuilder("t")
    gen = b.generator("gen", b.source("prompts"))
    a = b.scorer("a", gen, fn="m:a", output="reward_a")
    c = b.scorer("c", gen, fn="m:c", output="reward_c")
    assert b.loss("aipo", gen, a, c).loss.reward_weights == {"reward_a": 1.0, "reward_c": 1.0}


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ModelConfig(dim=60, n_heads=8), r"n_heads=8 must divide dim=60"),
        (lambda: ModelConfig(n_heads=4, n_kv_heads=3), r"n_kv_heads=3 must divide n_heads=4"),
        (lambda: ModelConfig(dim=12, n_heads=4), r"head_dim=3 must be even"),
        (lambda: ModelConfig(norm_eps=0.0), r"norm_eps=0.0 must be > 0"),
        (lambda: SamplingConfig(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (lambda: SamplingConfig(temperature=float("nan")), r"temperature=nan must be a finite number"),
        (lambda: LossConfig(rho=0.5), r"rho=0.5 must be >= 1"),
        (lambda: LossConfig(rho=float("inf")), r"rho=inf must be a finite number \(JSON has no inf or nan\)"),
        (lambda: LossConfig(reward_weights={}), r"reward_weights must name at least one reward field"),
        (lambda: LossConfig(reward_weights={"r": float("nan")}), r"reward_weights\['r'\]=nan must be a finite number"),
        (lambda: OptimizerConfig(betas=(0.9, 1.0)), r"betas=\(0.9, 1.0\) must be in \[0, 1\)"),
        (lambda: OptimizerConfig(weight_decay=-0.1), r"weight_decay=-0.1 must be >= 0"),
        (lambda: SourceConfig(batch_size=0), r"SourceConfig: batch_size=0 must be >= 1"),
    ],
    ids=["heads-dim", "kv-heads", "odd-head-dim", "norm-eps", "top-p", "nan-temperature", "rho", "inf-rho", "no-rewards", "nan-weight", "betas", "weight-decay", "batch"],
)
def test_config_errors_name_field_and_value(make, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make()


def test_builder_model_is_shared_unless_given() -> None:
    model = ModelConfig(dim=32, n_heads=2, n_kv_heads=2)
    b = GraphBuilder("t", model=model)
    gen = b.generator("gen", b.source("prompts"))
    assert gen.model == model


def _task_factory(seed):  # a module-level task factory, referenced by the source
    from flowrl.operators.tasks import CopyTask

    return CopyTask(seed)


def _pipeline(**source):
    from flowrl.graph.builder import GraphBuilder

    b = GraphBuilder("t")
    prompts = b.source("prompts", batch_size=4, **source)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=4)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    policy = b.policy("policy", b.loss("aipo", gen, reward))
    b.weights(policy, gen)
    return b.build()


def test_callable_task_is_stored_by_reference_and_runs():
    from flowrl.operators.tasks import CopyTask, make_task

    graph = _pipeline(task=_task_factory)
    ref = graph.node("prompts").source.task
    assert ref == f"{__name__}:_task_factory"
    assert isinstance(make_task(ref, 0), CopyTask)


def test_a_task_that_is_no_name_and_no_reference_is_refused_at_build():
    from flowrl.errors import FlowrlError

    with pytest.raises(FlowrlError, match="task=3 is a int"):
        _pipeline(task=3)
    with pytest.raises(FlowrlError, match="task 'no such task' is neither a task name nor a reference"):
        _pipeline(task="no such task")


def test_an_objective_that_is_no_name_is_refused_at_build():
    from flowrl.errors import GraphError
    from flowrl.graph.builder import GraphBuilder

    b = GraphBuilder("t")
    prompts = b.source("prompts", task="copy", batch_size=4)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=4)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    policy = b.policy("policy", b.loss("aipo", gen, reward, objective="ai po"))
    b.weights(policy, gen)
    with pytest.raises(GraphError, match="loss 'aipo': objective 'ai po' is not an objective name"):
        b.build()


@pytest.mark.parametrize(
    "node, value, error, message",
    [
        ("prompts", "cpoy", "ConfigError", "source 'prompts': unknown task 'cpoy'; built-in tasks are add, copy, longtail"),
        ("aipo", "aipoo", "GraphError", "loss 'aipo': unknown objective 'aipoo'; known objectives are aipo, cispo, decoupled_ppo, dppo, grpo, gspo, mis, opd, pg, ppo, ppo_clip, sapo, tis"),
    ],
    ids=["task", "objective"],
)
def test_unknown_registry_names_build_and_are_refused_at_run_start(node, value, error, message):
    """Which tasks and objectives exist is the run's registries' business (``flowrl.runtime.names``):
    the graph builds (no torch imported), ``run_graph`` refuses it before any work."""
    import flowrl.errors
    from flowrl.graph.builder import GraphBuilder
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.run import run_graph

    b = GraphBuilder("t")
    prompts = b.source("prompts", task=value if node == "prompts" else "copy", batch_size=4)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=4)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    policy = b.policy("policy", b.loss("aipo", gen, reward, objective=value if node == "aipo" else "aipo"))
    b.weights(policy, gen)
    graph = b.build()
    with pytest.raises(getattr(flowrl.errors, error), match=message):
        run_graph(graph, RunConfig(steps=1))
