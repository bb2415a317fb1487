"""The weight-transport conformance suite: the contract of ``flowrl.runtime.transports.weight_transport``, as tests.

Every transport passes it by mixing ``TransportConformance`` into a test class that says how to open
one writer and one reader on the same edge::

    class TestMyTransportConformance(TransportConformance):
        def open_pair(self, tmp_path):
            writer = MyTransport(..., side="writer")
            return writer, MyTransport(..., side="reader")  # or (writer, writer) when one object serves both

The suite calls ``publish`` on the writer and ``fetch_into`` / ``latest_version`` on the reader (and,
where both differ, on the writer too), from the test thread, and from a second thread in the
concurrency test. It assumes ``publish`` returns without waiting for a reader, as the contract says.
Class attributes tune the costly checks for slow transports (``concurrent_versions``,
``random_examples``).

A route into an engine that caches KV blocks of prompts (vLLM's prefix cache) owes the engine more:
after an update, a prompt longer than one KV block that was sampled before is sampled again with the
new weights' log-probs (no token attends to KV computed with the old ones): ``check_engine_update``,
which every route into vLLM passes (the group and file hops: ``tests/runtime/weights/test_route_into_vllm.py``;
the direct route: ``tests/operators/test_vllm_direct_engine.py``).
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowrl.errors import TransportError
from flowrl.runtime.transports.weight_transport import WeightTransport

__all__ = ["TransportConformance", "check_engine_update", "random_tensor", "same_bytes", "DTYPES", "SHAPES"]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
SHAPES = [(), (1,), (7,), (0,), (3, 0), (2, 3, 4), (16, 33)]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of random *bytes* (NaN and denormal bit patterns included; 0/1 for bool)."""
    numel = 1
    for d in shape:
        numel *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (so NaNs with equal bits compare equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _zeros_like(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(v.shape, dtype=dtype or v.dtype) for k, v in state.items()}


def _filled(state: dict[str, torch.Tensor], value: int) -> dict[str, torch.Tensor]:
    for t in state.values():
        t.fill_(value)
    return state


class TransportConformance:
    """Mixin: the checks every weight transport passes. Subclasses define ``open_pair``."""

    #: versions the writer publishes while a reader thread fetches concurrently
    concurrent_versions = 120
    #: hypothesis examples of random states round-tripped
    random_examples = 15

    def open_pair(self, tmp_path: Path) -> tuple[WeightTransport, WeightTransport]:
        """A new writer and a reader of one weight edge (they may be the same object)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def opened(self, tmp_path: Path) -> Iterator[tuple[Any, Any]]:
        writer, reader = self.open_pair(Path(tempfile.mkdtemp(dir=tmp_path)))
        try:
            yield writer, reader
        finally:
            reader.close()
            writer.close()

    @pytest.fixture
    def pair(self, tmp_path: Path) -> Iterator[tuple[Any, Any]]:
        with self.opened(tmp_path) as p:
            yield p

    @staticmethod
    def _sides(writer: Any, reader: Any) -> list[Any]:
        return [reader] if reader is writer else [reader, writer]

    # -- the protocol -------------------------------------------------------------------------

    def test_satisfies_the_protocol(self, pair):
        writer, reader = pair
        for t in self._sides(writer, reader):
            assert isinstance(t, WeightTransport)
            assert isinstance(t.name, str) and t.name

    def test_nothing_published_is_version_minus_one(self, pair):
        writer, reader = pair
        target = {"w": torch.full((2,), 7.0)}
        for t in self._sides(writer, reader):
            assert t.latest_version() == -1
            assert t.fetch_into(target) is None
        assert torch.equal(target["w"], torch.full((2,), 7.0))

    # -- round trips --------------------------------------------------------------------------

    def test_round_trip_is_exact_for_every_dtype_and_shape(self, pair):
        writer, reader = pair
        gen = torch.Generator().manual_seed(0)
        state = {f"{str(d).removeprefix('torch.')}/{'x'.join(map(str, s)) or 'scalar'}": random_tensor(s, d, gen)
                 for d in DTYPES for s in SHAPES}
        writer.publish(state, 0)
        for t in self._sides(writer, reader):
            target = _zeros_like(state)
            assert t.fetch_into(target) == 0
            assert t.latest_version() == 0
            bad = [k for k in state if not same_bytes(target[k], state[k])]
            assert not bad, f"{t.name}: tensors changed in transit: {bad}"

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
    @pytest.mark.parametrize("where", ["cuda-to-cuda", "cuda-to-cpu", "cpu-to-cuda"])
    def test_round_trip_with_cuda_tensors(self, pair, where):
        """A trainer or a generator on a GPU: the state, the target or both hold CUDA tensors."""
        writer, reader = pair
        gen = torch.Generator().manual_seed(1)
        state = {f"{str(d).removeprefix('torch.')}": random_tensor((16, 33), d, gen) for d in (torch.float32, torch.bfloat16, torch.int64)}
        src_device, dst_device = {"cuda-to-cuda": ("cuda", "cuda"), "cuda-to-cpu": ("cuda", "cpu"), "cpu-to-cuda": ("cpu", "cuda")}[where]
        writer.publish({k: v.to(src_device) for k, v in state.items()}, 0)
        for t in self._sides(writer, reader):
            target = {k: v.to(dst_device) for k, v in _zeros_like(state).items()}
            assert t.fetch_into(target) == 0
            assert {v.device.type for v in target.values()} == {dst_device}
            bad = [k for k in state if not same_bytes(target[k].cpu(), state[k])]
            assert not bad, f"{t.name}: tensors changed in transit: {bad}"

    def test_round_trip_of_random_states(self, tmp_path):
        names = st.text("abcdefghij._", min_size=1, max_size=12)
        shapes = st.lists(st.integers(0, 5), max_size=3).map(tuple)
        states = st.dictionaries(names, st.tuples(shapes, st.sampled_from(DTYPES)), min_size=1, max_size=6)

        @settings(max_examples=self.random_examples, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(spec=states, versions=st.lists(st.integers(0, 1000), min_size=1, max_size=3, unique=True), seed=st.integers(0, 2**16))
        def check(spec, versions, seed):
            gen = torch.Generator().manual_seed(seed)
            with self.opened(tmp_path) as (writer, reader):
                for version in sorted(versions):
                    state = {k: random_tensor(s, d, gen) for k, (s, d) in spec.items()}
                    writer.publish(state, version)
                    target = _zeros_like(state)
                    assert reader.fetch_into(target, newer_than=version - 1) == version
                    assert all(same_bytes(target[k], state[k]) for k in state)
                    assert reader.fetch_into(target, newer_than=version) is None

        check()

    def test_newer_than(self, pair):
        writer, reader = pair
        writer.publish({"w": torch.full((3,), 3.0)}, 3)
        target = {"w": torch.zeros(3)}
        assert reader.fetch_into(target, newer_than=10) is None
        assert reader.fetch_into(target, newer_than=3) is None
        assert torch.equal(target["w"], torch.zeros(3)), "a fetch that returns None must not write the target"
        assert reader.fetch_into(target, newer_than=2) == 3
        assert torch.equal(target["w"], torch.full((3,), 3.0))
        writer.publish({"w": torch.full((3,), 8.0)}, 8)
        assert reader.latest_version() == 8
        assert reader.fetch_into(target, newer_than=3) == 8
        assert torch.equal(target["w"], torch.full((3,), 8.0))
        assert reader.fetch_into(target, newer_than=-1) == 8  # -1: whatever is newest

    @pytest.mark.parametrize("bad", [5, 4, -2, 5.5, "6", True], ids=["equal", "older", "negative", "float", "str", "bool"])
    def test_versions_must_increase(self, pair, bad):
        writer, reader = pair
        writer.publish({"w": torch.ones(2)}, 5)
        with pytest.raises(TransportError, match=r"version"):
            writer.publish({"w": torch.full((2,), 9.0)}, bad)
        target = {"w": torch.zeros(2)}
        assert reader.fetch_into(target) == 5 and torch.equal(target["w"], torch.ones(2))
        writer.publish({"w": torch.full((2,), 6.0)}, 6)  # the transport still works
        assert reader.fetch_into(target) == 6 and torch.equal(target["w"], torch.full((2,), 6.0))

    def test_publish_copies_the_state(self, pair):
        writer, reader = pair
        state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor(1.5)}
        writer.publish(state, 0)
        state["w"].mul_(-1)
        state["b"].fill_(99.0)
        target = _zeros_like(state)
        assert reader.fetch_into(target) == 0
        assert torch.equal(target["w"], torch.arange(6.0).reshape(2, 3))
        assert target["b"].item() == 1.5

    @pytest.mark.parametrize("target_dtype", [torch.bfloat16, torch.float64, torch.float16], ids=str)
    def test_fetch_casts_into_the_target_dtype(self, pair, target_dtype):
        writer, reader = pair
        state = {"w": torch.randn(4, 5, generator=torch.Generator().manual_seed(1)), "s": torch.tensor(0.1)}
        writer.publish(state, 0)
        target = _zeros_like(state, target_dtype)
        assert reader.fetch_into(target) == 0
        for k in state:
            assert target[k].dtype == target_dtype
            assert torch.equal(target[k], state[k].to(target_dtype))

    def test_fetch_into_parameters_that_require_grad(self, pair):
        writer, reader = pair
        torch.manual_seed(0)
        src, dst = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
        writer.publish(dict(src.named_parameters()), 0)  # leaves that require grad, published as they are
        assert reader.fetch_into(dict(dst.named_parameters())) == 0
        assert torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)
        assert dst.weight.requires_grad and dst.weight.grad_fn is None

    def test_non_contiguous_source_and_target(self, pair):
        writer, reader = pair
        base = torch.arange(24.0).reshape(4, 6)
        writer.publish({"t": base.t(), "s": base[:, ::2]}, 0)
        target = {"t": torch.zeros(4, 6).t(), "s": torch.zeros(4, 6)[:, ::2]}  # strided views too
        assert reader.fetch_into(target) == 0
        assert torch.equal(target["t"], base.t()) and torch.equal(target["s"], base[:, ::2])

    # -- errors -------------------------------------------------------------------------------

    @pytest.mark.parametrize(
        ("change", "match"),
        [
            (lambda t: t.pop("layer.1"), r"lacks tensor\(s\) 'layer\.1'"),
            (lambda t: t.update(extra=torch.zeros(1)), r"has tensor\(s\) 'extra'"),
            (lambda t: t.update({"layer.1": torch.zeros(3, 2)}), r"target tensor 'layer\.1' has shape \[3, 2\].*\[2, 3\]"),
            (lambda t: t.update({"layer.1": torch.zeros(6)}), r"target tensor 'layer\.1' has shape \[6\]"),
        ],
        ids=["missing", "extra", "transposed-shape", "flat-shape"],
    )
    def test_mismatched_target_is_an_error_naming_the_tensor(self, pair, change, match):
        writer, reader = pair
        writer.publish({"layer.0": torch.ones(4), "layer.1": torch.ones(2, 3)}, 0)
        target = {"layer.0": torch.zeros(4), "layer.1": torch.zeros(2, 3)}
        change(target)
        with pytest.raises(TransportError, match=match):
            reader.fetch_into(target)
        assert torch.equal(target["layer.0"], torch.zeros(4)), "a failed fetch must not write part of the target"

    @pytest.mark.parametrize(
        ("state", "match"),
        [
            ({"a": torch.ones(2, 2), "b": torch.ones(3)}, r"'a' is float32\[2, 2\] at version 1.*float32\[2\]"),
            ({"a": torch.ones(2, dtype=torch.float64), "b": torch.ones(3)}, r"'a' is float64\[2\].*float32\[2\]"),
            ({"a": torch.ones(2)}, r"lacks tensor\(s\) 'b'"),
            ({"a": torch.ones(2), "b": torch.ones(3), "c": torch.ones(1)}, r"has tensor\(s\) 'c'"),
        ],
        ids=["shape", "dtype", "missing", "extra"],
    )
    def test_state_keeps_the_layout_of_the_first_publish(self, pair, state, match):
        writer, reader = pair
        writer.publish({"a": torch.ones(2), "b": torch.ones(3)}, 0)
        with pytest.raises(TransportError, match=match):
            writer.publish(state, 1)
        assert reader.latest_version() == 0

    def test_state_of_non_tensors_is_an_error(self, pair):
        writer, _ = pair
        with pytest.raises(TransportError, match=r"'w' is a list, not a torch.Tensor"):
            writer.publish({"w": [1.0, 2.0]}, 0)

    # -- concurrency --------------------------------------------------------------------------

    def test_concurrent_reader_never_sees_a_torn_state(self, pair):
        """A reader fetching in a loop while the writer publishes: every tensor holds the version returned."""
        writer, reader = pair
        state = {f"layer{i}.weight": torch.zeros(256, 128) for i in range(8)}
        state |= {"norm": torch.zeros(128, dtype=torch.bfloat16), "step": torch.zeros((), dtype=torch.int64)}
        last = self.concurrent_versions
        seen: list[int] = []
        errors: list[str] = []
        first = threading.Event()

        def read() -> None:
            target = _zeros_like(state)
            deadline = time.monotonic() + 60
            try:
                while (not seen or seen[-1] < last) and time.monotonic() < deadline:
                    got = reader.fetch_into(target)  # newer_than=-1: copy every time, to overlap publishes
                    if got is None:
                        time.sleep(0.0005)
                        continue
                    torn = [k for k, t in target.items() if not bool((t == got).all())]
                    if torn:
                        errors.append(f"version {got}: {torn} hold other versions")
                        return
                    if seen and got < seen[-1]:
                        errors.append(f"version went back from {seen[-1]} to {got}")
                        return
                    seen.append(got)
                    first.set()
            except Exception as exc:  # noqa: BLE001 - surfaced by the assert below
                errors.append(repr(exc))
                first.set()

        thread = threading.Thread(target=read, name="test-reader", daemon=True)
        thread.start()
        writer.publish(_filled(state, 0), 0)
        assert first.wait(30), "the reader never saw version 0"
        for version in range(1, last + 1):
            writer.publish(_filled(state, version), version)  # the same source, changed after each publish
        thread.join(60)
        assert not thread.is_alive(), "the reader did not finish in 60 s"
        assert not errors, errors
        assert seen[0] == 0 and seen[-1] == last

    # -- close --------------------------------------------------------------------------------

    def test_close_is_idempotent_and_final(self, tmp_path):
        writer, reader = self.open_pair(tmp_path)
        writer.publish({"w": torch.ones(1)}, 0)
        for _ in range(2):
            reader.close()
            writer.close()
        with pytest.raises(TransportError, match=r"after close\(\)"):
            writer.publish({"w": torch.ones(1)}, 1)
        with pytest.raises(TransportError, match=r"after close\(\)"):
            reader.fetch_into({"w": torch.zeros(1)})


# -- what a route into an engine with a prefix cache owes it ---------------------------------------------


def check_engine_update(engine: Any, prompt: list[int], update: Callable[[], Any], old: Any, new: Any) -> None:
    """``prompt`` (longer than one of the engine's KV blocks) sampled before ``update()`` (one new version
    through the route) is sampled after it with ``new``'s log-probs: the engine dropped the blocks it
    had cached with ``old``'s weights. Tolerance: float32 rounding of the two forwards at these
    weights' magnitudes (``tests/tolerances.py``); the update must move the log-probs by more than
    that, or the check could not tell a stale cache from a fresh one.

    ``old`` / ``new``: the models (``build_model`` of Hugging Face configs) of the weights the engine
    holds before and after the update.
    """
    from tests.models.helpers import left_padded, reference_logprobs
    from tests.tolerances import rollout_logprob_atol

    batch = left_padded([prompt])
    engine.generate(batch)  # the prompt's blocks cached with the old weights
    update()
    with torch.no_grad():
        out = engine.generate(batch)
        want, stale = reference_logprobs(new.hf, out), reference_logprobs(old.hf, out)
    atol = rollout_logprob_atol(new, out)
    mask = out["completion_mask"]
    assert float((want - stale)[mask].abs().max()) > atol, "the update does not move the log-probs: the check would not see a stale cache"
    torch.testing.assert_close(out["behaviour_logprobs"], want, rtol=0, atol=atol)
