"""Reading and editing module values inside ``model.trace``: ground truth is plain hooks."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import nnsight_lite
from nnsight_lite import MissedModuleError, NNsight, NNsightError, OutOfOrderError
from tests.helpers import record


class TestReading:
    """Values read in a body equal what a plain forward hook sees."""

    def test_outputs_equal_hooks(self, net, x8):
        model = NNsight(net)
        with model.trace(x8):
            a = model.inp.output.save()
            b = model.layers[1].output.save()
            c = model.layers[-1].output.save()
            out = model.output.save()
        seen, ref = record(net, ["inp", "layers.1", "layers.2"], x8)
        torch.testing.assert_close(a, seen[("inp", 0)])
        torch.testing.assert_close(b, seen[("layers.1", 0)])
        torch.testing.assert_close(c, seen[("layers.2", 0)])
        torch.testing.assert_close(out["logits"], ref["logits"])

    def test_input_and_inputs(self, net, x8):
        model = NNsight(net)
        with model.trace(x8, scale=2.0):
            root_in = model.input.save()
            args, kwargs = model.inputs
            scale = nnsight_lite.save(kwargs["scale"])
            lin_in = model.layers[0].input.save()
        seen, _ = record(net, ["act"], x8, scale=2.0)
        assert root_in is x8
        assert scale == 2.0
        # layers[0] input is the output of the block's first element after shared
        with model.trace(x8):
            blk = model.block.output[0].save()
        torch.testing.assert_close(lin_in, blk)

    def test_unedited_trace_equals_plain_forward(self, net, x8):
        model = NNsight(net)
        with model.trace(x8):
            out = model.output.save()
        torch.testing.assert_close(out["logits"], net(x8)["logits"], rtol=0, atol=0)

    def test_model_call_outside_trace_is_plain_forward(self, net, x8):
        model = NNsight(net)
        torch.testing.assert_close(model(x8)["logits"], net(x8)["logits"], rtol=0, atol=0)

    def test_the_model_runs_with_no_exception_being_handled(self, seq):
        """As in a plain call, the model's code sees no exception being handled while a trace
        runs it (the with-statement skipped its body with one), so an error it raises gets no
        context: the errors a model raises and catches stay as cheap as outside a trace."""
        import sys

        seen = []
        handle = seq[0].register_forward_hook(lambda m, i, o: seen.append(sys.exc_info()))
        try:
            seq(torch.randn(2, 6))
            model = NNsight(seq)
            with model.trace(torch.randn(2, 6)):
                model[1].output.save()
            with model.trace(torch.randn(2, 6)):  # no body reads anything
                pass
        finally:
            handle.remove()
        assert seen == [(None, None, None)] * 3

    def test_trace_false_returns_output(self, net, x8):
        model = NNsight(net)
        out = model.trace(x8, trace=False)
        torch.testing.assert_close(out["logits"], net(x8)["logits"])

    def test_unsaved_names_are_dropped(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with model.trace(x):
            kept = model[0].output.save()
            dropped = model[1].output  # noqa: F841
            nothing = None  # noqa: F841 (a name bound to None was not saved either)
        assert isinstance(kept, torch.Tensor)
        with pytest.raises(NameError):
            dropped  # noqa: B018
        with pytest.raises(NameError):
            nothing  # noqa: B018


class TestEditing:
    """Edits in a body change the forward exactly as the same edit in a plain hook."""

    def test_in_place_edit(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with model.trace(x):
            model[1].output[:, 0] = 0
            out = model.output.save()

        def zero(c, o):
            o[:, 0] = 0

        _, ref = record(seq, [], x, edits={"1": zero})
        torch.testing.assert_close(out, ref)

    def test_replace_output(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with model.trace(x):
            model[2].output = model[2].output * 2
            out = model.output.save()
        _, ref = record(seq, [], x, edits={"2": lambda c, o: o * 2})
        torch.testing.assert_close(out, ref)

    def test_replace_input(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with model.trace(x):
            model[1].input = model[1].input + 1
            out = model.output.save()
        ref = seq[3](seq[2](seq[1](seq[0](x) + 1)))
        torch.testing.assert_close(out, ref)

    def test_replace_inputs_pair(self, net, x8):
        model = NNsight(net)
        with model.trace(x8):
            args, kwargs = model.inputs
            model.inputs = (args, {"scale": 3.0})
            out = model.output.save()
        torch.testing.assert_close(out["logits"], net(x8, scale=3.0)["logits"])

    def test_tuple_output_element_in_place(self, net, x8):
        model = NNsight(net)
        with model.trace(x8):
            model.block.output[0][:] = 0
            out = model.output.save()

        def zero(c, o):
            o[0][:] = 0

        _, ref = record(net, [], x8, edits={"block": zero})
        torch.testing.assert_close(out["logits"], ref["logits"])

    def test_tuple_output_replaced(self, net, x8):
        model = NNsight(net)
        with model.trace(x8):
            h, s = model.block.output
            model.block.output = (h + 1, s)
            out = model.output.save()
        _, ref = record(net, [], x8, edits={"block": lambda c, o: (o[0] + 1, o[1])})
        torch.testing.assert_close(out["logits"], ref["logits"])

    def test_dict_output_edit(self, net, x8):
        model = NNsight(net)
        with model.trace(x8):
            model.output["logits"][:] = 1.5
            out = model.output.save()
        assert torch.all(out["logits"] == 1.5)

    def test_dataclass_output(self):
        @dataclasses.dataclass
        class Out:
            value: torch.Tensor

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(3, 3)

            def forward(self, x):
                return Out(self.lin(x))

        m = M()
        model = NNsight(m)
        x = torch.randn(2, 3)
        with model.trace(x):
            model.output.value[:] = 7
            got = model.output.save()
        assert torch.all(got.value == 7)

    def test_an_invoke_gets_its_rows_of_a_dict_dataclass_with_required_fields(self):
        """A model-output mapping that is a dataclass with a required field (HF's
        ``GenerateDecoderOnlyOutput`` has ``sequences``) keeps its type in each invoke's rows,
        so ``out.value`` works there, and a member a body replaces merges back into that type."""

        @dataclasses.dataclass
        class Out(dict):
            value: torch.Tensor
            extra: torch.Tensor = None

            def __post_init__(self):
                for f in dataclasses.fields(self):
                    if getattr(self, f.name) is not None:
                        self[f.name] = getattr(self, f.name)

            def __setitem__(self, key, item):
                super().__setitem__(key, item)
                super().__setattr__(key, item)

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(3, 3)

            def forward(self, x):
                return Out(self.lin(x))

        m = M()
        model = NNsight(m)
        x1, x2 = torch.randn(1, 3), torch.randn(2, 3)
        with model.trace() as tracer:
            with tracer.invoke(x1):
                a = model.output.save()
            with tracer.invoke(x2):
                model.output["value"] = model.output.value * 0
                b = model.output.save()
            with tracer.invoke():
                full = model.output.save()
        assert type(a) is Out and type(b) is Out and type(full) is Out
        torch.testing.assert_close(a.value, m(x1).value)
        torch.testing.assert_close(full.value, torch.cat([m(x1).value, torch.zeros(2, 3)]))

    def test_python_in_body(self, seq):
        """torch functions, methods, operators, if/for, comprehensions, user functions."""
        model = NNsight(seq)
        x = torch.randn(2, 6)

        def double(t):
            return t * 2

        with model.trace(x):
            norms = nnsight_lite.save([])
            for i in range(3):
                h = model[i].output
                if h.sum() > -1e9:
                    norms.append(torch.linalg.norm(h).item())
            squares = nnsight_lite.save([v ** 2 for v in norms])
            model[3].output = double(model[3].output)
            out = model.output.save()
        seen, ref = record(seq, ["0", "1", "2"], x, edits={"3": lambda c, o: o * 2})
        assert norms == pytest.approx([torch.linalg.norm(seen[(str(i), 0)]).item() for i in range(3)])
        assert squares == pytest.approx([v ** 2 for v in norms])
        torch.testing.assert_close(out, ref)

    def test_calling_a_module_in_the_body_is_not_traced(self, seq):
        """A logit-lens style extra call does not count as one of the model's calls."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with model.trace(x):
            h = model[1].output
            lens = model[3](h).save()
            last = model[3].output.save()
        torch.testing.assert_close(lens, seq[3](seq[1](seq[0](x))))
        torch.testing.assert_close(last, seq(x))


