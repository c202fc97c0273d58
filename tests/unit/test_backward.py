"""Gradients inside ``with loss.backward():``, against retain_grad / register_hook ground truth."""

from __future__ import annotations

import threading
import traceback
import warnings

import pytest
import torch

import nnsight_lite
from nnsight_lite import NNsight, OutOfOrderError, OutsideTraceError
from nnsight_lite.errors import GradientError


def reference_grads(seq, x, edit=None):
    """Plain PyTorch: retain_grad on every layer output, optional hook editing one of them."""
    hs = []
    h = x
    for i, layer in enumerate(seq):
        h = layer(h)
        h.retain_grad()
        if edit is not None and edit[0] == i:
            h.register_hook(edit[1])
        hs.append(h)
    h.sum().backward()
    return [t.grad for t in hs], [p.grad.clone() for p in seq.parameters()]


class TestPlainBackwardUnchanged:
    def test_plain_call_is_original(self, seq):
        x = torch.randn(2, 6)
        seq(x).sum().backward()
        got = [p.grad.clone() for p in seq.parameters()]
        seq.zero_grad()
        torch.autograd.backward(seq(x).sum())
        want = [p.grad.clone() for p in seq.parameters()]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)

    def test_plain_call_same_errors(self):
        t = torch.randn(3)
        with pytest.raises(RuntimeError, match="does not require grad"):
            t.sum().backward()

    def test_patched_once(self):
        assert getattr(torch.Tensor.backward, "__nnsight_lite__", False)


class TestReadingGrads:
    def test_in_trace_reverse_order(self, seq):
        x = torch.randn(2, 6)
        model = NNsight(seq)
        with model.trace(x):
            h1 = model[1].output
            h3 = model[3].output
            loss = h3.sum()
            with loss.backward():
                g3 = h3.grad.save()
                g1 = h1.grad.save()
        ref, _ = reference_grads(seq, x)
        torch.testing.assert_close(g3, ref[3])
        torch.testing.assert_close(g1, ref[1])

    def test_standalone_on_saved_tensors(self, seq):
        x = torch.randn(2, 6)
        model = NNsight(seq)
        with model.trace(x):
            h0 = model[0].output.save()
            out = model.output.save()
        with out.sum().backward():
            g0 = h0.grad.save()
        ref, _ = reference_grads(seq, x)
        torch.testing.assert_close(g0, ref[0])

    def test_standalone_no_trace(self):
        a = torch.randn(3, requires_grad=True)
        b = a * 2
        c = (b ** 2).sum()
        with c.backward():
            gb = b.grad.save()
            ga = a.grad.save()
        torch.testing.assert_close(gb, 2 * b.detach() * 2 / 2 * 1)  # d(b^2)/db = 2b
        torch.testing.assert_close(ga, 8 * a.detach())

    def test_parameter_grads_after_backward_block(self, seq):
        x = torch.randn(2, 6)
        model = NNsight(seq)
        with model.trace(x):
            loss = model.output.sum()
            with loss.backward():
                pass
        got = [p.grad.clone() for p in seq.parameters()]
        seq.zero_grad()
        _, want = reference_grads(seq, x)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


class TestEditingGrads:
    @pytest.mark.parametrize("kind", ["zero", "scale"])
    def test_edit_flows_to_earlier_layers(self, seq, kind):
        x = torch.randn(2, 6)
        model = NNsight(seq)
        with model.trace(x):
            h1 = model[1].output
            h3 = model[3].output
            with h3.sum().backward():
                if kind == "zero":
                    h3.grad[:] = 0
                else:
                    h3.grad = h3.grad * 2
                g1 = h1.grad.save()
        got_params = [p.grad.clone() for p in seq.parameters()]
        seq.zero_grad()
        hook = (lambda g: torch.zeros_like(g)) if kind == "zero" else (lambda g: g * 2)
        ref, ref_params = reference_grads(seq, x, edit=(3, hook))
        torch.testing.assert_close(g1, ref[1])
        for g, w in zip(got_params, ref_params):
            torch.testing.assert_close(g, w)

    def test_detach_stops_flow(self, seq):
        x = torch.randn(2, 6)
        model = NNsight(seq)
        with model.trace(x):
            model[1].output = model[1].output.detach()
            loss = model.output.sum()
            with loss.backward():
                pass
        assert seq[0].weight.grad is None
        assert seq[2].weight.grad is not None


