"""Older nnsight names still run: ``apply``, ``tracer.log``, ``CONFIG``, and the block form of
``tracer.iter`` (``with tracer.iter[...] as step:``) runs as the loop form in a body."""

from __future__ import annotations

import traceback

import pytest
import torch

import nnsight_lite
from nnsight_lite import NNsight
from nnsight_lite.errors import InvokeError, NNsightError


@pytest.fixture
def model():
    torch.manual_seed(0)
    return NNsight(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 2)))


def test_apply_is_a_plain_call(model):
    x = torch.randn(3, 4)
    with model.trace(x):
        top = nnsight_lite.apply(torch.topk, model.output, 1, dim=-1).indices.save()
    assert torch.equal(top, torch.topk(model._module(x), 1, dim=-1).indices)


def test_log_prints_from_the_body(model, capsys):
    x = torch.randn(2, 4)
    with model.trace(x) as tracer:
        tracer.log("shape", model[0].output.shape)
    assert capsys.readouterr().out == f"shape {torch.Size([2, 8])}\n"


def test_graph_era_constructors_and_log_run_as_in_nnsight_05(model, capsys):
    """nnsight 0.5 kept ``nnsight.list()``, ``nnsight.dict()``, ... (deprecated aliases of the
    builtins) and ``nnsight.log``; code using them ran into an AttributeError here. A body's
    ``nnsight.list().save()`` collects what plain forward hooks see."""
    x = torch.randn(3, 4)
    seen = []
    handles = [m.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
               for m in model._module]
    model._module(x)
    for h in handles:
        h.remove()
    with model.trace(x):
        outs = nnsight_lite.list().save()
        by_name = nnsight_lite.dict().save()
        for i, layer in enumerate(model):
            outs.append(layer.output)
            by_name[nnsight_lite.str(i)] = nnsight_lite.tuple(layer.output.shape)
        nnsight_lite.log("layers", len(outs))
    assert len(outs) == len(seen) == 3
    for got, want in zip(outs, seen):
        torch.testing.assert_close(got, want)
    assert by_name == {"0": (3, 8), "1": (3, 8), "2": (3, 2)}
    assert capsys.readouterr().out == "layers 3\n"
    assert nnsight_lite.int("4") == 4 and nnsight_lite.float is float


def test_nnsight_05_stop_session_and_trace(model):
    """nnsight 0.5's ``nnsight.stop()`` ends the innermost running trace as ``tracer.stop()``
    does (later modules never run: a hook on them sees nothing), ``nnsight.session()`` shares
    values between traces as ``model.session()`` does, and ``@nnsight.trace`` is a no-op;
    outside a body stop() says there is nothing to end."""
    x = torch.randn(3, 4)
    net = model._module
    ran = []
    handle = net[2].register_forward_hook(lambda m, a, out: ran.append(1))
    try:
        with model.trace(x):
            h = model[1].output.save()
            nnsight_lite.stop()
    finally:
        handle.remove()
    assert ran == [] and torch.equal(h, torch.relu(net[0](x)))
    with nnsight_lite.session():
        with model.trace(x):
            mid = model[1].output  # (not saved: the session shares it)
        with model.trace(x * 0):
            model[1].output[:] = mid
            out = model.output.save()
    assert "mid" not in locals()
    torch.testing.assert_close(out, net[2](torch.relu(net[0](x))))

    @nnsight_lite.trace
    def double(t):
        return t * 2

    assert torch.equal(double(x), x * 2)
    with pytest.raises(NNsightError, match=r"stop\(\) at .*outside the body of a running trace"):
        nnsight_lite.stop()
    with pytest.raises(InvokeError, match=r"stop\(\) at .*a trace given no inputs"):
        with model.trace() as tracer:
            nnsight_lite.stop()
            with tracer.invoke(x):
                model.output.save()


@pytest.mark.parametrize("name, instead", [("cond", "plain `if"), ("iter", "tracer.iter"),
                                           ("local", "compute the value in the body")])
def test_nnsight_05_refused_graph_era_forms_show_what_replaces_them(model, name, instead):
    """``nnsight.cond/iter/local`` (refused by nnsight 0.5 too) raise an error naming the
    plain Python that replaces them, in a body as outside, and the trace leaves nothing."""
    with pytest.raises(NNsightError, match=f"nnsight.{name}.*graph-era.*{instead}"):
        with model.trace(torch.randn(1, 4)):
            getattr(nnsight_lite, name)(model.output)
    with model.trace(torch.randn(1, 4)):
        out = model.output.save()
    assert out.shape == (1, 2)


def test_config_fields_read_and_set():
    cfg = nnsight_lite.CONFIG
    assert cfg.APP.DEBUG in (True, False)
    before = cfg.API.APIKEY
    cfg.set_default_api_key("abc")
    try:
        assert cfg.API.APIKEY == "abc"
        cfg.save()
    finally:
        cfg.API.APIKEY = before


