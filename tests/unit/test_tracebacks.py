"""An error leaving a body shows the user's frames: the with line, the body's lines, the user's
functions; no runtime frames and no internal exception as its context."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
import traceback

import pytest
import torch

import nnsight_lite
from nnsight_lite import NNsight, OutOfOrderError

PACKAGE = os.path.dirname(nnsight_lite.__file__)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def frames(exc):
    return [(os.path.basename(f.filename), f.name, f.line) for f in
            traceback.extract_tb(exc.__traceback__)]


def no_runtime_frames(exc):
    files = [f.filename for f in traceback.extract_tb(exc.__traceback__)]
    return not any(f.startswith(PACKAGE) or f.endswith("module.py") for f in files)


def _bad_matmul(h):
    return h @ torch.ones(3, 3)


class TestBodyErrors:
    def test_shows_the_with_line_the_body_line_and_the_users_function(self):
        model = NNsight(_net())
        with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
            with model.trace(torch.randn(2, 4)):
                h = model[0].output
                _bad_matmul(h)
        here = "test_shows_the_with_line_the_body_line_and_the_users_function"
        assert frames(info.value) == [
            ("test_tracebacks.py", here, "with model.trace(torch.randn(2, 4)):"),
            ("test_tracebacks.py", here, "_bad_matmul(h)"),
            ("test_tracebacks.py", "_bad_matmul", "return h @ torch.ones(3, 3)"),
        ]
        assert info.value.__context__ is None and info.value.__cause__ is None

    def test_ordering_errors_point_at_the_line_that_asked(self):
        model = NNsight(_net())
        with pytest.raises(OutOfOrderError, match="has already run that call") as info:
            with model.trace(torch.randn(2, 4)):
                model[2].output
                model[0].output
        assert frames(info.value)[-1][2] == "model[0].output"
        assert no_runtime_frames(info.value)

    def test_an_error_inside_the_model_shows_the_models_frames(self):
        """A bad replacement fails in the next layer: that layer's forward is what to see."""
        model = NNsight(_net())
        with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
            with model.trace(torch.randn(2, 4)):
                model[0].output = torch.zeros(2, 5)
        got = frames(info.value)
        assert got[0][2].startswith("with model.trace")
        assert got[-1][0] == "linear.py"
        assert not any(f.startswith(PACKAGE) for f in
                       (e.filename for e in traceback.extract_tb(info.value.__traceback__)))

    def test_invoke_backward_and_nested_bodies(self):
        model = NNsight(_net())
        other = NNsight(torch.nn.Linear(4, 4))
        with pytest.raises(ValueError, match="in invoke 1") as info:
            with model.trace() as tracer:
                with tracer.invoke(torch.randn(1, 4)):
                    pass
                with tracer.invoke(torch.randn(1, 4)):
                    raise ValueError("in invoke 1")
        assert [f[2] for f in frames(info.value)] == [
            "with model.trace() as tracer:", 'raise ValueError("in invoke 1")']
        with pytest.raises(KeyError) as info:
            with model.trace(torch.randn(2, 4)):
                h = model[0].output
                loss = model.output.sum()
                with loss.backward():
                    h.grad
                    {}["missing"]
        assert [f[2] for f in frames(info.value)] == [
            "with model.trace(torch.randn(2, 4)):", "with loss.backward():", '{}["missing"]']
        with pytest.raises(ValueError, match="invalid literal") as info:
            with model.trace(torch.randn(2, 4)):
                model[0].output
                with other.trace(torch.randn(1, 4)):
                    int("x")
        assert [f[2] for f in frames(info.value)] == [
            "with model.trace(torch.randn(2, 4)):", "with other.trace(torch.randn(1, 4)):",
            'int("x")']

    def test_the_users_own_context_is_kept(self):
        model = NNsight(_net())
        with pytest.raises(ValueError) as info:
            with model.trace(torch.randn(2, 4)):
                try:
                    {}["k"]
                except KeyError:
                    raise ValueError("while handling")
        assert isinstance(info.value.__context__, KeyError)

    def test_errors_the_runtime_raises_have_no_internal_context(self):
        model = NNsight(_net())
        with pytest.raises(nnsight_lite.BatchingError) as info:
            with model.trace() as tracer:
                with tracer.invoke(torch.randn(1, 4)):
                    pass
                with tracer.invoke(torch.randn(1, 5)):
                    pass
        assert info.value.__context__ is None
        assert no_runtime_frames(info.value)


    def test_an_error_raised_from_torchs_shows_no_runtime_frames_in_the_chain(self):
        """A backward block on a graph already freed: the GradientError is raised from torch's
        own error, which keeps torch's frames but had the with-statement's internal SkipBody
        as its context and the runtime's frame at its top (both printed before the user's
        error)."""
        x = torch.randn(2, 4, requires_grad=True)
        out = _net()(x).sum()
        out.backward()
        with pytest.raises(nnsight_lite.errors.GradientError, match="already freed") as info:
            with out.backward():
                g = x.grad.save()  # noqa: F841
        cause = info.value.__cause__
        assert isinstance(cause, RuntimeError) and "second time" in str(cause)
        assert cause.__context__ is None  # (the SkipBody it was raised while handling)
        assert no_runtime_frames(info.value)
        assert not any(f.filename.startswith(PACKAGE)
                       for f in traceback.extract_tb(cause.__traceback__))


