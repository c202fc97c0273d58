"""Code with no source at all (piped stdin, exec of a bare string): a trace given inputs runs
its body in place, the forward on a greenlet of its own; invokes give a clear error."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from nnsight_lite import NNsight
from nnsight_lite.errors import NoSourceError

SETUP = textwrap.dedent("""
    import torch
    from nnsight_lite import NNsight
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model = NNsight(net)
    x = torch.randn(3, 4)
    clean = lambda: all("forward" not in m.__dict__ for m in net.modules())
""")

READ_AND_EDIT = textwrap.dedent("""
    with model.trace(x):
        h = model[0].output.save()
        model[1].output[:] = 0
        out = model.output.save()
    seen = {}
    h1 = net[0].register_forward_hook(lambda m, i, o: seen.setdefault("h", o.detach().clone()))
    h2 = net[1].register_forward_hook(lambda m, i, o: torch.zeros_like(o))
    ref = net(x)
    h1.remove(); h2.remove()
    verdict = torch.equal(h, seen["h"]) and torch.equal(out, ref) and clean()
    print("READ-EDIT", verdict)
""")

BODY_ERROR = textwrap.dedent("""
    try:
        with model.trace(x):
            a = model[0].output
            raise ValueError("boom")
    except ValueError as e:
        print("BODY-ERROR", str(e) == "boom" and clean())
""")

INVOKES = textwrap.dedent("""
    try:
        with model.trace() as tracer:
            with tracer.invoke(x):
                h = model[0].output.save()
    except Exception as e:
        print("INVOKES", type(e).__name__, "invoke" in str(e) and "Jupyter" in str(e) and clean())
""")


BACKWARD = textwrap.dedent("""
    with model.trace(x):
        h = model[0].output.save()
        out = model.output.save()
    net.zero_grad()
    with out.sum().backward():
        g = h.grad.clone()
        h.grad[:] = 0
    w_grad = net[0].weight.grad.clone()
    h2 = net[0](x)
    h2.retain_grad()
    net.zero_grad()
    net[2](net[1](h2)).sum().backward()
    verdict = (torch.equal(g, h2.grad) and torch.count_nonzero(w_grad).item() == 0
               and "grad" not in torch.Tensor.__dict__ and clean())
    print("BACKWARD", verdict)
""")


def run_piped(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True,
                          timeout=180)


def test_piped_stdin_trace_reads_edits_and_cleans_up():
    """Piped into `python -`: a trace given inputs reads and edits like plain hooks do; a body
    raising leaves no wrapper; a trace with invokes gives the clear no-source error; a
    backward block reads a gradient as plain autograd gives it, and its edit (zeroing it)
    reaches the first layer's weight gradient."""
    proc = run_piped(SETUP + READ_AND_EDIT + BODY_ERROR + INVOKES + BACKWARD)
    assert proc.returncode == 0, proc.stderr
    assert "BACKWARD True" in proc.stdout
    assert "READ-EDIT True" in proc.stdout
    assert "BODY-ERROR True" in proc.stdout
    assert "INVOKES NoSourceError True" in proc.stdout


def _exec(src: str, ns: dict) -> None:
    exec(compile(src, "<string>", "exec"), ns)


@pytest.fixture
def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _clean(net) -> bool:
    return all("forward" not in m.__dict__ for m in net.modules())


def test_exec_string_trace_runs_in_place(net):
    """exec of a bare string: the body runs in place, reading and editing the real values;
    every name it binds stays bound (saved or not)."""
    x = torch.randn(3, 4)
    ns = {"model": NNsight(net), "x": x}
    _exec("with model.trace(x):\n    h = model[0].output.save()\n    tmp = model[1].output\n"
          "    model[1].output[:] = 0\n    out = model.output.save()\n", ns)
    seen = {}
    h1 = net[0].register_forward_hook(lambda m, i, o: seen.setdefault("h", o.detach().clone()))
    h2 = net[1].register_forward_hook(lambda m, i, o: torch.zeros_like(o))
    ref = net(x)
    h1.remove()
    h2.remove()
    assert torch.equal(ns["h"], seen["h"])
    assert torch.equal(ns["out"], ref)
    assert "tmp" in ns
    assert _clean(net)


def test_exec_string_body_error_leaves_model_clean(net):
    """A body raising mid-trace: the error reaches the caller and no wrapper is left."""
    ns = {"model": NNsight(net), "x": torch.randn(3, 4)}
    with pytest.raises(ValueError, match="boom"):
        _exec("with model.trace(x):\n    a = model[0].output\n    raise ValueError('boom')\n", ns)
    assert _clean(net)


def test_exec_string_stop_and_missed_module(net):
    """tracer.stop() ends the forward and keeps what was read; a module read out of order
    gives the usual error; the model is clean after both."""
    from nnsight_lite.errors import OutOfOrderError

    x = torch.randn(3, 4)
    ns = {"model": NNsight(net), "x": x}
    _exec("with model.trace(x) as tr:\n    a = model[0].output.save()\n    tr.stop()\n", ns)
    assert torch.equal(ns["a"], net[0](x))
    with pytest.raises(OutOfOrderError, match="has already run that call"):
        _exec("with model.trace(x):\n    b = model[2].output\n    a = model[0].output\n", ns)
    assert _clean(net)