class TestStopAndCalls:
    def test_stop_ends_forward(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        ran = []
        handle = seq[3].register_forward_hook(lambda *a: ran.append(1))
        try:
            with model.trace(x) as tracer:
                h = model[1].output.save()
                tracer.stop()
        finally:
            handle.remove()
        torch.testing.assert_close(h, seq[1](seq[0](x)))
        assert ran == []

    def test_stop_where_no_forward_of_its_trace_runs_raises(self, seq):
        """``tracer.stop()`` of a trace that has ended (after its block, in a later trace's
        body, in a session after that trace) raises saying so (a bare internal StopTrace
        escaped, and in a session it ended the session, silently skipping the code after);
        in the body of a trace given no inputs it raises InvokeError (it cancelled every
        invoke, silently). The model is left exact each time."""
        from nnsight_lite import InvokeError

        model = NNsight(seq)
        x = torch.randn(2, 6)
        with model.trace(x) as old:
            pass
        with pytest.raises(NNsightError, match=r"tracer.stop\(\) at .*test_trace.py:\d+ was "
                                               r"called on a trace that is not running"):
            old.stop()
        with pytest.raises(NNsightError, match="not running"):
            with model.trace(x):
                h = model[0].output
                old.stop()
        ran = []
        with pytest.raises(NNsightError, match="not running"):
            with model.session():
                with model.trace(x) as first:
                    h = model[0].output
                first.stop()
                ran.append("after")
        assert ran == []
        calls = []
        handle = seq[0].register_forward_hook(lambda *a: calls.append(1))
        try:
            with pytest.raises(InvokeError, match=r"tracer.stop\(\) at .*test_trace.py:\d+ is "
                                                  r"in the body of a trace given no inputs"):
                with model.trace() as tracer:
                    with tracer.invoke(x):
                        h = model[0].output.save()
                    tracer.stop()
        finally:
            handle.remove()
        assert calls == []
        with model.trace(x):
            out = model.output.save()
        torch.testing.assert_close(out, seq(x))

    def test_stop_before_the_forward_still_starts_the_later_invokes(self, seq):
        """``tracer.stop()`` at the top of invoke 0: the model does not run, and invoke 1's
        body still runs, to a MissedModuleError at its read that names the stop (its body
        was skipped, silently)."""
        model = NNsight(seq)
        x = torch.randn(1, 6)
        calls, ran = [], []
        handle = seq[0].register_forward_hook(lambda *a: calls.append(1))
        try:
            with pytest.raises(MissedModuleError, match=r"invoke 1 waited for model\[0\].output"
                               r".*tracer.stop\(\) at .*test_trace.py:\d+ ended the forward"):
                with model.trace() as tracer:
                    with tracer.invoke(x):
                        tracer.stop()
                    with tracer.invoke(x):
                        ran.append("invoke 1")
                        k = model[0].output.save()
        finally:
            handle.remove()
        assert ran == ["invoke 1"] and calls == []

    def test_stop_in_a_backward_block_keeps_what_the_block_saved(self, seq):
        """``tracer.stop()`` inside ``with loss.backward():`` ends the trace, and the gradient
        the block saved before it is kept (it was silently dropped: NameError after)."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with model.trace(x) as tracer:
            h = model[0].output
            partial = model[2].output.sum()
            with partial.backward():
                g = h.grad.save()
                tracer.stop()
        h_ref = seq[0](x).detach().requires_grad_(True)
        seq[2](seq[1](h_ref)).sum().backward()
        torch.testing.assert_close(g, h_ref.grad)

    def test_stop_in_an_invoke_keeps_what_its_body_saved(self, seq):
        """``tracer.stop()`` in an invoke's body (the second of two here) keeps the values
        that body saved before it, as in a trace given its input (the invoke's names were
        dropped: NameError after)."""
        model = NNsight(seq)
        x1, x2 = torch.randn(1, 6), torch.randn(1, 6)
        with model.trace() as tracer:
            with tracer.invoke(x1):
                first = model[1].output.save()
            with tracer.invoke(x2):
                second = model[1].output.save()
                tracer.stop()
        torch.testing.assert_close(first, seq[1](seq[0](x1)))
        torch.testing.assert_close(second, seq[1](seq[0](x2)))

    def test_a_read_another_invoke_still_waits_for_after_a_stop_raises(self, seq):
        """An invoke still waiting when another invoke's ``tracer.stop()`` ends the forward is
        told so (as nnsight raises OutOfOrderError there): it named the stop's line and its
        own, instead of ending silently and leaving its names unbound. ``tracer.result`` in an
        empty invoke is such a read. No wrapper is left behind."""
        model = NNsight(seq)
        x = torch.randn(1, 6)
        for late in ("later_module", "result"):
            with pytest.raises(OutOfOrderError) as info:
                with model.trace() as tracer:
                    with tracer.invoke(x):
                        first = model[1].output.save()
                        tracer.stop()  # stop line
                    with tracer.invoke():
                        r = (model[3].output if late == "later_module" else tracer.result).save()
            msg = str(info.value)
            assert isinstance(info.value, MissedModuleError)
            lines = open(__file__).read().splitlines()
            stop_line = f"{__file__}:{lines.index(' ' * 24 + 'tracer.stop()  # stop line') + 1}"
            assert msg.startswith("invoke 1 waited for model") and stop_line in msg, msg
            assert "ended the forward before it ran" in msg
        assert all("forward" not in m.__dict__ for m in seq.modules())
        with model.trace(x):  # and the model traces as before
            again = model[3].output.save()
        torch.testing.assert_close(again, seq(x))

    def test_outer_stop_in_a_nested_trace_ends_the_outer_trace(self, seq):
        """``outer.stop()`` called in the body of a trace nested in ``outer``'s body ends the
        outer model's forward (it stopped the inner one, and the outer body went on). What
        both bodies saved before the stop is kept."""
        inner_net = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU())
        outer_model, inner_model = NNsight(seq), NNsight(inner_net)
        x = torch.randn(2, 6)
        ran = []
        handles = [m.register_forward_hook(lambda m, i, o, n=n: ran.append(n))
                   for n, m in (("outer1", seq[1]), ("outer3", seq[3]), ("inner1", inner_net[1]))]
        try:
            with outer_model.trace(x) as outer:
                h = outer_model[0].output.save()
                with inner_model.trace(h) as inner:
                    b = inner_model[0].output.save()
                    outer.stop()
                after = outer_model[3].output.save()  # never reached
        finally:
            for handle in handles:
                handle.remove()
        assert ran == []  # neither model ran past the stop
        torch.testing.assert_close(h, seq[0](x))
        torch.testing.assert_close(b, inner_net[0](seq[0](x)))
        assert "after" not in locals()

    def test_shared_module_calls(self, net, x8):
        model = NNsight(net)
        with model.trace(x8):
            first = model.shared.output.save()
            second = model.shared.next().output.save()
        seen, _ = record(net, ["shared"], x8)
        torch.testing.assert_close(first, seen[("shared", 0)])
        torch.testing.assert_close(second, seen[("shared", 1)])

    def test_next_moves_every_later_read_of_the_body(self):
        """``module.next()`` is nnsight 0.5+'s alias of ``tracer.next()``: after ``a.next()``
        a read of another module addresses that module's second call too, and inside a
        ``tracer.iter`` loop the move lasts for the rest of the step only."""
        torch.manual_seed(0)

        class Twice(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Linear(4, 4)
                self.b = torch.nn.Linear(4, 4)

            def forward(self, x):
                return self.b(self.b(self.a(self.a(x))))

        net, x = Twice(), torch.randn(2, 4)
        seen, _ = record(net, ["a", "b"], x)
        model = NNsight(net)
        with model.trace(x):
            a1 = model.a.next().output.save()
            b1 = model.b.output.save()  # b's call 1 (its call 0 is still ahead, but not asked)
        torch.testing.assert_close(a1, seen[("a", 1)])
        torch.testing.assert_close(b1, seen[("b", 1)])
        with model.trace(x) as tracer:
            got = nnsight_lite.save([])
            for step in tracer.iter[0:2]:
                got.append(model.a.output)
                if step == 0:
                    tracer.next()
                    got.append(model.a.output)  # still step 0's move: a's call 1
        assert [torch.equal(g, seen[("a", c)]) for g, c in zip(got, [0, 1, 1])] == [True] * 3
        with pytest.raises(MissedModuleError, match=r"model\.b\.output \(call 2\).*ran only 2 "
                           r"time.*read this before the \.next\(\), or step back"):
            with model.trace(x):
                model.a.next().output
                model.b.next().output  # every read is now at call 2: b ran twice

    def test_iter_and_all(self, net, x8):
        model = NNsight(net)
        with model.trace(x8) as tracer:
            outs = nnsight_lite.save([])
            for step in tracer.iter[0:2]:
                outs.append(model.shared.output)
        seen, _ = record(net, ["shared"], x8)
        assert len(outs) == 2
        torch.testing.assert_close(outs[1], seen[("shared", 1)])

        with model.trace(x8) as tracer:
            steps = nnsight_lite.save([])
            for step in tracer.all():
                steps.append((step, model.shared.output.sum().item()))
            after = nnsight_lite.save(["loop ended"])
        assert [s for s, _ in steps] == [0, 1]
        assert steps[1][1] == pytest.approx(seen[("shared", 1)].sum().item())
        assert after == ["loop ended"]

    def test_a_read_after_an_open_loop_says_the_loop_ran_to_the_end(self, net, x8):
        """After ``for step in tracer.all():`` over a module the model calls twice, the loop
        ends with the forward; a read of a later module after it names the loop and the fix
        (read it in the loop, or bound the loop), not just 'after the forward'."""
        model = NNsight(net)
        with pytest.raises(MissedModuleError, match=r"model\.head\.output .*the open step loop "
                                                    r"before it .*one more call of model\.shared"
                                                    r".*tracer\.iter\[k:n\]"):
            with model.trace(x8) as tracer:
                for step in tracer.all():
                    model.shared.output
                model.head.output.save()

    def test_a_loop_that_runs_none_of_its_steps_warns(self, net, x8):
        """A step loop whose first step the run never makes (``tracer.iter[1:3]`` over a module
        a trace calls once, as if a trace generated) ran no step and said nothing (its names
        unbound later, no clue why). It warns, naming the step, the module and how many calls
        it made; a loop that ran some steps and outlasted the calls ends quietly, as before."""
        import warnings

        seen, _ = record(net, ["head", "shared"], x8)
        model = NNsight(net)
        with pytest.warns(UserWarning, match=r"ran none of its steps: its first step, call 1 of "
                          r"model\.head, never happened \(model\.head was called 1 time\(s\)"):
            with model.trace(x8) as tracer:
                got = nnsight_lite.save([])
                for step in tracer.iter[1:3]:
                    got.append(model.head.output)
        assert got == []
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (no warning: step 1 ran)
            with model.trace(x8) as tracer:
                got = nnsight_lite.save([])
                for step in tracer.iter[1:3]:
                    got.append(model.shared.output.clone())
        assert len(got) == 1
        torch.testing.assert_close(got[0], seen[("shared", 1)])

    def test_a_read_after_a_bounded_loop_that_outran_the_calls_says_so(self, net, x8):
        """Found by a hunt: ``tracer.iter[0:5]`` over a module the model calls twice ends with
        the forward too, but the error for a read after it called the loop open and advised
        bounding it (``tracer.iter[k:n]``), which it already was. It now names the call the
        loop asked for and how many the module made; the steps it did run saw the hooks'
        values."""
        seen, _ = record(net, ["shared"], x8)
        model = NNsight(net)
        for steps in (slice(0, 5), slice(0, 4, 2), [1, 2]):
            got = []
            with pytest.raises(MissedModuleError) as info:
                with model.trace(x8) as tracer:
                    for step in tracer.iter[steps]:
                        got.append(model.shared.output.clone())
                    model.head.output.save()
            msg = str(info.value)
            assert "open step loop" not in msg and "tracer.iter[k:n]" not in msg, msg
            assert re.search(r"model\.head\.output .*asked for call 2 of model\.shared, which "
                             r"ran only 2 time", msg), msg
            calls = range(2)[steps] if isinstance(steps, slice) else [1]
            assert len(got) == len(calls)
            for g, c in zip(got, calls):
                torch.testing.assert_close(g, seen[("shared", c)], rtol=0, atol=0)


class TestScan:
    def test_scan_gives_shapes_without_compute(self, net):
        model = NNsight(net)
        x = torch.randn(5, 8)
        with model.scan(x):
            shape = nnsight_lite.save(model.layers[0].output.shape)
            logits_shape = nnsight_lite.save(model.output["logits"].shape)
        assert tuple(shape) == (5, 8)
        assert tuple(logits_shape) == (5, 2)
        assert all(type(n) is int for n in (*shape, *logits_shape))

    def test_scan_leaves_the_models_state_as_it_was(self):
        """A scan's forward updates no state for real: BatchNorm's num_batches_tracked and a
        step counter (0-dim buffers changed in place) were incremented, and a buffer the
        forward rebinds would have been left a fake tensor. Every buffer and parameter equals
        what it was, and the next real forward equals a plain one."""
        torch.manual_seed(0)

        class Counting(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = torch.nn.Conv2d(3, 4, 3)
                self.bn = torch.nn.BatchNorm2d(4)
                self.register_buffer("count", torch.zeros(()))
                self.register_buffer("seen", torch.zeros(()))

            def forward(self, x):
                self.count += 1
                self.seen = self.seen + 1
                return self.bn(self.conv(x))

        net = Counting().train()
        model = NNsight(net)
        x = torch.randn(2, 3, 6, 6)
        before = {k: v.clone() for k, v in net.state_dict().items()}
        with model.scan(x):
            shape = nnsight_lite.save(model.bn.output.shape)
        assert tuple(shape) == (2, 4, 4, 4)
        after = net.state_dict()
        assert all(type(v) is torch.Tensor and torch.equal(v, before[k]) for k, v in after.items())
        twin = Counting().train()
        twin.load_state_dict(before)
        torch.testing.assert_close(net(x), twin(x))

    def test_a_wrong_shape_in_scan_raises_torchs_error_alone(self, net, caplog):
        """A scan whose input the model cannot take raises torch's shape error, without torch's
        fake-tensor log of the same traceback on stderr and without the skipped body's
        internal exception chained to it; the model is left clean and traces again."""
        from tests.strategies import leftovers

        model = NNsight(net)
        with pytest.raises(RuntimeError, match=r"must have same reduction dim|shapes cannot be "
                                               r"multiplied|size mismatch") as info:
            with model.scan(torch.randn(5, 7)):
                model.layers[0].output.shape
        chain, exc = [], info.value
        while exc is not None:
            chain.append(type(exc).__name__)
            exc = exc.__context__
        assert "SkipBody" not in chain, chain
        assert not [r for r in caplog.records if "failed while attempting" in r.getMessage()]
        assert leftovers(net) == []
        x = torch.randn(2, 8)
        with model.trace(x):
            out = model.output.save()
        torch.testing.assert_close(out["logits"], net(x)["logits"])

    def test_a_data_dependent_value_in_scan_is_a_symbol(self, net):
        """``.item()`` on a fake tensor has no value: in a scan it is a symbol (as nnsight's
        scan gives) where it raised torch's DataDependentOutputException."""
        model = NNsight(net)
        with model.scan(torch.randn(5, 8)):
            total = nnsight_lite.save(model.layers[0].output.sum().item())
        assert isinstance(total, torch.SymFloat)


def test_trace_with_an_empty_body_runs_the_forward_once(seq):
    calls = []
    h = seq[3].register_forward_hook(lambda *a: calls.append(1))
    try:
        with NNsight(seq).trace(torch.randn(2, 6)):
            pass
    finally:
        h.remove()
    assert calls == [1]


def test_changes_to_the_module_tree_between_traces_are_seen():
    """A trace reuses the previous trace's walk of the module tree only while every module
    keeps exactly its children: replacing, adding or removing one (at any depth) is seen."""
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU())
    net = torch.nn.Sequential(torch.nn.Linear(6, 6), inner, torch.nn.Linear(6, 3))
    model = NNsight(net)
    x = torch.randn(2, 6)
    with model.trace(x):
        a = model[2].output.save()
    torch.testing.assert_close(a, net(x))

    net[2] = torch.nn.Linear(6, 3)  # replaced
    with model.trace(x):
        b = model[2].output.save()
    torch.testing.assert_close(b, net(x))

    inner[0] = torch.nn.Linear(6, 6)  # replaced one level down
    with model.trace(x):
        c = model[1][0].output.save()
    torch.testing.assert_close(c, inner[0](net[0](x)))

    net.append(torch.nn.Linear(3, 2))  # added
    with model.trace(x):
        d = model[3].output.save()
    torch.testing.assert_close(d, net(x))

    removed = net[3]
    del net[3]  # removed: no longer wrapped, its output is not the model's
    with model.trace(x):
        e = model.output.save()
    torch.testing.assert_close(e, net(x))
    assert "forward" not in removed.__dict__
    assert all("forward" not in m.__dict__ for m in net.modules())


