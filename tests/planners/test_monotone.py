"""More devices never make a predicted step slower: every strategy and the baseline (issue 34, item 3).

Every strategy searches sub-clusters whose sizes do not depend on the cluster's
(``strategies.candidate_counts``), and the baseline's reported step is its own search over them, so
every candidate on N devices is a candidate on N' > N devices too. The property is drawn over
cluster sizes, device kinds, host sizes, examples, strategies and k; the known counterexample of
the every-device baseline (Llama-3 405B, 1008 against 1024 H100s) is checked by name.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.errors import PlanError
from flowrl.examples import EXAMPLES, build_example
from flowrl.modelspec import ModelSpec, model_preset
from flowrl.planners.baseline import plan_baseline
from flowrl.planners.cluster import parse_cluster
from flowrl.planners.estimate.common import Context
from flowrl.planners.plan import plan_graph
from flowrl.planners.strategies import STRATEGIES
from flowrl.planners.tuning import make_tuning
from flowrl.planners.workload import LLM_DEFAULTS, Workload

GRAPHS = {name: build_example(name) for name in EXAMPLES}
#: A model that needs several H100s to train (tp and pp are searched), and a step to go with it.
MID = ModelSpec(name="mid", n_layers=8, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256)
WORK = Workload(prompts_per_step=32, samples_per_prompt=4, prompt_len=128, gen_len=256)
#: One layer of 17B parameters: it trains on H100s only with tp >= 2, across hosts where a host has one device.
WIDE = ModelSpec(name="wide", n_layers=1, dim=32768, n_heads=256, n_kv_heads=8, ffn_dim=131072, vocab_size=32000, max_seq_len=4096)
MODELS = {"own": None, "mid": MID, "wide": WIDE}


def _figures(graph_name: str, cluster: str, strategy: str, k: int, model: str) -> tuple[float, float]:
    """(the plan's step, the baseline's step) on ``cluster``; inf for what does not fit."""
    graph = GRAPHS[graph_name]
    extra = {"model": MODELS[model], "workload": WORK} if MODELS[model] is not None else {}
    try:
        plan = plan_graph(graph, cluster, strategy=strategy, max_staleness=k, **extra)
    except PlanError as exc:
        assert "needs at least 2 devices" in str(exc) or "no placement" in str(exc), str(exc)
        return math.inf, math.inf
    return plan.step_s, math.inf if plan.baseline_step_s is None else plan.baseline_step_s


@settings(max_examples=25)
@given(
    graph_name=st.sampled_from(sorted(GRAPHS)),
    per_host=st.sampled_from([0, 1, 2, 4, 8]),  # 0: a CPU of that many cores
    hosts=st.integers(1, 24),
    more=st.integers(1, 12),
    strategy=st.sampled_from(STRATEGIES),
    k=st.integers(0, 1),
    model=st.sampled_from(sorted(MODELS)),
)
def test_more_devices_never_make_a_strategy_or_the_baseline_slower(graph_name, per_host, hosts, more, strategy, k, model):
    if per_host == 0:
        clusters = [f"cpu:{hosts}", f"cpu:{hosts + more}"]
        model = "own"  # the examples' own models on a CPU
    else:
        clusters = [f"{hosts}x{per_host}xH100", f"{hosts + more}x{per_host}xH100"]
    (step, base), (step_more, base_more) = (_figures(graph_name, c, strategy, k, model) for c in clusters)
    assert step_more <= step * (1 + 1e-12), f"{strategy} on {clusters[1]}: {step_more} s, slower than {step} s on {clusters[0]}"
    assert base_more <= base * (1 + 1e-12), f"baseline on {clusters[1]}: {base_more} s, slower than {base} s on {clusters[0]}"


def test_the_405b_baseline_is_no_slower_on_1024_h100s_than_on_1008():
    """The counterexample of issue 34: on every device, 1008 H100s hold d18t8p7 and 1024 cannot."""
    graph, model = GRAPHS["llamarl"], model_preset("llama3-405b")
    runs = {}
    for n in (1008, 1024):
        ctx = Context(cluster=parse_cluster(f"{n}xH100"), workload=LLM_DEFAULTS, tuning=make_tuning(gen_precision="bfloat16"))
        runs[n] = plan_baseline(graph, ctx, model=model)
    every = {n: r.all_devices.steps.sync_step_s for n, r in runs.items()}
    assert every[1024] > every[1008]  # the every-device figure is the counterexample ...
    best = {n: r.best_subset.steps.sync_step_s for n, r in runs.items()}
    assert best[1024] <= best[1008]  # ... the baseline's search is not
    assert runs[1008].best_subset.split.gen_count <= 1008