@pytest.mark.parametrize("name", ["NNSIGHT_DEBUG", "NNSIGHT_LITE_FULL_TRACEBACK"])
def test_config_debug_is_set_from_the_environment_at_import(name):
    """nnsight's docs/errors/debug-mode.md: ``NNSIGHT_DEBUG=1 python script.py`` turns on
    ``CONFIG.APP.DEBUG`` (nnsight 0.8.1 does); ``0`` or unset leaves it off. Found by the docs
    hunt: only nnsight_lite's own variable was read."""
    import os
    import subprocess
    import sys

    code = "import nnsight_lite; print(nnsight_lite.CONFIG.APP.DEBUG)"
    env = {k: v for k, v in os.environ.items()
           if k not in ("NNSIGHT_DEBUG", "NNSIGHT_LITE_FULL_TRACEBACK")}
    for value, want in (("1", "True"), ("0", "False"), (None, "False")):
        run_env = dict(env) if value is None else {**env, name: value}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out == want, (name, value, out)


def test_config_debug_keeps_the_runtime_frames(model):
    cfg = nnsight_lite.CONFIG
    old = cfg.APP.DEBUG
    files = {}
    for debug in (False, True):
        cfg.APP.DEBUG = debug
        try:
            with pytest.raises(ZeroDivisionError) as info:
                with model.trace(torch.randn(1, 4)):
                    model[0].output
                    1 / 0
        finally:
            cfg.APP.DEBUG = old
        files[debug] = [f.filename for f in traceback.extract_tb(info.value.__traceback__)]
    assert any("interleaver.py" in f for f in files[True])
    assert not any("nnsight_lite" in f for f in files[False])


class Looped(torch.nn.Module):
    """Applies one Linear three times: three calls of ``lin`` per forward."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        for _ in range(3):
            x = torch.tanh(self.lin(x))
        return x


def _plain_looped(net, x, zero_at=()):
    """Ground truth: each call's output of ``net.lin`` by a forward hook, zeroing the calls in
    ``zero_at``; and the model's output."""
    seen = []

    def hook(m, i, o):
        if len(seen) in zero_at:
            o = torch.zeros_like(o)
        seen.append(o.detach().clone())
        return o

    h = net.lin.register_forward_hook(hook)
    try:
        out = net(x)
    finally:
        h.remove()
    return seen, out


@pytest.mark.parametrize("form", ["iter[:]", "all()", "iter[1:3]"])
def test_block_form_of_iter_runs_its_block_once_per_step(form):
    """``with tracer.iter[...] as step:`` (nnsight's older block form, which nnsight 0.8 still
    runs) in a body runs its block once per step, as ``for step in ...`` does: ``step`` is the
    step index, an edit at one step changes only that call, and the code after the block runs."""
    torch.manual_seed(0)
    net = Looped()
    model = NNsight(net)
    x = torch.randn(2, 4)
    with model.trace(x) as tracer:
        steps = nnsight_lite.save([])
        outs = nnsight_lite.save([])
        if form == "all()":
            with tracer.all() as step:
                if step == 1:
                    model.lin.output[:] = 0
                outs.append(model.lin.output.clone())
                steps.append(step)
        elif form == "iter[:]":
            with tracer.iter[:] as step:
                if step == 1:
                    model.lin.output[:] = 0
                outs.append(model.lin.output.clone())
                steps.append(step)
        else:
            with tracer.iter[1:3] as step:
                if step == 1:
                    model.lin.output[:] = 0
                outs.append(model.lin.output.clone())
                steps.append(step)
        after = nnsight_lite.save(["ran"])
    seen, _ = _plain_looped(net, x, zero_at={1})
    wanted = [0, 1, 2] if form != "iter[1:3]" else [1, 2]
    assert steps == wanted
    assert all(torch.equal(a, seen[i]) for a, i in zip(outs, wanted, strict=True))
    assert after == ["ran"]


def test_block_form_without_as_runs_in_a_session():
    """Without ``as`` (nothing bound: the loop is ``for () in ...``) the block form runs once
    per step, in a session's trace too."""
    torch.manual_seed(0)
    net = Looped()
    model = NNsight(net)
    x = torch.randn(1, 4)
    with model.session():
        with model.trace(x) as tracer:
            outs = nnsight_lite.save([])
            with tracer.iter[:]:
                outs.append(model.lin.output.clone())
    seen, _ = _plain_looped(net, x)
    assert len(outs) == 3 and all(torch.equal(a, b) for a, b in zip(outs, seen))


class _Flags:
    """A context manager reached as ``obj.all()``, which is no tracer's: it counts entries."""

    def __init__(self):
        self.entered = 0
        self.exited = 0

    def all(self):
        return self

    def __enter__(self):
        self.entered += 1
        return "flag"

    def __exit__(self, *exc):
        self.exited += 1
        return False


def test_a_with_of_another_objects_all_runs_once_as_a_with(model):
    """Only tracer steps loop: ``with other.all() as v:`` in a body is an ordinary with-block
    (entered and exited once, ``v`` bound to what ``__enter__`` returns)."""
    flags = _Flags()
    x = torch.randn(1, 4)
    with model.trace(x):
        with flags.all() as v:
            got = nnsight_lite.save([v])
            h = model[0].output.save()
    assert (flags.entered, flags.exited, got) == (1, 1, ["flag"])
    assert torch.allclose(h, model._module[0](x))