def test_exec_string_invokes_raise_clear_error(net):
    """A trace without inputs (several invokes) cannot run in place: NoSourceError says why
    and what to do."""
    ns = {"model": NNsight(net), "x": torch.randn(3, 4)}
    with pytest.raises(NoSourceError, match="several invokes.*") as info:
        _exec("with model.trace() as tr:\n    with tr.invoke(x):\n        h = model.output\n", ns)
    assert "Jupyter" in str(info.value) and "python -c" in str(info.value)
    assert _clean(net)


def test_exec_string_remote_trace_raises_instead_of_running_here(net):
    """A remote trace ships its block's source, so without source it cannot run: exec of a
    bare string with remote="local" raises NoSourceError saying so; it does not run the body
    here in place (the model's forward never runs, nothing is bound)."""
    calls = []
    hook = net.register_forward_hook(lambda m, i, o: calls.append(1))
    ns = {"model": NNsight(net), "x": torch.randn(3, 4)}
    try:
        with pytest.raises(NoSourceError, match=r"the trace is remote \(remote=") as info:
            _exec("with model.trace(x, remote='local'):\n    out = model.output.save()\n", ns)
    finally:
        hook.remove()
    assert "Jupyter" in str(info.value)
    assert calls == [] and "out" not in ns
    assert _clean(net)


def test_source_that_does_not_match_still_raises(net):
    """Source that exists but is other code is not 'no source': it still raises."""
    import linecache

    from nnsight_lite import SourceUnavailableError

    filename = "<no-source-test-mismatch>"
    other = "with model.trace(x):\n    h = model[2].output.save()\n"
    linecache.cache[filename] = (len(other), None, other.splitlines(True), filename)
    try:
        ns = {"model": NNsight(net), "x": torch.randn(3, 4)}
        with pytest.raises(SourceUnavailableError, match="not the code that is running") as info:
            exec(compile("with model.trace(x):\n    h = model[0].output.save()\n", filename,
                         "exec"), ns)
        assert not isinstance(info.value, NoSourceError)
    finally:
        linecache.cache.pop(filename, None)
    assert "h" not in ns and _clean(net)


def test_exec_string_stop_in_a_backward_block_ends_only_the_backward(net):
    """Without source too, ``tracer.stop()`` in a backward block ends that backward pass: the
    trace's code after the block runs, and a block outside any trace ends normally."""
    x = torch.randn(3, 4)
    ns = {"model": NNsight(net), "x": x}
    _exec("with model.trace(x) as tr:\n    r = model[1].output.save()\n    out = model.output\n"
          "    with out.sum().backward():\n        g = r.grad.clone()\n        tr.stop()\n"
          "    after = out.clone().save()\n", ns)
    r2 = net[1](net[0](x))
    r2.retain_grad()
    net[2](r2).sum().backward()
    assert torch.equal(ns["g"], r2.grad) and torch.equal(ns["after"], net(x))
    _exec("with after.sum().backward():\n    tr.stop()\nended = True\n", ns)
    assert ns["ended"] is True and "grad" not in torch.Tensor.__dict__


def test_exec_string_backward_block(net):
    """exec of a bare string: a backward block runs in place, reads the gradient plain autograd
    gives, edits what flows on, and leaves torch.Tensor.grad unpatched and no hook behind."""
    from nnsight_lite.errors import GradientError, OutOfOrderError

    x = torch.randn(3, 4)
    ns = {"model": NNsight(net), "x": x, "net": net}
    _exec("with model.trace(x):\n    h = model[0].output.save()\n    r = model[1].output.save()\n"
          "    out = model.output.save()\n", ns)
    net.zero_grad()
    _exec("with out.sum().backward():\n    gr = r.grad.clone()\n    g = h.grad.clone()\n"
          "    h.grad[:] = 0\n", ns)
    h2 = net[0](x)
    r2 = net[1](h2)
    h2.retain_grad()
    r2.retain_grad()
    net.zero_grad()
    net[2](r2).sum().backward()
    assert torch.equal(ns["g"], h2.grad) and torch.equal(ns["gr"], r2.grad)
    assert "grad" not in torch.Tensor.__dict__
    _exec("with model.trace(x):\n    h = model[0].output.save()\n    r = model[1].output.save()\n"
          "    out = model.output.save()\n", ns)
    with pytest.raises(OutOfOrderError):
        _exec("with out.sum().backward():\n    a = h.grad\n    b = r.grad\n", ns)
    _exec("with model.trace(x):\n    out = model.output.save()\n", ns)
    ns["z"] = torch.randn(2, requires_grad=True)
    with pytest.raises(GradientError, match="never reached"):
        _exec("with out.sum().backward():\n    q = z.grad\n", ns)
    with pytest.raises(ValueError, match="boom"):
        _exec("with model.trace(x):\n    h = model[0].output.save()\n    out = model.output.save()\n"
              "with out.sum().backward():\n    a = h.grad\n    raise ValueError('boom')\n", ns)
    assert "grad" not in torch.Tensor.__dict__ and _clean(net)
    assert all(not m._backward_hooks for m in net.modules())
