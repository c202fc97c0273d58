"""Traces in Jupyter cells, through a real IPython kernel (ipykernel via jupyter_client).

Each cell's claims are checked inside the kernel against plain PyTorch (a forward hook, a
second plain forward); the test fails when the cell raises, and checks afterwards that the
kernel holds no hook, wrapper, suspended body or changed torch mode.
"""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

GROUND_TRUTH = """
def plain(inp, edit=None):
    '''net's forward with plain hooks: (ReLU output, logits), optionally editing the ReLU.'''
    seen = {}
    def hook(m, i, o):
        seen['h'] = o.clone()
        return edit(o.clone()) if edit else None
    handle = net[1].register_forward_hook(hook)
    try:
        return seen, net(inp)
    finally:
        handle.remove()
"""


@pytest.fixture(scope="module")
def k(kernel):
    kernel.check(GROUND_TRUTH)
    return kernel


class TestCells:
    def test_plain_cell_binds_saved_names_only(self, k):
        """A trace in a plain cell: saved names appear in the namespace, unsaved ones do not,
        and the values equal plain hooks."""
        k.check("""
with model.trace(x):
    scratch_a = model[0].output
    hidden_a = model[1].output.save()
    logits_a = model.output.save()
seen, out = plain(x)
assert torch.equal(hidden_a, seen['h']) and torch.equal(logits_a, out)
""")
        names = k.check("print('hidden_a' in globals(), 'logits_a' in globals(), 'scratch_a' in globals())")
        assert names.stdout.split() == ["True", "True", "False"]
        assert k.clean() == []

    def test_function_from_an_earlier_cell(self, k):
        """A trace inside a function defined in an earlier cell runs when a later cell calls it,
        with the function's arguments and closure."""
        k.check("""
def probe(inp, scale):
    with model.trace(inp):
        model[1].output[:] = model[1].output * scale
        out = model.output.save()
    return out
""")
        k.check("""
got = probe(x * 2, 3.0)
_, want = plain(x * 2, edit=lambda h: h * 3.0)
assert torch.allclose(got, want)
""")
        assert k.clean() == []

    def test_re_executed_cell_and_edited_cell(self, k):
        """Running the same cell again runs its trace again (with the current inputs); an edited
        version of the cell runs its new body, not the old one."""
        cell = """
with model.trace(x_re):
    out_re = model.output.save()
print(torch.allclose(out_re, net(x_re)))
"""
        for seed in (1, 2):
            k.check(f"x_re = torch.randn(5, 4, generator=torch.Generator().manual_seed({seed}))")
            assert k.check(cell).stdout.strip() == "True"
        edited = cell.replace("model.output.save()", "(model.output * 0).save()")
        assert k.check(edited).stdout.strip() == "False"
        assert k.check("print(bool((out_re == 0).all()))").stdout.strip() == "True"
        assert k.clean() == []

    def test_time_magic(self, k):
        """A trace in a %%time cell runs, prints the timing, and binds its saved names."""
        cell = k.check("""%%time
with model.trace(x):
    model[1].output[:, 0] = 0
    out_time = model.output.save()
""")
        assert "Wall time" in cell.stdout
        k.check("""
def zero_first(h):
    h[:, 0] = 0
    return h
assert torch.allclose(out_time, plain(x, edit=zero_first)[1])
""")
        assert k.clean() == []

    def test_capture_magic(self, k):
        """A trace in a %%capture cell runs; what the body prints is captured, not shown, and
        saved names are bound."""
        cell = k.check("""%%capture captured
with model.trace(x):
    print("inside the body", model[1].output.shape)
    out_capture = model.output.save()
""")
        assert cell.stdout == ""
        shown = k.check("print(captured.stdout.strip()); assert torch.equal(out_capture, net(x))")
        assert shown.stdout.strip() == "inside the body torch.Size([3, 8])"
        assert k.clean() == []

    def test_loop_over_prompts(self, k):
        """A loop over inputs in one cell: one trace per input, each saved value its own."""
        k.check("""
inputs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(s)) for s in range(5)]
maxima = []
for inp in inputs:
    with model.trace(inp):
        top = model.output.max().save()
    maxima.append(top)
assert [float(m) for m in maxima] == [float(net(inp).max()) for inp in inputs]
""")
        assert k.clean() == []

    def test_cell_that_also_defines_a_class(self, k):
        """A cell that defines a class (whose method and body both trace) and traces at top
        level runs every trace."""
        k.check("""
class Probe:
    with model.trace(x):
        at_class = model[1].output.sum().save()   # a trace in a class body
    def __init__(self, layer):
        self.layer = layer
    def read(self, inp):
        with model.trace(inp):
            got = model[self.layer].output.save()
        return got

with model.trace(x):
    top_level = model.output.save()
probe = Probe(2)
assert torch.equal(probe.read(x), net(x)) and torch.equal(top_level, net(x))
assert torch.equal(Probe.at_class, net[1](net[0](x)).sum())
""")
        assert k.clean() == []


