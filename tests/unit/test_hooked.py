"""``envoy(x, hook=True)`` from a body: the trace sees the call (nnsight 0.8's way to observe an
attached module applied in an edit or an invoke). Ground truth: the same modules run plainly."""

from __future__ import annotations

import pytest
import torch

from nnsight_lite import NNsight, OutOfOrderError


class Aux(torch.nn.Module):
    """An SAE-like attachment: ``up`` then ``down``."""

    def __init__(self, d=4, k=6):
        super().__init__()
        self.up = torch.nn.Linear(d, k)
        self.down = torch.nn.Linear(k, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.fixture
def parts():
    """A two-layer net with ``Aux`` attached to its first layer (not used by the forward)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    aux = Aux()
    net[0].aux = aux
    return net, aux, torch.randn(3, 4)


def _plain(net, aux, x):
    """Ground truth for layer 0's output replaced by ``aux`` of it: aux.up's output, layer 0's
    new output and the model's output."""
    with torch.no_grad():
        h0 = net[0](x)
        up = aux.up(h0)
        new = aux(h0)
        return up, new, net[1](new)


def test_an_edit_applying_an_attached_module_lets_the_trace_read_its_internals(parts):
    """An edit replaces layer 0's output with ``aux(h, hook=True)``; the trace's body then
    reads ``aux.up.output`` (served by the edit's call) and sees the edited output downstream."""
    net, aux, x = parts
    model = NNsight(net)
    with model.edit(inplace=True):
        model[0].output = model[0].aux(model[0].output, hook=True)
    try:
        with model.trace(x):
            up = model[0].aux.up.output.save()
            h0 = model[0].output.save()
            out = model.output.save()
    finally:
        model.clear_edits()
    want_up, want_h0, want_out = _plain(net, aux, x)
    assert torch.allclose(up, want_up) and torch.allclose(h0, want_h0)
    assert torch.allclose(out, want_out)


def test_an_empty_invoke_reads_what_another_invokes_hooked_call_computed(parts):
    """One invoke applies the attachment with ``hook=True``; a later empty invoke reads its
    internals and the replaced value, as nnsight 0.8 serves them."""
    net, aux, x = parts
    model = NNsight(net)
    with model.trace() as tracer:
        with tracer.invoke(x):
            model[0].output = model[0].aux(model[0].output, hook=True)
        with tracer.invoke():
            up = model[0].aux.up.output.save()
            out = model.output.save()
    want_up, _, want_out = _plain(net, aux, x)
    assert torch.allclose(up, want_up) and torch.allclose(out, want_out)


def test_a_body_cannot_read_the_internals_of_its_own_hooked_call(parts):
    """The call ran before the body asked for its internals: OutOfOrderError, as in nnsight."""
    net, aux, x = parts
    model = NNsight(net)
    with pytest.raises(OutOfOrderError, match=r"aux\.up"):
        with model.trace(x):
            model[0].aux(model[0].output, hook=True)
            model[0].aux.up.output


def test_without_hook_the_call_is_not_served(parts):
    """A plain call from a body (the logit-lens kind) is not one of the trace's calls: the
    edit's plain call leaves ``aux.up`` with no call for the trace to read."""
    net, aux, x = parts
    model = NNsight(net)
    with model.trace() as tracer:
        with tracer.invoke(x):
            new = model[0].aux(model[0].output).save()
        with tracer.invoke():
            calls = model.output.save()
    _, want_new, _ = _plain(net, aux, x)
    assert torch.allclose(new, want_new)
    assert torch.allclose(calls, net(x))  # the plain call replaced nothing


def test_outside_a_trace_hook_true_is_an_ordinary_call(parts):
    """Outside any trace ``envoy(x, hook=True)`` calls the module, as without ``hook``."""
    net, aux, x = parts
    model = NNsight(net)
    with torch.no_grad():
        assert torch.equal(model[0].aux(x, hook=True), aux(x))


def test_an_error_in_a_hooked_call_is_raised_at_the_bodys_line(parts):
    """What the module raises reaches the user from the line that called it, unwrapped."""
    net, aux, x = parts
    model = NNsight(net)
    with pytest.raises(RuntimeError, match=r"shapes cannot be multiplied") as info:
        with model.trace(x):
            model[0].aux(torch.randn(3, 5), hook=True)  # the line that fails
    lines = [f.line for f in __import__("traceback").extract_tb(info.value.__traceback__)]
    assert any("the line that fails" in (ln or "") for ln in lines)


def test_a_hooked_call_at_each_call_of_a_reused_module(parts):
    """An edit replaces both calls of a module the forward calls twice (like two generation
    steps; ``.next()`` for the second) by hooked calls; the trace reads the attachment's
    internals at each of its own calls."""
    torch.manual_seed(0)

    class Twice(torch.nn.Module):  # calls layer 0 twice per forward, like two steps
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net[1](self.net[0](self.net[0](x)))

    net, aux, x = parts
    model = NNsight(Twice(net))
    with model.edit(inplace=True):
        layer = model.net[0]
        layer.output = layer.aux(layer.output, hook=True)
        layer.next()
        layer.output = layer.aux(layer.output, hook=True)
    ups = []
    try:
        with model.trace(x) as tracer:
            for _ in tracer.iter[:2]:
                ups.append(model.net[0].aux.up.output.save())
            out = model.output.save()
    finally:
        model.clear_edits()
    with torch.no_grad():
        a = aux(net[0](x))
        b = aux(net[0](a))
        want = [aux.up(net[0](x)), aux.up(net[0](a))]
        want_out = net[1](b)
    assert all(torch.allclose(u, w) for u, w in zip(ups, want, strict=True))
    assert torch.allclose(out, want_out)


def test_a_stop_inside_an_edits_hooked_call_ends_the_trace_quietly(parts):
    """nnsight's SAE-evaluation tutorial: an edit runs the attached module alongside the model
    (``model.layer.sae(model.layer.output, hook=True)``, result discarded) and each trace reads
    the module's internals, then calls ``tracer.stop()``, which ends the forward inside the
    edit's call. The trace ends with the value read, the model is unchanged by the edit, and
    the edit's body (cut at its call, its later reads too) ends silently, as in nnsight. Found
    by a docs hunt: it raised TypeError 'cannot unpack non-iterable ModuleCall object'."""
    net, aux, x = parts
    up, _, _ = _plain(net, aux, x)
    model = NNsight(net)
    with model.edit(inplace=True):
        model[0].aux(model[0].output, hook=True)
        model[1].output[:] = 0  # (cut by the stop: never reached)
    for _ in range(2):
        with torch.no_grad(), model.trace(x) as tracer:
            got = model[0].aux.up.output.save()
            tracer.stop()
        torch.testing.assert_close(got, up)
    model.clear_edits()
    with model.edit(inplace=True):
        model[0].aux(model[0].output, hook=True)
    with torch.no_grad(), model.trace(x):
        out = model.output.save()
    torch.testing.assert_close(out, net(x))  # the discarded call changes nothing
