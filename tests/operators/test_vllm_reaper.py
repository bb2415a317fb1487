"""vLLM's processes end with the process that started them, even when it is SIGKILLed (vllm_reaper)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowrl.operators.engines.vllm_reaper import _WATCHDOG, Reaper, descendants, start_time, started_since

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the reaper reads /proc (Linux)")


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether ``pid`` ended within ``within_s`` (a zombie that nobody reaps counts as ended)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except OSError:
            return True
        if state in (b"Z", b"X"):
            return True
        time.sleep(0.05)
    return False


OWNER = """
import subprocess, sys, time
from flowrl.operators.engines.vllm_reaper import Reaper, descendants, started_since
before = descendants()
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
reaper = Reaper.watch(started_since(before))
print(engine.pid, reaper.pid, flush=True)
time.sleep(120)
"""


def test_an_owner_killed_with_sigkill_takes_the_processes_it_started_with_it():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        engine, watchdog = map(int, owner.stdout.readline().split())
        assert start_time(engine) is not None and start_time(watchdog) is not None
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        assert _gone(engine), "the process the killed owner started is still running"
        assert _gone(watchdog), "the watchdog did not exit after its job"
    finally:
        owner.kill()
        owner.wait()


def test_close_kills_what_a_shutdown_left_and_the_watchdog_exits_without_killing_others():
    before = descendants()
    survivor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    reaper = Reaper.watch(started_since(before))
    watchdog = reaper.pid
    assert watchdog is not None and survivor.pid in descendants()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # started after: not watched
    try:
        reaper.close()
        assert survivor.wait(timeout=10) == -signal.SIGKILL
        assert _gone(watchdog)
        assert bystander.poll() is None
        reaper.close()  # idempotent
    finally:
        for p in (survivor, bystander):
            p.kill()
            p.wait()


def test_a_pid_that_now_names_another_process_is_not_killed():
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        wrong_start = str(int(start_time(other.pid)) - 1)  # the pid as a process that started earlier held it
        subprocess.run([sys.executable, "-S", "-c", _WATCHDOG, f"{other.pid}:{wrong_start}"], input=b"", check=True, timeout=10)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_nothing_to_watch_starts_no_watchdog():
    reaper = Reaper.watch([])
    assert reaper.pid is None
    reaper.close()
    assert os.getpid() not in descendants()


VLLM_OWNER = """
import os, sys, msgspec
from pathlib import Path
from flowrl.graph.configs import HFModelConfig, SamplingConfig
from flowrl.graph.nodes import GeneratorNode
from flowrl.operators.engines import vllm_engine
from flowrl.operators.engines.vllm_reaper import descendants
from tests.operators.test_vllm_engine import _vllm_dir
d = _vllm_dir(Path(sys.argv[1]))
node = GeneratorNode(name="gen", model=HFModelConfig(path=str(d)), sampling=SamplingConfig(n_samples=2, max_new_tokens=4), engine="vllm")
gen = vllm_engine.VLLMGenerator(node, seed=0)
print(" ".join(map(str, sorted(descendants()))), flush=True)
import time; time.sleep(300)
"""


@pytest.mark.slow
def test_a_process_holding_a_vllm_engine_killed_with_sigkill_leaves_no_vllm_process(tmp_path):
    """What an OOM kill or the process backend's kill of a failed worker does: vLLM's engine core and
    worker end too (before the reaper they lived on, re-parented to init, holding the model's memory)."""
    pytest.importorskip("vllm")
    owner = subprocess.Popen([sys.executable, "-c", VLLM_OWNER, str(tmp_path / "qwen2")], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).parents[2])
    try:
        started = [int(p) for p in owner.stdout.readline().split()]
        vllm = [p for p in started if b"VLLM" in Path(f"/proc/{p}/cmdline").read_bytes() + Path(f"/proc/{p}/comm").read_bytes()]
        assert vllm, f"no vLLM process among the owner's descendants {started}"
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        assert all(_gone(p, within_s=20) for p in vllm), "vLLM's processes outlived the killed process that started them"
    finally:
        owner.kill()
        owner.wait()