AUTORELOADED = """
def probe(model, x):
    with model.trace(x):
        h = model[1].output.save()
    return h


class Prober:
    def __init__(self, model):
        self.model = model

    def read(self, x):
        with self.model.trace(x):
            h = self.model[1].output.save()
        return h
"""


class TestAutoreload:
    def test_functions_edited_under_autoreload_run_their_new_bodies(self, fresh_kernel, tmp_path):
        """With `%autoreload 2` (IPython 9 recompiles an edited function from its definition
        alone; IPython 8, the last for Python 3.10, reloads the whole module), a function and a
        method of an object made before the edit run their edited trace bodies, checked against
        a plain hook."""
        k = fresh_kernel
        (tmp_path / "helpers_nb.py").write_text(AUTORELOADED)
        k.check(GROUND_TRUTH)
        k.check(f"import sys, os; sys.path.insert(0, {str(tmp_path)!r})")
        k.check("%load_ext autoreload\n%autoreload 2")
        k.check("""
import helpers_nb
prober = helpers_nb.Prober(model)
assert torch.equal(helpers_nb.probe(model, x), plain(x)[0]['h'])
assert torch.equal(prober.read(x), plain(x)[0]['h'])
""")
        k.check("pass")  # (autoreload records a module's source before the cell after its import)
        path = tmp_path / "helpers_nb.py"
        path.write_text(AUTORELOADED.replace("output.save()", "output.mul(2).save()"))
        later = os.stat(path).st_mtime + 5
        os.utime(path, (later, later))  # (autoreload compares modification times)
        k.check("""
import IPython  # IPython 9: recompiled from the def alone; 8: the module reloaded (line 2)
assert helpers_nb.probe.__code__.co_firstlineno == (1 if IPython.version_info[0] >= 9 else 2)
assert torch.equal(helpers_nb.probe(model, x), 2 * plain(x)[0]['h'])
assert torch.equal(prober.read(x), 2 * plain(x)[0]['h'])
""")
        assert k.clean() == []


class TestErrors:
    def test_error_shows_the_cell_line_then_the_next_cell_works(self, k):
        """An exception in a body reaches the cell unchanged, its traceback shows the cell's own
        line and no runtime frame; the next cell's trace is exact and nothing is left behind."""
        cell = k.run("""
with model.trace(x):
    h = model[1].output
    ratio = h.sum() / undefined_name_in_body
""")
        assert cell.error is not None and cell.error["ename"] == "NameError"
        tb = cell.error["traceback"]
        assert "line 3" in tb
        assert "ratio = h.sum() / undefined_name_in_body" in tb
        assert "nnsight_lite" not in tb and "greenlet" not in tb
        assert k.clean() == []
        k.check("""
with model.trace(x):
    model[1].output[:] = model[1].output + 1
    after_error = model.output.save()
assert torch.equal(after_error, plain(x, edit=lambda h: h + 1)[1])
""")

    def test_library_error_names_the_cell_line(self, k):
        """A library error (reading modules out of order) names the cell's line and says what
        to do; the model is clean after it."""
        cell = k.run("""
with model.trace(x):
    late = model[2].output
    early = model[0].output
""")
        assert cell.error["ename"] == "OutOfOrderError"
        assert "early = model[0].output" in cell.error["traceback"]
        assert ":3" in cell.error["evalue"] and "model.0" in cell.error["evalue"].replace("[", ".").replace("]", "")
        assert k.clean() == []

    def test_a_block_that_cannot_run_shows_the_cell_line_only(self, k):
        """An error raised while entering a block (here `__enter__()` called without a `with`)
        shows the cell's line, not the runtime's source lookup."""
        cell = k.run("tracer_entered = model.trace(x).__enter__()")
        assert cell.error["ename"] == "WithBlockNotFoundError"
        tb = cell.error["traceback"]
        assert "tracer_entered = model.trace(x).__enter__()" in tb
        assert "nnsight_lite" not in tb.split("WithBlockNotFoundError: ")[0].split("Traceback")[-1]
        assert k.clean() == []


