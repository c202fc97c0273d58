"""Ctrl-C (KeyboardInterrupt) at any line of the runtime's clean-up leaves nothing behind.

An interrupt is raised at one bytecode line of the code that ends a trace or a backward block
(a trace function raising KeyboardInterrupt there, as the signal handler would), for every line
in turn. Each time the user gets the KeyboardInterrupt, the model has no wrapper left, no body
is left suspended (the autouse guard checks too), and the next trace equals the plain forward.
"""

from __future__ import annotations

import sys

import pytest
import torch

from nnsight_lite import NNsight
from nnsight_lite import backward as backward_module
from nnsight_lite import interleaver, workers
from tests.conftest import _leftovers

TARGETS = {
    "uninstall": interleaver.Interleaver._uninstall.__code__,
    "kill_all": interleaver.Interleaver._kill_all.__code__,
    "switch_job": workers.switch_job.__code__,
    "backward_cleanup": backward_module.Backward._cleanup.__code__,
}


def interrupt_at(code, n):
    """A trace function raising KeyboardInterrupt at the ``n``-th line run in ``code`` (once).
    Returns (tracer, fired) where ``fired()`` tells whether it has raised."""
    state = {"seen": 0, "fired": False}

    def local(frame, event, arg):
        if event == "line" and not state["fired"]:
            if state["seen"] == n:
                state["fired"] = True
                raise KeyboardInterrupt(f"test interrupt at line {frame.f_lineno}")
            state["seen"] += 1
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code is code and not state["fired"] else None

    return tracer, lambda: state["fired"]


def traced_step(model, x):
    with model.trace(x):
        h = model[0].output
        model[1].output[:] = model[1].output * 2
        out = model.output
        with out.sum().backward():
            g = h.grad.save()  # noqa: F841
        last = out.save()  # noqa: F841


@pytest.mark.parametrize("where", sorted(TARGETS))
def test_interrupt_at_every_line_of_the_clean_up(seq, where):
    """KeyboardInterrupt at line n of the clean-up, for every n until the code runs without
    reaching it: the user sees the KeyboardInterrupt and the model is clean and exact after."""
    model = NNsight(seq)
    x = torch.randn(2, 6)
    previous = sys.gettrace()
    fired_at = []
    for n in range(200):
        tracer, fired = interrupt_at(TARGETS[where], n)
        sys.settrace(tracer)
        try:
            traced_step(model, x)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(previous)
        if not fired():
            break
        fired_at.append(n)
        assert _leftovers() == [], (where, n)
        with model.trace(x):
            out = model.output.save()
        assert torch.equal(out, seq(x)), (where, n)
    else:
        pytest.fail("the clean-up kept reaching new lines")
    assert fired_at, f"the interrupt never reached {where}"
    seq.zero_grad()