class TestGradErrors:
    def test_forward_order_is_out_of_order(self, seq):
        model = NNsight(seq)
        with pytest.raises(OutOfOrderError, match="reverse execution order") as info:
            with model.trace(torch.randn(2, 6)):
                h1 = model[1].output
                h3 = model[3].output[:, :3]
                with h3.sum().backward():
                    g1 = h1.grad
                    g3 = h3.grad
        msg = str(info.value)
        assert "tensor of shape (2, 3)" in msg and "tensor of shape (2, 6)" in msg

    def test_a_replacement_that_cuts_the_graph_is_named(self, seq):
        """nnsight's modification gotcha: `.output = torch.zeros_like(...)` on a later module,
        then an earlier tensor's `.grad`: the error names the replacement (module path, invoke,
        line) as what cut the graph, and says to edit in place; it said only "not part of this
        loss's graph, or ... computed before it was asked for" (nnsight 0.8.1: "'<id>.grad.i0'
        was requested but the model already ran past it"). The in-place form it suggests gives
        torch's gradient (zeros past the zeroed layer)."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with pytest.raises(GradientError, match=r"never reached it: model\[2\]\.output was "
                           r"replaced by invoke 0 at .*test_backward\.py:\d+ with a tensor that "
                           r"does not require grad, which cuts the loss's graph there\. Edit the "
                           r"value in place") as info:
            with model.trace(x):
                h = model[0].output
                model[2].output = torch.zeros_like(model[2].output)  # the cut
                with model.output.sum().backward():
                    g = h.grad.save()
        assert "the tensor is not part of" not in str(info.value)
        with pytest.raises(GradientError, match="the tensor is not part of this loss's graph"):
            with model.trace(x):  # no replacement: the general reason, as before
                h = model[0].output
                other = (torch.randn(2, 6, requires_grad=True) * 2).sum()
                with other.backward():
                    g = h.grad.save()
        with model.trace(x):
            h = model[0].output
            model[2].output[:] = 0
            with model.output.sum().backward():
                g = h.grad.save()
        h0 = seq[0](x)
        h0.retain_grad()
        h2 = seq[2](seq[1](h0)) * 0
        seq[3](h2).sum().backward()
        seq.zero_grad()
        torch.testing.assert_close(g, h0.grad)

    def test_a_loss_that_is_not_a_scalar(self, seq):
        """``with out.backward():`` on a loss of several elements (a forgotten ``.sum()``)
        raises GradientError (a RuntimeError, as torch's is) naming the line and the loss's
        shape and saying to reduce it or pass gradient=; it raised torch's bare "grad can be
        implicitly created only for scalar outputs" from inside autograd."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with pytest.raises(GradientError, match=r"`with loss\.backward\(\):` at .*test_backward"
                           r"\.py:\d+: the loss is a tensor of shape \(2, 6\).*not a single "
                           r"number.*\.sum\(\)\.backward\(\).*gradient=") as info:
            with model.trace(x):
                h = model[1].output
                with model.output.backward():  # no .sum()
                    g = h.grad.save()
        assert isinstance(info.value, RuntimeError)
        assert any(fs.filename == __file__ and "no .sum()" in (fs.line or "")
                   for fs in traceback.extract_tb(info.value.__traceback__))
        with model.trace(x):  # as the message says
            h = model[1].output
            with model.output.backward(gradient=torch.ones(2, 6)):
                g = h.grad.save()
        hx = seq[:2](x).detach().requires_grad_(True)
        seq[2:](hx).sum().backward()
        torch.testing.assert_close(g, hx.grad)

    def test_tensor_not_requiring_grad(self, seq):
        t = torch.randn(3)
        a = torch.randn(3, requires_grad=True)
        with pytest.raises(GradientError, match=r"requires_grad_\(True\)"):
            with (a * 2).sum().backward():
                t.grad

    def test_tensor_not_in_graph(self):
        a = torch.randn(3, requires_grad=True)
        other = torch.randn(3, requires_grad=True) * 3
        with pytest.raises(GradientError, match="never reached it"):
            with (a * 2).sum().backward():
                other.grad

    def test_view_made_after_use_says_index_the_gradient(self, seq):
        """``h[:, 0].grad`` (the view made in the body, after the model used ``h``) is never
        reached, as a plain hook on such a view never fires; the error says to index the
        gradient instead, which gives retain_grad's rows."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with pytest.raises(GradientError, match=r"view .*`h.grad\[:, 0\]`, not `h\[:, 0\].grad`"):
            with model.trace(x):
                h = model[1].output
                col = h[:, 0]
                with model.output.sum().backward():
                    col.grad
        fired = []
        ref = seq[1](seq[0](x))
        ref.retain_grad()
        out = seq[3](seq[2](ref))
        ref[:, 0].register_hook(fired.append)
        out.sum().backward()
        assert fired == []
        with model.trace(x):
            h = model[1].output
            with model.output.sum().backward():
                g = h.grad[:, 0].save()
        torch.testing.assert_close(g, ref.grad[:, 0])

    def test_a_view_the_model_makes_off_the_graph_is_not_called_a_body_view(self):
        """A module whose output is a view (``x.view(...)`` in its forward) that the loss does
        not use at all: a plain hook on it never fires, and the error says it is not part of
        the loss's graph; it said the body made a view after its base was used and to write
        ``h.grad[:, 0]``, which does not apply (its base is off the graph too)."""

        class Flat(torch.nn.Module):
            def forward(self, x):
                return x.view(x.shape[0], -1)

        class Two(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Linear(4, 4)
                self.flat = Flat()
                self.b = torch.nn.Linear(4, 4)

            def forward(self, x):
                self.flat(self.a(x))  # a side branch the output does not use
                return self.b(x)

        net = Two()
        x = torch.randn(2, 4)
        fired = []
        handle = net.flat.register_forward_hook(
            lambda m, i, out: (out._base is not None and out.register_hook(fired.append)))
        try:
            net(x).sum().backward()
        finally:
            handle.remove()
        assert fired == []  # (the view is made, and backprop never reaches it)
        model = NNsight(net)
        with pytest.raises(GradientError, match="not part of this loss's graph") as info:
            with model.trace(x):
                h = model.flat.output
                with model.output.sum().backward():
                    h.grad
        assert "h.grad[:, 0]" not in str(info.value)

    def test_a_leaf_the_loss_does_not_use_is_not_called_out_of_turn(self):
        """A parameter of a module whose output the loss does not use (and an activation of
        it read after a used parameter): plain hooks on them never fire, and the error says
        they are not part of the loss's graph; it said a leaf was read out of turn and to
        read it right after its operation's output, which would not help."""

        class Two(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Linear(4, 4)
                self.b = torch.nn.Linear(4, 4)

            def forward(self, x):
                self.a(x)  # a side branch the output does not use
                return self.b(x)

        net = Two()
        x = torch.randn(2, 4)
        fired = []
        w_hook = net.a.weight.register_hook(fired.append)
        out_hook = net.a.register_forward_hook(lambda m, i, out: out.register_hook(fired.append))
        try:
            net(x).sum().backward()
        finally:
            w_hook.remove()
            out_hook.remove()
        assert fired == []
        net.zero_grad()
        model = NNsight(net)
        for reads in ("weight", "used weight, then the unused output"):
            with pytest.raises(GradientError, match="not part of this loss's graph") as info:
                with model.trace(x):
                    h = model.a.output
                    with model.output.sum().backward():
                        if reads == "weight":
                            net.a.weight.grad
                        else:
                            net.b.weight.grad
                            h.grad
            assert "a leaf" not in str(info.value), reads

    def test_tensor_left_out_of_inputs_says_so(self, seq):
        """backward(inputs=[w]) runs backprop only as far as ``w`` needs, so an activation
        after ``w``'s layer is never reached (a plain hook there does not fire either)."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        w = seq[3].weight
        with pytest.raises(GradientError, match="given inputs=.*add it to inputs="):
            with model.trace(x):
                h = model[1].output
                with model.output.sum().backward(inputs=[w]):
                    h.grad
        fired = []
        h = seq[1](seq[0](x))
        h.register_hook(fired.append)
        seq[3](seq[2](h)).sum().backward(inputs=[w])
        assert fired == []

    def test_leaf_read_out_of_turn_says_so(self, seq):
        """A parameter's gradient arrives as backprop passes the layer that uses it: the last
        layer's weight before the activations below it (plain hooks fire in that order), so
        reading an activation first and then that weight misses the weight, and the error
        says why."""
        order = []
        w = seq[3].weight
        h = seq[1](seq[0](torch.randn(2, 6)))
        h.register_hook(lambda g: order.append("h"))
        w_hook = w.register_hook(lambda g: order.append("w"))
        seq[3](seq[2](h)).sum().backward()
        w_hook.remove()
        assert order == ["w", "h"]
        seq.zero_grad()
        model = NNsight(seq)
        with pytest.raises(GradientError, match=r"it is a leaf \(a parameter or an input\)"):
            with model.trace(torch.randn(2, 6)):
                h = model[1].output
                with model.output.sum().backward():
                    h.grad
                    w.grad
        with pytest.raises(GradientError, match=r"shape \(6, 6\).* read before it is a leaf"):
            with model.trace(torch.randn(2, 6)):
                h = model[1].output
                with model.output.sum().backward():
                    seq[0].weight.grad
                    h.grad

    def test_no_grad_loss(self, seq):
        model = NNsight(seq)
        with pytest.raises(GradientError, match="does not require grad"):
            with torch.no_grad():
                with model.trace(torch.randn(2, 6)):
                    loss = model.output.sum()
                    with loss.backward():
                        pass

    def test_module_output_inside_backward_block_says_bind_it_before(self, seq):
        """Reading ``.output`` inside a backward block says the forward is over and how to
        write it (bind the value before the block), not that no trace is running; the trace's
        hooks are gone afterwards and the model runs plainly."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with pytest.raises(OutsideTraceError, match=r"inside a `with loss.backward\(\):` block"
                           r".*bind `h = model\[1\]\.output` before"):
            with model.trace(x):
                loss = model.output.sum()
                with loss.backward():
                    model[1].output.grad
        torch.testing.assert_close(model(x), seq[3](seq[2](seq[1](seq[0](x)))))

    def test_setting_a_gradient_of_another_shape(self, seq):
        """``h.grad = g`` with g of another shape raises GradientError at that line naming both
        shapes; it was autograd's bare "hook '<unknown>' has changed the size of value", raised
        at the `with` line. Nothing is left behind, and a same-shape set still works."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with pytest.raises(GradientError, match=r"\.grad of a tensor of shape \(2, 6\) .*was set "
                           r"at .*test_backward\.py:\d+ to a tensor of shape \(3,\) .*must keep "
                           r"its shape \(2, 6\)") as info:
            with model.trace(x):
                h = model[1].output
                with model.output.sum().backward():
                    h.grad = torch.zeros(3)  # the wrong shape
        assert any(fs.filename == __file__ and "the wrong shape" in (fs.line or "")
                   for fs in traceback.extract_tb(info.value.__traceback__))
        seq.zero_grad()
        with model.trace(x):
            h = model[1].output
            with model.output.sum().backward():
                h.grad = torch.zeros(2, 6)
        assert not seq[0].weight.grad.any() and seq[3].weight.grad.any()

    def test_old_idiom_reading_activation_grad(self, seq):
        """``h.grad`` of an activation outside a backward block raises GradientError, without
        torch's own non-leaf warning first, and so does ``h.grad = g`` there (it was kept as a
        plain attribute that no backprop reads, silently); an activation that retains its
        grad, or a leaf, reads and takes it as usual."""
        model = NNsight(seq)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (torch's "non-leaf Tensor" warning would raise)
            with pytest.raises(GradientError, match=r"with loss.backward\(\):\n +g = h.grad"):
                with model.trace(torch.randn(2, 6)):
                    h = model[1].output
                    model.output.sum().backward()
                    g = h.grad
            # the advice's example takes .grad of what the line took it of, as written
            with pytest.raises(GradientError, match=r"g = model\[1\]\.output\[:, 0\]\.grad"):
                with model.trace(torch.randn(2, 6)):
                    print(model[1].output[:, 0].grad)
            x = torch.randn(2, 6, requires_grad=True)
            with model.trace(x):
                h = model[1].output
                h.retain_grad()
                model.output.sum().backward()
                g = h.grad.save()
                gx = x.grad.save()
            with pytest.raises(GradientError, match=r"assigned at .*test_backward.py:\d+ "
                               r"outside a backward context(.|\n)*with loss.backward\(\):"
                               r"\n +a\.grad = new_grad"):
                with model.trace(x):
                    a = model[2].output
                    a.grad = torch.ones(2, 6)
            with model.trace(x):  # (a leaf's, or a retained one's, is torch's attribute)
                a = model[2].output
                a.retain_grad()
                a.grad = torch.ones(2, 6)
                assigned = a.grad.save()
                x.grad = None
                cleared = nnsight_lite.save(x.grad)
        assert torch.equal(assigned, torch.ones(2, 6)) and cleared is None
        torch.testing.assert_close(model(x), seq(x))
        h = seq[1](seq[0](x))
        h.retain_grad()
        seq[3](seq[2](h)).sum().backward()
        torch.testing.assert_close(g, h.grad)
        assert gx is not None and gx.shape == x.shape


class TestStop:
    def test_stop_in_a_backward_block_ends_only_the_backward(self, seq):
        """``tracer.stop()`` in ``with loss.backward():`` ends that backward pass (earlier
        layers get no gradient, the grad read before it is kept) and the trace body goes on
        after the block (as in nnsight); the trace's own output is the plain forward's."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        seen = []
        hook = seq[0].register_full_backward_hook(lambda m, gi, go: seen.append(1))
        try:
            with model.trace(x) as tracer:
                h = model[2].output
                out = model.output
                with out.sum().backward():
                    g = h.grad.save()
                    tracer.stop()
                after = out.clone().save()
        finally:
            hook.remove()
        h = seq[2](seq[1](seq[0](x)))
        h.retain_grad()
        ref = seq[3](h)
        ref.sum().backward()
        torch.testing.assert_close(g, h.grad)
        torch.testing.assert_close(after, ref)
        assert seen == []  # (backprop never reached model[0])


