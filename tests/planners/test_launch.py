"""The emitted launch's text: one torchrun script per host of the plan (node rank, hosts, processes, endpoint placeholder), a README."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest

from flowrl.examples import build_example
from flowrl.planners.launch import host_launches, launch_files
from flowrl.planners.plan import plan_graph

RUN = ["my graph.py", "--backend", "torchrun", "--device", "cuda"]


@pytest.fixture(scope="module")
def two_hosts():
    plan = plan_graph(build_example("llamarl"), "2x8xH100", strategy="gen:d8@0-7 | policy:d8@8-15")
    return launch_files(plan, RUN, exists=[("GRAPH", "my graph.py")], planned_in="/home/me/work")


def _words(tmp_path, script: str, *extra: str) -> list[str]:
    """The words bash hands torchrun when the script runs (``printf`` in its place), with MASTER_ADDR set and
    the script's graph file present: what its quoting and variables really give."""
    path = tmp_path / "launch" / "host.sh"
    path.parent.mkdir(exist_ok=True)
    path.write_text(script.replace("exec torchrun", "exec printf '%s\\n' torchrun"))
    (tmp_path / "my graph.py").write_text("")
    done = subprocess.run(["bash", str(path), *extra], cwd=tmp_path, env={**os.environ, "MASTER_ADDR": "10.0.0.1"},
                          capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.splitlines()


def test_two_hosts_of_eight_get_a_script_each(two_hosts, tmp_path):
    assert sorted(two_hosts) == ["README.txt", "host0.sh", "host1.sh"]
    for rank in (0, 1):
        words = _words(tmp_path, two_hosts[f"host{rank}.sh"], "--steps", "3")
        flags = {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}
        assert words[0] == "torchrun"
        assert (flags["--nnodes"], flags["--node-rank"], flags["--nproc-per-node"]) == ("2", str(rank), "8")
        assert (flags["--rdzv-backend"], flags["--master-addr"], flags["--master-port"]) == ("static", "10.0.0.1", "29500")
        run = words[words.index("-m"):]
        assert run[:3] == ["-m", "flowrl", "run"] and run[3:8] == RUN  # the graph file with its space, one word
        assert run[8:] == ["--plan", str(tmp_path / "launch" / "plan.json"), "--steps", "3"]  # the plan beside the script; more flags after
    host0, host1 = two_hosts["host0.sh"], two_hosts["host1.sh"]
    assert "# ranks 0-7 here: gen (0-7)." in host0 and "# ranks 8-15 here: policy (8-15)." in host1
    assert 'export FLOWRL_CONTROLLER_ADDR="${FLOWRL_CONTROLLER_ADDR:-$MASTER_ADDR}"' in host1
    readme = two_hosts["README.txt"]
    assert "host1.sh    host 1's launch: torchrun with 8 processes (ranks 8-15: policy (8-15))." in readme
    assert "  MASTER_ADDR=<host 0 address> bash host0.sh\n  MASTER_ADDR=<host 0 address> bash host1.sh\n" in readme
    assert "  flowrl run 'my graph.py' --backend torchrun --device cuda --plan plan.json\n" in readme


def test_the_scripts_are_bash_that_stops_without_its_endpoint_or_graph(two_hosts, tmp_path):
    for name in ("host0.sh", "host1.sh"):
        (tmp_path / name).write_text(two_hosts[name])
        assert subprocess.run(["bash", "-n", str(tmp_path / name)]).returncode == 0
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR",)}
    done = subprocess.run(["bash", str(tmp_path / "host1.sh")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "MASTER_ADDR: set MASTER_ADDR to the address of host 0 (it runs rank 0)" in done.stderr
    done = subprocess.run(["bash", str(tmp_path / "host1.sh")], cwd=tmp_path, env={**env, "MASTER_ADDR": "10.0.0.1"}, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr == "host1.sh: GRAPH my graph.py is not here; run this script from the directory flowrl plan ran in (/home/me/work) or one where it resolves\n"


@pytest.mark.parametrize(
    ("cluster", "strategy", "hosts"),
    [
        ("cpu:3", "gen:d1@0 | policy:d2@1-2", [(1, 3)]),
        ("8xH100", "gen:d2@0-1 | policy:d4@2-5", [(1, 6)]),  # one host: the devices the plan uses
        ("3x8xH100", "gen:d4@0-3 | policy:d16@4-19", [(3, 8)] * 3),  # several: every host's devices, the last one's idle ranks included
    ],
    ids=["cpu-3", "gpu-part-of-a-host", "three-hosts"],
)
def test_hosts_and_processes_follow_the_devices_the_plan_uses(cluster, strategy, hosts):
    plan = plan_graph(build_example("llamarl"), cluster, strategy=strategy)
    assert [(h.nnodes, h.nproc) for h in host_launches(plan)] == hosts
    if len(hosts) == 1:
        script = launch_files(plan, ["llamarl", "--backend", "torchrun"])["host0.sh"]
        assert f"exec torchrun --standalone --nnodes 1 --nproc-per-node {hosts[0][1]} \\\n" in script and "MASTER_ADDR" not in script
