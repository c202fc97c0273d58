"""Remote traces on the served MLP give what the same trace gives locally, and only saved
names come back. Ground truth: the same body run locally on the same weights."""

from __future__ import annotations

import inspect

import pytest
import torch

import nnsight_lite
from nnsight_lite.errors import OutOfOrderError, RemoteError


def _x(rows=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g)


class TestSameResultsAsLocal:
    def test_read_edit_replace(self, backend, mlp_model):
        """Saved activations, an in-place edit and a replaced output equal the local run."""
        model, x = mlp_model, _x()
        scale = torch.tensor(3.0)
        with model.trace(x, remote=True):
            h0 = model[0].output.save()
            model[1].output[:, :4] = 0
            model[2].output = model[2].output * scale
            out = model.output.save()
        remote = (h0, out)
        with model.trace(x):
            h0 = model[0].output.save()
            model[1].output[:, :4] = 0
            model[2].output = model[2].output * scale
            out = model.output.save()
        for r, l in zip(remote, (h0, out)):
            assert torch.equal(r, l)
        plain = model._module(x)
        assert not torch.equal(out, plain)  # the edits changed the result

    def test_invokes_and_cross_invoke_values(self, backend, mlp_model):
        """Several invokes batched in one forward, one patching another, equal the local run."""
        model, a, b = mlp_model, _x(2, 1), _x(1, 2)

        def run(**kw):
            with model.trace(**kw) as tracer:
                with tracer.invoke(a):
                    clean = model[2].output[:1].clone().save()
                with tracer.invoke(b):
                    model[2].output[:] = clean
                    patched = model.output.save()
            return clean, patched

        # a trace inside a function: the caller values are that function's locals
        remote, local = run(remote=True), run()
        for r, l in zip(remote, local):
            assert torch.equal(r, l)

    def test_backward_block(self, backend, mlp_model):
        """A backward block inside a remote trace returns the same gradients as locally."""
        model, x = mlp_model, _x()
        with model.trace(x, remote=True):
            h = model[2].output
            loss = model.output.sum()
            with loss.backward():
                g_remote = h.grad.save()
        with model.trace(x):
            h = model[2].output
            loss = model.output.sum()
            with loss.backward():
                g_local = h.grad.save()
        assert torch.equal(g_remote, g_local)
        h_ref = model._module[:3](x).detach().requires_grad_(True)
        model._module[3:](h_ref).sum().backward()
        assert torch.allclose(g_remote, h_ref.grad)

    def test_scan(self, backend, mlp_model):
        """model.scan(..., remote=True) gives the shapes a local scan gives."""
        model = mlp_model
        with model.scan(_x(5), remote=True):
            shape = nnsight_lite.save(tuple(model[2].output.shape))
        assert shape == (5, 16)

    def test_edit(self, backend, mlp_model):
        """A persistent edit made on the client applies on the server to the edited copy only."""
        model, x = mlp_model, _x()
        with model.edit() as edited:
            edited[1].output[:] = 0
        with edited.trace(x, remote=True):
            out_edited = edited.output.save()
        with model.trace(x, remote=True):
            out_plain = model.output.save()
        bias = model._module[2:](torch.zeros(3, 16))
        assert torch.allclose(out_edited, bias)
        assert torch.allclose(out_plain, model._module(x))

    def test_edit_error_names_the_edit(self, backend, mlp_model):
        """An edit's out-of-order read, met on the server, is named by the edit's with line."""
        model, x = mlp_model, _x()
        made_at = inspect.currentframe().f_lineno + 1
        with model.edit() as edited:
            b = edited[2].output
            edited[1].output[:] = 0
        with pytest.raises(OutOfOrderError) as info:
            with edited.trace(x, remote=True):
                out = edited.output.save()
        assert str(info.value).startswith(
            f"the model's persistent edit (made by `with model.edit(...)` at {__file__}:{made_at})"
            " asked for model[1].output")

    def test_session_training_loop(self, backend, mlp_model):
        """A small adapter trained in a remote session ends where a local session ends; only
        saved values come back; the session's values stay on the server between traces."""
        model, x = mlp_model, _x(4)
        target = torch.ones(4, 4)

        def train(**kw):
            torch.manual_seed(0)
            adapter = torch.nn.Linear(16, 16)
            with model.session(**kw):
                opt = torch.optim.SGD(adapter.parameters(), lr=0.1)
                losses = nnsight_lite.save([])
                for _ in range(3):
                    with model.trace(x):
                        model[2].output = model[2].output + adapter(model[2].output)
                        loss = ((model.output - target) ** 2).mean()
                        loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
                weight = adapter.weight.detach().save()
            return losses, weight

        (rl, rw), (ll, lw) = train(remote=True), train()
        assert rl == pytest.approx(ll) and rl[-1] < rl[0]
        assert torch.allclose(rw, lw)


