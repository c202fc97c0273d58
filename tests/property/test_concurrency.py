"""Traces that overlap: two threads on two models, and a trace opened inside another's body.

    TestTwoThreads      two threads tracing two random models at the same time get exactly the
                        results plain hooks give each model alone, and leave nothing behind
    TestNestedTraces    a trace inside another trace's body: on another model it works (and
                        its saves reach the outer body); reading the outer model from the inner
                        body, or nesting on the same model, works or raises a clear error
"""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nnsight_lite import NNsight, NNsightError, OutsideTraceError
from tests.strategies import (
    assert_same,
    build,
    envoys_of,
    forward_events,
    inputs,
    leftovers,
    model_specs,
    programs,
    reference,
    rewind,
    run_op,
    seeds,
)

pytestmark = pytest.mark.timeout(120)


def _trace_loop(model, module, x, progs, envoys, out, errors, barrier):
    try:
        barrier.wait(10)
        for program in progs:
            results = []
            with model.trace(x):
                offsets = {}
                for op in program:
                    run_op(op, envoys, offsets, results)
                final = rewind(model, offsets).output.save()
            out.append((program, results, final))
    except BaseException as exc:  # reported by the main thread
        errors.append(exc)


class TestTwoThreads:
    @settings(max_examples=max(10, settings().max_examples // 4))
    @given(specs=st.tuples(model_specs(), model_specs()), seed=seeds, data=st.data())
    def test_independent_results(self, specs, seed, data):
        setups = []
        for spec in specs:
            module = build(spec)
            (x,) = inputs(spec, [2], seed)
            events = forward_events(module, x)
            model = NNsight(module)
            progs = [data.draw(programs(events, edits=True, max_size=5)) for _ in range(15)]
            setups.append((model, module, x, progs, envoys_of(model), [], []))
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=_trace_loop, args=(*s, barrier)) for s in setups]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a thread hung"
        for model, module, x, progs, envoys, out, errors in setups:
            assert not errors, errors
            assert len(out) == len(progs)
            for program, results, final in out:
                want_reads, want_out, _ = reference(module, x, program)
                assert_same(final, want_out, exact=False)
                assert len(results) == len(want_reads)
                for g, w in zip(results, want_reads):
                    assert_same(g, w, exact=False)
            assert not leftovers(module)


def _two_models():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.GELU(), torch.nn.Linear(4, 2))
    b = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Linear(5, 1))
    return a, b


class TestNestedTraces:
    def test_other_model_inside_body(self):
        a, b = _two_models()
        ma, mb = NNsight(a), NNsight(b)
        xa, xb = torch.randn(2, 3), torch.randn(4, 5)
        with ma.trace(xa):
            h = ma[0].output.save()
            with mb.trace(xb):
                mb[0].output[:, 0] = 0
                inner = mb.output.save()
            ma[2].output = ma[2].output + inner.sum()
            outer = ma.output.save()
        ref_h = a[0](xa)
        hb = b[0](xb)
        hb[:, 0] = 0
        ref_inner = b[1](hb)
        torch.testing.assert_close(h, ref_h)
        torch.testing.assert_close(inner, ref_inner)
        torch.testing.assert_close(outer, a(xa) + ref_inner.sum())
        assert not leftovers(a) and not leftovers(b)

    def test_outer_model_read_from_inner_body_is_a_clear_error(self):
        a, b = _two_models()
        ma, mb = NNsight(a), NNsight(b)
        with pytest.raises(OutsideTraceError, match=r"model\[2\].*not part of the model being traced"):
            with ma.trace(torch.randn(2, 3)):
                with mb.trace(torch.randn(4, 5)):
                    x = ma[2].output
        assert not leftovers(a) and not leftovers(b)
        torch.testing.assert_close(a(torch.ones(1, 3)), a(torch.ones(1, 3)))

    def test_same_model_nested_works_or_errors_clearly(self):
        a, _ = _two_models()
        ma = NNsight(a)
        xa = torch.randn(2, 3)
        want = a(xa)
        try:
            with ma.trace(xa):
                h = ma[0].output.save()
                with ma.trace(xa):
                    inner = ma.output.save()
                outer = ma.output.save()
        except NNsightError as exc:  # a clear, library-raised error is acceptable
            assert "trace" in str(exc)
        else:
            torch.testing.assert_close(inner, want)
            torch.testing.assert_close(outer, want)
            torch.testing.assert_close(h, a[0](xa))
        assert not leftovers(a)
        torch.testing.assert_close(a(xa), want)

    def test_error_in_inner_trace_cleans_both(self):
        a, b = _two_models()
        ma, mb = NNsight(a), NNsight(b)
        with pytest.raises(KeyError, match="inner"):
            with ma.trace(torch.randn(2, 3)):
                h = ma[0].output
                with mb.trace(torch.randn(4, 5)):
                    g = mb[0].output
                    raise KeyError("inner")
        assert not leftovers(a) and not leftovers(b)