class TestThreads:
    def test_hooks_fire_on_calling_thread(self, seq):
        x = torch.randn(2, 6)
        model = NNsight(seq)
        threads = []
        with model.trace(x):
            h = model[2].output
            with model.output.sum().backward():
                threads.append(threading.get_ident())
                g = h.grad.save()
                threads.append(threading.get_ident())
        assert threads == [threading.get_ident()] * 2

    def test_backward_runs_with_autograd_multithreading_off(self, seq):
        """With multithreading off autograd runs device work on the calling thread (PyTorch's
        documented behaviour of set_multithreading_enabled(False)); outside it is restored."""
        model = NNsight(seq)
        seen = []
        with model.trace(torch.randn(2, 6)):
            h = model[1].output
            with model.output.sum().backward():
                g = h.grad
                seen.append(torch.autograd.is_multithreading_enabled())
        assert seen == [False]
        assert torch.autograd.is_multithreading_enabled()

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (autograd device threads)")
    def test_cuda_backward_runs_on_calling_thread(self):
        seq = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)).cuda()
        x = torch.randn(2, 6, device="cuda")
        model = NNsight(seq)
        with model.trace(x):
            h = model[0].output
            with model.output.sum().backward():
                g = h.grad.save()
        ref = seq[0](x)
        ref.retain_grad()
        seq[1](ref).sum().backward()
        torch.testing.assert_close(g, ref.grad)


