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


def run_traced(tracer, previous, step):
    """``step()`` with ``tracer`` as the trace function; a KeyboardInterrupt it raises is the
    user's to see, so it is dropped here."""
    sys.settrace(tracer)
    try:
        step()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(previous)


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
        run_traced(tracer, previous, lambda: traced_step(model, x))
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



def interrupt_on_call(n):
    """A trace function raising KeyboardInterrupt as the ``n``-th Python function call from
    now on begins (once): Python delivers a pending signal at a function's first
    instruction, before any ``try`` in it. Returns (tracer, fired)."""
    state = {"seen": 0, "fired": False}
    gc_callbacks = _gc_callback_codes()

    def tracer(frame, event, arg):
        if (event == "call" and not state["fired"]  # (not in a callback of the collector's,
                and not frame.f_code.co_filename.endswith("_weakrefset.py")  # a weakref's or
                and frame.f_code not in gc_callbacks):  # a gc.callbacks entry (torch
            if state["seen"] == n:  # dynamo has one): what it raises there is only printed)
                state["fired"] = True
                raise KeyboardInterrupt("test interrupt at a call")
            state["seen"] += 1
        return None

    return tracer, lambda: state["fired"]


def _gc_callback_codes() -> set:
    import gc

    return {getattr(cb, "__code__", None) for cb in gc.callbacks}


def test_interrupt_as_any_function_of_a_trace_begins(seq):
    """KeyboardInterrupt at the entry of the n-th Python function a two-invoke trace with a
    backward block calls, for every n (user code, torch's and nnsight_lite's alike): the model
    is left with no wrapper and exact, and no worker stays attached to a body. (Before, an
    interrupt at the entry of the clean-up's own helper skipped the clean-up: every wrapper
    stayed on the model, which could not be traced again.)"""
    model = NNsight(seq)
    x = torch.randn(2, 6)

    def step():
        with model.trace() as tr:
            with tr.invoke(x):
                traced_body(model)
            with tr.invoke(x):
                traced_body(model)

    step()  # (the first run compiles its bodies: thousands of calls into ast)
    previous = sys.gettrace()
    n = 0
    while True:
        tracer, fired = interrupt_on_call(n)
        run_traced(tracer, previous, step)
        if not fired():
            break
        assert _leftovers() == [], n
        assert not [w for w in list(workers._workers)
                    if not w.dead and (w.mediator is not None or w.grads is not None)], n
        with model.trace(x):
            out = model.output.save()
        assert torch.equal(out, seq(x)), n
        n += 1
        assert n < 5000, "the calls kept coming"
    assert n > 50
    seq.zero_grad()


def traced_body(model):
    h = model[0].output
    out = model.output
    with out.sum().backward(retain_graph=True):
        g = h.grad.save()  # noqa: F841