class Doubled(nnsight_lite.Envoy):
    """An Envoy class of the client's own (``envoys=``), with a property of its own."""

    @property
    def twice(self):
        return self.output * 2


class TestWrappedLikeTheClient:
    def test_rename_and_envoys_of_the_client_model(self, backend, mlp_model):
        """A client model wrapped with rename= aliases and an envoys= class (the served MLP was
        wrapped with neither) reads the same values by those names remotely as locally, equal
        to the plain modules' outputs; the served model is left unwrapped."""
        model = nnsight_lite.NNsight(mlp_model._module, rename={"0": "first", "4": ["head"]},
                                     envoys={torch.nn.Linear: Doubled})
        x = _x()

        def run(**kw):
            with model.trace(x, **kw):
                first = model.first.output.save()
                twice = model.head.twice.save()
            return first, twice

        remote, local = run(remote=True), run()
        net = mlp_model._module
        assert torch.equal(remote[0], local[0]) and torch.equal(remote[1], local[1])
        torch.testing.assert_close(remote[0], net[0](x))
        torch.testing.assert_close(remote[1], net(x) * 2)
        with mlp_model.trace(x, remote=True):
            plain = nnsight_lite.save(type(mlp_model[0]).__name__)
            has_alias = nnsight_lite.save(hasattr(mlp_model, "first"))
        assert plain == "Envoy" and has_alias is False


class TestOnlySavedReturn:
    def test_unsaved_names_are_not_bound(self, backend, mlp_model):
        """Names a remote body binds without .save() are not bound in the caller."""
        model = mlp_model
        with model.trace(_x(), remote=True):
            kept = model[0].output.save()
            dropped = model[2].output  # noqa: F841
        assert isinstance(kept, torch.Tensor)
        assert "dropped" not in locals()


