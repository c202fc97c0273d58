"""User mistakes get specific, located errors; nothing is ever left behind or hangs."""

from __future__ import annotations

import inspect
import re
import sys
import traceback

import pytest
import torch

from nnsight_lite import (
    MissedModuleError,
    ModulePathError,
    NNsight,
    NNsightError,
    OutOfOrderError,
    OutsideTraceError,
)
from nnsight_lite.errors import (
    InferenceModeSwitchError,
    InputError,
    InvokeError,
    NotAContainerError,
    ReusedContextError,
)


def _this_file_line(exc: BaseException, text: str) -> bool:
    """Whether the traceback of ``exc`` has a frame in this file at a line containing ``text``."""
    for fs in traceback.extract_tb(exc.__traceback__):
        if fs.filename == __file__ and text in (fs.line or ""):
            return True
    return False


class _Routed(torch.nn.Module):
    """Calls one module of a ModuleDict."""

    def __init__(self):
        super().__init__()
        self.heads = torch.nn.ModuleDict({"a": torch.nn.Linear(8, 8)})

    def forward(self, x):
        return self.heads["a"](x)


class TestOrderErrors:
    def test_errors_about_inputs_name_inputs(self, seq):
        """``.inputs`` read out of order, or of a module that never runs, is named ``.inputs``
        in the error (the input stage is ``.input`` inside: it said what the body never read),
        while the forward's own position keeps its name."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with pytest.raises(OutOfOrderError, match=r"asked for model\[1\]\.inputs at .*now at "
                                                   r"model\[2\]\.output"):
            with model.trace(x):
                b = model[2].output
                a = model[1].inputs
        routed = _Routed()
        routed.heads["b"] = torch.nn.Linear(8, 8)  # never called
        model = NNsight(routed)
        with pytest.raises(MissedModuleError, match=r"waited for model\.heads\.b\.inputs at"):
            with model.trace(torch.randn(2, 8)):
                a = model.heads.b.inputs

    def test_out_of_order_names_module_invoke_and_line(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with pytest.raises(OutOfOrderError) as info:
            with model.trace(x):
                b = model[2].output
                a = model[1].output  # the offending line
        msg = str(info.value)
        assert "model[1].output" in msg and "invoke 0" in msg
        assert f"{__file__}:" in msg and "now at model[2].output" in msg
        assert "order the model computes them" in msg
        assert _this_file_line(info.value, "the offending line")
        assert isinstance(info.value, RuntimeError)

    def test_skip_of_a_module_that_already_ran(self, seq, net, x8):
        """.skip() of a module that already ran (or never runs) names the .skip(...) the body
        wrote; it named model[0].input, which the line does not mention."""
        model = NNsight(seq)
        with pytest.raises(OutOfOrderError, match=r"invoke 0 asked for model\[0\]\.skip\(\.\.\.\) "
                           r"at .*test_errors\.py:\d+, but model\[0\] has already run") as info:
            with model.trace(torch.randn(2, 6)):
                h = model[1].output
                model[0].skip(h)  # too late
        assert ".input" not in str(info.value)
        assert _this_file_line(info.value, "too late")
        model = NNsight(net)
        with pytest.raises(MissedModuleError, match=r"waited for model\.unused\.skip\(\.\.\.\)"):
            with model.trace(x8):
                model.unused.skip(x8)

    def test_an_earlier_call_of_the_same_module(self, net, x8):
        """Asking for a module's call 0 after it has run call 1 (a read after a step loop) names
        the call asked for and the one the forward is at; it named neither call 0 nor the
        module apart ('now at model.shared.output, call 1') and spoke of 'the later module'."""
        model = NNsight(net)
        with pytest.raises(OutOfOrderError, match=r"asked for model\.shared\.output \(call 0\) "
                           r"at .*test_errors\.py:\d+, but model\.shared has already run that "
                           r"call \(the forward is now at its call 1\).*inside the loop") as info:
            with model.trace(x8) as tracer:
                for step in tracer.iter[0:2]:
                    h = model.shared.output
                last = model.shared.output  # back at call 0
        assert "the later module" not in str(info.value)
        assert _this_file_line(info.value, "back at call 0")

    def test_another_module_read_after_a_step_loop(self, net, x8):
        """A read of another module after a step loop (nnsight's iteration gotcha:
        ``model.lm_head.output`` after ``for step in tracer.all():``) says the read is at call 0
        again and that the loop ran past it, and shows the two fixes; it said only 'move this
        line above the access to the later module', naming no call and no loop (nnsight 0.8.1:
        "'model.lm_head.output.i0' was requested but the model already ran past it"). The empty
        invoke it suggests reads the value a plain hook sees."""
        model = NNsight(net)
        with pytest.raises(OutOfOrderError, match=r"asked for model\.inp\.output \(call 0\) at "
                           r".*test_errors\.py:\d+, after a step loop .*had run the model past "
                           r"that call.*a read is at call 0.*`if step == k:`.*empty `with "
                           r"tracer\.invoke\(\):`") as info:
            with model.trace() as tracer:
                with tracer.invoke(x8):
                    for step in tracer.iter[0:2]:
                        h = model.shared.output
                    out = model.inp.output  # after the loop
        assert _this_file_line(info.value, "after the loop")
        with pytest.raises(OutOfOrderError, match="move this line above") as info:
            with model.trace(x8):  # no loop: the plain message
                h = model.shared.output.save()
                i = model.inp.output
        assert "step loop" not in str(info.value)
        seen = []
        handle = net.inp.register_forward_hook(lambda m, a, o: seen.append(o))
        with torch.no_grad():
            net(x8)
        handle.remove()
        with model.trace() as tracer:
            with tracer.invoke(x8):
                for step in tracer.iter[0:2]:
                    h = model.shared.output
            with tracer.invoke():
                out = model.inp.output.save()
        torch.testing.assert_close(out, seen[0])

    def test_module_that_never_runs(self, net, x8):
        model = NNsight(net)
        with pytest.raises(MissedModuleError, match=r"model\.unused\.output .*never ran") as info:
            with model.trace(x8):
                u = model.unused.output  # never called
        assert _this_file_line(info.value, "never called")

    def test_a_container_that_is_never_called(self, net, x8):
        """.output of a ModuleList (a container, never called) says so and names a child to read
        instead (it said the module may be defined but unused)."""
        model = NNsight(net)
        with pytest.raises(MissedModuleError, match=r"model\.layers is a ModuleList, a container "
                           r"that is never called itself.*e\.g\. model\.layers\[-1\]\.output"):
            with model.trace(x8):
                model.layers.output
        model = NNsight(_Routed())
        with pytest.raises(MissedModuleError, match=r"model\.heads is a ModuleDict.*no \.input "
                           r"of its own.*e\.g\. model\.heads\['a'\]\.input"):
            with model.trace(x8):
                model.heads.input

    def test_a_module_that_only_holds_parameters(self):
        """A plain ``torch.nn.Module`` that only holds parameters its parent's code uses directly
        (what a torch.export'ed program's ``module()`` keeps for each submodule): its ``.output``
        said it was "a container that is never called itself ... Read one of the modules it
        holds instead", though it holds none. It says what it is and where to look."""

        class UsesWeights(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inp = torch.nn.Module()
                self.inp.weight = torch.nn.Parameter(torch.randn(8, 4))

            def forward(self, x):
                return torch.nn.functional.linear(x, self.inp.weight)

        torch.manual_seed(0)
        net = UsesWeights()
        x = torch.randn(2, 4)
        model = NNsight(net)
        with model.trace(x):
            out = model.output.save()
        torch.testing.assert_close(out, net(x))
        with pytest.raises(MissedModuleError, match=r"model\.inp is a plain Module with no "
                           r"forward and no modules of its own: it only holds parameters.*Read "
                           r"the operation that uses them in model\.source"):
            with model.trace(x):
                model.inp.output

    def test_call_index_past_last_call(self, net, x8):
        model = NNsight(net)
        with pytest.raises(MissedModuleError, match=r"ran only 2 time\(s\).*call 2"):
            with model.trace(x8):
                a = model.shared.output
                b = model.shared.next().output
                c = model.shared.next().output

    def test_a_step_back_before_call_0(self, net, x8):
        """.next(-1) at call 0 raises InputError at once (it asked for 'call -1' and said the
        module had already run it); a step back after a .next() still works."""
        model = NNsight(net)
        with pytest.raises(InputError, match=r"model\.shared\.next\(-1\) at .*test_errors\.py:"
                           r"\d+ steps back past the first call: this body's reads are at call 0"):
            with model.trace(x8):
                model.shared.next(-1).output
        with pytest.raises(InputError, match=r"^tracer\.next\(-2\) at .*call 1, and calls count"):
            with model.trace(x8) as tracer:
                tracer.next()
                tracer.next(-2)
        with model.trace(x8) as tracer:
            tracer.next()
            tracer.next(-1)  # back at call 0
            first = model.shared.output.save()
            second = model.shared.next().output.save()
        assert not torch.equal(first, second)

    def test_reading_after_the_trace(self, seq):
        model = NNsight(seq)
        with pytest.raises(OutsideTraceError, match=r"model\[0\]\.output was read outside"):
            model[0].output

    def test_setting_or_skipping_after_the_trace(self, seq):
        """A write or a skip outside a trace is named as such, with the advice for edits (it
        said the value was read, and to call .save())."""
        model = NNsight(seq)
        with pytest.raises(OutsideTraceError, match=r"model\[0\]\.output was set outside a "
                           r"trace body \(at .*test_errors\.py:\d+\).*model\.edit") as info:
            model[0].output = torch.zeros(2, 6)
        assert "read" not in str(info.value) and ".save()" not in str(info.value)
        with pytest.raises(OutsideTraceError, match=r"model\[0\]\.inputs was set outside"):
            model[0].inputs = ((torch.zeros(2, 6),), {})
        with pytest.raises(OutsideTraceError, match=r"model\[1\]\.skip\(\) was called outside "
                           r"a trace body") as info:
            model[1].skip(torch.zeros(2, 6))
        assert "read" not in str(info.value) and ".save()" not in str(info.value)
        with pytest.raises(OutsideTraceError, match=r"^tracer\.next\(\) was called outside"):
            with model.trace(torch.randn(2, 6)) as tracer:
                pass
            tracer.next()

    def test_misspelled_module_lists_near_matches(self, net):
        model = NNsight(net)
        with pytest.raises(ModulePathError, match=r"no submodule or attribute 'layres'.*'layers'"):
            model.layres
        with pytest.raises(AttributeError):
            model.layres  # also an AttributeError, so hasattr works
        assert not hasattr(model, "nonexistent")

    def test_index_out_of_range(self, net):
        model = NNsight(net)
        with pytest.raises(IndexError, match=r"model\.layers\[7\]"):
            model.layers[7]

    def test_a_bad_index_or_key_names_the_line(self, net, x8):
        """An index past a ModuleList's end names the user's line (as a misspelled name's
        error does; it named none); a key a ModuleDict lacks names the line and the keys it
        has (it said "model.heads['b']: 'b' (ModuleDict of length 1)"). Raised in a body,
        the trace leaves nothing behind and the next one is the plain forward."""
        model = NNsight(net)
        with pytest.raises(IndexError, match=r"model\.layers\[99\] at .*test_errors\.py:\d+: "
                           r"index 99 is out of range \(ModuleList of length 3\)") as info:
            with model.trace(x8):
                h = model.layers[99].output  # past the end
        assert _this_file_line(info.value, "past the end")
        routed = NNsight(_Routed())
        with pytest.raises(KeyError, match=r"model\.heads\['b'\] at .*test_errors\.py:\d+: no "
                           r"module under 'b' \(ModuleDict of length 1; its keys: a\)"):
            routed.heads["b"]
        with model.trace(x8):
            out = model.output.save()
        torch.testing.assert_close(out["logits"], net(x8)["logits"])

    def test_indexing_a_module_that_is_not_a_container(self, net):
        """model["layers"] on a module that is no container raises NotAContainerError (a
        TypeError) naming the index, the line and the attribute to use; it raised the
        internal "object of type 'Net' has no len()"."""
        model = NNsight(net)
        with pytest.raises(NotAContainerError, match=r"^model\['layers'\] at .*test_errors\.py:"
                           r"\d+: model \(Net\) is not a container of modules: indexing works .*"
                           r"reach it as model\.layers\.$"):
            model["layers"]
        with pytest.raises(TypeError, match=r"model\.inp \(Linear\) is not a container.*print"):
            model.inp[0]

    def test_trace_body_reads_other_models_values(self, seq, net, x8):
        a, b = NNsight(seq), NNsight(net)
        with pytest.raises(OutsideTraceError, match="not part of the model being traced"):
            with b.trace(x8):
                a[0].output

    def test_another_models_values_where_its_trace_is_open(self, seq, net, x8):
        """Two traces in one `with` statement, or one nested in another: the body belongs to
        the last / innermost, and a read of the other model's value says so and where to read
        it. It said to open a trace on that model, which was open."""
        a, b = NNsight(seq), NNsight(net)
        x = torch.randn(3, 6)
        with pytest.raises(OutsideTraceError, match=r"^model\[0\] is not part of the model being "
                           r"traced here \(at .*test_errors\.py:\d+\): a body reads the values "
                           r"of the model of the innermost trace.*the last of them") as info:
            with a.trace(x), b.trace(x8):
                a[0].output
        assert "Open a trace on that model" not in str(info.value)
        with pytest.raises(OutsideTraceError, match=r"A trace of that model is open around this "
                           r"one: read its values in that trace's body, outside this inner"):
            with a.trace(x):
                with b.trace(x8):
                    a[0].output
        with a.trace(x):  # the way the message says
            h = a[0].output
            with b.trace(x8):
                g = (b.inp.output.sum() + h.sum()).save()
        assert g.shape == ()

    def test_an_envoy_kept_from_before_its_module_was_replaced(self, seq):
        """An Envoy held in a variable while its module is replaced in the model stands for
        the old module: the error says so and how to reach the new one (it said the module
        was not part of the model being traced, and to open a trace on that model)."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        layer = model[2]
        seq[2] = torch.nn.Linear(6, 6)
        with pytest.raises(OutsideTraceError) as info:
            with model.trace(x):
                layer.output
        text = str(info.value)
        assert "before it was replaced" in text and "read it through the model again" in text
        assert "model[2]" in text and f"{__file__}:" in text
        with model.trace(x):  # read through the model: the new module
            out = model[2].output.save()
        torch.testing.assert_close(out, seq[2](seq[1](seq[0](x))))

    def test_a_module_put_in_during_the_trace(self, seq):
        """A module put into the model by a body is not followed by that trace: the error
        says it was put in after the trace began, and to read it in the next trace."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with pytest.raises(OutsideTraceError, match="put into the model after this trace began"):
            with model.trace(x):
                seq[2] = torch.nn.Linear(6, 6)
                model[2].output
        with model.trace(x):
            out = model[2].output.save()
        torch.testing.assert_close(out, seq[2](seq[1](seq[0](x))))

    def test_a_module_removed_from_the_model(self, net, x8):
        """An Envoy of a module that has left the model (deleted) says it is no longer part of
        the model."""
        model = NNsight(net)
        gone = model.unused
        del net.unused
        with pytest.raises(OutsideTraceError, match="no longer part of the model"):
            with model.trace(x8):
                gone.output


def _edit_label(lineno: int) -> str:
    return f"the model's persistent edit (made by `with model.edit(...)` at {__file__}:{lineno})"


class TestEditErrors:
    """A mistake in a persistent edit's body, met while a later trace runs it, is named by the
    edit's ``with model.edit(...)`` line, not as one of the trace's invokes; the trace's own
    invokes keep their numbers from 0; and the model is left clean and usable."""

    def test_out_of_order_read_in_an_edit(self, seq):
        """An edit that reads a module after a later one raises OutOfOrderError naming the
        edit's with line and the offending line; after clear_edits the model traces as plain."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        made_at = inspect.currentframe().f_lineno + 1
        with model.edit(inplace=True):
            b = model[2].output
            model[1].output[:] = 0  # edit reads too late
        with pytest.raises(OutOfOrderError) as info:
            with model.trace(x):
                out = model.output.save()
        msg = str(info.value)
        assert msg.startswith(_edit_label(made_at) + " asked for model[1].output at ")
        assert "invoke 0" not in msg
        assert _this_file_line(info.value, "edit reads too late")
        model.clear_edits()
        with model.trace(x):
            out = model.output.save()
        torch.testing.assert_close(out, seq(x))

    def test_edit_waiting_for_a_module_that_never_runs(self, net, x8):
        """An edit reading an unused module raises MissedModuleError naming the edit."""
        model = NNsight(net)
        made_at = inspect.currentframe().f_lineno + 1
        with model.edit() as edited:
            u = edited.unused.output
        with pytest.raises(MissedModuleError, match=r"model\.unused\.output .*never ran") as info:
            with edited.trace(x8):
                out = edited.output.save()
        assert str(info.value).startswith(_edit_label(made_at) + " waited for")
        with model.trace(x8):  # the unedited model is untouched
            out = model.output.save()
        torch.testing.assert_close(out, net(x8))

    def test_users_exception_in_an_edit_gets_a_note(self, seq):
        """The edit's own exception reaches the caller unchanged, with a note naming the edit
        and how to remove it."""
        model = NNsight(seq)
        err = ValueError("edit broke")
        made_at = inspect.currentframe().f_lineno + 1
        with model.edit(inplace=True):
            model[0].output[:] = 0
            raise err
        with pytest.raises(ValueError) as info:
            with model.trace(torch.randn(2, 6)):
                out = model.output.save()
        assert info.value is err
        notes = getattr(info.value, "__notes__", [])
        assert notes == [f"nnsight_lite: raised in {_edit_label(made_at)}, which runs in every "
                         "trace of this model before the trace's own bodies; "
                         "model.clear_edits() removes it"]

    def test_invokes_after_an_edit_count_from_zero(self, seq):
        """With an edit, the trace's own invokes are still invoke 0, 1, ...: invoke 1's
        out-of-order read says invoke 1."""
        model = NNsight(seq)
        with model.edit(inplace=True):
            model[0].output[:] = 0
        with pytest.raises(OutOfOrderError, match=r"^invoke 1 asked for model\[0\]\.output"):
            with model.trace() as tracer:
                with tracer.invoke(torch.randn(1, 6)):
                    a = model[2].output
                with tracer.invoke(torch.randn(1, 6)):
                    b = model[3].output
                    c = model[0].output


class TestUserExceptions:
    def test_user_exception_reaches_caller_unchanged(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        err = ValueError("mine")
        with pytest.raises(ValueError) as info:
            with model.trace(x):
                h = model[1].output
                raise err  # user raise
        assert info.value is err
        assert _this_file_line(info.value, "user raise")
        assert not isinstance(info.value, NNsightError)

    @pytest.mark.parametrize("given, what", [("hello", "a str ('hello')"),
                                             ([1, 2, 3], "a list of int")])
    def test_text_or_plain_numbers_given_to_nnsight(self, seq, given, what):
        """Text or a list of numbers passed to an NNsight model's trace reaches its forward as
        it is, where torch raises TypeError at the model's line: a note says NNsight passes
        inputs unchanged, what it got, and what to pass (a tensor; LanguageModel for text).
        Torch's message is unchanged, and had no such note."""
        model = NNsight(seq)
        with pytest.raises(TypeError) as plain:
            seq(given)
        with pytest.raises(TypeError) as info:
            with model.trace(given):
                h = model[0].output
        assert str(info.value) == str(plain.value)
        assert getattr(info.value, "__notes__", []) == [
            "nnsight_lite: NNsight passes the inputs of model.trace(...) to Sequential.forward "
            f"as they are, and it got {what}. Pass what the module takes (a tensor: "
            "torch.tensor(...)); for text, LanguageModel tokenizes it."]
        x = torch.randn(2, 6)
        with model.trace(x):
            out = model.output.save()
        torch.testing.assert_close(out, seq(x))

    def test_no_raw_input_note_for_a_string_option_and_another_type_error(self):
        """A forward that takes a string option (`model.trace(x, "mean")`) and raises a
        TypeError of its own (here torch.cat given a tensor, not a sequence) gets torch's error
        alone, as plain PyTorch gives it: the note saying NNsight passed text where a tensor
        belongs was given for any TypeError while some input was a str."""

        class Pool(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(6, 6)

            def forward(self, x, how):
                h = self.fc(x)
                return torch.cat(h, 1) if how == "cat" else h.mean(0)

        net = Pool()
        x = torch.randn(2, 6)
        with pytest.raises(TypeError) as plain:
            net(x, "cat")
        model = NNsight(net)
        with pytest.raises(TypeError) as info:
            with model.trace(x, "cat"):
                h = model.fc.output.save()
        assert str(info.value) == str(plain.value)
        assert getattr(info.value, "__notes__", []) == []
        with model.trace(x, "mean"):
            out = model.output.save()
        torch.testing.assert_close(out, net(x, "mean"))

    def test_inputs_set_to_a_tensor(self, seq):
        """``.inputs = tensor`` (not an (args, kwargs) pair) raises InputError, a TypeError and
        a ValueError (nnsight 0.8 raises ValueError; it was a TypeError only), naming the line
        and saying to set .input instead."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with pytest.raises(InputError, match=r"model\[1\]\.inputs must be set to an \(args, "
                           r"kwargs\) pair, got Tensor \(at .*test_errors\.py:\d+\); to replace "
                           r"the first argument set \.input instead") as info:
            with model.trace(x):
                model[1].inputs = torch.zeros(2, 6)  # not a pair
        assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
        assert _this_file_line(info.value, "not a pair")
        with model.trace(x):
            model[1].input = torch.zeros(2, 6)
            out = model.output.save()
        torch.testing.assert_close(out, seq[1:](torch.zeros(2, 6)))

    def test_error_before_any_request(self, seq):
        model = NNsight(seq)
        with pytest.raises(ZeroDivisionError):
            with model.trace(torch.randn(2, 6)):
                1 / 0

    @pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
    def test_cleanup_after_error(self, seq, exc):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        before = seq(x)
        with pytest.raises(exc):
            with model.trace(x):
                model[1].output[:] = 0
                raise exc()
        # model runs unedited, no wrappers left (the autouse fixture also checks)
        torch.testing.assert_close(seq(x), before)
        assert all("forward" not in m.__dict__ for m in seq.modules())

    @pytest.mark.parametrize("invokes", [1, 2])
    def test_a_body_error_the_models_own_except_catches_still_reaches_the_caller(self,
                                                                             invokes):
        """A body's error is raised into the forward at the module call that served it; a
        model that wraps that call in ``try/except Exception`` (a fallback path) swallowed it:
        the trace ended with no error, the rest of the body never ran and its names were
        missing. The error now reaches the with-statement when the forward ends, with a note
        saying the model caught it; nothing is left behind and the model is exact after."""
        torch.manual_seed(0)

        class Fallback(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Linear(4, 4)
                self.b = torch.nn.Linear(4, 4)
                self.c = torch.nn.Linear(4, 2)

            def forward(self, x):
                try:
                    h = self.a(x)
                except Exception:
                    h = self.b(x)
                return self.c(h)

        net = Fallback()
        model = NNsight(net)
        x = torch.randn(3, 4)
        err = ValueError("a bug in my intervention")
        with pytest.raises(ValueError) as info:
            if invokes == 1:
                with model.trace(x):
                    h = model.a.output
                    raise err  # user raise
            else:
                with model.trace() as tracer:
                    with tracer.invoke(x):
                        h = model.a.output
                        raise err  # user raise
                    with tracer.invoke(x):
                        out = model.output.save()
        assert info.value is err and _this_file_line(info.value, "user raise")
        assert any("the model's own code caught this error" in n
                   for n in getattr(info.value, "__notes__", []))
        with model.trace(x):
            out = model.output.save()
        torch.testing.assert_close(out, net(x))

    def test_the_output_of_a_module_that_raised_inside_a_caught_call(self):
        """A module that raises where the model catches the error has no output: reading it
        says so (it said the module 'ran only 1 time(s), so call 0 never happened')."""
        class Flaky(torch.nn.Module):
            def forward(self, x):
                raise RuntimeError("no kernel for this input")

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = Flaky()
                self.b = torch.nn.Linear(4, 4)

            def forward(self, x):
                try:
                    return self.a(x)
                except RuntimeError:
                    return self.b(x)

        model = NNsight(Net())
        with pytest.raises(MissedModuleError, match=r"invoke 0 waited for model.a.output at "
                           r".*test_errors.py:\d+, but model.a began that call and raised before "
                           r"it returned \(the model's own code caught the error"):
            with model.trace(torch.randn(2, 4)):
                out = model.a.output.save()

    def test_error_in_model_forward(self):
        class Bad(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(2, 2)

            def forward(self, x):
                self.lin(x)
                raise KeyError("model broke")

        model = NNsight(Bad())
        with pytest.raises(KeyError, match="model broke"):
            with model.trace(torch.randn(1, 2)):
                h = model.lin.output.save()
                o = model.output


class TestTorchModes:
    def test_no_grad_inside_body_does_not_leak_into_model(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with model.trace(x):
            with torch.no_grad():
                a = model[0].output  # waits inside no_grad
                b = model[2].output.save()
            out = model[3].output.save()
        assert b.requires_grad, "model[1..2] must run with grad even though the body waited in no_grad"
        assert out.requires_grad

    def test_grad_mode_restored_after_error(self, seq):
        model = NNsight(seq)
        with pytest.raises(RuntimeError):
            with model.trace(torch.randn(2, 6)):
                torch.set_grad_enabled(False)
                model[0].output
                raise RuntimeError("x")
        assert torch.is_grad_enabled()

    def test_trace_inside_no_grad(self, seq):
        model = NNsight(seq)
        with torch.no_grad():
            with model.trace(torch.randn(2, 6)):
                h = model[1].output.save()
        assert not h.requires_grad

    def test_waiting_inside_inference_mode_is_an_error(self, seq):
        model = NNsight(seq)
        with pytest.raises(InferenceModeSwitchError, match="inference_mode"):
            with model.trace(torch.randn(2, 6)):
                with torch.inference_mode():
                    model[0].output
                    model[1].output
        assert not torch.is_inference_mode_enabled()

    def test_waiting_inside_inference_mode_names_the_value_and_line(self, seq):
        """The error names what the body waited for and the line; it said only "waited for a
        module value"."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with pytest.raises(InferenceModeSwitchError, match=r"invoke 0 waited for "
                           r"model\[1\]\.output at .*test_errors\.py:\d+ inside its own "
                           r"torch\.inference_mode\(\) block") as info:
            with model.trace(x):
                with torch.inference_mode():
                    h = model[1].output  # waits here
        assert _this_file_line(info.value, "waits here")
        with model.trace(x):
            out = model.output.save()
        torch.testing.assert_close(out, seq(x))

    def test_trace_inside_inference_mode(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with torch.inference_mode():
            with model.trace(x):
                h = model[3].output.save()
        torch.testing.assert_close(h, seq(x))


def test_reading_values_in_a_trace_without_inputs(seq):
    model = NNsight(seq)
    with pytest.raises(OutsideTraceError, match=r"trace that was given no inputs.*tracer\.invoke"):
        with model.trace() as tracer:
            model[0].output


class TestMisplacedInvokes:
    """``tracer.invoke(...)`` where no invoke can be added raises InvokeError (a RuntimeError)
    that names the line and says which of the three mistakes it is; the trace leaves nothing
    behind (the autouse fixture checks hooks and greenlets)."""

    def test_an_invoke_inside_another_invokes_body(self, seq):
        model = NNsight(seq)
        with pytest.raises(InvokeError, match=r"at .*test_errors\.py:\d+ .*inside another "
                           r"invoke's body") as info:
            with model.trace() as tracer:
                with tracer.invoke(torch.randn(1, 6)):
                    model[0].output
                    with tracer.invoke(torch.randn(1, 6)):  # nested: the mistake
                        pass
        assert isinstance(info.value, RuntimeError)
        assert _this_file_line(info.value, "nested: the mistake")

    def test_an_invoke_in_a_trace_given_inputs(self, seq):
        model = NNsight(seq)
        with pytest.raises(InvokeError, match=r"model\.trace\(\.\.\.\) itself was given inputs"):
            with model.trace(torch.randn(1, 6)) as tracer:
                with tracer.invoke(torch.randn(1, 6)):
                    pass

    def test_an_invoke_after_the_trace(self, seq):
        model = NNsight(seq)
        with model.trace() as tracer:
            with tracer.invoke(torch.randn(1, 6)):
                pass
        with pytest.raises(InvokeError, match=r"its trace is not running"):
            tracer.invoke(torch.randn(1, 6))



class TestReusedContexts:
    """A ``model.trace(...)``, ``tracer.invoke(...)`` or ``model.edit()`` object runs one
    with-block; entering it again raises ReusedContextError (a RuntimeError) naming the call and
    the user's line. A reused tracer had said its trace "was given no inputs" (it had been; the
    block's end lets go of them), or raised AttributeError ('NoneType' object has no attribute
    '_prepare_inputs') with invokes; a reused invoke ran its second body twice, silently (the
    first one's names were never bound); a reused editor raised AttributeError and left the
    body-skipping trace function set (sys.gettrace(), checked by the autouse fixture)."""

    def test_a_tracer_entered_again(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        tracer = model.trace(x)
        with tracer:
            first = model[1].output.save()
        with pytest.raises(ReusedContextError, match=r"with-statement at .*test_errors\.py:\d+ "
                           r"enters a model\.trace\(\.\.\.\) object that has run its block "
                           r"already.*Call model\.trace\(\.\.\.\) again") as info:
            with tracer:  # the second time
                again = model[1].output.save()
        assert isinstance(info.value, RuntimeError)
        assert "no inputs" not in str(info.value)
        assert _this_file_line(info.value, "the second time")
        with model.trace(x):
            out = model.output.save()
        torch.testing.assert_close(out, seq(x))
        torch.testing.assert_close(first, seq[:2](x))

    def test_a_tracer_of_invokes_entered_again(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        tracer = model.trace()
        with tracer:
            with tracer.invoke(x):
                first = model[1].output.save()
        with pytest.raises(ReusedContextError, match=r"model\.trace\(\.\.\.\)"):
            with tracer:
                with tracer.invoke(x):
                    again = model[1].output.save()
        torch.testing.assert_close(first, seq[:2](x))

    def test_an_invoke_entered_again(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with pytest.raises(ReusedContextError, match=r"with-statement at .*test_errors\.py:\d+ "
                           r"enters a tracer\.invoke\(\.\.\.\) object that has run its block "
                           r"already") as info:
            with model.trace() as tracer:
                invoke = tracer.invoke(x)
                with invoke:
                    a = model[1].output.save()
                with invoke:  # reused
                    b = model[2].output.save()
        assert _this_file_line(info.value, "reused")
        with model.trace(x):
            out = model.output.save()
        torch.testing.assert_close(out, seq(x))

    def test_an_edit_entered_again(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        editor = model.edit()
        with editor as edited:
            edited[1].output[:] = 0
        with pytest.raises(ReusedContextError, match=r"with-statement at .*test_errors\.py:\d+ "
                           r"enters a model\.edit\(\) object that has run its block "
                           r"already") as info:
            with editor as again:  # reused
                again[2].output[:] = 0
        assert _this_file_line(info.value, "reused")
        assert sys.gettrace() is None
        with edited.trace(x):  # the first edit only
            out = edited.output.save()
        torch.testing.assert_close(out, seq[2:](torch.zeros(2, 6)))
        with model.trace(x):
            plain = model.output.save()
        torch.testing.assert_close(plain, seq(x))

    def test_a_session_may_run_again(self, seq):
        """A session object runs each block it is entered with (it holds no inputs)."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        session = model.session()
        outs = []
        for _ in range(2):
            with session:
                with model.trace(x):
                    out = model.output.save()
            outs.append(out)
        torch.testing.assert_close(outs[0], seq(x))
        torch.testing.assert_close(outs[1], seq(x))

def test_nnsight_code_catching_value_error_still_catches(seq, net, x8):
    """nnsight 0.8 raises ValueError for a value read outside a trace and for a module call
    that never happened; code written for it (``except ValueError``) catches ours too."""
    with pytest.raises(ValueError, match="outside a trace body"):
        NNsight(seq)[0].output
    model = NNsight(net)
    with pytest.raises(ValueError, match="never ran"):
        with model.trace(x8):
            model.unused.output


def test_every_exception_type_is_importable_from_the_package():
    """The README says every exception type is importable from ``nnsight_lite``
    (``from nnsight_lite import GradientError``): each NNsightError subclass that errors.py
    defines is there, as the same class, and in ``__all__``."""
    import nnsight_lite
    import nnsight_lite.errors as errors

    defined = [c for c in vars(errors).values() if inspect.isclass(c)
               and issubclass(c, errors.NNsightError) and c.__module__ == errors.__name__]
    assert len(defined) > 10
    for cls in defined:
        assert getattr(nnsight_lite, cls.__name__, None) is cls, cls.__name__
        assert cls.__name__ in nnsight_lite.__all__, cls.__name__


def _skip_first(tracer, model, h):
    model[0].skip(h)


def _set_output(tracer, model, h):
    model[0].output = h


def _loop_over_steps(tracer, model, h):
    for step in tracer.iter[0:1]:
        pass


class TestForwardOperationsInABackwardBlock:
    """What acts on the model's forward (tracer.result, tracer.cache(), tracer.next(),
    tracer.iter, module.skip(), setting .output) used inside a `with loss.backward():` block
    raises OutsideTraceError saying it cannot be used there (the forward is over), at the
    user's line, and to use it in the trace body before the block. It had said the trace was
    given no inputs, that the call was outside a trace body, or garbled the name (`a
    module.tracer.next()`, "bind `h = model[0].skip()`")."""

    @pytest.mark.parametrize("op, name", [
        (lambda tracer, model, h: tracer.result, "tracer.result"),
        (lambda tracer, model, h: tracer.cache(), r"tracer\.cache\(\)"),
        (lambda tracer, model, h: tracer.next(), r"tracer\.next\(\)"),
        (_loop_over_steps, r"tracer\.iter\[\.\.\.\]"),
        (_skip_first, r"model\[0\]\.skip\(\)"),
        (_set_output, r"model\[0\]\.output"),
    ])
    def test_says_it_cannot_be_used_there(self, seq, op, name):
        model = NNsight(seq)
        with pytest.raises(OutsideTraceError) as info:
            with model.trace(torch.randn(2, 6)) as tracer:
                h = model[0].output
                with model.output.sum().backward():
                    op(tracer, model, h)
        text = str(info.value)
        assert re.match(rf"{name} cannot be used inside a `with loss.backward\(\):` block "
                        rf"\(at {re.escape(__file__)}:\d+\)", text), text
        assert "the forward is over" in text and "in the trace body, before" in text
        assert "given no inputs" not in text and "a module." not in text

    def test_a_barrier(self, seq):
        """tracer.barrier()'s call in a backward block inside an invoke said it was outside an
        invoke body (while its note said invoke 0); the other invoke does not hang."""
        model = NNsight(seq)
        x = torch.randn(1, 6)
        with pytest.raises(OutsideTraceError, match=r"tracer\.barrier\(\) cannot be used inside "
                           r"a `with loss.backward\(\):` block .*before or after") as info:
            with model.trace() as tracer:
                b = tracer.barrier(2)
                with tracer.invoke(x):
                    h = model[0].output
                    with model.output.sum().backward():
                        b()  # in the backward block
                with tracer.invoke(x):
                    b()
                    model[0].output
        assert "outside an invoke body" not in str(info.value)
        assert _this_file_line(info.value, "in the backward block")


class _Base:
    def scale(self):
        return 2.0


class _Probe(_Base):
    def run(self, model, x):
        with model.trace(x):
            s = super().scale()  # zero-argument super in a body
            o = (model[0].output * s).save()
        return o


class TestNotesOnABodysOwnCode:
    """Errors a body's code raises because it runs as its own block of code, not as lines of
    the function around it, reach the user unchanged with a note saying what to write; they
    had none."""

    def test_zero_argument_super(self, seq):
        model = NNsight(seq)
        with pytest.raises(RuntimeError, match=r"^super\(\): no arguments") as info:
            _Probe().run(model, torch.randn(2, 6))
        assert _notes(info.value) == [
            "nnsight_lite: a `with` block's body runs as its own block of code, so a "
            "zero-argument super() there has no class or self to go by: write "
            "super(_Probe, self) in the body, or call it before the block."]
        assert _this_file_line(info.value, "zero-argument super in a body")

    def test_del_of_a_name_of_the_enclosing_function(self, seq):
        model = NNsight(seq)
        cache = {"big": torch.zeros(3)}
        with pytest.raises(NameError, match="'cache'") as info:
            with model.trace(torch.randn(2, 6)):
                n = len(cache)  # readable
                del cache
        assert _notes(info.value) == [
            "nnsight_lite: 'cache' is a variable of the code around the `with` block; its body "
            "reads it, but runs as its own block of code and cannot unbind it. Write "
            "`del cache` after the block."]
        with pytest.raises(NameError) as info:
            with model.trace(torch.randn(2, 6)):
                undefined_name  # noqa: B018, F821
        assert _notes(info.value) == []


class TestUnsavedNames:
    """A name one block bound without .save() is gone when the block ends (as in nnsight);
    a later block of the same code reading it raised a bare NameError. It gets a note naming
    the block that bound it and what to write (save it there, or hold both blocks in a
    session, which hands every name on)."""

    def test_a_name_an_earlier_trace_bound_without_saving(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with model.trace(x):
            h = model[1].output  # bound, not saved
        first = next(i for i, text in enumerate(open(__file__), 1)
                     if text.rstrip().endswith("# bound, not saved")) - 1
        with pytest.raises(NameError, match="'h'") as info:
            with model.trace(x):
                model[1].output[:] = h * 2  # the later read
        assert _notes(info.value) == [
            f"nnsight_lite: 'h' is bound in the body of the `with` block at {__file__}:"
            f"{first}, but a block keeps only the names it saved, so it was dropped when that "
            "block ended. Save it there (`h = ....save()`), or put both blocks in `with "
            "model.session():`, which hands every name on to the next block."]
        assert _this_file_line(info.value, "the later read")
        with model.session():  # what the note says works
            with model.trace(x):
                h = model[1].output
            with model.trace(x):
                model[1].output[:] = h * 2
                out = model.output.save()
        torch.testing.assert_close(out, seq[2:](seq[:2](x) * 2))

    def test_read_in_an_invoke(self, seq):
        """The same where the later read is in an invoke (whose missing name waits for the
        other invokes before it raises)."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with model.trace(x):
            h = model[1].output  # bound here, not saved
        first = next(i for i, text in enumerate(open(__file__), 1)
                     if text.rstrip().endswith("# bound here, not saved")) - 1
        with pytest.raises(NameError, match="'h'") as info:
            with model.trace() as tracer:
                with tracer.invoke(x):
                    model[1].output[:] = h
        assert len(_notes(info.value)) == 1
        assert _notes(info.value)[0].startswith(
            f"nnsight_lite: 'h' is bound in the body of the `with` block at {__file__}:{first}, "
            "but a block keeps only the names it saved")

    def test_across_notebook_cells(self, seq):
        """The same across two cells of a notebook (two code objects at the top level of one
        namespace), where the mistake is most often made."""
        import linecache

        model = NNsight(seq)
        ns = {"model": model, "x": torch.randn(2, 6)}
        cells = ["with model.trace(x):\n    h = model[1].output\n",
                 "with model.trace(x):\n    model[1].output[:] = h\n"]
        names = [f"<nnsight-lite-test-cell-{i}>" for i in range(2)]
        for src, name in zip(cells, names):
            linecache.cache[name] = (len(src), None, src.splitlines(True), name)
        try:
            exec(compile(cells[0], names[0], "exec"), ns)
            with pytest.raises(NameError, match="'h'") as info:
                exec(compile(cells[1], names[1], "exec"), ns)
        finally:
            for name in names:
                linecache.cache.pop(name, None)
        assert len(_notes(info.value)) == 1
        assert _notes(info.value)[0].startswith(
            f"nnsight_lite: 'h' is bound in the body of the `with` block at {names[0]}:1, but a "
            "block keeps only the names it saved")
        assert "h" not in ns

    def test_no_note_where_the_block_saved_the_name_but_failed(self, seq):
        """A block that saves the name but raised before binding it (caught around it) did
        not drop it unsaved: the later block's NameError gets no note telling the user to
        save it (they did)."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with pytest.raises(AttributeError):
            with model.trace(x):
                model[1].output.no_such_method()
                h = model[1].output.save()
        with pytest.raises(NameError, match="'h'") as info:
            with model.trace(x):
                model[1].output[:] = h
        assert _notes(info.value) == []
        # (the plain-PyTorch value the block would have saved, had it run to the end)
        with model.trace(x):
            h = model[1].output.save()
        torch.testing.assert_close(h, seq[:2](x))

    def test_no_note_across_cells_where_the_cell_saved_the_name_but_failed(self, seq):
        import linecache

        model = NNsight(seq)
        ns = {"model": model, "x": torch.randn(2, 6)}
        cells = ["with model.trace(x):\n    model[1].output.no_such_method()\n"
                 "    h = model[1].output.save()\n",
                 "with model.trace(x):\n    model[1].output[:] = h\n"]
        names = [f"<nnsight-lite-test-failed-cell-{i}>" for i in range(2)]
        for src, name in zip(cells, names):
            linecache.cache[name] = (len(src), None, src.splitlines(True), name)
        try:
            with pytest.raises(AttributeError):
                exec(compile(cells[0], names[0], "exec"), ns)
            with pytest.raises(NameError, match="'h'") as info:
                exec(compile(cells[1], names[1], "exec"), ns)
        finally:
            for name in names:
                linecache.cache.pop(name, None)
        assert _notes(info.value) == []
        assert "h" not in ns

    def test_no_note_for_a_name_no_block_binds(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with model.trace(x):
            g = model[1].output
        with pytest.raises(NameError) as info:
            with model.trace(x):
                model[1].output[:] = unknown_name  # noqa: F821
        assert _notes(info.value) == []

def _notes(exc) -> list:
    return list(getattr(exc, "__notes__", []))


def test_nnsight_of_a_hub_id_says_to_load_it_with_language_model():
    """nnsight's docs/models/nnsight-base.md gotcha: ``NNsight("openai-community/gpt2")``
    (nnsight 0.8.1: "'str' object has no attribute '__dict__'") names the class that loads
    hub ids and directories; it said only "got str"."""
    with pytest.raises(TypeError, match=r"got str; 'openai-community/gpt2' looks like a Hugging "
                       r"Face hub id or directory: load it with LanguageModel\("
                       r"'openai-community/gpt2'\)"):
        NNsight("openai-community/gpt2")
    with pytest.raises(TypeError, match=r"NNsight wraps a torch\.nn\.Module, got int$"):
        NNsight(3)
