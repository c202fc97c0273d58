"""A state machine (property 7): traces, invokes, backward blocks, sessions and persistent edits
on one model, in any order.

The machine keeps *targets*: ``model`` itself and the copies ``model.edit()`` returned (all
wrapping the same module), each with the edits it is expected to carry, as op lists. Rules:

    trace_with_edits / invokes / failing_trace   on any target: its recorded edits run first,
                                                 so the reference is plain hooks doing the
                                                 target's edit ops, then the body's ops
    backward_block                               on a target without edits (edits can change
                                                 which tensor is created when, and so the
                                                 order gradients must be read in)
    trace_in_session                             ``with model.session():`` with two traces (on
                                                 any two targets): the second patches in a
                                                 value the first read without ``.save()``;
                                                 only the saved output leaves the session
    persistent_edit                              ``with target.edit() as edited:`` adds a target
                                                 carrying ``target``'s edits plus the new one
    inplace_edit / clear_edits                   ``target.edit(inplace=True)`` / ``clear_edits()``
    plain_forward                                calling any target is the plain forward

Every step is checked against plain PyTorch, and after every step the invariants hold: no
instance forward, hook or suspended body greenlet is left, torch modes and ``Tensor.backward``
are unchanged, every target carries as many edits as expected, and the plain forward is
bit-for-bit what it was at the start (edits live on the wrappers, never on the module).

Bodies are captured from source, so each ``with`` block is written once, literally; what varies
is the data it reads (op lists drawn by hypothesis).

Run: ``CI=true pytest tests/property`` (deterministic); ``HYPOTHESIS_PROFILE=thorough`` for more.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from nnsight_lite import MissedModuleError, NNsight, OutOfOrderError
from nnsight_lite.backward import backward as patched_backward
from tests.strategies import (
    EXCEPTIONS,
    Op,
    address,
    assert_same,
    batch_sizes,
    build,
    edit_programs,
    envoys_of,
    forward_events,
    inputs,
    leftovers,
    model_specs,
    programs,
    reference,
    rewind,
    run_op,
    run_program,
    seeds,
    torch_modes,
)

MAX_TARGETS = 4  # model and up to three edited copies


class Target:
    """A wrapper the machine traces: ``model`` or a copy from ``model.edit()``, with the edits
    (op lists, in the order recorded) it should apply on every trace."""

    def __init__(self, wrapper, edits):
        self.wrapper = wrapper
        self.envoys = envoys_of(wrapper)
        self.edits = list(edits)

    def edit_ops(self):
        return [op for ops in self.edits for op in ops]


class TraceMachine(RuleBasedStateMachine):
    @initialize(spec=model_specs(max_stages=4), seed=seeds)
    def setup(self, spec, seed):
        self.spec = spec
        self.module = build(spec)
        self.model = NNsight(self.module)
        self.targets = [Target(self.model, [])]
        self.bare = Target(NNsight(self.module), [])  # never edited: for backward blocks
        (self.x,) = inputs(spec, [2], seed)
        self.events = forward_events(self.module, self.x)
        with torch.no_grad():
            self.plain = self.module(self.x)
        self.modes = torch_modes()
        self.tracer = sys.gettrace()

    def pick(self, data, label="target"):
        return self.targets[data.draw(st.integers(0, len(self.targets) - 1), label=label)]

    @rule(data=st.data())
    def trace_with_edits(self, data):
        target = self.pick(data)
        program = data.draw(programs(self.events, edits=True, max_size=6))
        want_reads, want_out, _ = reference(self.module, self.x, target.edit_ops() + program)
        model, envoys, results = target.wrapper, target.envoys, []
        with model.trace(self.x):
            offsets = {}
            for op in program:
                run_op(op, envoys, offsets, results)
            out = rewind(model, offsets).output.save()
        assert_same(out, want_out, exact=False)
        for got, ref in zip(results, want_reads):
            assert_same(got, ref, exact=False)
        assert len(results) == len(want_reads)

    @rule(sizes=st.lists(batch_sizes, min_size=1, max_size=3), seed=seeds, data=st.data())
    def invokes(self, sizes, seed, data):
        target = self.pick(data)
        xs = inputs(self.spec, sizes, seed)
        last = self.events[-1]
        final = Op("read", "", "output", 0, last.index)
        progs = [data.draw(programs(self.events, edits=True, max_size=4)) + [final] for _ in xs]
        together = [[] for _ in xs]
        jobs = iter([(p, target.envoys, r) for p, r in zip(progs, together)])
        with target.wrapper.trace() as tracer:
            for x in xs:
                with tracer.invoke(x):
                    run_program(*next(jobs))
        # edits run once on the whole batch; every edit here is row-wise, so per row they are
        # what the same edits do on that invoke's input alone
        for x, program, got in zip(xs, progs, together):
            want, _, _ = reference(self.module, x, target.edit_ops() + program)
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert_same(g, w, exact=False)

    @rule(data=st.data(), exc=st.sampled_from(sorted(EXCEPTIONS)))
    def failing_trace(self, data, exc):
        target = self.pick(data)
        program = data.draw(programs(self.events, edits=True, in_order=False, max_size=5))
        program.insert(data.draw(st.integers(0, len(program))), Op("raise", exc=exc))
        model, envoys = target.wrapper, target.envoys
        with pytest.raises((OutOfOrderError, MissedModuleError, type(EXCEPTIONS[exc]()))):
            with model.trace(self.x):
                offsets = {}
                for op in program:
                    run_op(op, envoys, offsets, [])

    @rule(data=st.data(), standalone=st.booleans())
    def backward_block(self, data, standalone):
        target = data.draw(st.sampled_from([t for t in self.targets if not t.edits] + [self.bare]))
        outs = [e for e in self.events if e.kind == "output"]
        # forward order by event; gradients are read in reverse order of the tensors' creation
        # (a tuple's element or a block's output can be an earlier module's tensor)
        picked = sorted(data.draw(st.lists(st.sampled_from(outs), min_size=1, max_size=3)),
                        key=lambda e: e.index)
        back = sorted(range(len(picked)), key=lambda k: picked[k].origin[0], reverse=True)
        ops = [Op("read", e.path, "output", e.call, e.index) for e in picked]
        x = self.x.clone().requires_grad_(True)
        _, ref_out, ref = reference(self.module, x, ops, retain=True)
        (ref_out ** 2).sum().backward()
        want = [ref[(ops[k].path, ops[k].call)][0].grad for k in back]
        model, envoys, vals, got = target.wrapper, target.envoys, [], []
        if standalone:
            with model.trace(x):
                offsets = {}
                for op in ops:
                    out = address(envoys[op.path], op, offsets).output
                    vals.append(out[0] if isinstance(out, tuple) else out)
                final = rewind(model, offsets).output.save()
            with (final ** 2).sum().backward():
                for k in back:
                    got.append(vals[k].grad.clone())
        else:
            with model.trace(x):
                offsets = {}
                for op in ops:
                    out = address(envoys[op.path], op, offsets).output
                    vals.append(out[0] if isinstance(out, tuple) else out)
                loss = (rewind(model, offsets).output ** 2).sum()
                with loss.backward():
                    for k in back:
                        got.append(vals[k].grad.clone())
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        self.module.zero_grad(set_to_none=True)

    @rule(seed=seeds, data=st.data())
    def trace_in_session(self, seed, data):
        """Trace 1 (on ``first``) reads an output into ``h`` without saving it; trace 2 (on
        ``second``, another input) sets the same output to ``h`` and saves the final output."""
        first, second = self.pick(data, "first"), self.pick(data, "second")
        at = data.draw(st.sampled_from([e for e in self.events if e.kind == "output"]))
        pick = Op("read", at.path, "output", at.call, at.index)
        before = [e for e in self.events if e.index <= at.index]
        after = [e for e in self.events if e.index > at.index]
        prog1 = data.draw(programs(before, edits=True, max_size=3))
        prog2 = data.draw(programs(after, edits=True, max_size=3)) if after else []
        (x2,) = inputs(self.spec, [self.x.shape[0]], seed)

        reads1, _, outs1 = reference(self.module, self.x, first.edit_ops() + prog1 + [pick],
                                     retain=True)
        carried = outs1[(at.path, at.call)]
        carried = tuple(carried) if at.tensor_elems > 1 else carried[0]
        reads2, want_out, _ = reference(self.module, x2, second.edit_ops() + prog2,
                                        patch={(at.path, at.call): carried})
        reads1.pop()  # the read of `h` itself collects nothing in the body

        m1, e1, m2, e2, results = first.wrapper, first.envoys, second.wrapper, second.envoys, []
        with self.model.session():
            with m1.trace(self.x):
                offsets = {}
                for op in prog1:
                    run_op(op, e1, offsets, results)
                h = address(e1[pick.path], pick, offsets).output
            with m2.trace(x2):
                offsets = {}
                address(e2[pick.path], pick, offsets).output = h
                for op in prog2:
                    run_op(op, e2, offsets, results)
                out = rewind(m2, offsets).output.save()
        # only saved values leave the session (`h` too when it is the very tensor saved)
        assert locals().get("h", out) is out
        assert_same(out, want_out, exact=False)
        want_reads = reads1 + reads2
        assert len(results) == len(want_reads)
        for got, ref in zip(results, want_reads):
            assert_same(got, ref, exact=False)

    @rule(data=st.data())
    def persistent_edit(self, data):
        base = self.pick(data, "base")
        edit_ops = data.draw(edit_programs(self.events))
        before = len(base.wrapper._edits)
        with base.wrapper.edit() as edited:
            run_program(edit_ops, envoys_of(edited), [])
        assert edited is not base.wrapper
        assert len(base.wrapper._edits) == before  # the base stays as it was
        new = Target(edited, base.edits + [edit_ops])
        if len(self.targets) < MAX_TARGETS:
            self.targets.append(new)
        else:  # keep the machine small: the newest copy replaces the oldest one
            self.targets[1:] = self.targets[2:] + [new]

    @rule(data=st.data())
    def inplace_edit(self, data):
        target = self.pick(data)
        edit_ops = data.draw(edit_programs(self.events))
        model = target.wrapper
        with model.edit(inplace=True):
            run_program(edit_ops, envoys_of(model), [])
        target.edits.append(edit_ops)

    @rule(data=st.data())
    def clear_edits(self, data):
        target = self.pick(data)
        target.wrapper.clear_edits()
        target.edits.clear()

    @rule()
    def plain_forward(self):
        with torch.no_grad():
            for target in self.targets:
                assert torch.equal(target.wrapper(self.x), self.plain)

    @invariant()
    def nothing_left_behind(self):
        if not hasattr(self, "module"):
            return
        assert not leftovers(self.module)
        assert torch_modes() == self.modes
        assert sys.gettrace() is self.tracer
        assert torch.Tensor.backward is patched_backward
        for target in self.targets:
            assert len(target.wrapper._edits) == len(target.edits)
        assert not self.bare.wrapper._edits
        with torch.no_grad():
            assert torch.equal(self.module(self.x), self.plain)


TraceMachine.TestCase.settings = settings(settings(), stateful_step_count=25)
TestTraceMachine = pytest.mark.timeout(240)(TraceMachine.TestCase)
