"""The planner prices a policy with ``sharding="fsdp"`` as the runtime runs it: ZeRO stage 3, weights from shards."""

from __future__ import annotations

from flowrl.examples.llamarl import build_llamarl
from flowrl.planners.estimate.train import zero_stage
from flowrl.planners.plan import plan_graph
from flowrl.planners.tuning import Tuning
from tests.runtime.test_fsdp import fsdp_graph


def test_an_fsdp_policy_is_zero_stage_3_whatever_the_tuning_says():
    assert zero_stage(Tuning(zero_stage=0), "fsdp") == 3
    assert zero_stage(Tuning(zero_stage=0)) == 0


def test_an_fsdp_policy_holds_half_the_state_per_device_and_syncs_from_its_shards():
    """Policy on 2 devices with ZeRO off in the tuning: the FSDP policy's weights, gradients and
    AdamW states per device are half the replicated policy's; its weight sync is priced from shards."""
    plans = [plan_graph(g, "4xA100", strategy="gen:d1@0 | policy:d2@1-2", zero_stage=0) for g in (build_llamarl(), fsdp_graph())]
    replica, sharded = (p.placements["policy"].memory for p in plans)
    assert (sharded.weights, sharded.grads, sharded.optimizer) == (replica.weights // 2, replica.grads // 2, replica.optimizer // 2)
    assert all("FSDP" not in s.note for s in plans[0].weight_syncs)
    assert all("from FSDP shards" in s.note for s in plans[1].weight_syncs)
    assert [s.wire_bytes for s in plans[0].weight_syncs] == [s.wire_bytes for s in plans[1].weight_syncs]  # the same bytes, other senders