def test_an_install_interrupted_part_way_leaves_every_module_as_it_was():
    """If wrapping the modules fails part way (here a module's ``forward`` lookup raises, as a
    KeyboardInterrupt could), the trace raises and every module is left unwrapped."""

    class Flaky(torch.nn.Linear):
        fail = False

        @property
        def forward(self):
            if Flaky.fail:
                raise RuntimeError("forward lookup failed")
            return super().forward

    net = torch.nn.Sequential(torch.nn.Linear(6, 6), Flaky(6, 6), torch.nn.Linear(6, 3))
    model = NNsight(net)
    x = torch.randn(2, 6)
    with model.trace(x):  # a first trace: the next one reuses its walk
        out = model.output.save()
    Flaky.fail = True
    try:
        with pytest.raises(RuntimeError, match="forward lookup failed"):
            with model.trace(x):
                out = model.output.save()
    finally:
        Flaky.fail = False
    assert all("forward" not in m.__dict__ for m in net.modules())
    torch.testing.assert_close(net(x), out)
    with model.trace(x):
        again = model.output.save()
    torch.testing.assert_close(again, out)


class TestNestedBlocksNames:
    def test_names_a_nested_block_binds_reach_the_enclosing_body_unsaved(self, seq):
        """Only the outermost block keeps just the saved names (as nnsight does): a trace of
        another model and a backward block nested in a trace body hand every name they bind
        to that body, saved or not; after the outer trace, only what was saved is bound."""
        probe_net = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU())
        model, probe = NNsight(seq), NNsight(probe_net)
        x = torch.randn(2, 6)
        with model.trace(x):
            h = model[0].output
            with probe.trace(h):
                o = probe[0].output  # not saved
            o_sum = o.sum().save()
            loss = model.output.sum()
            with loss.backward():
                g = h.grad  # not saved
            g_sum = g.sum().save()
        h_ref = seq[0](x).detach().requires_grad_(True)
        seq[3](seq[2](seq[1](h_ref))).sum().backward()
        torch.testing.assert_close(o_sum, probe_net[0](seq[0](x)).sum())
        torch.testing.assert_close(g_sum, h_ref.grad.sum())
        assert "o" not in locals() and "g" not in locals()  # unsaved: gone after the trace


