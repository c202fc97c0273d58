"""Putting the counting wrappers on for a trace and taking them off (install.py).

From the second trace of a model on, the wrappers are swapped in with a few bulk operations;
every change the model may have had between traces must still be seen, and the module must be
left exactly as it was."""

from __future__ import annotations

import pytest
import torch

from nnsight_lite import NNsight, save
from nnsight_lite.errors import MissedModuleError
from tests.helpers import record


def _stack():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))


def _doubled_twice():
    """A fresh ``Double`` class (its own, so a test may change it), ``Sequential(Double())``,
    its NNsight wrapper and an input, after two traces (the second reuses the first's walk)
    that each saw the doubled output."""

    class Double(torch.nn.Module):
        def forward(self, x):
            return x * 2

    net = torch.nn.Sequential(Double())
    model = NNsight(net)
    x = torch.ones(2, 4)
    assert torch.equal(_trace_out(model, x, 0), x * 2)
    assert torch.equal(_trace_out(model, x, 0), x * 2)
    return Double, net, model, x


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

    def test_a_child_replaced_after_its_container_got_a_new_dict_is_traced(self):
        """``del seq[0:0]`` removes nothing but gives the Sequential a new ``_modules`` dict
        (torch rebuilds it); a child replaced after that goes into the new dict, and the next
        trace must see it (it kept comparing the old dict, and ran on the old tree for good)."""
        net = _stack()
        model = NNsight(net)
        x = torch.randn(2, 4)
        _trace_out(model, x, 2)
        _trace_out(model, x, 2)
        del net[0:0]
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
        Double, net, model, x = _doubled_twice()
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

    def test_a_module_class_swapped_between_traces_is_run(self):
        """``module.__class__ = Other`` between traces: the next trace runs Other's forward."""

        class Triple(torch.nn.Module):
            def forward(self, x):
                return x * 3

        _, net, model, x = _doubled_twice()
        net[0].__class__ = Triple
        assert torch.equal(_trace_out(model, x, 0), x * 3)


class _Gate(torch.nn.Module):
    """Runs ``inner`` ``times`` times (a number set between traces)."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.times = 3

    def forward(self, x):
        for _ in range(self.times):
            x = self.inner(x)
        return x


class TestCountsPerTrace:
    """Call counts start from zero in every trace, whatever the last trace counted."""

    def test_each_trace_counts_its_own_calls(self):
        """Reading calls 0-2 of a module run three times gives the same values trace after trace
        (equal to hooks), though the last trace left its counter at 3."""
        torch.manual_seed(0)
        net = _Gate()
        model = NNsight(net)
        x = torch.randn(2, 4)
        seen, _ = record(net, ["inner"], x)
        for _ in range(3):
            with model.trace(x):
                got = save([model.inner.output, model.inner.next().output,
                            model.inner.next().output])
            assert all(torch.equal(got[i], seen[("inner", i)]) for i in range(3))

    def test_a_module_that_ran_last_trace_but_not_now_is_reported(self):
        """A module that ran in the previous trace but not in this one is 'never ran', not
        'already ran' (its old count does not leak into the new trace)."""
        torch.manual_seed(0)
        net = _Gate()
        model = NNsight(net)
        x = torch.randn(2, 4)
        with model.trace(x):
            model.inner.output.save()
        net.times = 0
        with pytest.raises(MissedModuleError, match="never ran"):
            with model.trace(x):
                model.inner.output.save()
        net.times = 1
        with pytest.raises(MissedModuleError, match="ran only 1 time"):
            with model.trace(x):
                model.inner.next().output.save()


class _Direct(torch.nn.Module):
    """Calls its child through ``child.forward(x)`` (no ``__call__``), then as usual."""

    def __init__(self):
        super().__init__()
        self.child = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.child(self.child.forward(x))


class TestCallPaths:
    """A module call is counted once whichever way it is made: through ``module(...)`` (the
    call entry), ``module.forward(...)``, torch hooks, or a compiled call of the module's own."""

    def test_a_forward_called_directly_is_counted_with_the_others(self):
        """``child.forward(x)`` is call 0 and ``child(h)`` call 1: each serves its own value."""
        torch.manual_seed(0)
        net = _Direct()
        model = NNsight(net)
        x = torch.randn(2, 4)
        w, b = net.child.weight, net.child.bias
        first = torch.nn.functional.linear(x, w, b)
        second = torch.nn.functional.linear(first, w, b)
        for _ in range(2):  # (the second trace swaps the wrappers in all at once)
            with model.trace(x):
                got = save([model.child.output, model.child.next().output])
            assert torch.equal(got[0], first) and torch.equal(got[1], second)

    def test_a_hook_a_body_adds_runs_after_the_body_saw_the_output(self):
        """A forward hook registered from a body mid-trace runs on the module's next call; the
        body reads the output as forward returned it, and the model goes on with the hook's."""
        net = _stack()
        model = NNsight(net)
        x = torch.randn(2, 4)
        _trace_out(model, x, 2)
        with model.trace(x):
            handle = net[2].register_forward_hook(lambda m, i, o: o + 1)
            try:
                h = model[2].output.save()
                out = model.output.save()
            finally:
                handle.remove()
        plain = net(x)
        assert torch.equal(h, plain) and torch.equal(out, plain + 1)

    def test_global_module_hooks_run_and_see_every_call_once(self):
        """With a global forward hook set (``register_module_forward_hook``), each module's
        hook fires once per call in a trace, as in a plain forward."""
        net = _stack()
        model = NNsight(net)
        x = torch.randn(2, 4)
        fired = []
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, i, o: fired.append(m))
        try:
            net(x)
            plain = list(fired)
            for _ in range(2):
                fired.clear()
                h = _trace_out(model, x, 1)
                assert fired == plain
                assert torch.equal(h, torch.relu(net[0](x)))
        finally:
            handle.remove()

    def test_a_compiled_call_of_the_modules_own_is_used_and_kept(self):
        """A module with its own ``_compiled_call_impl`` (where ``module.compile()`` puts
        torch.compile's) still goes through it in a trace; bodies read the forward's output,
        and the module keeps its own entry afterwards."""
        net = _stack()
        mod = net[2]

        def doubled(*args, **kwargs):  # stands in for a compiled call: it changes the result
            return mod._call_impl(*args, **kwargs) * 2

        mod._compiled_call_impl = doubled
        model = NNsight(net)
        x = torch.randn(2, 4)
        try:
            for _ in range(2):
                with model.trace(x):
                    h = model[2].output.save()
                    out = model.output.save()
                inner = mod.forward(torch.relu(net[0](x)))
                assert torch.equal(h, inner) and torch.equal(out, inner * 2)
                assert mod.__dict__["_compiled_call_impl"] is doubled
        finally:
            del mod._compiled_call_impl

    def test_a_compiled_call_a_body_sets_is_kept_after_the_trace(self):
        """A body that compiles a module (``module.compile()`` sets the module's
        ``_compiled_call_impl``) keeps it after the trace, on the first trace (module by
        module) and on later ones (wrappers swapped all at once); the trace's own is gone."""
        net = _stack()
        mod = net[2]
        model = NNsight(net)
        x = torch.randn(2, 4)

        def mine(*args, **kwargs):  # stands in for torch.compile's
            return mod._call_impl(*args, **kwargs)

        try:
            for _ in range(3):
                with model.trace(x):
                    h = model[1].output.save()
                    mod._compiled_call_impl = mine
                assert mod.__dict__["_compiled_call_impl"] is mine
                assert torch.equal(h, torch.relu(net[0](x)))
                del mod._compiled_call_impl
                assert torch.equal(_trace_out(model, x, 2), net(x))
        finally:
            mod.__dict__.pop("_compiled_call_impl", None)


