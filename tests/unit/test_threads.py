"""Traces in several threads: independent models work; one model in two threads is refused."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
import torch

from nnsight_lite import NNsight, NNsightError


@contextmanager
def paused_in_another_thread(run, started, proceed):
    """Run ``run`` in a thread until it sets ``started`` (it then waits mid-trace for
    ``proceed``); after the block, let it go on and join it."""
    t = threading.Thread(target=run)
    t.start()
    try:
        assert started.wait(10)
        yield
    finally:
        proceed.set()
        t.join(10)


def test_same_model_in_two_threads_is_refused(seq):
    model = NNsight(seq)
    x = torch.randn(2, 6)
    started, proceed = threading.Event(), threading.Event()
    result = {}

    def worker():
        with model.trace(x):
            h = model[0].output
            started.set()
            proceed.wait(10)
            out = model.output.save()
        result["out"] = out

    with paused_in_another_thread(worker, started, proceed):
        with pytest.raises(NNsightError, match="being traced by another thread"):
            with model.trace(x):
                h = model.output.save()
    torch.testing.assert_close(result["out"], seq(x))
    assert all("forward" not in m.__dict__ for m in seq.modules())


def test_a_finished_thread_frees_the_workers_it_made(seq):
    """Every thread that traces makes its own worker greenlets (a forward's, the bodies',
    a backward body's); when the thread ends they must go with it, and with them the memory
    of their stacks: a program that streams each generate in a new thread (README) would
    otherwise grow by most of a MiB per call."""
    import gc

    from nnsight_lite import workers

    model = NNsight(seq)
    x = torch.randn(2, 6)
    outs = []

    def traced():
        with model.trace() as tracer:
            for _ in range(2):
                with tracer.invoke(x):
                    h = model[1].output
                    out = model.output.save()
                    with out.sum().backward(retain_graph=True):
                        g = h.grad.save()
        outs.append((out, g))

    gc.collect()
    before = len(workers._workers)
    for _ in range(5):
        t = threading.Thread(target=traced)
        t.start()
        t.join(30)
    gc.collect()
    assert len(outs) == 5
    torch.testing.assert_close(outs[-1][0], seq(x))
    assert len(workers._workers) == before  # none of the threads' workers is left


def test_two_models_sharing_modules_in_two_threads_are_refused():
    """A model and a wrapper of one of its parts share modules: while one thread traces the
    first, a trace of the second in another thread is refused with a clear error (it ran, took
    the other trace's wrappers off the shared modules and put them back for good, and the
    other trace reported a module that never ran). Both work again afterwards."""
    started, proceed = threading.Event(), threading.Event()

    class Pause(torch.nn.Module):
        def forward(self, x):
            started.set()
            assert proceed.wait(10)
            return x

    shared = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    whole = torch.nn.Sequential(shared, Pause())
    a, b = NNsight(whole), NNsight(shared)
    x = torch.randn(2, 4)
    proceed.set()
    for m in (a, b):  # (each model's plan is made: the fast install path is taken below)
        with m.trace(x):
            pass
    started.clear()
    proceed.clear()
    result = {}

    def run_a():
        with a.trace(x):
            out = a[0].output.save()
        result["a"] = out

    with paused_in_another_thread(run_a, started, proceed):
        with pytest.raises(NNsightError, match="another thread is tracing"):
            with b.trace(x):
                h = b[1].output.save()
    torch.testing.assert_close(result["a"], shared(x))
    assert all("forward" not in m.__dict__ and "_compiled_call_impl" not in m.__dict__
               for m in whole.modules())
    with b.trace(x):
        h = b[1].output.save()
    torch.testing.assert_close(h, shared(x))


def test_a_module_the_forward_runs_on_a_worker_thread_is_named_so():
    """A forward that hands a submodule to a thread pool: the trace counts only the calls on
    the thread that runs the forward, so a body waiting for that submodule cannot be served.
    The error says it ran on another thread (it said the forward never calls it), the model's
    result is still the plain forward's, and the module next to it is read as usual."""
    from concurrent.futures import ThreadPoolExecutor

    from nnsight_lite import MissedModuleError

    class Pooled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)
            self.pool = ThreadPoolExecutor(1)

        def forward(self, x):
            return self.b(self.pool.submit(self.a, x).result())

    net = Pooled()
    model = NNsight(net)
    x = torch.randn(2, 4)
    try:
        with pytest.raises(MissedModuleError, match=r"model\.a ran only on another thread"):
            with model.trace(x):
                h = model.a.output.save()
        with model.trace(x):
            hb = model.b.input.save()
            out = model.output.save()
        torch.testing.assert_close(hb, net.a(x))
        torch.testing.assert_close(out, net(x))
        # a module that simply never runs keeps its own message
        net.c = torch.nn.Linear(4, 4)
        with pytest.raises(MissedModuleError, match="does not call it"):
            with model.trace(x):
                hc = model.c.output.save()
    finally:
        net.pool.shutdown()


def test_threads_capturing_sources_at_once_while_the_collector_runs(tmp_path):
    """Threads whose first traces capture their sources at the same moment, with the garbage
    collector running Python code (a gc callback) part way through: on CPython 3.11.0-3.11.7
    one thread's ``ast.parse`` then moved the other's AST depth counter and the trace raised a
    spurious ``SystemError: AST constructor recursion depth mismatch`` (CPython gh-106905).
    nnsight_lite's parses take turns. Each thread checks its saved output against the plain
    forward."""
    import gc
    import importlib.util
    import sys

    filler = "".join(f"def f{i}(a, b):\n    return [a + b * {i} for _ in range(3)]\n"
                     for i in range(300))
    body = ("def run(model, x):\n"
            "    with model.trace(x):\n"
            "        out = model.output.save()\n"
            "    return out\n")
    threads, rounds = 4, 6
    mods = []
    for k in range(threads * rounds):  # (a file each: every first trace parses its source)
        path = tmp_path / f"captured_{k}.py"
        path.write_text(filler + body)
        spec = importlib.util.spec_from_file_location(f"captured_{k}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mods.append(mod)
    errors = []

    def collecting(phase, info):
        sum(range(100))  # (Python code run by the collector: other threads may run here)

    def work(mine):
        net = torch.nn.Sequential(torch.nn.Linear(3, 3))
        model, x = NNsight(net), torch.randn(2, 3)
        try:
            for mod in mine:
                out = mod.run(model, x)
                assert torch.equal(out, net(x))
        except BaseException as exc:  # noqa: BLE001 - (reported below)
            errors.append(exc)

    interval, thresholds = sys.getswitchinterval(), gc.get_threshold()
    gc.callbacks.append(collecting)
    sys.setswitchinterval(1e-6)
    gc.set_threshold(20)
    try:
        ts = [threading.Thread(target=work, args=(mods[i::threads],)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
    finally:
        gc.callbacks.remove(collecting)
        sys.setswitchinterval(interval)
        gc.set_threshold(*thresholds)
    assert not errors, errors
