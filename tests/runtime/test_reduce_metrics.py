"""``reduce_metrics`` on a 2-rank gloo group: maxima stay maxima, minima minima, token counts add up, a
per-token mean is weighted by its own tokens, dropped groups add up, everything else by samples (a data-parallel policy's metrics row)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.runtime.helpers import launch_ranks

#: rank -> (its metrics, its samples)
RANKS = {
    0: ({"loss": 1.0, "mismatch/kl": 0.1, "mismatch/tokens": 30.0, "mismatch/abs_logp_max": 0.5, "shaping/dropped_groups": 2.0,
         "policy/entropy": 2.0, "policy/tokens": 10.0, "x/length_min": 3.0}, 1.0),
    1: ({"loss": 4.0, "mismatch/kl": 0.4, "mismatch/tokens": 10.0, "mismatch/abs_logp_max": 0.2, "shaping/dropped_groups": 1.0,
         "policy/entropy": 1.0, "policy/tokens": 10.0, "x/length_min": 7.0}, 3.0),
}


def test_each_metric_is_reduced_as_its_name_says(tmp_path: Path) -> None:
    results, logs = launch_ranks("tests.runtime.test_reduce_metrics", 2, tmp_path, timeout_s=120)
    assert set(results) == {0, 1}, "\n".join(logs)
    expected = {  # worked out by hand from RANKS
        "loss": (1.0 * 1 + 4.0 * 3) / 4,  # samples-weighted: 3.25
        "mismatch/kl": (0.1 * 30 + 0.4 * 10) / 40,  # tokens-weighted: 0.175
        "mismatch/tokens": 40.0,  # a sum
        "mismatch/abs_logp_max": 0.5,  # a max
        "shaping/dropped_groups": 3.0,  # a sum (the samples-weighted mean would be 1.25)
        "policy/entropy": (2.0 * 10 + 1.0 * 10) / 20,  # weighted by its own tokens: 1.5 (by samples 1.25, by mismatch/tokens 1.75)
        "policy/tokens": 20.0,
        "x/length_min": 3.0,  # a min
    }
    for rank in (0, 1):
        assert results[rank].keys() == expected.keys()
        for key, value in expected.items():
            assert abs(results[rank][key] - value) < 1e-12, (rank, key, results[rank][key], value)


def _worker_main(argv: list[str]) -> None:
    import torch.distributed as dist

    from flowrl.runtime.parallel.distributed import reduce_metrics

    rank, world, init, out = int(argv[0]), int(argv[1]), argv[2], Path(argv[3])
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        metrics, samples = RANKS[rank]
        (out / f"rank{rank}.json").write_text(json.dumps(reduce_metrics(metrics, samples, group=None)))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process  # no interpreter teardown (rank_exit)

    _worker_main(sys.argv[1:])
    end_rank_process(0)
