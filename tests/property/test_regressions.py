"""Minimal repros of what the property suite found, kept as ordinary tests.

Open bugs are ``xfail(strict=True)``: when one is fixed the test XPASSes, fails the run, and the
marker should be removed. One is open, a known gap (README).
"""

from __future__ import annotations

import greenlet
import pytest
import torch

import nnsight_lite  # noqa: F401  (patches Tensor.backward)
from nnsight_lite import NNsight


def _seq():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))


def test_invoke_body_sees_its_own_loop_variable():
    """Found writing property 4: the natural loop over invokes read the wrong ``i`` (fixed: each
    invoke sees the trace body's names as they were when the invoke block ended)."""
    model = NNsight(_seq())
    xs = [torch.randn(1, 3), torch.randn(2, 3)]
    seen = []
    with model.trace() as tracer:
        for i, x in enumerate(xs):
            with tracer.invoke(x):
                seen.append((i, model[0].output.shape[0]))
    assert seen == [(0, 1), (1, 2)]  # was [(1, 1), (1, 2)]


def test_invokes_binding_the_same_name_keep_their_own_value():
    """Follows from the loop-variable bug: two invokes binding `h` and reading it again after
    waiting used to see each other's `h` (the other invoke's rows)."""
    seq = _seq()
    model = NNsight(seq)
    x1, x2 = torch.randn(1, 3), torch.randn(2, 3)
    with model.trace() as tracer:
        with tracer.invoke(x1):
            h = model[0].output
            model[1].output = h * 1.0
            a = model.output.save()
        with tracer.invoke(x2):
            h = model[0].output
            model[1].output = h * 1.0
            b = model.output.save()
    torch.testing.assert_close(a, seq[0](x1))
    torch.testing.assert_close(b, seq[0](x2))


def test_greenlet_exit_raised_in_trace_body_reaches_caller():
    """Found probing property 6 (fixed by the pooled-worker interleaver): a body raising
    GreenletExit used to end the trace silently."""
    model = NNsight(_seq())
    err = greenlet.GreenletExit("mine")
    with pytest.raises(greenlet.GreenletExit) as info:
        with model.trace(torch.randn(2, 3)):
            h = model[0].output
            raise err
    assert info.value is err


def test_greenlet_exit_raised_in_backward_body_reaches_caller():
    """Found probing property 6: the backward body's GreenletExit was swallowed (fixed: only the
    exit the library throws in itself is)."""
    a = torch.randn(3, requires_grad=True)
    b = a * 2
    with pytest.raises(greenlet.GreenletExit):
        with (b ** 2).sum().backward():
            g = b.grad
            raise greenlet.GreenletExit("mine")


@pytest.mark.xfail(strict=True, reason="Known gap (README): a replacement by one invoke gives "
                   "the batch a new tensor, so another invoke's in-place edit of it misses the "
                   "value it aliases in the plain forward")
def test_inplace_edit_of_an_aliasing_output_beside_another_invokes_replacement():
    """Found by the invoke-cache property: invoke 1 zeroes an eval-mode dropout's output in
    place, which in its own trace (and in plain hooks) zeroes the dropout's input too, reused
    by the residual; beside invoke 0's replacement of that output it reaches a copy only."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.drop = torch.nn.Dropout(0.1)

        def forward(self, x):
            h = self.lin(x)
            return self.drop(h) + h  # eval: drop(h) is h itself

    torch.manual_seed(0)
    net = Net().eval()
    x0, x1 = torch.randn(1, 2), torch.randn(1, 2)
    hook = net.drop.register_forward_hook(lambda m, i, o: o.zero_())
    try:
        want = net(x1)  # the in-place edit done by a plain hook
    finally:
        hook.remove()
    model = NNsight(net)
    with model.trace() as tracer:
        with tracer.invoke(x0):
            model.drop.output = model.drop.output * 0
        with tracer.invoke(x1):
            model.drop.output[:] = 0
            got = model.output.save()
    torch.testing.assert_close(got, want)