@pytest.mark.parametrize("where", ["body", "forward"])
def test_a_copy_made_while_a_trace_runs_is_a_plain_module(where):
    """``copy.deepcopy`` of a module while a trace of its model runs, in a body or in the
    model's own forward (a lazily made target network, as in BYOL or DQN code), makes a plain
    module: it computes with its own weights, in the trace and after it, and holds nothing of
    the trace (it kept each module's forward wrapper, which ran the original modules, and
    the next plain call of the model raised).
    ``pickle`` of the model in a body works too (it raised "Can't pickle local object")."""
    import copy
    import pickle

    torch.manual_seed(0)

    class Twin(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.online = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
            self.target = None

        def forward(self, x):
            if self.target is None and where == "forward":
                self.target = copy.deepcopy(self.online)
                with torch.no_grad():
                    for p in self.target.parameters():
                        p.mul_(2)
            out = self.online(x)
            return out if self.target is None else out + self.target(x)

    net = Twin()
    model = NNsight(net)
    x = torch.randn(3, 4)
    with model.trace(x):
        first = model.online.output.save()
        if where == "body":
            copied = save(copy.deepcopy(net.online))
            blob = save(pickle.dumps(net.online))
            with torch.no_grad():
                for p in copied.parameters():
                    p.zero_()
            in_body = save(copied(x))
        out = model.output.save()
    leftovers = [n for n, m in net.named_modules() if "forward" in m.__dict__]
    if where == "body":
        assert torch.equal(in_body, torch.zeros(3, 4)) and torch.equal(copied(x), in_body)
        assert "forward" not in copied.__dict__
        again = pickle.loads(blob)
        assert torch.equal(again(x), net.online(x))
        torch.testing.assert_close(out, net.online(x))
    else:
        target = net.target
        assert all("forward" not in m.__dict__ for m in target.modules())
        torch.testing.assert_close(out, net.online(x) + target(x))
        torch.testing.assert_close(target(x), torch.tanh(x @ (2 * net.online[0].weight).T
                                                        + 2 * net.online[0].bias))
    assert leftovers == []
    torch.testing.assert_close(first, net.online(x))
    with model.trace(x):
        out = model.output.save()
    torch.testing.assert_close(out, net(x))
