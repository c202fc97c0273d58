"""Nothing is left behind (property 6), whatever a program does and however it fails.

After every generated program - successful, stopped, or failing by an exception injected in
the body (ValueError, KeyboardInterrupt, SystemExit, raised inside torch modes or not), in the
model's own forward, in a backward body or in autograd, or by a request out of order, never
served, or made inside ``torch.inference_mode()`` - no module keeps an instance ``forward`` or a
hook, no body greenlet is left suspended, grad / inference / autocast mode and the line tracer
are what they were, ``Tensor.backward`` is still the patched one, and the model's next plain
forward is bit-for-bit what it was. For one invoke the outcome itself is predicted exactly.

    TestSingleInvoke     predicted outcome + invariants
    TestManyInvokes      one faulty program among several invokes (and faults while collecting)
    TestBackwardFaults   faults inside ``with loss.backward():`` bodies and autograd hooks

Run: ``CI=true pytest tests/property`` (deterministic); ``HYPOTHESIS_PROFILE=thorough`` for more.
GreenletExit is not injected: a body raising it ends silently (see test_regressions.py).
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

import nnsight_lite
from nnsight_lite import MissedModuleError, NNsight, OutOfOrderError
from nnsight_lite.backward import backward as patched_backward
from nnsight_lite.errors import GradientError, InferenceModeSwitchError
from tests.strategies import (
    EXCEPTIONS,
    Op,
    address,
    batch_sizes,
    build,
    envoys_of,
    forward_events,
    inputs,
    leftovers,
    model_specs,
    never_events,
    op_at,
    rewind,
    run_op,
    run_program,
    seeds,
    torch_modes,
)

pytestmark = pytest.mark.timeout(90)

LIBRARY_ERRORS = (OutOfOrderError, MissedModuleError, InferenceModeSwitchError, GradientError)
exc_names = st.sampled_from(sorted(EXCEPTIONS))


@st.composite
def faulty_programs(draw, events, never):
    """Reads/edits (some inside no_grad / autocast / inference_mode) in any order, with faults."""
    idx = draw(st.lists(st.integers(0, len(events) - 1), min_size=0, max_size=6))
    if draw(st.booleans()):
        idx.sort()
    ops = [draw(op_at(events[i], edits=True, modes=True)) for i in idx]
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from(["raise", "raise", "stop", "grad_off", "never"]))
        if kind == "raise":
            op = Op("raise", kind=draw(st.sampled_from(["plain", "in_mode"])), exc=draw(exc_names))
        elif kind == "never":
            if not never:
                continue
            path, k, call = draw(st.sampled_from(never))
            op = Op("read", path, k, call, None)
        else:
            op = Op(kind)
        ops.insert(draw(st.integers(0, len(ops))), op)
    return ops


@st.composite
def bombs(draw, module):
    """None, or (plan position, exception name): the model's forward raises there."""
    if not draw(st.booleans()):
        return None
    return draw(st.integers(0, len(module.plan) - 1)), draw(exc_names)


def _count_until_raise(module, x) -> int:
    count = [0]
    handles = []

    def tick(*a, **k):
        count[0] += 1

    for m in module.modules():
        handles.append(m.register_forward_pre_hook(tick, with_kwargs=True))
        handles.append(m.register_forward_hook(tick, with_kwargs=True))
    try:
        with torch.no_grad():
            module(x)
    except ValueError:
        pass
    finally:
        for h in handles:
            h.remove()
    return count[0]


def predict(ops, boundary, bomb_exc):
    """The outcome of running ``ops`` in one invoke: None (success) or the exception type."""
    last = -1
    for op in ops:
        a = op.action
        if a == "raise":
            return type(EXCEPTIONS[op.exc]())
        if a == "stop":
            return None
        if a == "grad_off":
            continue
        ev = op.event
        if ev is None:
            return type(bomb_exc) if bomb_exc is not None else MissedModuleError
        if ev < last:
            return OutOfOrderError
        if a == "read_inference" and ev != last:
            return InferenceModeSwitchError
        if ev >= boundary:
            return type(bomb_exc)
        last = ev
    return type(bomb_exc) if bomb_exc is not None else None


class State:
    """What must be the same before and after a program."""

    def __init__(self, module, x):
        self.module = module
        self.x = x
        self.modes = torch_modes()
        self.tracer = sys.gettrace()
        with torch.no_grad():
            self.out = module(x)

    def check(self):
        module = self.module
        module.bomb = None
        assert not leftovers(module)
        assert torch_modes() == self.modes
        assert sys.gettrace() is self.tracer
        assert torch.Tensor.backward is patched_backward
        with torch.no_grad():
            assert torch.equal(module(self.x), self.out)


def _setup(spec, sizes, seed):
    module = build(spec)
    xs = inputs(spec, sizes, seed)
    events = forward_events(module, xs[0])
    model = NNsight(module)
    return module, model, xs, events, envoys_of(model)


