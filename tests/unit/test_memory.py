"""Activations that were not saved are freed when the trace ends."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from nnsight_lite import NNsight
from nnsight_lite.errors import GradientError, MissedModuleError, OutOfOrderError
from tests.helpers import cycles_left_by


def test_unsaved_activations_are_freed(seq):
    model = NNsight(seq)
    x = torch.randn(2, 6)
    refs = []
    # no_grad: with grad on, autograd's own graph keeps each Linear's input alive for backward
    with torch.no_grad():
        with model.trace(x):
            for i in range(4):
                refs.append(weakref.ref(model[i].output))
            keep = model[3].output.save()
    alive = [r() is not None for r in refs]
    # only the saved tensor (layer 3's output) survives; no gc pass is needed for the rest
    assert alive == [False, False, False, True]
    del keep
    gc.collect()
    assert refs[3]() is None


def test_tracer_object_holds_no_activations(seq):
    model = NNsight(seq)
    refs = []
    with torch.no_grad():
        with model.trace(torch.randn(2, 6)) as tracer:
            refs.append(weakref.ref(model[1].output))
    assert refs[0]() is None
    assert tracer is not None


@pytest.mark.parametrize("block", ["trace", "invokes", "error", "scan", "session", "edit"])
def test_a_context_object_left_bound_does_not_keep_the_model(block):
    """``with model.trace(x) as tracer:`` leaves ``tracer`` bound (in a notebook, for good):
    once the block is over it holds the model only weakly, and not the inputs, so ``del
    model`` frees the torch model and its weights (it stayed alive as long as ``tracer``
    was bound). Also a trace that raised, invokes, scan, a session and 0.8's
    ``as (tracer, edited)`` of an edit. The object still reads ``tracer.model`` while the
    model lives."""
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))
    model = NNsight(net)
    x = torch.randn(2, 6)
    x_ref, net_ref = weakref.ref(x), weakref.ref(net)
    if block == "trace":
        with model.trace(x) as kept:
            out = model.output.save()
    elif block == "invokes":
        with model.trace() as kept:
            with kept.invoke(x):
                out = model.output.save()
    elif block == "error":
        with pytest.raises(ValueError):
            with model.trace(x) as kept:
                raise ValueError("a mistake in the body")
        out = net(x)
    elif block == "scan":
        with model.scan(x) as kept:
            pass
        out = net(x)
    elif block == "session":
        with model.session() as kept:
            with model.trace(x):
                out = model.output.save()
    else:
        with model.edit() as (kept, edited):
            edited[1].output[:] = 0
        out = net(x)
        del edited
    assert torch.equal(out, net(x)) or block == "edit"
    if block in ("trace", "invokes", "error", "scan"):
        assert kept.model is model
    del model, net, x, out
    gc.collect()
    assert net_ref() is None and x_ref() is None
    assert kept is not None


def test_error_path_frees_activations(seq):
    model = NNsight(seq)
    refs = []
    try:
        with model.trace(torch.randn(2, 6)):
            refs.append(weakref.ref(model[1].output))
            raise ValueError("x")
    except ValueError:
        pass
    gc.collect()
    assert refs and refs[0]() is None


def test_traces_free_everything_without_the_garbage_collector(seq):
    """Everything a trace makes is freed by reference counting as soon as it ends: activations
    (GPU memory!) must not wait for a garbage-collector pass that allocations on the device
    never trigger. Covers one invoke, several invokes passing values, backward bodies in and
    after a trace, sessions, tracer.stop() and bodies that fail."""
    model = NNsight(seq)
    x = torch.randn(2, 6)

    def one_invoke():
        with model.trace(x):
            model[1].output[:] = 0
            out = model.output.save()
        assert out.shape == (2, 6)

    def invokes():
        with model.trace() as tracer:
            for i in range(3):
                with tracer.invoke(x + i):
                    h = model[1].output
                    out = model.output.save()
            with tracer.invoke(x):
                model[1].output[:] = h
        assert out.shape == (2, 6)

    def backward():
        with model.trace(x.requires_grad_(True)):
            hs = model[1].output.save()
            loss = model.output.sum()
            with loss.backward(retain_graph=True):
                g = hs.grad.save()
        with (hs * 2).sum().backward():
            g2 = hs.grad.save()
        assert torch.equal(g2, torch.full_like(hs, 2.0)) and g.shape == hs.shape

    def session():
        with model.session():
            with model.trace(x):
                h = model[1].output
            with model.trace(x):
                model[1].output = h * 2
                out = model.output.save()
        assert out.shape == (2, 6)

    def stopped():
        with model.trace(x) as tracer:
            h = model[1].output.save()
            tracer.stop()
        assert h.shape == (2, 6)

    def failed():
        with pytest.raises(ValueError):
            with model.trace() as tracer:
                with tracer.invoke(x):
                    h = model[1].output
                with tracer.invoke(x):
                    model[1].output[:] = h
                    raise ValueError("the user's bug")
        with pytest.raises(OutOfOrderError, match="has already run that call"):
            with model.trace(x):
                out = model[2].output
                h = model[0].output

    def errors_thrown_into_bodies():
        with pytest.raises(MissedModuleError):  # from the end of the forward
            with model.trace(x):
                a = model[2].output
                b = model[2].next().output
        with pytest.raises(NameError):  # a name an earlier invoke never binds
            with model.trace() as tracer:
                with tracer.invoke(x):
                    q = model[2].output
                with tracer.invoke(x):
                    model[1].output[:] = never_bound  # noqa: F821
        with pytest.raises(GradientError):  # a tensor backprop never reaches
            other = torch.randn(2, 6, requires_grad=True) * 1
            with model.trace(x):
                loss = model.output.sum()
                with loss.backward():
                    g = other.grad.save()

    def functions_bound_in_invoke_and_edit_bodies():
        with model.trace() as tracer:
            with tracer.invoke(x):
                h = model[0].output
                double = lambda t: t * 2  # noqa: E731  (its globals are this invoke's scope)
                out = double(model.output).save()
        with with_helper.trace(x):
            out2 = with_helper.output.save()
        assert out.shape == out2.shape

    with model.edit() as with_helper:
        def helper(t):
            return t

        with_helper[0].output = helper(with_helper[0].output)

    for fn in (one_invoke, invokes, backward, session, stopped, failed, errors_thrown_into_bodies,
               functions_bound_in_invoke_and_edit_bodies):
        fn()  # warm the caches first (compiled bodies are kept)
        assert cycles_left_by(fn) == [], fn.__name__


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) * 2


def test_the_first_trace_at_a_new_call_site_leaves_no_reference_cycles():
    """A with-statement met for the first time (each run of a notebook cell is a new one) is
    compiled then: with-bodies, nested invokes, a .source forward instrumented, a backward
    block. That left a reference cycle per call site (ast.fix_missing_locations recurses
    through a closure that refers to itself) for the collector."""
    import linecache

    model = NNsight(_Block())
    x = torch.randn(3, 8, requires_grad=True)
    source = (
        "def run():\n"
        "    with model.trace() as tracer:\n"
        "        with tracer.invoke(x):\n"
        "            s = model.source.torch_relu_0.output.save()\n"
        "            out = model.output.save()\n"
        "        with tracer.invoke(x):\n"
        "            model.lin.output[:] = 0\n"
        "    with out.sum().backward():\n"
        "        g = x.grad.save()\n"
        "    return s, g\n")
    for i in range(3):
        name = f"<a new call site {i} of {__name__}>"
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        scope = {"model": model, "x": x}
        try:
            exec(compile(source, name, "exec"), scope)
            assert cycles_left_by(scope["run"]) == []
        finally:
            del linecache.cache[name]


@pytest.mark.parametrize("invokes", [1, 2])
def test_a_model_traced_by_new_workers_is_freed(invokes):
    """A trace run while no pooled worker greenlet is idle makes new ones (for its forward,
    its bodies and a backward body); they stay pooled for later traces but must hold nothing
    of this one: the model, its inputs and the activations it made go when the user drops
    them."""
    from nnsight_lite import workers

    net = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 6))
    x = torch.randn(2, 6)
    refs = [weakref.ref(net), weakref.ref(net[0]), weakref.ref(x)]
    pools = [getattr(workers._pool, name, None) for name in workers._POOL_NAMES]
    pools = [p for p in pools if p is not None]
    pooled = [list(p) for p in pools]
    for p in pools:  # (so this trace has to make its workers: bodies' and the forward's)
        p.clear()
    try:
        model = NNsight(net)
        with model.trace() as tracer:
            for _ in range(invokes):
                with tracer.invoke(x):
                    h = model[0].output
                    refs.append(weakref.ref(h))
                    out = model.output.save()
                    with out.sum().backward(retain_graph=True):  # (one batch, one graph)
                        g = h.grad.save()
                        refs.append(weakref.ref(g))
        assert len(workers._pool.idle) >= invokes  # the new workers
        assert len(workers._pool.runners) >= 1
        assert len(workers._pool.grads_idle) >= 1
        del model, tracer, net, x, out, g
        gc.collect()
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        for p, old in zip(pools, pooled):
            p.extend(old)


def test_a_replaced_submodule_is_freed_by_the_next_trace(seq):
    """A submodule replaced in a traced model is freed once the model is traced again (the
    wrappers kept for reuse see the new tree and let the old module go)."""
    model = NNsight(seq)
    x = torch.randn(2, 6)
    for _ in range(2):
        with model.trace(x):
            model[1].output.save()
    old = weakref.ref(seq[1])
    seq[1] = torch.nn.Linear(6, 6)
    with model.trace(x):
        out = model[1].output.save()
    gc.collect()
    assert old() is None
    torch.testing.assert_close(out, seq[1](seq[0](x)))


def test_pooled_workers_let_go_of_the_callers_context_variables(seq):
    """Bodies see the caller's context variables (each job runs in a copy of the caller's
    context); once the trace is over, the pooled workers must not keep that copy, or a value
    the user resets in a ContextVar (a tensor here) lives on in the pool."""
    import contextvars

    var = contextvars.ContextVar("nnsight_lite_test_var", default=None)
    model = NNsight(seq)
    x = torch.randn(2, 6)
    held = torch.randn(3)
    ref = weakref.ref(held)
    var.set(held)
    with model.trace() as tracer:
        with tracer.invoke(x):
            seen = var.get().clone().save()  # a body reads the caller's variable
            h = model[0].output
            out = model.output.save()
            with out.sum().backward():
                g = h.grad.save()
                seen_in_backward = var.get().clone().save()
    torch.testing.assert_close(seen, held)
    torch.testing.assert_close(seen_in_backward, held)
    var.set(None)
    del held
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("kept", ["view", "entry"])
def test_a_kept_cache_does_not_keep_the_model(kept):
    """A cache view (or one of its entries) kept after the user drops the model holds the
    recorded values, not the model: as a dict of values recorded with plain forward hooks
    would, the model and its weights go, by reference counting (a notebook keeps ``cache``
    bound while the model is re-created, so every old model stayed alive, weights on the GPU
    too, until the cache cell ran again). The view still answers by path; navigation by
    attribute needs the model, and says that it is gone."""
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x = torch.randn(2, 6)
    seen = {}
    handles = [m.register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, o.detach()))
               for n, m in net.named_children()]
    want = net(x).detach()  # (its graph would hold the weights)
    for h in handles:
        h.remove()
    model = NNsight(net)
    with model.trace(x) as tracer:
        cache = tracer.cache()
    assert torch.equal(cache.output, want)  # navigation while the model lives
    assert repr(cache["model.1"]) == "<cache entry: ReLU, 1 visit(s)>"
    held = cache if kept == "view" else cache["model.2"]
    refs = [weakref.ref(net), weakref.ref(net[0].weight), weakref.ref(net[2].weight),
            weakref.ref(model)]
    gc.disable()
    try:
        del model, net, tracer, cache
        alive = [r() is not None for r in refs]
    finally:
        gc.enable()
    assert alive == [False] * 4
    if kept == "view":
        for name, value in seen.items():
            assert torch.equal(held[f"model.{name}"].output, value)
        assert repr(held["model.1"]) == "<cache entry: ReLU, 1 visit(s)>"
        with pytest.raises(AttributeError, match="model is gone"):
            held.output
    else:
        assert torch.equal(held.output, seen["2"])


def test_code_that_ran_traces_is_not_kept(seq):
    """The compiled bodies of with-statements are cached per code object (a cell's, a
    function's); once that code is gone (a notebook cell that ran, a function defined again)
    its cache entries go too, as plain code that ran is not kept. The cache held the last
    1024 code objects it saw, with their compiled bodies (some kB each in a notebook)."""
    import linecache

    src = ("with model.trace(x):\n"
           "    out = model.output.save()\n"
           "def f():\n"
           "    with model.trace() as tracer:\n"
           "        with tracer.invoke(x):\n"
           "            o = model.output.save()\n"
           "    return o\n"
           "out2 = f()\n")
    filename = "<nnsight-lite-test-cell-code>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    try:
        x = torch.randn(2, 6)
        want = seq(x)
        for _ in range(2):  # (a second run finds its bodies cached, as a loop would)
            code = compile(src, filename, "exec")
            scope = {"model": NNsight(seq), "x": x}
            exec(code, scope)
            assert torch.equal(scope["out"], want) and torch.equal(scope["out2"], want)
            refs = [weakref.ref(code), weakref.ref(scope["f"].__code__)]
            gc.disable()
            try:
                scope.clear()  # (f and its globals are a cycle of plain Python's own)
                del code, scope
                alive = [r() is not None for r in refs]
            finally:
                gc.enable()
            assert alive == [False, False]
    finally:
        linecache.cache.pop(filename, None)


def test_code_that_called_backward_is_not_kept():
    """``Tensor.backward`` (patched so that ``with loss.backward():`` works) looks at the code
    calling it, and caches what it found per code object; once that code is gone (a training
    step function defined again in a notebook, a cell that ran) the cache lets it go, as plain
    PyTorch's backward keeps nothing of its caller. It held the last 4096 such code objects
    (and through them the source lines of the trace bodies among them)."""
    src = ("def step(w):\n"
           "    loss = (w * 2).sum()\n"
           "    loss.backward()\n"
           "    return w.grad\n")
    w = torch.ones(3, requires_grad=True)
    for _ in range(2):
        scope = {}
        exec(compile(src, "<nnsight-lite-test-step>", "exec"), scope)
        grad = scope["step"](w)
        assert torch.equal(grad, torch.full((3,), 2.0))
        w.grad = None
        ref = weakref.ref(scope["step"].__code__)
        gc.disable()
        try:
            scope.clear()  # (step and its globals are a cycle of plain Python's own)
            del scope
            alive = ref() is not None
        finally:
            gc.enable()
        assert not alive


@pytest.mark.parametrize("where", ["after", "inside"])
def test_a_backward_context_left_bound_does_not_keep_the_graph(where):
    """``with loss.backward() as bw:`` leaves ``bw`` bound (in a notebook, for good): once the
    block is over it holds neither the loss nor its graph, whose nodes hold the weights and the
    leaf inputs (plain ``loss.backward()`` returns None and keeps nothing). It held the loss,
    so the model's weights and the input outlived the model; in a trace body too."""
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))
    model = NNsight(net)
    x = torch.randn(2, 6, requires_grad=True)
    if where == "after":
        with model.trace(x):
            h = model[0].output.save()
            out = model.output.save()
        with out.sum().backward() as bw:
            g = h.grad.save()
    else:
        with model.trace(x):
            h = model[0].output.save()
            out = model.output.save()
            with out.sum().backward() as bw:
                g = h.grad.save()
            bw = bw.save()
    plain = net[0](x)
    plain_grad, = torch.autograd.grad(net[1](plain).sum(), plain)
    torch.testing.assert_close(g, plain_grad)
    refs = [weakref.ref(net), weakref.ref(net[0].weight), weakref.ref(x), weakref.ref(out)]
    gc.disable()
    try:
        del model, net, x, h, out, plain, plain_grad
        alive = [r() is not None for r in refs]
    finally:
        gc.enable()
    assert alive == [False] * 4
    assert bw is not None
