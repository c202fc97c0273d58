"""Request order (property 5): in order always succeeds, out of order always raises.

    TestForwardOrder    module values: any program either runs (events in order) or raises
                        OutOfOrderError / MissedModuleError at the first bad request, and every
                        value read before that equals a plain hook's; never a hang
    TestGradientOrder   ``.grad`` in ``with loss.backward():`` (in a trace and standalone):
                        reverse execution order succeeds with retain_grad's values, a read of a
                        tensor computed after the last one read raises OutOfOrderError
    TestGradientEdits   ``t.grad = ...`` edits give the parameter gradients of tensor hooks

Run: ``CI=true pytest tests/property`` (deterministic); ``HYPOTHESIS_PROFILE=thorough`` for more.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

import nnsight_lite
from nnsight_lite import MissedModuleError, NNsight, OutOfOrderError
from tests.strategies import (
    Op,
    address,
    assert_same,
    batch_sizes,
    build,
    envoys_of,
    forward_events,
    inputs,
    leftovers,
    model_specs,
    never_events,
    op_at,
    param_grads,
    reference,
    rewind,
    run_op,
    seeds,
)

pytestmark = pytest.mark.timeout(60)


@st.composite
def any_order_programs(draw, events, never):
    """Reads and edits at events in any order, sometimes a request that never happens."""
    idx = draw(st.lists(st.integers(0, len(events) - 1), min_size=1, max_size=8))
    how = draw(st.sampled_from(["sorted", "one_swap", "any", "any"]))
    if how != "any":
        idx.sort()
    if how == "one_swap" and len(idx) > 1:
        i = draw(st.integers(0, len(idx) - 2))
        idx[i], idx[i + 1] = idx[i + 1], idx[i]
    ops = [draw(op_at(events[i], edits=True)) for i in idx]
    if never and draw(st.integers(0, 3)) == 0:
        path, kind, call = draw(st.sampled_from(never))
        ops.insert(draw(st.integers(0, len(ops))), Op("read", path, kind, call, None))
    return ops


def expected_failure(ops):
    """(position, error type) of the first request that must fail, or (None, None)."""
    last = -1
    for j, op in enumerate(ops):
        if op.event is None:
            return j, MissedModuleError
        if op.event < last:
            return j, OutOfOrderError
        last = op.event
    return None, None


class TestForwardOrder:
    @given(spec=model_specs(), seed=seeds, n=batch_sizes, data=st.data())
    def test_in_order_succeeds_out_of_order_raises(self, spec, seed, n, data):
        module = build(spec)
        (x,) = inputs(spec, [n], seed)
        events = forward_events(module, x)
        model = NNsight(module)
        envoys = envoys_of(model)
        ops = data.draw(any_order_programs(events, never_events(module, events)))
        fail_at, error = expected_failure(ops)
        done = ops if fail_at is None else ops[:fail_at]
        want, _, _ = reference(module, x, done)

        results = []
        ran = []
        try:
            with model.trace(x):
                offsets = {}
                for op in ops:
                    ran.append(op)
                    run_op(op, envoys, offsets, results)
        except (OutOfOrderError, MissedModuleError) as exc:
            event(f"outcome: {type(exc).__name__}")
            assert error is not None, f"unexpected {exc!r}"
            assert type(exc) is error, exc
            assert len(ran) == fail_at + 1, "the error must come at the first bad request"
            bad = ops[fail_at]
            label = "model" + ("." + bad.path if bad.path else "")
            assert label.replace(".", "") in str(exc).replace("[", "").replace("]", "").replace(".", "")
            assert "invoke 0" in str(exc)
        else:
            assert error is None, f"expected {error.__name__} at op {fail_at}"
        assert len(results) == len(want)
        for got, ref in zip(results, want):
            assert_same(got, ref)
        assert not leftovers(module)


@st.composite
def grad_picks(draw, events):
    """Output tensors to read forward-wise: [(event index, element)], sorted by event."""
    outs = [e for e in events if e.kind == "output"]
    chosen = draw(st.lists(st.sampled_from(outs), min_size=1, max_size=5))
    chosen.sort(key=lambda e: e.index)
    return [(e.index, draw(st.integers(0, e.tensor_elems - 1))) for e in chosen]


def _read_picks(picks, events, envoys, ts):
    """Inside a trace body: read each picked output tensor, in event order."""
    offsets = {}
    for ev, elem in picks:
        e = events[ev]
        op = Op("read", e.path, "output", e.call, ev)
        out = address(envoys[e.path], op, offsets).output
        ts.append(out[elem] if isinstance(out, tuple) else out)
    rewind(envoys[""], offsets)  # (the trace reads model.output next)


def _ref_tensors(module, x, picks, events):
    _, out, outs = reference(module, x, [], retain=True)
    return out, [outs[(events[ev].path, events[ev].call)][elem] for ev, elem in picks]


class TestGradientOrder:
    @given(spec=model_specs(), seed=seeds, n=batch_sizes, standalone=st.booleans(), data=st.data())
    def test_reverse_order_succeeds_forward_order_raises(self, spec, seed, n, standalone, data):
        module = build(spec)
        (x,) = inputs(spec, [n], seed)
        x.requires_grad_(True)  # so every module output is in the loss's graph
        events = forward_events(module, x)
        picks = data.draw(grad_picks(events))
        order = data.draw(st.lists(st.integers(0, len(picks) - 1), min_size=1, max_size=6))
        # the position of each tensor's creation: its first event (a tuple element or a block's
        # output can be the same tensor object as an earlier module's output)
        born = [events[ev].origin[elem] for ev, elem in picks]
        fail_at = None
        for j in range(1, len(order)):
            if born[order[j]] > min(born[k] for k in order[:j]):
                fail_at = j
                break

        ref_out, ref_ts = _ref_tensors(module, x, picks, events)
        (ref_out ** 2).sum().backward()
        want = [ref_ts[k].grad for k in order]
        module.zero_grad(set_to_none=True)

        model = NNsight(module)
        envoys = envoys_of(model)
        ts, got = [], []
        try:
            if standalone:
                with model.trace(x):
                    _read_picks(picks, events, envoys, ts)
                    out = model.output.save()
                with (out ** 2).sum().backward():
                    for k in order:
                        got.append(ts[k].grad.clone())
            else:
                with model.trace(x):
                    _read_picks(picks, events, envoys, ts)
                    loss = (model.output ** 2).sum()
                    with loss.backward():
                        for k in order:
                            got.append(ts[k].grad.clone())
        except OutOfOrderError as exc:
            event("outcome: OutOfOrderError")
            assert fail_at is not None, f"unexpected {exc!r}"
            assert len(got) == fail_at
            assert "reverse execution order" in str(exc)
        else:
            assert fail_at is None, f"expected OutOfOrderError at grad read {fail_at}"
            assert len(got) == len(order)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        assert not leftovers(module)


class TestGradientEdits:
    @given(spec=model_specs(), seed=seeds, n=batch_sizes, data=st.data())
    def test_grad_edits_equal_tensor_hooks(self, spec, seed, n, data):
        module = build(spec)
        (x,) = inputs(spec, [n], seed)
        x.requires_grad_(True)  # so every module output is in the loss's graph
        events = forward_events(module, x)
        picks = data.draw(grad_picks(events))
        born = [events[ev].origin[elem] for ev, elem in picks]
        # reverse creation order (ties: the same tensor, any order)
        order = sorted(range(len(picks)), key=lambda k: born[k], reverse=True)
        edits = [data.draw(st.tuples(st.sampled_from(["read", "scale", "zero"]),
                                     st.sampled_from([0.5, -2.0]))) for _ in order]

        ref_out, ref_ts = _ref_tensors(module, x, picks, events)
        ref_reads = []
        for k, (what, s) in zip(order, edits):
            if what == "read":
                ref_ts[k].register_hook(lambda g: ref_reads.append(g.clone()))
            elif what == "scale":
                ref_ts[k].register_hook(lambda g, s=s: g * s)
            else:
                ref_ts[k].register_hook(lambda g: torch.zeros_like(g))
        (ref_out ** 2).sum().backward()
        want_grads = param_grads(module)
        module.zero_grad(set_to_none=True)

        model = NNsight(module)
        envoys = envoys_of(model)
        ts, reads = [], []
        with model.trace(x):
            _read_picks(picks, events, envoys, ts)
            loss = (model.output ** 2).sum()
            with loss.backward():
                for k, (what, s) in zip(order, edits):
                    if what == "read":
                        reads.append(ts[k].grad.clone())
                    elif what == "scale":
                        ts[k].grad = ts[k].grad * s
                    else:
                        ts[k].grad[:] = 0
        for g, w in zip(reads, ref_reads):
            torch.testing.assert_close(g, w)
        assert len(reads) == len(ref_reads)
        for g, w in zip(param_grads(module), want_grads):
            assert (g is None) == (w is None)
            if g is not None:
                torch.testing.assert_close(g, w)
        assert not leftovers(module)
        assert nnsight_lite  # the patched Tensor.backward is what runs the blocks above
