"""Faults under torchrun, as a cluster user meets them: the HF example restarting by itself.

The README's cluster command on the built-in engine at k = 0 (the computation deterministic on the
CPU): ``torchrun --max-restarts 3 --nproc-per-node 3 -m flowrl run hf_copy --model DIR --sharding fsdp
--backend torchrun --plan place.json --checkpoint-dir ck --checkpoint-every E --resume auto
--liveness-timeout T`` with the generator on rank 0 and the policy sharded with FSDP2 over ranks
1-2. One job takes three faults in turn, each once training has gone on after the one before: a
SIGKILL of a policy rank (1), a SIGKILL of the generator rank (0), a SIGSTOP of a policy rank (2).
An uninterrupted job with the same command is the reference.

Prints JSON: per fault, the seconds from the fault to training again (the first metrics row written
after the restart's resume), the steps re-done (rows written before the fault past the checkpoint
resumed from), and the restart's resume point; for the job, prompts lost and repeated against the
reference (goal 0), whether its rows are 1..steps once each, and whether its final policy state
(every shard's tensors) equals the reference's bit for bit; wall times and the load. With ``--vllm``
also the same job on the vLLM engine whose engine core is SIGKILLed: its recovery and prompts.

    python benches/faults.py                    # 40 steps, a checkpoint every 4, --liveness-timeout 10
    python benches/faults.py --steps 60 --every 5 --liveness 20
    python benches/faults.py --vllm             # also the README's vLLM job, its engine core SIGKILLed once
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.reliability.killresume import check_run, descendants, equal_states, final_state, free_port, rank_pid, rows_of  # noqa: E402

FAULTS = (("SIGKILL", 1, "policy rank"), ("SIGKILL", 0, "generator rank"), ("SIGSTOP", 2, "policy rank"))






def _engine_pid(agent: int) -> int | None:
    """vLLM's engine core among the job's processes."""
    for pid in descendants(agent):
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::EngineCor"):
                return pid
        except OSError:
            continue
    return None


def start(cwd: Path, model: Path, steps: int, every: int, liveness: float, engine: str = "builtin") -> subprocess.Popen:
    (cwd / "place.json").write_text('{"gen": [0], "policy": [1, 2]}')
    cmd = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "3", "--nproc-per-node", "3",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           "-m", "flowrl", "run", "hf_copy", "--model", str(model), "--sharding", "fsdp", "--backend", "torchrun",
           "--plan", "place.json", "--quiet", "--steps", str(steps), "--max-staleness", "0", "--checkpoint-dir", "ck",
           "--checkpoint-every", str(every), "--resume", "auto", "--metrics", "m.jsonl", "--liveness-timeout", str(liveness), "--engine", engine]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FLOWRL_DIST_TIMEOUT_S": "60"}
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=open(cwd / "err.txt", "w"), start_new_session=True)


def resumes(cwd: Path) -> list[int]:
    """The step of each resume the job's restarts reported, in order."""
    return [int(s) for s in re.findall(r"resuming from ck/step-(\d+)", (cwd / "err.txt").read_text(errors="replace"))]


