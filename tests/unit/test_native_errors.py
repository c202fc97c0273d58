"""Errors raised inside torch's C++ code while a body runs on a worker greenlet.

torch records a C++ backtrace for every error it raises (even one the body catches), unwinding
up to 64 native frames. On a greenlet that walk could pass the greenlet's base into stack memory
the rest of the program has reused since, and crash the interpreter. Run in a subprocess, so a
crash fails this test instead of ending the test run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import random, torch, nnsight_lite as nl

    def at_depth(n, fn):
        # fn() called n C-level calls deeper: bodies resumed from many stack positions
        if n == 0:
            return fn()
        return next(map(at_depth, (n - 1,), (fn,)))

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model = nl.NNsight(net)
    x = torch.randn(2, 4)

    def trace():
        with model.trace(x):
            h = model[0].output
            try:
                h @ torch.ones(3, 3)  # a shape error raised in C++, caught by the body
            except RuntimeError:
                pass
            out = model[1].output.save()
        return out

    rng = random.Random(0)
    for _ in range(400):
        out = at_depth(rng.randint(0, 40), trace)
    assert torch.equal(out, net(x))
    print("survived")
""")


def test_torch_errors_caught_in_bodies_at_any_stack_depth_do_not_crash():
    """400 traces started at random native stack depths, each body catching a torch shape
    error, end normally with the right result (before the fix: a segmentation fault)."""
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == "survived"
