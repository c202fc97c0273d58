"""The opt-in allow-list policy for remote bodies (nnsight_lite/remote/policy.py): it passes the
bodies researchers write and refuses, naming file and line, what it promises to refuse."""

import inspect
import math
import textwrap

import pytest
import torch

import nnsight_lite
from nnsight_lite import NNsight
from nnsight_lite.errors import NNsightError, PolicyError
from nnsight_lite.remote.policy import DEFAULT_ALLOW, check_body


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _everyday_bodies(model, x, steer):
    """Bodies in the style of the README: read, edit, replace, loops, helpers, invokes, grads."""
    with model.trace(x):
        h = model[0].output.save()
        norms = [float(v.detach().norm()) for v in h]
        model[1].output[:, 0] = 0
        model[2].output = model[2].output * 2 + steer.sum()
        top = sorted(range(len(norms)), key=lambda i: -norms[i])[:2]
        nnsight_lite.save(top)
        out = torch.nn.functional.softmax(model.output, dim=-1).save()
        scale = math.sqrt(4)

        def clamp(t, lo=-1.0):
            return t.clamp(min=lo) * scale

        c = clamp(out).save()
        print(f"norm {h.norm():.3f}", len(top))
    with model.trace() as tracer:
        with tracer.invoke(x):
            a = model[0].output.save()
        with tracer.invoke(x + 1):
            model[0].output[:] = a
            b = model.output.save()
    with model.trace(x):
        hidden = model[0].output
        loss = model.output.sum()
        with loss.backward():
            g = hidden.grad.save()
    return h, out, c, b, g


def _source_of(func):
    lines, first = inspect.getsourcelines(func)
    body_start = next(i for i, line in enumerate(lines) if line.strip().startswith("with "))
    return "".join(lines[body_start:-1]), first + body_start


def test_everyday_bodies_pass_and_run():
    """The bodies the README teaches pass the default policy, and they do run (locally here)."""
    source, first = _source_of(_everyday_bodies)
    check_body(source, __file__, first)
    model = NNsight(_net())
    x = torch.randn(2, 4)
    h, out, c, b, g = _everyday_bodies(model, x, torch.ones(3))
    torch.testing.assert_close(h, model._module[0](x))
    assert g.shape == h.shape and out.shape == (2, 3) and c.shape == (2, 3) and b.shape == (2, 3)


REFUSED = [
    ("import os", "import modules"),
    ("from torch import load", "import modules"),
    ("h = model.layer.output.__class__", "dunder"),
    ("t = x.__dict__", "dunder"),
    ("b = __builtins__", "dunder"),
    ("m = model._module", "private"),
    ("c = torch._C", "private"),
    ("f = open('/etc/passwd')", "builtin `open`"),
    ("e = eval('1')", "builtin `eval`"),
    ("v = getattr(x, 'grad')", "builtin `getattr`"),
    ("o = open", "builtin `open`"),
    ("r = helper(x)", "`helper(...)` calls a name"),
    ("s = '{0.grad}'.format(x)", ".format"),
    ("torch.save(x, 'out.pt')", "torch.save"),
    ("w = torch.load('w.pt')", "torch.load"),
    ("m = torch.hub.load('a', 'b')", "torch.hub"),
    ("torch.ops.aten.add(x, x)", "torch.ops"),
    ("class A:\n    pass", "classes"),
    ("def __init__(self):\n    pass", "dunder"),
]


@pytest.mark.parametrize("line,why", REFUSED)
def test_refusals_name_the_file_and_line(line, why):
    """Each refused construct raises PolicyError (an NNsightError and a PermissionError) that
    cites the user's file and line (the body's 3rd line here) and says why."""
    body = "with model.trace(x):\n    h = model.layer.output.save()\n" + textwrap.indent(line, "    ")
    with pytest.raises(PolicyError) as info:
        check_body(body, "experiment.py", 40)
    msg = str(info.value)
    assert msg.startswith("experiment.py:42: "), msg
    assert why in msg
    assert isinstance(info.value, NNsightError) and isinstance(info.value, PermissionError)


def test_names_the_body_defines_may_be_called_and_rebinding_builtins_is_allowed():
    """A function or name bound in the body itself is callable; a caller-bound torch alias
    still cannot reach torch.load."""
    check_body("def f(t):\n    return t * 2\ny = f(x)\nlist = [1]\nz = list[0]\n", "a.py", 1)
    with pytest.raises(PolicyError, match="torch.load"):
        check_body("w = T.load('w.pt')\n", "a.py", 1, values={"T": torch})


def test_values_must_be_data_or_allowed_modules():
    """Caller values are checked after unpickling: data, containers of data, allowed modules and
    the server's own reference types pass; functions and other objects are refused at the line
    that first uses them."""
    ok = {"x": torch.ones(2), "n": 3, "s": "Paris", "idx": [slice(0, 2), (1, 2.5)],
          "d": {"a": torch.float16}, "F": torch.nn.functional, "m": math}
    check_body("y = F.relu(x) * n\nz = m.sqrt(2)\n", "a.py", 1, values=ok)
    fns = {"relu": torch.nn.functional.relu, "save": nnsight_lite.save, "x": torch.ones(2)}
    check_body("y = save(relu(x))\n", "a.py", 1, values=fns)
    with pytest.raises(PolicyError, match="caller's `load` is a function from torch.serialization"):
        check_body("w = load('w.pt')\n", "a.py", 1, values={"load": torch.load})

    class Ref:
        pass

    check_body("y = model.layer.output\n", "a.py", 1, values={"model": Ref()}, value_types=(Ref,))
    with pytest.raises(PolicyError, match=r"a\.py:3: .*caller's `helper` is a function"):
        check_body("y = 1\nz = 2\nw = helper.real\n", "a.py", 1, values={"helper": _net})
    with pytest.raises(PolicyError, match="module os"):
        import os

        check_body("y = p.getcwd\n", "a.py", 1, values={"p": os})
    with pytest.raises(PolicyError, match="torch.hub"):
        check_body("y = h.list\n", "a.py", 1, values={"h": torch.hub})


def test_custom_allow_list_replaces_the_default():
    """``allow=`` replaces the default names: here print and torch are allowed, math is not."""
    check_body("print(torch.ones(1))\n", "a.py", 1, allow={"print", "torch"})
    with pytest.raises(PolicyError, match="len"):
        check_body("n = len(x)\n", "a.py", 1, allow={"print", "torch"})
    assert "len" in DEFAULT_ALLOW and "open" not in DEFAULT_ALLOW


def test_a_body_that_does_not_parse_is_refused_with_its_line():
    """Bad syntax is refused before anything runs, with the line."""
    with pytest.raises(PolicyError, match=r"a\.py:6: "):
        check_body("y = 1\nz = (\n", "a.py", 5)
