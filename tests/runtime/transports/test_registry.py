"""The transport registry: built-ins by name, user transports, errors; the package imports no torch."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from flowrl.errors import TransportError
from flowrl.runtime import transports
from flowrl.runtime.transports.weight_transport import WeightTransport
from flowrl.runtime.transports.registry import BUILTIN_TRANSPORTS, create_transport, register_transport, transport_names


def _options(name: str, tmp_path) -> dict:
    return {"shm": {"name": f"flowrl-test-{uuid.uuid4().hex[:8]}", "create": True}, "file": {"directory": str(tmp_path)}}.get(name, {})


@pytest.mark.parametrize("name", ["inprocess", "shm", "file"])  # 'collective' needs a process group: its own tests
def test_builtins_are_created_by_name(name, tmp_path):
    t = create_transport(name, **_options(name, tmp_path))
    assert isinstance(t, WeightTransport) and t.name == name
    assert t.latest_version() == -1
    t.close()


def test_builtin_names():
    assert {"inprocess", "shm", "file", "collective"} <= set(transport_names())


def test_every_builtin_has_a_class_with_its_traits():
    """The registry's table (name -> class) and the traits table (``flowrl.transport_traits.BUILTINS``) list the same names."""
    import importlib

    from flowrl.transport_traits import BUILTINS

    assert set(BUILTIN_TRANSPORTS) == set(BUILTINS)
    for name, (module, attr) in BUILTIN_TRANSPORTS.items():
        cls = getattr(importlib.import_module(module), attr)
        assert cls.name == name and cls.traits == BUILTINS[name], name


def test_package_exports_the_classes():
    assert transports.InProcessTransport.name == "inprocess"
    assert transports.SharedMemoryTransport.name == "shm"
    assert transports.FileTransport.name == "file"
    assert transports.WeightTransport is WeightTransport
    with pytest.raises(AttributeError, match="NoSuchTransport"):
        transports.NoSuchTransport  # noqa: B018


def test_user_transports_register_by_name():
    made = []

    def factory(**options):
        made.append(options)
        return create_transport("inprocess")

    register_transport("test-mine", factory, replace=True)
    assert "test-mine" in transport_names()
    create_transport("test-mine", name="x", depth=2).close()  # 'name' is free for the factory's own use
    assert made == [{"name": "x", "depth": 2}]
    with pytest.raises(TransportError, match=r"'test-mine' is already registered; pass replace=True"):
        register_transport("test-mine", factory)
    with pytest.raises(TransportError, match=r"'shm' is already registered"):
        register_transport("shm", factory)


def test_unknown_transport_lists_the_known_ones():
    with pytest.raises(TransportError, match=r"unknown transport 'carrier-pigeon'; known transports: \[.*'file'.*'shm'"):
        create_transport("carrier-pigeon")


def test_importing_the_package_does_not_import_torch():
    """Graph validation asks the registry for names; that must stay cheap."""
    code = "import sys, flowrl.runtime.transports as t; t.transport_names(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
