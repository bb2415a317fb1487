"""Parts of the direct route's tests without vLLM's engine: a stand-in worker process that runs flowrl's
real worker extension (its join and receive, gloo), the ``LLM`` stand-in that calls it over a socket
(JSON, as vLLM's RPC carries plain data), and the policy's ranks as plain processes.

Entry points (``python tests/operators/vllm_direct_parts.py ...``):

- ``worker RPC_PORT [RANK]``: one stand-in vLLM worker (of rank ``RANK`` in its engine, default 0),
  serving RPC calls on ``127.0.0.1:RPC_PORT``;
- ``sender MODE STORE_PORT RANK WORLD PG_PORT OUT [DIE_AFTER]``: one policy rank (``MODE``:
  ``replicated`` or ``fsdp``) serving version 1 of ``toy_state()``; with ``DIE_AFTER`` it exits
  abruptly after gathering that many tensors (a rank that fails mid-sync). With ``FLOWRL_TEST_MODEL_DIR``
  the policy is that directory's seeded model (``FLOWRL_TEST_SEED``), served at ``FLOWRL_TEST_VERSION``
  on channel ``FLOWRL_TEST_CHANNEL``.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
import os
import socket
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import torch

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = float(os.environ.get("FLOWRL_TEST_TIMEOUT_S", "60"))  # the engine tests wait for vLLM's start
BUCKET_BYTES = 8 << 20  # several buckets, and one tensor (16 MiB) alone in its own


class Toy(torch.nn.Module):
    """A 9M-parameter stand-in for a policy (36 MB in float32), Hugging Face-like names."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(512, 1024)
        self.up_proj = torch.nn.Linear(1024, 4096)
        self.down_proj = torch.nn.Linear(4096, 1024)


def hf_model(directory: str, seed: int) -> torch.nn.Module:
    """The policy's model of a config-only Hugging Face directory, seeded (``init="random"``)."""
    from flowrl.graph.configs import HFModelConfig
    from flowrl.models.registry import build_model

    return build_model(HFModelConfig(path=directory, init="random", seed=seed))


def toy_model() -> Toy:
    torch.manual_seed(0)
    return Toy()


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def rss_bytes(pid: int | str = "self") -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class FakeLLM:
    """What ``DirectReceiver`` uses of ``vllm.LLM``: the workers' count and ``collective_rpc`` (every
    worker called before any answer is read, as vLLM does: a join blocks until all members joined)."""

    def __init__(self, *conns: Any) -> None:
        self.conns = conns
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(world_size=len(conns))))

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = ()) -> list[Any]:
        for conn in self.conns:
            conn.send_bytes(msgspec.json.encode({"method": method, "args": list(args)}))
        replies = []
        for conn in self.conns:
            if not conn.poll(timeout):
                raise TimeoutError(f"worker did not answer {method} within {timeout} s")
            reply = msgspec.json.decode(conn.recv_bytes())  # EOFError: the worker died
            if "error" in reply:
                raise RuntimeError(reply["error"])
            replies.append(reply["ok"])
        return replies

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


def start_workers(count: int = 1) -> tuple[list[Any], FakeLLM]:
    """``count`` stand-in worker processes of one engine (ranks 0..count-1, as vLLM's tensor-parallel
    workers) and the ``FakeLLM`` that drives them."""
    import subprocess

    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(120)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, __file__, "worker", str(server.getsockname()[1]), str(r)], env=env) for r in range(count)]
    conns: dict[int, Connection] = {}
    try:
        for _ in range(count):
            sock, _ = server.accept()
            conn = Connection(sock.detach())
            conns[int(msgspec.json.decode(conn.recv_bytes()))] = conn  # each worker says its rank first
    except BaseException:
        for proc in procs:
            proc.kill()
            proc.wait()
        raise
    finally:
        server.close()
    return procs, FakeLLM(*(conns[r] for r in range(count)))


def start_worker() -> tuple[Any, FakeLLM]:
    """A stand-in worker process and the ``FakeLLM`` that drives it."""
    (proc,), llm = start_workers(1)
    return proc, llm


def _worker(port: int, rank: int = 0) -> None:
    from flowrl.operators.engines.vllm_worker import FlowrlWorkerExtension

    class Worker(FlowrlWorkerExtension):
        device = "cpu"

        def __init__(self) -> None:
            self.rank = rank
            self.model = torch.nn.Module()
            self.model_runner = SimpleNamespace(get_model=lambda: self.model)
            self.loaded: dict[str, torch.Tensor] = {}

        def reload_weights(self, weights_iterator: Any) -> None:
            for name, t in weights_iterator:
                self.loaded[name] = t

        def digests(self) -> dict[str, Any]:
            return {n: digest(t) for n, t in self.loaded.items()} | {"__dtypes__": sorted({str(t.dtype) for t in self.loaded.values()})}

    worker = Worker()
    conn = Connection(socket.create_connection(("127.0.0.1", port)).detach())
    conn.send_bytes(msgspec.json.encode(rank))
    while True:
        try:
            call = msgspec.json.decode(conn.recv_bytes())
        except EOFError:
            return
        try:
            reply = {"ok": getattr(worker, call["method"])(*call["args"])}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        conn.send_bytes(msgspec.json.encode(reply))


def _sender(mode: str, store_port: int, rank: int, world: int, pg_port: int, out: str, die_after: int = 0) -> None:
    import torch.distributed as dist

    from flowrl.operators.engines import vllm_direct
    from flowrl.operators.engines.vllm_direct import Channel, DirectSender

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    model = hf_model(os.environ["FLOWRL_TEST_MODEL_DIR"], int(os.environ.get("FLOWRL_TEST_SEED", "0"))) if "FLOWRL_TEST_MODEL_DIR" in os.environ else toy_model()
    version = int(os.environ.get("FLOWRL_TEST_VERSION", "1"))
    group = None
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank, world_size=world)
        if isinstance(model, Toy):
            fully_shard(model.up_proj)
            fully_shard(model.down_proj)
        fully_shard(model)
        group = dist.group.WORLD
    if die_after:
        full, calls = vllm_direct._full, [0]

        def dying(t: Any, dtype: Any, device: Any) -> Any:
            calls[0] += 1
            if calls[0] > die_after:
                os._exit(3)  # abruptly, mid-sync: no clean-up runs
            return full(t, dtype, device)

        vllm_direct._full = dying
    sender = DirectSender(Channel(store, os.environ.get("FLOWRL_TEST_CHANNEL", "gen"), timeout_s=TIMEOUT_S), sending=rank == 0, group=group)
    sender.connect()
    before = rss_bytes()
    served = sender.serve(model.state_dict(), version=version)
    report = {"served": served, "bytes_sent": sender.bytes_sent, "peak_bucket_bytes": sender.peak_bucket_bytes,
              "rss_before": before, "rss_after": rss_bytes()}
    Path(out).write_bytes(msgspec.json.encode(report))
    sender.close()
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":  # a member of a gloo group: ends without interpreter teardown (flowrl.runtime.backends.torchrun.rank_exit)
    sys.path.insert(0, str(ROOT))
    from flowrl.runtime.backends.torchrun.rank_exit import end_rank_process

    if sys.argv[1] == "worker":
        _worker(*map(int, sys.argv[2:4]))
    else:
        _sender(sys.argv[2], *map(int, sys.argv[3:7]), sys.argv[7], *map(int, sys.argv[8:9]))
    end_rank_process(0)