class TestInvokeRows:
    def test_each_invokes_grad_is_its_rows(self, seq):
        model = NNsight(seq)
        x1, x2 = torch.randn(1, 6), torch.randn(2, 6)
        with model.trace() as tracer:
            with tracer.invoke(x1):
                h1 = model[1].output
            with tracer.invoke(x2):
                h2 = model[1].output
            with tracer.invoke():
                loss = (model.output ** 2).sum()
                with loss.backward():
                    g1 = h1.grad.save()
                    g2 = h2.grad.save()
                    h2.grad = torch.zeros_like(h2.grad)
        got = seq[0].weight.grad.clone()
        seq.zero_grad()
        hs = seq[1](seq[0](torch.cat([x1, x2])))
        hs.retain_grad()
        (seq[3](seq[2](hs)) ** 2).sum().backward()
        torch.testing.assert_close(g1, hs.grad[:1])
        torch.testing.assert_close(g2, hs.grad[1:])
        # invoke 1's rows were zeroed: only invoke 0's rows reach layer 0's weight
        seq.zero_grad()
        h = seq[1](seq[0](torch.cat([x1, x2])))
        h.register_hook(lambda g: torch.cat([g[:1], torch.zeros_like(g[1:])]))
        (seq[3](seq[2](h)) ** 2).sum().backward()
        torch.testing.assert_close(got, seq[0].weight.grad)


    def test_retain_grad_on_an_invokes_value_gives_its_rows(self, seq):
        """``h.retain_grad()`` on an invoke's value in a trace of several invokes, then a plain
        ``loss.backward()`` after the trace: ``h.grad`` is that invoke's rows of the batch
        activation's gradient, as with one invoke (where ``h`` is the batch tensor itself);
        a second backward adds to it, as torch's retain_grad does. Before, the invoke's value
        (a slice the forward does not go on from) kept ``.grad`` None. Found by a workflow
        hunt (attribution over clean and corrupted invokes)."""
        model = NNsight(seq)
        x = torch.randn(3, 6)
        with model.trace() as tracer:
            with tracer.invoke(x[:1]):
                a = model[1].output.save()
                a.retain_grad()
                out_a = model.output.save()
            with tracer.invoke(x[1:]):
                b = model[1].output.save()
                b.retain_grad()
                out_b = model.output.save()
        (out_a.sum() + (out_b ** 2).sum()).backward(retain_graph=True)
        first_a, first_b = a.grad.clone(), b.grad.clone()
        (out_a.sum() + (out_b ** 2).sum()).backward()
        h = seq[1](seq[0](x))
        h.retain_grad()
        out = seq[3](seq[2](h))
        (out[:1].sum() + (out[1:] ** 2).sum()).backward()
        torch.testing.assert_close(first_a, h.grad[:1])
        torch.testing.assert_close(first_b, h.grad[1:])
        torch.testing.assert_close(a.grad, 2 * h.grad[:1])
        torch.testing.assert_close(b.grad, 2 * h.grad[1:])
        with model.trace(x[:1]):  # one invoke: the batch tensor itself, torch's own retain_grad
            one = model[1].output.save()
            one.retain_grad()
            out_one = model.output.save()
        out_one.sum().backward()
        torch.testing.assert_close(one.grad, h.grad[:1])

    def test_retain_grad_keeps_torchs_errors(self, seq):
        """Where torch refuses (a value computed without gradients) the message is torch's."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with pytest.raises(RuntimeError, match="retain_grad"):
            with torch.no_grad(), model.trace() as tracer:
                with tracer.invoke(x[:1]):
                    model[1].output.retain_grad()
                with tracer.invoke(x[1:]):
                    pass


class TestSeveralBackwards:
    def test_retain_graph_then_second_block(self, seq):
        x = torch.randn(2, 6)
        model = NNsight(seq)
        with model.trace(x):
            h1 = model[1].output
            out = model.output
            with out.sum().backward(retain_graph=True):
                ga = h1.grad.save()
            with (out ** 2).sum().backward():
                gb = h1.grad.save()
        ref = seq[1](seq[0](x))
        ref.retain_grad()
        o = seq[3](seq[2](ref))
        o.sum().backward(retain_graph=True)
        want_a = ref.grad.clone()
        ref.grad = None
        (o ** 2).sum().backward()
        torch.testing.assert_close(ga, want_a)
        torch.testing.assert_close(gb, ref.grad)

    def test_clip_one_modules_gradient_like_a_hook(self, seq):
        x = torch.randn(4, 6) * 10
        model = NNsight(seq)
        with model.trace(x):
            h2 = model[2].output
            with (model.output ** 2).sum().backward():
                h2.grad = h2.grad.clamp(-0.1, 0.1)
        got = [p.grad.clone() for p in seq.parameters()]
        seq.zero_grad()
        h = seq[2](seq[1](seq[0](x)))
        h.register_hook(lambda g: g.clamp(-0.1, 0.1))
        (seq[3](h) ** 2).sum().backward()
        for g, p in zip(got, seq.parameters()):
            torch.testing.assert_close(g, p.grad)

    def test_inference_mode_gives_gradient_error(self, seq):
        model = NNsight(seq)
        with pytest.raises(GradientError, match="inference_mode"):
            with torch.inference_mode():
                with model.trace(torch.randn(2, 6)):
                    loss = model.output.sum()
                    with loss.backward():
                        pass


def test_freezing_a_module_by_leaving_it_out_of_the_optimizer(seq):
    """Train through a trace with layer 1 left out of the optimizer: it stays unchanged and the
    others move exactly as in the same plain-PyTorch loop."""
    import copy

    plain = copy.deepcopy(seq)
    x, target = torch.randn(8, 6), torch.randn(8, 6)
    model = NNsight(seq)
    frozen = set(seq[1].parameters())
    opt = torch.optim.SGD([p for p in seq.parameters() if p not in frozen], lr=0.1)
    frozen_plain = set(plain[1].parameters())
    opt_plain = torch.optim.SGD([p for p in plain.parameters() if p not in frozen_plain], lr=0.1)
    before = seq[1].weight.detach().clone()
    for _ in range(3):
        with model.trace(x):
            loss = ((model.output - target) ** 2).mean()
            with loss.backward():
                pass
        opt.step()
        opt.zero_grad()
        ((plain(x) - target) ** 2).mean().backward()
        opt_plain.step()
        opt_plain.zero_grad()
    torch.testing.assert_close(seq[1].weight, before)
    for a, b in zip(seq.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b)


class TestFreedGraphAcrossInvokes:
    """A backward in each of two invokes frees the one graph they share: autograd's "backward
    through the graph a second time" becomes a GradientError naming the cause and the fix
    (nnsight's test_backward_errors)."""

    @staticmethod
    def _two(model, first_retain, second_retain):
        x0, x1 = torch.randn(2, 6), torch.randn(3, 6)
        with model.trace() as tracer:
            with tracer.invoke(x0):
                a = model[0].output
                with model.output.sum().backward(retain_graph=first_retain):
                    ga = a.grad.save()
            with tracer.invoke(x1):
                b = model[0].output
                with model.output.sum().backward(retain_graph=second_retain):
                    gb = b.grad.save()
        return x0, x1, ga, gb

    def test_the_error_names_the_shared_graph_and_the_fix(self, seq):
        """Neither backward retains: the second raises GradientError (a RuntimeError) at its
        `with` line, saying invokes share one graph and to pass retain_graph=True; with this
        call already retaining, it says the earlier one did not."""
        model = NNsight(seq)
        with pytest.raises(GradientError, match=r"share one autograd graph.*retain_graph=True") \
                as err:
            self._two(model, None, None)
        assert isinstance(err.value, RuntimeError)
        assert "test_backward.py" in str(err.value)
        assert isinstance(err.value.__cause__, RuntimeError)  # torch's own error, chained
        with pytest.raises(GradientError, match="the earlier one that did not"):
            self._two(model, None, True)

    def test_retaining_all_but_the_last_gives_each_invoke_its_gradient(self, seq):
        """The fix works: each invoke's gradient equals plain autograd on its rows alone."""
        model = NNsight(seq)
        x0, x1, ga, gb = self._two(model, True, None)
        for x, got in ((x0, ga), (x1, gb)):
            h = seq[0](x)
            h.retain_grad()
            seq[1:](h).sum().backward()
            torch.testing.assert_close(got, h.grad)

    def test_other_autograd_errors_are_not_reworded(self, seq):
        """A backward failing for another reason (a gradient of the wrong shape) raises
        torch's own RuntimeError, unchanged."""
        model = NNsight(seq)
        with pytest.raises(RuntimeError) as err:
            with model.trace(torch.randn(2, 6)):
                with model.output.sum().backward(gradient=torch.zeros(3, 3)):
                    pass
        assert not isinstance(err.value, GradientError)


class _NoInputGrad(torch.autograd.Function):
    """``x * w`` whose backward gives ``x`` no gradient (None), as a quantized Linear's does."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x)
        return x * w

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return None, (g * x).sum(0)


class _Gate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return _NoInputGrad.apply(x, self.w)


def _gated():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), _Gate(),
                               torch.nn.Tanh(), torch.nn.Linear(8, 3))


class TestNoneGradient:
    """Backprop can reach an activation with no gradient (None): the op that uses it gives it
    none (a dynamically quantized Linear, a custom Function returning None). torch hands its
    hooks None and leaves a retained ``.grad`` None; the body's ``h.grad`` raised
    "AttributeError: 'NoneType' object has no attribute 'clone'" from inside the backward (with
    or without source), and setting it "'NoneType' object has no attribute 'shape'"."""

    def _reference(self, net, x):
        h1 = net[1](net[0](x))
        h1.retain_grad()
        h3 = net[3](net[2](h1))
        h3.retain_grad()
        net[4](h3).sum().backward()
        return h1.grad, h3.grad, net[2].w.grad.clone()

    def test_the_grad_is_none_as_torch_leaves_it(self):
        net = _gated()
        x = torch.randn(2, 4)
        g1_ref, g3_ref, gw_ref = self._reference(net, x)
        assert g1_ref is None
        net.zero_grad()
        model = NNsight(net)
        with model.trace(x):
            a = model[1].output
            b = model[3].output
            loss = model.output.sum()
            with loss.backward():
                g3 = b.grad.save()
                g1 = nnsight_lite.save(a.grad)
        assert g1 is None
        assert torch.equal(g3, g3_ref)
        assert torch.equal(net[2].w.grad, gw_ref)

    def test_each_invokes_grad_is_none(self):
        net = _gated()
        x = torch.randn(2, 4)
        _, g3_ref, _ = self._reference(net, x)
        model = NNsight(net)
        with model.trace() as tracer:
            with tracer.invoke(x[:1]):
                a0 = model[1].output
                b0 = model[3].output
            with tracer.invoke(x[1:]):
                a1 = model[1].output
                b1 = model[3].output
                loss = model.output.sum()  # (this invoke's rows: row 1's gradients are the
                with loss.backward():  # whole batch's)
                    g3 = b1.grad.save()
                    grads = nnsight_lite.save([a1.grad, a0.grad])
        assert grads == [None, None]
        assert torch.equal(g3, g3_ref[1:])

    def test_setting_it_says_there_is_nothing_to_replace(self):
        net = _gated()
        model = NNsight(net)
        with pytest.raises(GradientError, match="reached it with no gradient"):
            with model.trace(torch.randn(2, 4)):
                a = model[1].output
                loss = model.output.sum()
                with loss.backward():
                    a.grad = torch.ones(2, 8)

    def test_without_source_too(self):
        net = _gated()
        x = torch.randn(2, 4)
        _, g3_ref, _ = self._reference(net, x)
        ns = {"model": NNsight(net), "x": x}
        exec(compile("with model.trace(x):\n    a = model[1].output\n    b = model[3].output\n"
                     "    loss = model.output.sum()\n"
                     "with loss.backward():\n    g3 = b.grad\n    g1 = a.grad\n",
                     "<string>", "exec"), ns)
        assert ns["g1"] is None
        assert torch.equal(ns["g3"], g3_ref)


class TestInPlaceEditBeforeBackward:
    """A body's in-place edit of an output that the model's backward needs (a Tanh's: its
    gradient is computed from its output) makes autograd raise its "modified by an inplace
    operation" RuntimeError; it stays torch's error, with a note saying to set a new value
    instead, and that way gives the gradient a hook replacing the value gives."""

    @staticmethod
    def _net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))

    @pytest.mark.parametrize("with_block", [True, False])
    def test_the_error_gets_a_note_saying_to_set_a_value(self, with_block):
        net = self._net()
        model = NNsight(net)
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as err:
            with model.trace(torch.randn(2, 6)):
                h = model[0].output
                model[1].output[:, 0] = 0
                loss = model.output.sum()
                if with_block:
                    with loss.backward():
                        g = h.grad.save()  # noqa: F841
                else:
                    loss.backward()
        assert type(err.value) is RuntimeError  # torch's own, not reworded
        notes = getattr(err.value, "__notes__", [])
        said = [n for n in notes if "Set a new value instead" in n]
        assert len(said) == 1 and "model.layer.output = h" in said[0], notes
        x = torch.randn(2, 6)
        torch.testing.assert_close(model(x), net(x))  # nothing left on the model

    def test_setting_an_edited_clone_gives_the_hooks_gradient(self):
        net = self._net()
        model = NNsight(net)
        x = torch.randn(2, 6)
        with model.trace(x):
            h0 = model[0].output
            h = model[1].output.clone()
            h[:, 0] = 0
            model[1].output = h
            with model.output.sum().backward():
                g = h0.grad.save()

        def zero_first(module, args, out):
            out = out.clone()
            out[:, 0] = 0
            return out

        handle = net[1].register_forward_hook(zero_first)
        try:
            ref = net[0](x)
            ref.retain_grad()
            net[2](net[1](ref)).sum().backward()
        finally:
            handle.remove()
        torch.testing.assert_close(g, ref.grad)

    def test_other_runtime_errors_get_no_such_note(self, seq):
        model = NNsight(seq)
        with pytest.raises(RuntimeError) as err:
            with model.trace(torch.randn(2, 6)):
                with model.output.sum().backward(gradient=torch.zeros(3, 3)):
                    pass
        assert not any("Set a new value" in n for n in getattr(err.value, "__notes__", []))