def test_an_open_loop_whose_steps_read_nothing_raises_instead_of_spinning(seq, monkeypatch):
    """In a trace (no generation length to bound it), ``for step in tracer.all():`` whose
    steps stop reading modules could never reach the end of the model's calls: after a long
    run of such steps it raises saying so (it spun for ever), and the model is left clean."""
    from nnsight_lite import steps

    monkeypatch.setattr(steps, "_IDLE_STEPS", 1000)
    model = NNsight(seq)
    x = torch.randn(2, 6)
    with pytest.raises(NNsightError, match="1,000 steps in a row without reading a module"):
        with model.trace(x) as tracer:
            for step in tracer.all():
                if step == 0:
                    h = model[0].output.save()
    with model.trace(x):
        out = model.output.save()
    torch.testing.assert_close(out, seq(x))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
class TestTransformerFastPath:
    """torch's ``TransformerEncoderLayer`` in eval mode without grad runs a fused fast path that
    calls none of its submodules, unless a forward hook or pre-hook is on the layer or a module
    inside it. A trace uses no hooks, so a body reading ``layers[0].self_attn`` (or ``linear1``,
    ``norm2``) under ``torch.no_grad()`` got ``MissedModuleError`` ("the model's forward does
    not call it") where a hook sees the call (nnsight 0.8.1 fails too). A layer in which a body
    waits for a value skips its fast path as a hooked one does, the MultiheadAttention inside
    keeping its own, so every value equals the hooks'; a layer nobody reads inside runs fast."""

    def _encoder(self):
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
        return torch.nn.TransformerEncoder(layer, 2).eval()

    @pytest.mark.parametrize("grad_off", [torch.no_grad, torch.inference_mode])
    @pytest.mark.parametrize("masked", [False, True])
    @pytest.mark.parametrize("names", [["layers.0.self_attn", "layers.1.linear2"],
                                       ["layers.1.norm2"], ["layers.0"]])
    def test_reads_inside_a_layer_equal_the_hooks(self, grad_off, masked, names):
        enc = self._encoder()
        model = NNsight(enc)
        x = torch.randn(2, 5, 16)
        kwargs = {}
        if masked:
            mask = torch.zeros(2, 5, dtype=torch.bool)
            mask[1, 3:] = True
            kwargs["src_key_padding_mask"] = mask
        with grad_off():
            seen, ref = record(enc, names, x, **kwargs)
            with model.trace(x, **kwargs):
                got = nnsight_lite.save([model.get(n).output for n in names])
                out = model.output.save()
        for name, value in zip(names, got):
            want = seen[(name, 0)]
            if isinstance(value, tuple):
                value, want = value[0], want[0]
            if value.is_nested:
                value, want = value.to_padded_tensor(0.0), want.to_padded_tensor(0.0)
            assert torch.equal(value, want), name
        assert torch.equal(out, ref)
        assert torch.backends.mha.get_fastpath_enabled() is True

    def test_a_cache_and_a_later_layer_equal_the_hooks(self):
        enc = self._encoder()
        model = NNsight(enc)
        x = torch.randn(2, 5, 16)
        with torch.no_grad():
            seen, ref = record(enc, ["layers.0.linear1", "layers.1.self_attn"], x)
            with model.trace(x) as tracer:
                cache = tracer.cache()
            with model.trace(x):  # layer 0 runs fast: nothing waits inside it
                attn = model.layers[1].self_attn.output[0].save()
                out = model.output.save()
            plain = enc(x)
        assert torch.equal(cache["model.layers.0.linear1"].output, seen[("layers.0.linear1", 0)])
        assert torch.equal(cache["model"].output, ref)
        assert torch.equal(attn, seen[("layers.1.self_attn", 0)][0])
        assert torch.equal(out, plain)

    def test_two_threads_read_inside_layers_of_their_own_models(self):
        """Traces of separate models on two threads at once (the README's "separate model
        objects work"): thread B's trace ran while thread A's was inside a guarded layer, and
        B's layer, which B's body reads inside, took the fast path (MissedModuleError): B's
        guard saw A's flag object in torch's global and took it for a flag turned off."""
        import threading

        enc_a, enc_b = self._encoder(), self._encoder()
        model_a, model_b = NNsight(enc_a), NNsight(enc_b)
        x, y = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
        with torch.no_grad():
            seen_a, ref_a = record(enc_a, ["layers.0.self_attn", "layers.0.linear1"], x)
            seen_b, ref_b = record(enc_b, ["layers.0.linear1"], y)
        go, done, got = threading.Event(), threading.Event(), {}

        def other():
            go.wait()
            try:
                with torch.no_grad(), model_b.trace(y):
                    got["b"] = model_b.layers[0].linear1.output.save()
                    got["b_out"] = model_b.output.save()
            except Exception as exc:  # (reported in the main thread)
                got["b"] = exc
            finally:
                done.set()

        thread = threading.Thread(target=other)
        thread.start()
        try:
            with torch.no_grad(), model_a.trace(x):
                attn = model_a.layers[0].self_attn.output[0].save()
                go.set()  # B's whole trace runs now, while A's layer 0 is running
                done.wait(60)
                lin = model_a.layers[0].linear1.output.save()
                out = model_a.output.save()
        finally:
            go.set()
            thread.join(60)
        assert isinstance(got["b"], torch.Tensor), got["b"]
        assert torch.equal(got["b"], seen_b[("layers.0.linear1", 0)])
        assert torch.equal(got["b_out"], ref_b)
        assert torch.equal(attn, seen_a[("layers.0.self_attn", 0)][0])
        assert torch.equal(lin, seen_a[("layers.0.linear1", 0)]) and torch.equal(out, ref_a)
        assert torch.backends.mha.get_fastpath_enabled() is True
