"""Putting the counting wrappers on for a trace and taking them off (interleaver._install).

From the second trace of a model on, the wrappers are swapped in with a few bulk operations;
every change the model may have had between traces must still be seen, and the module must be
left exactly as it was."""

from __future__ import annotations

import torch

from nnsight_lite import NNsight
from tests.helpers import record


def _stack():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))


def _trace_out(model, x, i):
    with model.trace(x):
        h = model[i].output.save()
    return h


class TestBetweenTraces:
    """Each trace sees the model as it is now, after traces that reused the last one's walk."""

    def test_module_dicts_are_left_as_they_were(self):
        """After several traces no module's ``__dict__`` has gained or lost a key."""
        net = _stack()
        before = [dict(m.__dict__) for m in net.modules()]
        model = NNsight(net)
        x = torch.randn(2, 4)
        for _ in range(3):
            _trace_out(model, x, 2)
        after = [dict(m.__dict__) for m in net.modules()]
        assert [d.keys() for d in after] == [d.keys() for d in before]

    def test_a_replaced_child_is_traced(self):
        """A child replaced between traces is wrapped and served (equals a hook on it)."""
        net = _stack()
        model = NNsight(net)
        x = torch.randn(2, 4)
        _trace_out(model, x, 2)
        _trace_out(model, x, 2)
        net[2] = torch.nn.Linear(4, 4)
        got = _trace_out(model, x, 2)
        seen, _ = record(net, ["2"], x)
        assert torch.equal(got, seen[("2", 0)])

    def test_a_renamed_child_is_found_by_its_new_name(self):
        """A child moved to a new name between traces is reached by that name."""
        torch.manual_seed(0)

        class Holder(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Linear(4, 4)

            def forward(self, x):
                return next(iter(self._modules.values()))(x)

        net = Holder()
        model = NNsight(net)
        x = torch.randn(2, 4)
        for _ in range(2):
            with model.trace(x):
                h = model.a.output.save()
        child = net.a
        del net.a
        net.b = child
        with model.trace(x):
            h = model.b.output.save()
        assert torch.equal(h, child(x))

    def test_a_class_forward_replaced_between_traces_is_run(self):
        """Replacing a class's ``forward`` between traces changes what the next trace runs."""

        class Double(torch.nn.Module):
            def forward(self, x):
                return x * 2

        net = torch.nn.Sequential(Double())
        model = NNsight(net)
        x = torch.ones(2, 4)
        assert torch.equal(_trace_out(model, x, 0), x * 2)
        assert torch.equal(_trace_out(model, x, 0), x * 2)
        Double.forward = lambda self, x: x * 3
        assert torch.equal(_trace_out(model, x, 0), x * 3)

    def test_an_instance_forward_set_between_traces_is_run_and_kept(self):
        """A ``forward`` set on the instance between traces (as accelerate's hooks do) runs in
        the next trace and is the module's forward again after it."""
        net = _stack()
        model = NNsight(net)
        x = torch.randn(2, 4)
        _trace_out(model, x, 2)
        _trace_out(model, x, 2)
        plain = net[2].forward

        def patched(inp):
            return plain(inp) + 1

        net[2].forward = patched
        got = _trace_out(model, x, 2)
        assert torch.equal(got, net(x))
        assert net[2].__dict__["forward"] is patched
        del net[2].forward
        assert torch.equal(_trace_out(model, x, 2), net(x))
        assert "forward" not in net[2].__dict__
