"""From a plan to its launch: the per-host torchrun scripts and the README that ``flowrl plan --emit DIR`` writes.

A plan's devices are the ranks of one torchrun job: device ``d`` is global rank ``d``, on host
``d // devices_per_host`` of the plan's cluster. ``launch_files`` writes, for the hosts the plan
uses, one bash script each, ``host<i>.sh``, holding the torchrun command of that host (its node
rank, the hosts in all, the processes per host) and the ``flowrl run`` arguments that run the plan
(given by the caller: ``flowrl.cli.emit`` decides them), with the plan file named by a path next to
the script, so the script runs from any directory; and ``README.txt`` saying what each file is and
how to start them. The text is built here (pure: no files, no processes).

- One host: ``torchrun --standalone`` (a rendezvous on this host, on a free port).
- Several hosts: the static rendezvous (torchrun's default) with ``--node-rank i``: host ``i`` takes
  ranks ``i * nproc .. (i + 1) * nproc - 1`` as the plan numbers them, and host 0 runs rank 0, the
  controller. (The ``c10d`` rendezvous would order the hosts by name and ignore ``--node-rank``.)
  The endpoint is a placeholder the user fills: ``MASTER_ADDR`` (host 0's address; the script stops,
  saying so, when it is unset) and ``MASTER_PORT`` (default 29500); ``FLOWRL_CONTROLLER_ADDR``
  defaults to ``MASTER_ADDR`` (rank 0 listens there for the other ranks).
- Arguments after the script go to ``flowrl run`` (``bash host0.sh --steps 100 --metrics m.jsonl``),
  the same on every host.

Example:
    >>> from flowrl.examples import build_example
    >>> from flowrl.planners.plan import plan_graph
    >>> plan = plan_graph(build_example("llamarl"), "2x8xH100", strategy="gen:d8@0-7 | policy:d8@8-15")
    >>> files = launch_files(plan, ["llamarl", "--backend", "torchrun", "--device", "cuda"])
    >>> sorted(files)
    ['README.txt', 'host0.sh', 'host1.sh']
    >>> print(next(line for line in files["host1.sh"].splitlines() if line.startswith("exec")))
    exec torchrun --nnodes 2 --node-rank 1 --nproc-per-node 8 --rdzv-backend static --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}" \\
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence

from flowrl.graph.nodes import IN_POLICY_KINDS
from flowrl.placement.layout import device_ranges
from flowrl.planners.plan_data import Plan

__all__ = ["PLAN_FILE", "README_FILE", "HostLaunch", "host_launches", "launch_files", "script_name"]

#: The plan file's name in the emitted directory.
PLAN_FILE = "plan.json"
#: The README's name in the emitted directory.
README_FILE = "README.txt"
#: The rendezvous port when ``MASTER_PORT`` is unset.
DEFAULT_PORT = 29500


def script_name(host: int) -> str:
    """``host0.sh``, ``host1.sh``, ..."""
    return f"host{host}.sh"


class HostLaunch:
    """One host's share of the job: its node rank, the hosts in all, its processes, its global ranks."""

    def __init__(self, node_rank: int, nnodes: int, nproc: int) -> None:
        self.node_rank, self.nnodes, self.nproc = node_rank, nnodes, nproc

    @property
    def ranks(self) -> range:
        return range(self.node_rank * self.nproc, (self.node_rank + 1) * self.nproc)

    def torchrun(self) -> list[str]:
        """torchrun's own flags for this host (shell words; the endpoint as variables the script checks)."""
        if self.nnodes == 1:
            return ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", str(self.nproc)]
        return [
            "torchrun", "--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank), "--nproc-per-node", str(self.nproc),
            "--rdzv-backend", "static", '--master-addr "$MASTER_ADDR"', f'--master-port "${{MASTER_PORT:-{DEFAULT_PORT}}}"',
        ]  # fmt: skip


def host_launches(plan: Plan) -> list[HostLaunch]:
    """The hosts the plan uses, in node-rank order: as many as its highest device needs, each with
    the cluster's devices per host (one host: just the devices the plan uses)."""
    needed = 1 + max((d for p in plan.placements.values() for d in p.devices), default=0)
    per_host = plan.cluster_spec.devices_per_host if plan.cluster_spec is not None else needed
    nnodes = math.ceil(needed / per_host)
    nproc = needed if nnodes == 1 else per_host
    return [HostLaunch(i, nnodes, nproc) for i in range(nnodes)]


def _nodes_on(plan: Plan, ranks: range) -> str:
    """``"gen (0-7)"``: the nodes with a rank on ``ranks``, with those ranks."""
    parts = []
    for name, p in plan.placements.items():
        mine = tuple(d for d in p.devices if d in ranks)
        if mine and p.kind not in IN_POLICY_KINDS:  # a loss runs inside its policy
            parts.append(f"{name} ({device_ranges(mine)})")
    return ", ".join(parts) or "no node (idle ranks)"