class TestErrorsAndOutput:
    def test_user_exception_same_type_with_location(self, backend, mlp_model):
        """An exception raised in a remote body arrives as its own type with its own message,
        its traceback ending at the user's line in the body (as locally)."""
        import traceback

        model = mlp_model
        with pytest.raises(ValueError) as info:
            with model.trace(_x(), remote=True):
                h = model[0].output
                raise ValueError(f"bad shape {tuple(h.shape)}")
        assert info.value.args == ("bad shape (3, 16)",)
        last = traceback.extract_tb(info.value.__traceback__)[-1]
        assert last.filename == __file__ and "raise ValueError" in last.line

    def test_runtime_error_names_users_line(self, backend, mlp_model):
        """The runtime's own errors (reading modules out of order) cite the user's file:line,
        not the server's synthetic name for it."""
        model = mlp_model
        with pytest.raises(OutOfOrderError) as info:
            with model.trace(_x(), remote=True):
                model[2].output.save()
                model[0].output.save()  # already ran
        msg = str(info.value)
        assert f"{__file__}:" in msg and "<remote" not in msg

    def test_print_reaches_client(self, backend, mlp_model, capsys):
        """print() in a remote body shows on the client's stdout."""
        model = mlp_model
        with model.trace(_x(), remote=True):
            print("rows:", model[0].output.shape[0])
        assert "rows: 3" in capsys.readouterr().out

    def test_stderr_reaches_client(self, backend, mlp_model, capsys):
        """What a remote body writes to stderr shows on the client's stderr, as it does when
        the body runs locally."""
        import sys

        model = mlp_model
        with model.trace(_x(), remote=True):
            print("rows on stderr:", model[0].output.shape[0], file=sys.stderr)
        assert "rows on stderr: 3" in capsys.readouterr().err

    def test_warnings_are_warnings_on_the_client(self, backend, mlp_model):
        """A remote body's ``warnings.warn`` is issued on the client as the warning the same
        body issues locally: its category, message, file and line (so the client's filters,
        ``pytest.warns`` and ``catch_warnings`` see it); a warning repeated in a loop once, as
        Python's default filter shows it locally."""
        import warnings

        model = mlp_model

        def run(**kw):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("default")
                with model.trace(_x(), **kw):
                    for _ in range(3):
                        warnings.warn(f"odd width {model[0].output.shape[1]}", FutureWarning)
                    torch.nn.functional.softmax(model[1].output)  # (torch warns: no dim)
            return [(w.category, str(w.message), w.filename, w.lineno) for w in caught]

        local = run()
        assert local[0] == (FutureWarning, "odd width 16", __file__, local[0][3])
        assert len(local) == 2 and "softmax" in str(local[1][1])
        assert run(remote=True) == local

    def test_client_filters_decide(self, backend, mlp_model):
        """The client's filters apply to a remote body's warnings: ignored ones do not show,
        and 'error' raises the warning at the with-statement."""
        import warnings

        model = mlp_model
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("always", UserWarning)
            with model.trace(_x(), remote=True):
                warnings.warn("old", DeprecationWarning)
                warnings.warn("new")
        assert [(w.category, str(w.message)) for w in caught] == [(UserWarning, "new")]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(UserWarning, match="^new$"):
                with model.trace(_x(), remote=True):
                    warnings.warn("new")

    def test_a_module_of_yours_is_sent_by_value_once_registered(self, backend, mlp_model,
                                                                 tmp_path, monkeypatch):
        """A function from a module of the user's that the replicas cannot import fails the
        request with an error naming nnsight_lite.register; registered (nnsight's
        ``nnsight.register``), the module goes by value and the trace equals the local one."""
        import importlib
        import sys

        import cloudpickle

        (tmp_path / "my_helpers_s22.py").write_text("def double(t):\n    return t * 2\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        mine = importlib.import_module("my_helpers_s22")
        double, model, x = mine.double, mlp_model, _x()
        try:
            with pytest.raises(RemoteError, match=r"nnsight_lite\.register\(module\)"):
                with model.trace(x, remote=True):
                    h = double(model[0].output).save()
            nnsight_lite.register("my_helpers_s22")
            nnsight_lite.register(sys.modules[__name__])  # (the with-statement's own module,
            with model.trace(x, remote=True):  # which a trace sends by value and lets go of)
                h = double(model[0].output).save()
            assert {"my_helpers_s22", __name__} <= cloudpickle.list_registry_pickle_by_value()
            with model.trace(x):
                want = (model[0].output * 2).save()
            assert torch.equal(h, want)
        finally:
            for name in ("my_helpers_s22", __name__):
                if name in cloudpickle.list_registry_pickle_by_value():
                    cloudpickle.unregister_pickle_by_value(sys.modules[name])
            sys.modules.pop("my_helpers_s22", None)

    def test_unknown_model_lists_served(self, served, mlp_model):
        """A model name that is not served gives a RemoteError listing what is."""
        from nnsight_lite import remote

        model = mlp_model
        with pytest.raises(RemoteError, match=r"no model named 'nope'.*'mlp'"):
            with model.trace(_x(), backend=remote.Backend("nope")):
                model.output.save()


class TestAccess:
    def test_cluster_runs_with_token_authentication(self, cluster):
        """The test cluster runs with Ray's token authentication on (Ray 2.60's default for a
        local cluster), so every remote test above went through it."""
        assert cluster["token_auth"] is True
