"""Traces of random models against plain forward hooks (properties 1-4 of the runtime).

    TestUneditedTrace     a trace with no edits returns exactly the plain forward's output
    TestReadsEqualHooks   every value read equals what a plain hook sees at that module and call
    TestEditsEqualHooks   edits give the output and parameter gradients of the same hook edits
    TestInvokes           N invokes in one trace give the results of N separate traces

Run: ``CI=true pytest tests/property`` (the deterministic "ci" profile: 40 examples per test);
``HYPOTHESIS_PROFILE=thorough pytest tests/property`` runs 1000 examples per test locally.
Models, inputs and programs come from ``tests/strategies.py``; each body is written literally
below and interprets its generated program with ``run_op``.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from nnsight_lite import NNsight
from tests.strategies import (
    Op,
    assert_same,
    batch_sizes,
    build,
    envoys_of,
    forward_events,
    inputs,
    leftovers,
    model_specs,
    param_grads,
    programs,
    reference,
    rewind,
    run_op,
    run_program,
    seeds,
)


def _setup(spec, sizes, seed):
    module = build(spec)
    xs = inputs(spec, sizes, seed)
    return module, NNsight(module), xs, forward_events(module, xs[0])


def _root_output_op(events):
    last = events[-1]
    assert last.path == "" and last.kind == "output"
    return Op("read", "", "output", 0, last.index)


class TestUneditedTrace:
    """Property 1: with no edits, the trace's output is the plain forward's, bit for bit."""

    @given(spec=model_specs(), seed=seeds, n=batch_sizes, data=st.data())
    def test_output_is_plain_forward(self, spec, seed, n, data):
        module, model, (x,), events = _setup(spec, [n], seed)
        _bind(model)
        program = data.draw(programs(events, edits=False))
        want = module(x)
        results = []
        with model.trace(x):
            offsets = {}
            for op in program:
                run_op(op, envoys, offsets, results)
            out = rewind(model, offsets).output.save()
        assert torch.equal(out, want)
        assert torch.equal(module(x), want)
        assert not leftovers(module)

    @given(spec=model_specs(), seed=seeds)
    def test_empty_and_output_only_bodies(self, spec, seed):
        module, model, (x,), _ = _setup(spec, [2], seed)
        want = module(x)
        with model.trace(x):
            pass
        with model.trace(x):
            out = model.output.save()
        assert torch.equal(out, want)


envoys: dict = {}  # set per example below; bodies read it as a global


def _bind(model):
    envoys.clear()
    envoys.update(envoys_of(model))


class TestReadsEqualHooks:
    """Property 2: each read equals a plain forward hook's value at that module and call."""

    @given(spec=model_specs(), seed=seeds, n=batch_sizes, data=st.data())
    def test_reads(self, spec, seed, n, data):
        module, model, (x,), events = _setup(spec, [n], seed)
        _bind(model)
        program = data.draw(programs(events, edits=False, max_size=12))
        want, _, _ = reference(module, x, program)
        results = []
        with model.trace(x):
            offsets = {}
            for op in program:
                run_op(op, envoys, offsets, results)
        assert len(results) == len(want)
        for got, ref in zip(results, want):
            assert_same(got, ref)


class TestEditsEqualHooks:
    """Property 3: edits (in place and replacement, outputs and inputs, any module and call)
    give the final output and parameter gradients of the same edits in plain hooks."""

    @given(spec=model_specs(), seed=seeds, n=batch_sizes, data=st.data())
    def test_edits(self, spec, seed, n, data):
        module, model, (x,), events = _setup(spec, [n], seed)
        _bind(model)
        program = data.draw(programs(events, edits=True, max_size=10))
        want_reads, want_out, _ = reference(module, x, program)
        # a model of parameter-free stages only (an activation) has no graph to backprop
        has_graph = want_out.requires_grad
        if has_graph:
            (want_out ** 2).sum().backward()
        want_grads = param_grads(module)
        module.zero_grad(set_to_none=True)

        results = []
        with model.trace(x):
            offsets = {}
            for op in program:
                run_op(op, envoys, offsets, results)
            out = rewind(model, offsets).output.save()
        assert out.requires_grad == has_graph
        if has_graph:
            (out ** 2).sum().backward()
        got_grads = param_grads(module)

        assert_same(out, want_out, exact=False)
        assert len(results) == len(want_reads)
        for got, ref in zip(results, want_reads):
            assert_same(got, ref, exact=False)
        for g, w in zip(got_grads, want_grads):
            assert (g is None) == (w is None)
            if g is not None:
                torch.testing.assert_close(g, w)
        assert not leftovers(module)


class TestInvokes:
    """Property 4: N invokes in one trace equal N separate traces (each invoke its own rows)."""

    @given(spec=model_specs(), seed=seeds, sizes=st.lists(batch_sizes, min_size=1, max_size=4),
           data=st.data())
    def test_invokes_equal_separate_traces(self, spec, seed, sizes, data):
        module, model, xs, events = _setup(spec, sizes, seed)
        _bind(model)
        final = _root_output_op(events)
        progs = [data.draw(programs(events, edits=True, max_size=6)) + [final] for _ in xs]

        separate = []
        for x, program in zip(xs, progs):
            res = []
            with model.trace(x):
                run_program(program, envoys, res)
            separate.append(res)

        together = [[] for _ in xs]
        jobs = iter([(p, envoys, r) for p, r in zip(progs, together)])
        with model.trace() as tracer:
            for x in xs:
                with tracer.invoke(x):
                    # one call: invoke bodies share a namespace, so each keeps its state in
                    # run_program's frame (a loop variable read here would be the last one)
                    run_program(*next(jobs))
        for got, want in zip(together, separate):
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert_same(g, w, exact=False)
        assert not leftovers(module)