SLOW_MODEL = """
import time

class Slow(torch.nn.Module):
    '''Sleeps in its forward while it is told to (and says so), then doubles its input.'''
    def __init__(self):
        super().__init__()
        self.sleep = 0.0
    def forward(self, h):
        if self.sleep:
            print("in the slow forward", flush=True)
            time.sleep(self.sleep)
        return h * 2

torch.manual_seed(0)
slow_net = torch.nn.Sequential(torch.nn.Linear(4, 8), Slow(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2))
slow_model = NNsight(slow_net)
"""

EXACT_AFTER = """
slow_net[1].sleep = 0.0
with slow_model.trace(x):
    mid = slow_model[2].output.save()
    slow_model[3].output[:] = 0
    out_after = slow_model.output.save()
seen = {}
handle = slow_net[2].register_forward_hook(lambda m, i, o: seen.update(mid=o.clone()))
plain_out = slow_net(x)
handle.remove()
assert torch.equal(mid, seen['mid'])
assert torch.equal(out_after, slow_net[4](torch.zeros(3, 8)))
with slow_model.trace(x):
    untouched = slow_model.output.save()
assert torch.equal(untouched, plain_out)
print("exact")
"""


class TestInterrupt:
    def test_sigint_during_a_long_forward_leaves_the_model_clean(self, fresh_kernel):
        """SIGINT sent through the kernel manager while the forward runs (a body edited an
        earlier module and waits for a later one) stops the cell with KeyboardInterrupt; no
        wrapper, hook or suspended body is left, and the next traces are exact."""
        k = fresh_kernel
        k.check(SLOW_MODEL)
        cell = k.run("""
slow_net[1].sleep = 30.0
with slow_model.trace(x):
    slow_model[0].output[:] = 1
    never = slow_model[4].output.save()
""", interrupt_after="in the slow forward", delay=0.3, timeout=25)
        assert cell.error is not None and cell.error["ename"] == "KeyboardInterrupt"
        assert "never" not in k.check("print(sorted(globals()))").stdout
        assert k.clean() == []
        assert k.check(EXACT_AFTER).stdout.strip() == "exact"
        assert k.clean() == []

    def test_sigint_in_a_loop_of_traces_leaves_the_model_clean(self, fresh_kernel):
        """SIGINT at whatever point a busy loop of traces (with edits, saves and a backward
        block) has reached leaves nothing behind, three times over; the next trace is exact."""
        k = fresh_kernel
        k.check(SLOW_MODEL)
        for attempt, delay in enumerate((0.05, 0.21, 0.43)):
            cell = k.run("""
print("looping", flush=True)
for i in range(10**6):
    with slow_model.trace(x):
        h = slow_model[0].output
        slow_model[2].output[:] = slow_model[2].output * 1.5
        out = slow_model.output
        with out.sum().backward():
            g = h.grad.save()
        last = out.save()
""", interrupt_after="looping", delay=delay, timeout=30)
            # (IPython may fail to format a traceback interrupted at a line-less instruction,
            # "Unexpected exception formatting exception": then the interrupt is on stderr)
            interrupted = cell.error is not None and cell.error["ename"] == "KeyboardInterrupt"
            assert interrupted or "KeyboardInterrupt" in cell.stderr, (attempt, cell)
            assert k.clean() == [], attempt
        assert k.check(EXACT_AFTER).stdout.strip() == "exact"


class TestReprs:
    def test_print_model_and_envoy_repr_and_saved_tensor_repr(self, k):
        """print(model) shows the module tree; an Envoy's repr is its module's; a saved tensor
        displays as the tensor it is."""
        printed = k.check("print(model)").stdout
        assert printed == k.check("print(net)").stdout
        assert "(0): Linear(in_features=4, out_features=8, bias=True)" in printed
        envoy = k.check("model[2]").text
        assert envoy == "Linear(in_features=8, out_features=2, bias=True)"
        k.check("""
with model.trace(x):
    shown = model.output.save()
""")
        assert k.check("type(shown).__name__").text == "'Tensor'"
        assert k.check("shown").text == k.check("net(x)").text
        assert k.check("shown").text.startswith("tensor([[")