def _helper_with_block(tracer, model):
    with tracer.iter[:]:
        model[0].output


def test_block_form_outside_a_body_shows_the_loop_form(model):
    """Entered from a function defined outside the body (not compiled with it), the block
    form raises an error naming the form written and showing the ``for`` loop."""
    with pytest.raises(NNsightError, match=r"`with tracer\.iter\[\.\.\.\]:`.*\n.*for step in "
                       r"tracer\.iter\[\.\.\.\]:"):
        with model.trace(torch.randn(1, 4)) as tracer:
            _helper_with_block(tracer, model)


def test_a_stepped_iter_slice_reads_every_other_call():
    """``tracer.iter[0:3:2]`` honours the slice's step (calls 0 and 2; nnsight 0.8.1 ignores
    it): the reads equal a hook's outputs at those calls, an edit at call 2 only changes that
    call, and the model's output is the hooked model's."""
    torch.manual_seed(0)
    net = Looped()
    model = NNsight(net)
    x = torch.randn(2, 4)
    with model.trace(x) as tracer:
        steps = nnsight_lite.save([])
        outs = nnsight_lite.save([])
        for step in tracer.iter[0:3:2]:
            if step == 2:
                model.lin.output[:] = 0
            outs.append(model.lin.output.clone())
            steps.append(step)
        out = model.output.save()
    seen, plain_out = _plain_looped(net, x, zero_at={2})
    assert steps == [0, 2]
    assert torch.equal(outs[0], seen[0]) and torch.equal(outs[1], seen[2])
    assert torch.equal(out, plain_out)


def test_nnsight_module_paths_are_attributes_after_the_top_import():
    """nnsight code reaches its classes by attribute after ``import nnsight`` alone
    (``nnsight.intervention.envoy.Envoy`` in an isinstance check); so does nnsight_lite's, in a
    fresh interpreter (this process has imported the subpackage already)."""
    import subprocess
    import sys

    code = (
        "import nnsight_lite\n"
        "assert nnsight_lite.intervention.envoy.Envoy is nnsight_lite.Envoy\n"
        "assert nnsight_lite.intervention.interleaver.OutOfOrderError is "
        "nnsight_lite.OutOfOrderError\n"
        "assert nnsight_lite.modeling.language.LanguageModel is nnsight_lite.LanguageModel\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


class _Ids(torch.nn.Module):
    """Token ids (batch, time) -> embeddings -> logits: invokes may differ in length."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.out = torch.nn.Linear(4, 3)

    def forward(self, ids):
        return self.out(self.emb(ids))


def _pad_batch(invokes, fn):
    n = max(ids.shape[1] for (ids,), _ in invokes)
    return (torch.cat([torch.nn.functional.pad(ids, (0, n - ids.shape[1]))
                       for (ids,), _ in invokes]),), {}


class _PaddedModel(NNsight):
    def _batch_size(self, *inputs, **kwargs):
        return inputs[0].shape[0] if inputs else 0

    def _batch(self, invokes, fn):
        return _pad_batch(invokes, fn)


class _PaddedEnvoy(nnsight_lite.Envoy):
    def _batch_size(self, *inputs, **kwargs):
        return inputs[0].shape[0] if inputs else 0

    def _batch(self, invokes, fn):
        return _pad_batch(invokes, fn)


@pytest.mark.parametrize("cls", [_PaddedModel, _PaddedEnvoy])
def test_batch_size_and_batch_overrides_batch_the_invokes(cls):
    """nnsight's documented extension point: a model (or Envoy) subclass that overrides
    ``_batch_size`` and ``_batch`` batches its invokes its own way (here: ids of different
    lengths, right-padded). Each invoke's rows equal the module on its own padded input."""
    torch.manual_seed(0)
    net = _Ids()
    model = cls(net)
    a_in, b_in = torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5], [6, 7]])
    with model.trace() as tracer:
        with tracer.invoke(a_in):
            a = model.emb.output.save()
        with tracer.invoke(b_in):
            b = model.out.output.save()
    torch.testing.assert_close(a, net.emb(a_in), rtol=0, atol=0)
    padded = torch.nn.functional.pad(b_in, (0, 1))
    torch.testing.assert_close(b, net(padded), rtol=0, atol=0)


def test_tracer_cls_is_refused_with_what_to_do_instead(net):
    """``model.trace(x, tracer_cls=MyTracer)`` (nnsight's extension hook) raises InputError
    when the trace is made, saying it is not supported and what to do (it went on to the
    forward and raised TypeError there); nothing is left on the model."""
    model = nnsight_lite.NNsight(net)
    x = torch.randn(2, 8)
    with pytest.raises(nnsight_lite.InputError, match="tracer_cls=.*not supported"):
        with model.trace(x, tracer_cls=object):
            pass
    with model.trace(x):
        out = model.output.save()
    torch.testing.assert_close(out, net(x))