class TestSingleInvoke:
    @given(spec=model_specs(), seed=seeds, n=batch_sizes, data=st.data())
    def test_outcome_and_nothing_left(self, spec, seed, n, data):
        module, model, (x,), events, envoys = _setup(spec, [n], seed)
        ops = data.draw(faulty_programs(events, never_events(module, events)))
        bomb = data.draw(bombs(module))
        boundary = _count_until_raise_at(module, x, bomb)
        bomb_exc = None if bomb is None else EXCEPTIONS[bomb[1]]()
        want = predict(ops, boundary, bomb_exc)
        state = State(module, x)
        module.bomb = None if bomb is None else (bomb[0], bomb_exc)
        outcome = None
        try:
            with model.trace(x) as tracer:
                offsets = {}
                for op in ops:
                    run_op(op, envoys, offsets, [], tracer)
        except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt/SystemExit included
            outcome = exc
        finally:
            module.bomb = None
        event(f"outcome: {type(outcome).__name__}")
        assert type(outcome) is (want or type(None)), (outcome, want)
        if bomb_exc is not None and want is type(bomb_exc) and not any(op.action == "raise" for op in ops):
            assert outcome is bomb_exc, "the model's own exception must reach the caller unchanged"
        state.check()


def _count_until_raise_at(module, x, bomb):
    if bomb is None:
        return 10**9
    module.bomb = (bomb[0], ValueError("probe"))
    try:
        return _count_until_raise(module, x)
    finally:
        module.bomb = None


class TestManyInvokes:
    @given(spec=model_specs(), seed=seeds, sizes=st.lists(batch_sizes, min_size=2, max_size=3),
           collect_fault=st.one_of(st.none(), st.tuples(st.integers(0, 3), exc_names)),
           data=st.data())
    def test_nothing_left(self, spec, seed, sizes, collect_fault, data):
        module, model, xs, events, envoys = _setup(spec, sizes, seed)
        never = never_events(module, events)
        progs = [data.draw(faulty_programs(events, never)) for _ in xs]
        bomb = data.draw(bombs(module))
        state = State(module, xs[0])
        module.bomb = None if bomb is None else (bomb[0], EXCEPTIONS[bomb[1]]())
        jobs = iter([(p, envoys, []) for p in progs])
        count = [0]
        try:
            with model.trace() as tracer:
                for x in xs:
                    if collect_fault is not None and collect_fault[0] == count[0]:
                        raise EXCEPTIONS[collect_fault[1]]()
                    count[0] += 1
                    with tracer.invoke(x):
                        run_program(*next(jobs), tracer)
        except (KeyboardInterrupt, SystemExit, ValueError, *LIBRARY_ERRORS) as exc:
            event(f"outcome: {type(exc).__name__}")
        finally:
            module.bomb = None
        state.check()


class TestBackwardFaults:
    @given(spec=model_specs(), seed=seeds, n=batch_sizes, standalone=st.booleans(),
           where=st.sampled_from(["body", "hook", "order", "none"]), exc=exc_names,
           data=st.data())
    def test_nothing_left(self, spec, seed, n, standalone, where, exc, data):
        module, model, (x,), events, envoys = _setup(spec, [n], seed)
        x.requires_grad_(True)
        outs = [e for e in events if e.kind == "output"]
        picked = data.draw(st.lists(st.sampled_from(outs), min_size=1, max_size=4))
        picked.sort(key=lambda e: e.index)
        ops = [Op("read", e.path, "output", e.call, e.index) for e in picked]
        order = data.draw(st.lists(st.integers(0, len(ops) - 1), min_size=1, max_size=4))
        if where != "order":
            order.sort(reverse=True)
        cut = data.draw(st.integers(0, len(order)))
        state = State(module, x)
        error = EXCEPTIONS[exc]()

        def hook(g):
            raise error

        vals: list = []
        try:
            if standalone:
                with model.trace(x):
                    offsets = {}
                    for op in ops:
                        vals.append(_tensor(envoys, op, offsets))
                    out = rewind(model, offsets).output.save()
                loss = (out ** 2).sum()
                if where == "hook":
                    loss.register_hook(hook)
                with loss.backward():
                    for j, k in enumerate(order):
                        if where == "body" and j == cut:
                            raise error
                        g = vals[k].grad
            else:
                with model.trace(x):
                    offsets = {}
                    for op in ops:
                        vals.append(_tensor(envoys, op, offsets))
                    loss = (rewind(model, offsets).output ** 2).sum()
                    if where == "hook":
                        loss.register_hook(hook)
                    with loss.backward():
                        for j, k in enumerate(order):
                            if where == "body" and j == cut:
                                raise error
                            g = vals[k].grad
        except (KeyboardInterrupt, SystemExit, ValueError, *LIBRARY_ERRORS) as exc:
            event(f"outcome: {type(exc).__name__}")
        state.check()
        assert nnsight_lite


def _tensor(envoys, op, offsets):
    out = address(envoys[op.path], op, offsets).output
    return out[0] if isinstance(out, tuple) else out