def run_faulted(cwd: Path, model: Path, steps: int, every: int, liveness: float, timeout: float,
                faults_in_turn: tuple = FAULTS, engine: str = "builtin") -> dict:
    job = start(cwd, model, steps, every, liveness, engine)
    t0 = time.monotonic()
    faults = []
    try:
        for i, (sig, rank, role) in enumerate(faults_in_turn):
            want_rows = (i + 1) * steps // (len(faults_in_turn) + 1)
            while len(rows_of(cwd / "m.jsonl")) < want_rows or len(resumes(cwd)) < i:  # training again after the previous fault
                if job.poll() is not None or time.monotonic() - t0 > timeout:
                    raise RuntimeError(f"the job ended or stalled before fault {i + 1}: {(cwd / 'err.txt').read_text()[-3000:]}")
                time.sleep(0.02)
            victim = _engine_pid(job.pid) if rank == "engine" else rank_pid(job.pid, rank)
            before = len(rows_of(cwd / "m.jsonl"))
            hit = time.monotonic()
            os.kill(victim, getattr(signal, sig))
            while len(resumes(cwd)) < i + 1 or len(rows_of(cwd / "m.jsonl")) <= resumes(cwd)[i]:
                if job.poll() is not None or time.monotonic() - hit > timeout:
                    raise RuntimeError(f"no training after fault {i + 1}: {(cwd / 'err.txt').read_text()[-3000:]}")
                time.sleep(0.02)
            again = time.monotonic() - hit
            resumed = resumes(cwd)[i]
            faults.append({"fault": f"{sig} {role}" if rank == "engine" else f"{sig} rank {rank} ({role})", "rows_at_fault": before, "resumed_from_step": resumed,
                           "steps_redone": before - resumed, "fault_to_training_s": round(again, 2)})
        job.wait(timeout=timeout)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    said = [line for line in (cwd / "err.txt").read_text(errors="replace").splitlines() if "flowrl run: error:" in line]
    return {"exit": job.returncode, "wall_s": round(time.monotonic() - t0, 1), "faults": faults, "errors_said": said}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--liveness", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--vllm-only", action="store_true", help="the vLLM job alone (its prompts against a built-in reference run)")
    p.add_argument("--vllm", action="store_true", help="also a job on the vLLM engine whose engine core is SIGKILLed (prompts checked; not bit-exact)")
    args = p.parse_args()
    from flowrl.examples.hf_copy import write_assets

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="flowrl-faults-") as tmp:
        model = write_assets(Path(tmp) / "hf2", heads=2)
        clean_dir, fault_dir = Path(tmp) / "clean", Path(tmp) / "fault"
        clean_dir.mkdir()
        fault_dir.mkdir()
        t0 = time.monotonic()
        clean = start(clean_dir, model, args.steps, args.every, args.liveness)
        clean.wait(timeout=args.timeout)
        clean_s = time.monotonic() - t0
        want = [r["prompt_index"] for r in rows_of(clean_dir / "m.jsonl")]
        out, problems, lost, repeated, same, differ = {}, [], None, None, None, None
        if not args.vllm_only:
            out = run_faulted(fault_dir, model, args.steps, args.every, args.liveness, args.timeout)
            lost, repeated = check_run(fault_dir / "m.jsonl", want, 0, problems)
            same, differ = equal_states(final_state(clean_dir / "ck", args.steps), final_state(fault_dir / "ck", args.steps))
        extra = {}
        if args.vllm or args.vllm_only:
            vllm_dir = Path(tmp) / "vllm"
            vllm_dir.mkdir()
            extra["vllm"] = run_faulted(vllm_dir, model, args.steps, args.every, args.liveness, args.timeout,
                                        (("SIGKILL", "engine", "vLLM's engine core on rank 0"),), engine="vllm")
            vllm_problems: list[str] = []
            extra["vllm"]["prompts_lost"], extra["vllm"]["prompts_repeated"] = check_run(vllm_dir / "m.jsonl", want, 0, vllm_problems)
            extra["vllm"]["rows_problems"] = vllm_problems

        print(json.dumps({
            "command": "torchrun --max-restarts 3 --nproc-per-node 3 -m flowrl run hf_copy --sharding fsdp --backend torchrun "
                       f"(gen on rank 0, policy FSDP2 on 1-2) --steps {args.steps} --max-staleness 0 --checkpoint-every {args.every} "
                       f"--resume auto --liveness-timeout {args.liveness:g}",
            "reference": {"exit": clean.returncode, "wall_s": round(clean_s, 1), "rows": len(want)},
            **out,
            "prompts_lost": lost, "prompts_repeated": repeated, "rows_problems": problems,
            "final_policy_equal_bit_for_bit": same, "entries_differing": differ, **extra,
            "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
        }, indent=1))


if __name__ == "__main__":
    main()