def _script(plan: Plan, host: HostLaunch, run_args: Sequence[str], exists: Sequence[tuple[str, str]], planned_in: str) -> str:
    multi = host.nnodes > 1
    run = ["-m", "flowrl", "run", *(shlex.quote(a) for a in run_args), "--plan", f'"$here/{PLAN_FILE}"', '"$@"']
    lines = [
        "#!/usr/bin/env bash",
        f"# flowrl: host {host.node_rank} of {host.nnodes} of the plan of graph {plan.graph!r} on {plan.cluster}: {plan}",
        f"# ranks {device_ranges(tuple(host.ranks))} here: {_nodes_on(plan, host.ranks)}.",
        "# Start every host's script at the same time, each with MASTER_ADDR set to host 0's address:" if multi else "# Run it:",
        f"#   {'MASTER_ADDR=<host 0 address> ' if multi else ''}bash {script_name(host.node_rank)} [more 'flowrl run' flags{', the same on every host' if multi else ''}]",
        "set -euo pipefail",
        'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
    ]
    if multi:
        lines += [
            ': "${MASTER_ADDR:?set MASTER_ADDR to the address of host 0 (it runs rank 0), reachable from every host}"',
            'export FLOWRL_CONTROLLER_ADDR="${FLOWRL_CONTROLLER_ADDR:-$MASTER_ADDR}"  # rank 0, on host 0, listens there for the other ranks',
        ]
    for flag, path in exists:  # relative paths of the plan's command: they must resolve where the script runs
        quoted = shlex.quote(path)
        message = f"{script_name(host.node_rank)}: {flag} {path} is not here; run this script from the directory flowrl plan ran in ({planned_in}) or one where it resolves"
        lines.append(f"[ -e {quoted} ] || {{ echo {shlex.quote(message)} >&2; exit 2; }}")
    lines.append("exec " + " ".join(host.torchrun()) + " \\")
    lines.append("    " + " ".join(run))
    return "\n".join(lines) + "\n"


def _readme(plan: Plan, hosts: list[HostLaunch], run_args: Sequence[str]) -> str:
    multi = len(hosts) > 1
    run = " ".join(shlex.quote(a) for a in run_args)
    lines = [
        f"Launch files of the plan of graph {plan.graph!r} on {plan.cluster}: {plan}",
        f"(predicted step: {plan.step_s:.3g} s at max_staleness {plan.max_staleness}; 'flowrl plan' printed the whole plan).",
        "",
        f"{PLAN_FILE:<11} the plan: every node's devices (torchrun ranks) and mesh, with its predicted times.",
        f"{'':<11} 'flowrl run --plan {PLAN_FILE}' runs it; 'flowrl viz GRAPH --plan {PLAN_FILE}' draws it.",
    ]
    for h in hosts:
        lines.append(
            f"{script_name(h.node_rank):<11} host {h.node_rank}'s launch: torchrun with {h.nproc} processes (ranks "
            f"{device_ranges(tuple(h.ranks))}: {_nodes_on(plan, h.ranks)}){', the controller on rank 0' if h.node_rank == 0 else ''}."
        )
    lines += [f"{README_FILE:<11} this file.", "", "Each script runs, under torchrun:", f"  flowrl run {run} --plan {PLAN_FILE}", ""]
    if multi:
        lines += [
            "Run every host's script at the same time, each on its host, with MASTER_ADDR set to host 0's",
            f"address (and MASTER_PORT if {DEFAULT_PORT} is taken):",
            *(f"  MASTER_ADDR=<host 0 address> bash {script_name(h.node_rank)}" for h in hosts),
            "Every host needs flowrl, the graph and its files at the same paths, and a --checkpoint-dir every rank sees.",
        ]
    else:
        lines += [f"Run it: bash {script_name(0)}"]
    lines += [
        "More 'flowrl run' flags go after the script's name (the same on every host), e.g.:",
        f"  bash {script_name(0)} --steps 100 --metrics metrics.jsonl",
        "The scripts find the plan file next to themselves; a relative graph or model path resolves from the",
        "directory the script is run in.",
    ]
    return "\n".join(lines) + "\n"


def launch_files(
    plan: Plan, run_args: Sequence[str], *, exists: Sequence[tuple[str, str]] = (), planned_in: str = "."
) -> dict[str, str]:
    """File name -> text of the emitted launch (module docstring); the plan file itself is the caller's to write.

    Args:
        plan: the plan to launch.
        run_args: ``flowrl run``'s arguments that run it, without ``--plan`` (the scripts add it).
        exists: ``(flag, path)`` of relative paths among them that each script checks before launching.
        planned_in: the directory the plan was made in, for the message of that check.
    """
    hosts = host_launches(plan)
    files = {script_name(h.node_rank): _script(plan, h, run_args, exists, planned_in) for h in hosts}
    files[README_FILE] = _readme(plan, hosts, run_args)
    return files