class TestBlocksThatCannotRun:
    """An error raised while entering a block (its source cannot be used, its body breaks a
    rule) shows the user's `with` line, not the runtime's source lookup and body compiling."""

    def test_a_module_edited_after_import(self, tmp_path, monkeypatch):
        (tmp_path / "edited_probe.py").write_text(
            "def probe(model, x):\n    with model.trace(x):\n        o = model.output.save()\n"
            "    return o\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        import edited_probe

        (tmp_path / "edited_probe.py").write_text(
            "\n\ndef probe(model, x):\n    with model.trace(x):\n        o = model.output.mul(2).save()\n"
            "    return o\n")
        model = NNsight(_net())
        with pytest.raises(nnsight_lite.SourceUnavailableError, match="edited after") as info:
            edited_probe.probe(model, torch.randn(2, 4))
        assert no_runtime_frames(info.value)
        assert [f[:2] for f in frames(info.value)] == [
            ("test_tracebacks.py", "test_a_module_edited_after_import"),
            ("edited_probe.py", "probe")]

    def test_a_body_on_the_with_line_and_enter_called_directly(self):
        model = NNsight(_net())
        x = torch.randn(2, 4)
        with pytest.raises(nnsight_lite.errors.BodySyntaxError) as info:
            with model.trace(x): model.output.save()  # noqa: E701
        assert no_runtime_frames(info.value)
        assert frames(info.value)[-1][2] == "with model.trace(x): model.output.save()  # noqa: E701"
        with pytest.raises(nnsight_lite.errors.WithBlockNotFoundError) as info:
            model.trace(x).__enter__()
        assert no_runtime_frames(info.value)
        assert frames(info.value)[-1][2] == "model.trace(x).__enter__()"

    def test_an_edit_block(self):
        """model.edit() enters through its own `as` binding: the same short traceback."""
        model = NNsight(_net())
        with pytest.raises(nnsight_lite.errors.WithBlockNotFoundError) as info:
            model.edit().__enter__()
        assert no_runtime_frames(info.value)
        with model.edit() as edited:  # and a good edit block still binds the model
            edited[1].output[:] = 0
        x = torch.randn(2, 4)
        with edited.trace(x):
            out = edited.output.save()
        net = model._module
        assert torch.equal(out, net[2](torch.zeros(2, 8)))


def _notes(exc) -> list:
    return list(getattr(exc, "__notes__", []))


class TestWrongShapeReplacement:
    """An error the model raises after a body replaced a value with one of another shape gets a
    note per such replacement: which module's output/input, which invoke, the user's line, and
    the shape set vs the shape the model had. The error itself is PyTorch's, unchanged."""

    def test_output_of_another_shape(self):
        """A trace's one invoke sets a (3,) output where the module made (2, 8): the error in
        the next layer names model[0].output, invoke 0, this line and both shapes."""
        net = _net()
        model = NNsight(net)
        x = torch.randn(2, 4)
        with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
            with model.trace(x):
                model[0].output = torch.zeros(3)  # the bad replacement
        line = inspect.currentframe().f_lineno - 1
        assert _notes(info.value) == [
            "nnsight_lite: this may come from a replaced value: model[0].output was set by "
            f"invoke 0 at {__file__}:{line} to a tensor of shape (3,) in place of a tensor of "
            "shape (2, 8). Give it the shape the model produced there, or edit the value in "
            "place (`model[0].output[:] = ...`)."]
        with model.trace(x):  # nothing left behind: the next trace is the plain forward
            out = model.output.save()
        torch.testing.assert_close(out, net(x))

    def test_second_invoke_and_an_input(self):
        """In a batch of two invokes, invoke 1 replacing its rows' input with another shape:
        the error (here from merging the rows back) names invoke 1 and ``.input``."""
        model = NNsight(_net())
        with pytest.raises(RuntimeError) as info:
            with model.trace() as tracer:
                with tracer.invoke(torch.randn(1, 4)):
                    a = model[2].output
                with tracer.invoke(torch.randn(1, 4)):
                    model[2].input = torch.zeros(1, 5)
        (note,) = _notes(info.value)
        assert note.startswith("nnsight_lite: this may come from a replaced value: "
                               "model[2].input was set by invoke 1 at ")
        assert "a tensor of shape (1, 5) in place of a tensor of shape (1, 8)" in note

    def test_output_of_another_dtype(self):
        """A bfloat16 model whose activation a body replaces with a float32 value of the same
        shape (a float32 steering vector added to it): the next layer fails on the dtypes, as
        it does with a plain forward hook returning that value, and the error names the
        replaced output, this line and both dtypes, with the conversion to write."""
        net = _net().to(torch.bfloat16)
        x = torch.randn(2, 4, dtype=torch.bfloat16)
        steer = torch.ones(8)  # float32
        handle = net[1].register_forward_hook(lambda m, i, out: out + steer)
        with pytest.raises(RuntimeError) as plain:
            net(x)
        handle.remove()
        model = NNsight(net)
        with pytest.raises(RuntimeError) as info:
            with model.trace(x):
                model[1].output = model[1].output + steer  # promoted to float32
        line = inspect.currentframe().f_lineno - 1
        assert str(info.value) == str(plain.value)
        assert _notes(info.value) == [
            "nnsight_lite: this may come from a replaced value: model[1].output was set by "
            f"invoke 0 at {__file__}:{line} to a float32 tensor of shape (2, 8) in place of a "
            "bfloat16 tensor of shape (2, 8). Convert it to what the model produced there "
            "(`.to(torch.bfloat16)`), or edit the value in place (`model[1].output[:] = ...` "
            "converts it)."]
        with model.trace(x):  # what the note says to write works, and equals the hook's result
            model[1].output = (model[1].output + steer).to(torch.bfloat16)
            out = model.output.save()
        torch.testing.assert_close(out, net[2]((net[1](net[0](x)) + steer).to(torch.bfloat16)))

    def test_a_skip_with_a_value_of_another_shape(self):
        """.skip(value) where value's shape is not the module's input's (a skipped layer mostly
        passes that shape on): the model's error names the skipped module, the invoke, this
        line and both shapes (it had no note). A skip of the input's shape leaves no record."""
        net = _net()
        model = NNsight(net)
        x = torch.randn(2, 4)
        with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
            with model.trace(x):
                model[1].skip(torch.zeros(2, 3))  # the bad skip
        line = inspect.currentframe().f_lineno - 1
        assert _notes(info.value) == [
            "nnsight_lite: this may come from a skipped module: model[1] was skipped by invoke 0 "
            f"at {__file__}:{line} with a tensor of shape (2, 3) as its output, where its input "
            "was a tensor of shape (2, 8). Give .skip() a value of the shape, dtype and device "
            "the module returns."]
        with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
            with model.trace(x):
                model[0].output = torch.zeros(2, 5)
                model[1].skip(torch.zeros(2, 5))  # the input's shape: not noted
        (note,) = _notes(info.value)
        assert "model[0].output was set" in note

    def test_a_skip_with_a_value_of_another_dtype(self):
        """A float64 skip value of the right shape: the next layer fails on dtypes and the note
        names the skip and both dtypes (it had none: only shapes were compared); a value of
        the module's own dtype works and equals a hook returning it."""
        net = _net()
        model = NNsight(net)
        x = torch.randn(2, 4)
        with pytest.raises(RuntimeError, match="dtype") as info:
            with model.trace(x):
                model[1].skip(torch.zeros(2, 8, dtype=torch.float64))
        line = inspect.currentframe().f_lineno - 1
        assert _notes(info.value) == [
            "nnsight_lite: this may come from a skipped module: model[1] was skipped by invoke 0 "
            f"at {__file__}:{line} with a float64 tensor of shape (2, 8) as its output, where "
            "its input was a float32 tensor of shape (2, 8). Give .skip() a value of the shape, "
            "dtype and device the module returns."]
        with model.trace(x):
            model[1].skip(torch.zeros(2, 8))
            out = model.output.save()
        handle = net[1].register_forward_hook(lambda m, a, o: torch.zeros(2, 8))
        try:
            torch.testing.assert_close(out, net(x))
        finally:
            handle.remove()

    def test_a_tuple_output_set_to_a_tensor_and_back(self):
        """An attention module returns ``(out, weights)`` and its caller unpacks it: setting its
        ``.output`` to a tensor makes the caller's unpacking fail, and the note says the model
        produced a tuple there and how to set one (or edit its tensor in place); the reverse, a
        tuple set where the model produced a tensor, says to set a tensor. Both said "Give it
        the shape the model produced there, or edit the value in place (`....output[:] =
        ...`)", which a tuple cannot take."""

        class Attn(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = torch.nn.Linear(4, 4)

            def forward(self, x):
                return self.proj(x), x.sum(-1)

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.attn = Attn()
                self.mlp = torch.nn.Linear(4, 4)

            def forward(self, x):
                h, _ = self.attn(x)
                return self.mlp(h)

        torch.manual_seed(0)
        net = Block()
        model = NNsight(net)
        x = torch.randn(3, 4)
        with pytest.raises(ValueError, match="too many values to unpack") as info:
            with model.trace(x):
                out = model.attn.output
                model.attn.output = out[0] * 2  # a tensor for a tuple
        line = inspect.currentframe().f_lineno - 1
        assert _notes(info.value) == [
            "nnsight_lite: this may come from a replaced value: model.attn.output was set by "
            f"invoke 0 at {__file__}:{line} to a tensor of shape (3, 4) in place of a tuple. "
            "The model produced a tuple of 2 there: set a tuple of the same form "
            "(`model.attn.output = (new, *model.attn.output[1:])`), or edit its tensor in place "
            "(`model.attn.output[0][:] = ...`)."]
        with pytest.raises(TypeError, match="must be Tensor, not tuple") as info:
            with model.trace(x):
                h = model.attn.proj.output
                model.attn.proj.output = (h, h)  # a tuple for a tensor
        line = inspect.currentframe().f_lineno - 1
        assert _notes(info.value) == [
            "nnsight_lite: this may come from a replaced value: model.attn.proj.output was set "
            f"by invoke 0 at {__file__}:{line} to a tuple in place of a tensor of shape (3, 4). "
            "The model produced a tensor there: set a tensor of that shape, or edit the value in "
            "place (`model.attn.proj.output[:] = ...`)."]
        with model.trace(x):  # what the first note says to write works
            model.attn.output = (model.attn.output[0] * 2, *model.attn.output[1:])
            y = model.output.save()
        torch.testing.assert_close(y, net.mlp(net.attn.proj(x) * 2))

    def test_no_note_for_same_shape_or_for_a_bodys_own_error(self):
        """A same-shape replacement leaves no record; an error a body raises itself (after a
        wrong-shape replacement) is the body's and gets no replacement note."""
        net = _net()
        model = NNsight(net)
        x = torch.randn(2, 4)
        with model.trace(x):
            model[0].output = torch.zeros(2, 8)
            out = model.output.save()
        torch.testing.assert_close(out, net[2](net[1](torch.zeros(2, 8))))
        with pytest.raises(ValueError, match="mine") as info:
            with model.trace(x):
                model[0].output = torch.zeros(3)
                raise ValueError("mine")
        assert _notes(info.value) == []


SCRIPT = textwrap.dedent("""
    import torch
    from nnsight_lite import NNsight
    model = NNsight(torch.nn.Linear(4, 4))
    with model.trace(torch.randn(2, 4)):
        h = model.output
        h @ torch.ones(3, 3)
""")


@pytest.mark.parametrize("full", [False, True])
def test_printed_traceback_and_the_debug_switch(tmp_path, full):
    """Printed by Python itself: short, no SkipBody; NNSIGHT_LITE_FULL_TRACEBACK=1 keeps every
    frame for debugging the runtime."""
    script = tmp_path / "user.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, NNSIGHT_LITE_FULL_TRACEBACK="1" if full else "0")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(PACKAGE)).stderr
    assert out.rstrip().endswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied "
                                 "(2x4 and 3x3)")
    assert "SkipBody" not in out and "During handling" not in out
    if full:
        assert "interleaver.py" in out
    else:
        assert "nnsight_lite" not in out
        assert out.count('File "') == 2  # the with line and the body line
        assert len(out.splitlines()) <= 8


def test_in_an_ipython_cell_the_cells_lines_are_shown():
    IPython = pytest.importorskip("IPython")
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython() or IPython.get_ipython()
    shell.user_ns.update(torch=torch, NNsight=NNsight)
    shell.run_cell("model = NNsight(torch.nn.Linear(4, 4))")
    result = shell.run_cell(
        "with model.trace(torch.randn(2, 4)):\n"
        "    h = model.output\n"
        "    h @ torch.ones(3, 3)\n"
    )
    exc = result.error_in_exec
    assert isinstance(exc, RuntimeError)
    lines = [f.line for f in traceback.extract_tb(exc.__traceback__)
             if not f.filename.endswith("interactiveshell.py")]
    assert lines == ["with model.trace(torch.randn(2, 4)):", "h @ torch.ones(3, 3)"]
    assert exc.__context__ is None
