"""``flowrl calibrate``'s options for what a graph needs: --widths, --graph, --vllm; mistakes exit 2 before any measurement."""

from __future__ import annotations

import json

import pytest

from flowrl.cli.main import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["calibrate", "--widths", "896,x"], "--widths '896,x': expected comma-separated integers"),
        (["calibrate", "--widths", "8"], "--widths '8': each width must be >= 16"),
        (["calibrate", "--graph", "no_such_graph"], "cannot find graph 'no_such_graph'"),
    ],
    ids=["widths-form", "widths-small", "graph"],
)
def test_calibrate_mistakes_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in " ".join(err.split()) and "Traceback" not in err


def test_the_widths_and_vllm_shape_asked_for():
    import argparse

    from flowrl.cli.calibrate import _needs

    def ask(**kw):
        needs = _needs(argparse.Namespace(**{"graph": None, "widths": None, "vllm": False, **kw}))
        return needs.widths, needs.vllm_model

    assert ask() == ((), None)
    assert ask(widths="896, 64,896") == ((64, 896), None)
    assert ask(graph="llamarl", widths="48") == ((48, 64), None)  # llamarl's generator and policy are 64 wide
    pytest.importorskip("vllm")
    widths, model = ask(vllm=True)
    assert widths == () and model.dim == 896  # qwen2.5-0.5b's shape by default


@pytest.mark.slow  # a whole calibration (--runslow; test_plan_cli runs one by default)
def test_calibrate_for_a_graph_measures_its_width(capsys):
    assert main(["calibrate", "--graph", "llamarl", "--widths", "48", "--matmul-size", "32", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    widths = [w for w, _ in json.loads(out)["device"]["cpu"]["train_flops_by_width"]]
    assert 48 in widths and 64 in widths  # --widths' and llamarl's (64, also a default)
