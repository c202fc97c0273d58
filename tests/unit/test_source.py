"""Operations inside a module's forward (``envoy.source.<op>``): names, reading and editing,
ordering errors, per-call addressing, invokes, nested ``.source``, and that forwards nobody
asks about run untouched. Ground truth is plain computation on the same weights."""

from __future__ import annotations

import functools
import gc
import sys
import weakref

import pytest
import torch

import nnsight_lite
from nnsight_lite import NNsight
from nnsight_lite.errors import (
    MissedModuleError,
    ModulePathError,
    OutOfOrderError,
    OutsideTraceError,
    SourceUnavailableError,
)
from tests.strategies import leftovers


def scaled_scores(q, k, scale):
    """A plain Python function an operation calls (for nested .source)."""
    s = torch.matmul(q, k.transpose(0, 1))
    return torch.softmax(s * scale, dim=-1)


class Block(torch.nn.Module):
    """Calls torch functions, a method chain, a submodule twice and a helper function."""

    def __init__(self, d=6):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.frames = []  # code objects the forward ran with (instrumented or not)

    def forward(self, x, branch=False):
        self.frames.append(sys._getframe().f_code)
        h = self.lin(x)
        h = torch.relu(h) + torch.relu(-h)
        if branch:
            h = torch.tanh(h)
        s = scaled_scores(h, h, 0.5)
        return self.lin(torch.matmul(s, h)).sum(-1)



class _WithUnused(torch.nn.Module):
    """One Linear it calls and one (``unused``) it never calls."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.unused = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)

def plain(block, x, relu0=None, scores=None):
    """The Block forward written out by hand, with optional edits."""
    h = block.lin(x)
    a = torch.relu(h)
    if relu0 is not None:
        a = relu0(a)
    h = a + torch.relu(-h)
    s = torch.softmax(torch.matmul(h, h.T) * 0.5, dim=-1)
    if scores is not None:
        s = scores(s)
    return block.lin(torch.matmul(s, h)).sum(-1)


@pytest.fixture
def block():
    torch.manual_seed(0)
    return Block()


@pytest.fixture
def x():
    torch.manual_seed(1)
    return torch.randn(4, 6)


class TestNames:
    def test_names_follow_the_dotted_callee_with_a_per_name_index(self, block):
        """Names are the dotted callee joined by '_' plus an index per name; inner calls and
        method chains are named first (self.lin(torch.matmul(..)).sum -> ..._sum_0). Calls
        that read their caller's frame (sys._getframe) are left alone. An assignment of one
        value to one name is an operation after the calls of its value, named as nnsight 0.8
        names it (``h = ...`` the second time: h_1), as nnsight 0.8.1 lists this forward."""
        names = [op.name for op in NNsight(block).source]
        assert names == ["self_frames_append_0", "self_lin_0", "h_0", "torch_relu_0",
                         "torch_relu_1", "h_1", "torch_tanh_0", "h_2", "scaled_scores_0", "s_0",
                         "torch_matmul_0", "self_lin_1", "self_lin_1_sum_0"]
        assert NNsight(block).source.names == names  # (nnsight's .source.names)

    def test_print_shows_each_name_beside_its_line(self, block):
        """print(envoy.source) shows the forward's lines, each op's name on its line; an op
        printed alone shows its line marked with -->."""
        model = NNsight(block)
        text = str(model.source)
        line = next(ln for ln in text.splitlines() if "torch_tanh_0" in ln)
        assert "h = torch.tanh(h)" in line
        assert any(ln.strip().startswith("torch_relu_1") and ln.rstrip().endswith("+")
                   for ln in text.splitlines())
        one = repr(model.source.torch_tanh_0)
        marked = [ln for ln in one.splitlines() if ln.lstrip().startswith("-->")]
        assert len(marked) == 1 and "torch.tanh(h)" in marked[0]

    def test_misspelled_name_lists_near_matches(self, block):
        """A name that is not an op raises ModulePathError (an AttributeError) naming it and
        suggesting the close ones."""
        with pytest.raises(ModulePathError, match=r"no operation 'torch_relu_3'.*torch_relu_0"):
            NNsight(block).source.torch_relu_3
        with pytest.raises(AttributeError):
            NNsight(block).source.nothing_like_it

    def test_misspelled_attribute_of_an_operation(self, block, x):
        """A typo after an operation's name (``.ouput``) raises ModulePathError naming the
        operation's path, the line and the close names (it was a bare AttributeError)."""
        model = NNsight(block)
        with pytest.raises(ModulePathError, match=r"model\.source\.torch_relu_0 \(an operation\) "
                           r"has no attribute 'ouput' \(at .*test_source\.py:\d+\)\. Did you "
                           r"mean 'output'"):
            with model.trace(x):
                model.source.torch_relu_0.ouput
        assert not hasattr(model.source.torch_relu_0, "nothing_like_it")


class Picker(torch.nn.Module):
    """Binds a function to a name before calling it and chains a call on a call's result: where
    nnsight 0.8 numbers operations differently from the names here."""

    def __init__(self, d=6):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        act = torch.relu                         # 0.8: the binding act_0
        h = act(self.lin(x))                     # here act_0; 0.8: act_1
        t = h.view(2, -1).transpose(0, 1)        # here h_view_0_transpose_0; 0.8: transpose_0
        return t.sum(0)


class TestNnsight08Names:
    def test_08_names_reach_the_same_operations(self, x):
        """nnsight 0.8's names (an assignment shares the counter of the call after it; a
        chained call is named by its last attribute) reach the same operations as the names
        here: same values as the plain computation, and an edit through either name lands."""
        torch.manual_seed(0)
        net = Picker()
        model = NNsight(net)
        assert model.source.act_1 is model.source.act_0
        assert model.source.transpose_0 is model.source.h_view_0_transpose_0
        with model.trace(x):
            a = model.source.act_1.output.clone().save()
            t = model.source.transpose_0.output.save()
            model.source.transpose_0.output[:] = 1.0
            out = model.output.save()
        with torch.no_grad():
            h = torch.relu(net.lin(x))
            assert torch.equal(a, h) and torch.equal(t, torch.ones_like(t))
            assert torch.equal(out, torch.ones(h.numel() // 2, 2).sum(0))

    def test_names_here_win_and_the_listing_is_unchanged(self):
        """A name that is an operation here keeps meaning it (``act_0`` is the call, which
        nnsight 0.8 names act_1, as 0.8's act_0 is the assignment ``act = torch.relu``, which is
        then no operation here); aliases are not listed."""
        model = NNsight(Picker())
        names = [op.name for op in model.source]
        assert names == ["self_lin_0", "act_0", "h_0", "h_view_0", "h_view_0_transpose_0",
                         "t_0", "t_sum_0"]
        assert not any(ln.strip().startswith("transpose_0") for ln in str(model.source).splitlines())
        with pytest.raises(ModulePathError, match=r"no operation 'act_2'"):
            model.source.act_2


    def test_an_assignment_is_an_operation_under_its_08_name(self, x):
        """nnsight 0.8 makes an assignment an operation (``h = act(self.lin(x))`` is ``h_0``;
        its tutorials read ``ssm_state_3``): here too, where it binds one value to one target
        and its 0.8 name is not a call's here. Its .input and .output are the value assigned
        (against the plain computation), and a replaced output is what the name is bound to."""
        torch.manual_seed(0)
        net = Picker()
        model = NNsight(net)
        with model.trace(x):
            given = model.source.h_0.input.save()
            h = model.source.h_0.output.clone().save()
            model.source.h_0.output = model.source.h_0.output * 0 + 2.0
            t = model.source.t_0.output.save()
            out = model.output.save()
        with torch.no_grad():
            plain = torch.relu(net.lin(x))
            torch.testing.assert_close(given, plain)
            torch.testing.assert_close(h, plain)
            two = torch.full_like(plain, 2.0)
            torch.testing.assert_close(t, two.view(2, -1).transpose(0, 1))
            torch.testing.assert_close(out, two.view(2, -1).transpose(0, 1).sum(0))

    def test_each_pair_of_a_pairwise_assignment_is_an_operation(self, x):
        """``a, b = self.lin(x), x.relu()`` binds two values: nnsight 0.8 names them a_0 and b_0
        (transformers' Mamba: ``conv_state, recurrent_state = None, None``), and each is an
        operation here too, after the calls of the value; replacing b_0's output changes what
        b is bound to. A name that is neither an operation nor an assignment lists near
        matches, saying nothing of assignments."""
        torch.manual_seed(0)
        net = Pairs()
        model = NNsight(net)
        assert model.source.names == ["self_lin_0", "x_relu_0", "a_0", "b_0"]
        with model.trace(x):
            a = model.source.a_0.output.save()
            model.source.b_0.output = torch.zeros_like(model.source.b_0.output)
            out = model.output.save()
        with torch.no_grad():
            torch.testing.assert_close(a, net.lin(x))
            torch.testing.assert_close(out, net.lin(x))
        with pytest.raises(ModulePathError) as info:
            model.source.a_5
        assert "assignment" not in str(info.value)


class Pairs(torch.nn.Module):
    """Assigns two values pairwise: nnsight 0.8 names each (a_0, b_0)."""

    def __init__(self, d=6):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        a, b = self.lin(x), x.relu()
        return a + b


class TestValues:
    def test_outputs_and_inputs_equal_plain_computation(self, block, x):
        """.output, .input and .inputs of ops equal the values computed by hand."""
        model = NNsight(block)
        with model.trace(x):
            r0 = model.source.torch_relu_0.output.save()
            r1_in = model.source.torch_relu_1.input.save()
            args, kwargs = model.source.scaled_scores_0.inputs
            scale = nnsight_lite.save((args[2], kwargs))
            s = model.source.scaled_scores_0.output.save()
            out = model.output.save()
        h = block.lin(x)
        torch.testing.assert_close(r0, torch.relu(h))
        torch.testing.assert_close(r1_in, -h)
        torch.testing.assert_close(s, scaled_scores(*[torch.relu(h) + torch.relu(-h)] * 2, 0.5))
        assert scale == (0.5, {})
        torch.testing.assert_close(out, plain(block, x))

    def test_edits_in_place_and_by_assignment_change_the_forward(self, block, x):
        """Editing an op's output in place or assigning a new one changes what the rest of
        the forward computes, exactly as the same edit done by hand; so does setting .input."""
        model = NNsight(block)
        with model.trace(x):
            model.source.torch_relu_0.output[:, 0] = 0
            model.source.scaled_scores_0.output = model.source.scaled_scores_0.output * 2
            out = model.output.save()

        def zero_col(a):
            a = a.clone()
            a[:, 0] = 0
            return a

        torch.testing.assert_close(out, plain(block, x, relu0=zero_col, scores=lambda s: s * 2))
        with model.trace(x):
            model.source.torch_relu_0.input = torch.zeros(4, 6)
            out2 = model.output.save()
        torch.testing.assert_close(out2, plain(block, x, relu0=torch.zeros_like))

    def test_skip_uses_the_given_value(self, block, x):
        """.skip(value) on an op does not run it and uses value as its output."""
        model = NNsight(block)
        ones = torch.full((4, 4), 0.25)
        with model.trace(x):
            model.source.scaled_scores_0.skip(ones)
            out = model.output.save()
        torch.testing.assert_close(out, plain(block, x, scores=lambda s: ones))

    def test_invokes_see_their_own_rows(self, block, x):
        """With two invokes, each reads only its rows of an op's output, and an edit made in
        one invoke changes only its rows."""
        model = NNsight(block)
        with model.trace() as tracer:
            with tracer.invoke(x[:1]):
                a = model.source.torch_relu_0.output.save()
            with tracer.invoke(x[1:]):
                model.source.torch_relu_0.output[:] = 0
                b = model.source.torch_relu_0.output.save()
                out = model.output.save()
        torch.testing.assert_close(a, torch.relu(block.lin(x[:1])))
        assert b.shape == (3, 6) and not b.any()
        # scores mix rows across the batch: compare the whole forward with the same edit
        ref = plain(block, x, relu0=lambda r: torch.cat([r[:1], torch.zeros_like(r[1:])]))
        torch.testing.assert_close(out, ref[1:])


class TestOrder:
    def test_op_that_already_ran_raises_out_of_order(self, block, x):
        """Reading an op after a later one raises OutOfOrderError naming the op."""
        model = NNsight(block)
        with pytest.raises(OutOfOrderError, match=r"model\.source\.torch_relu_0\.output"):
            with model.trace(x):
                model.source.torch_relu_1.output
                model.source.torch_relu_0.output

    def test_op_that_never_runs_raises_missed(self, block, x):
        """An op on a branch the forward does not take raises MissedModuleError naming it."""
        model = NNsight(block)
        with pytest.raises(MissedModuleError, match=r"model\.source\.torch_tanh_0\.output"):
            with model.trace(x):
                model.source.torch_tanh_0.output
        with model.trace(x, branch=True):
            t = model.source.torch_tanh_0.output.save()
        torch.testing.assert_close(t, torch.tanh(torch.relu(block.lin(x)) + torch.relu(-block.lin(x))))

    def test_op_that_never_runs_points_at_the_source_listing(self, block, x):
        """The MissedModuleError of an op that never ran names the line it is on and points at
        print(<module>.source), which lists operations (it pointed at print(model), which does
        not)."""
        model = NNsight(block)
        line = next(i for i, text in enumerate(open(__file__), 1) if "h = torch.tanh(h)" in text)
        with pytest.raises(MissedModuleError) as info:
            with model.trace(x):
                model.source.torch_tanh_0.output
        text = str(info.value)
        assert f"the line it is on ({__file__}:{line}) did not run" in text
        assert "print(model.source) shows each operation" in text
        assert "print(model)" not in text

    def test_op_of_a_module_that_never_runs_says_the_module_never_ran(self, x):
        """An op of a module the forward never calls (an unused submodule) is missed because the
        module is: the error says so and names the module. It said the op's line "did not run (a
        branch the forward did not take, or code after a return)", a line inside a module that
        never ran, and sent the user to print its .source."""
        torch.manual_seed(0)
        seq = _WithUnused()
        model = NNsight(seq)
        x = torch.randn(2, 8)
        with pytest.raises(MissedModuleError, match=r"waited for model\.unused\.source\."
                           r"F_linear_0\.output at .*test_source\.py:\d+, but model\.unused "
                           r"never ran in this forward: the model's forward does not call it") \
                as info:
            with model.trace(x):
                y = model.unused.source.F_linear_0.output  # never runs
        assert "did not run" not in str(info.value)
        assert any(fs.filename == __file__ and "never runs" in (fs.line or "")
                   for fs in __import__("traceback").extract_tb(info.value.__traceback__))
        with model.trace(x):
            out = model.output.save()
        torch.testing.assert_close(out, seq(x))

    def test_first_use_after_the_module_ran_is_refused(self, x):
        """Operations are counted from the first use in a trace: asking for an operation's value
        after the module already ran uncounted raises OutOfOrderError that says to touch
        .source at the top."""
        torch.manual_seed(0)
        model = NNsight(torch.nn.Sequential(Block(), torch.nn.Identity()))
        with pytest.raises(OutOfOrderError, match=r"an operation of model\[0\]\.source was "
                           r"asked for .* Touch model\[0\]\.source at the top"):
            with model.trace(x):
                model[1].output
                model[0].source.torch_relu_0.next().output

    def test_touching_source_after_the_module_ran_is_no_error(self, x):
        """Printing ``.source`` or naming an operation in a body after its module ran (looking
        up op names while debugging) is no request for a value: it raises nothing, and the
        trace's values are the plain forward's. Found by a hunt: it raised OutOfOrderError, where
        nnsight 0.8.1 prints."""
        torch.manual_seed(0)
        net = torch.nn.Sequential(Block(), torch.nn.Identity())
        model = NNsight(net)
        with model.trace(x):
            out = model[1].output.save()
            listing = nnsight_lite.save(str(model[0].source))
            name = nnsight_lite.save(model[0].source.torch_relu_0.name)
            root = nnsight_lite.save(str(model.source))
        assert "torch_relu_0" in listing and name == "torch_relu_0" and "forward" in root
        torch.testing.assert_close(out, net(x), rtol=0, atol=0)


    def test_a_later_trace_counts_the_operations_from_its_start(self, block, x):
        """Once a trace's body asked for a module's operations, the model's later traces run
        its forward instrumented from their start, as nnsight keeps it: a body may then read an
        operation after a value computed inside the module's own call (``model.lin.output``,
        the Linear that forward calls first), the warm-up nnsight's TransformerLens migration
        tutorial relies on. The refused trace itself counts as that first trace. Found by a
        docs hunt: the later trace raised OutOfOrderError, where nnsight 0.8.1 runs it."""
        model = NNsight(block)
        with pytest.raises(OutOfOrderError, match=r"later traces count them from their start"):
            with model.trace(x):
                model.lin.output
                model.source.torch_relu_0.output
        for _ in range(2):
            with model.trace(x):
                h = model.lin.output.save()
                r = model.source.torch_relu_0.output.clone().save()
                model.source.torch_relu_0.output[:] = 0
                out = model.output.save()
            torch.testing.assert_close(h, block.lin(x))
            torch.testing.assert_close(r, torch.relu(block.lin(x)))
            torch.testing.assert_close(out, plain(block, x, relu0=torch.zeros_like))
        with model.trace(x):
            out = model.output.save()
        torch.testing.assert_close(out, plain(block, x))
        torch.testing.assert_close(block(x), plain(block, x))
        assert block.frames[-1] is Block.forward.__code__  # a plain call runs it as it is


class TestCalls:
    def test_next_iter_and_all_address_each_call(self, x):
        """A module called three times: its op's .next(), tracer.iter[i] and tracer.all() give
        the op's value at each call, as plain computation does."""
        torch.manual_seed(0)
        blk = Block()

        class Thrice(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.blk = blk

            def forward(self, x):
                for _ in range(3):
                    x = self.blk(x).unsqueeze(-1).expand(-1, 6)
                return x

        model = NNsight(Thrice())
        with model.trace(x) as tracer:
            by_next = nnsight_lite.save([model.blk.source.torch_relu_0.output])
            for _ in range(2):
                by_next.append(model.blk.source.torch_relu_0.next().output)
        with model.trace(x) as tracer:
            for _ in tracer.iter[2]:
                two = model.blk.source.torch_relu_0.output.save()
        with model.trace(x) as tracer:
            by_all = nnsight_lite.save([])
            for _ in tracer.all():
                by_all.append(model.blk.source.torch_relu_0.output)
        h, ref = x, []
        for _ in range(3):
            ref.append(torch.relu(blk.lin(h)))
            h = plain(blk, h).unsqueeze(-1).expand(-1, 6)
        for i in range(3):
            torch.testing.assert_close(by_next[i], ref[i])
            torch.testing.assert_close(by_all[i], ref[i])
        torch.testing.assert_close(two, ref[2])
        assert len(by_all) == 3

    def test_two_calls_of_one_op_site_in_a_forward(self, block, x):
        """A submodule called twice is two ops (self_lin_0, self_lin_1) with their inputs."""
        model = NNsight(block)
        with model.trace(x):
            a = model.source.self_lin_0.input.save()
            b = model.source.self_lin_1.output.save()
        torch.testing.assert_close(a, x)
        torch.testing.assert_close(b.sum(-1), plain(block, x))


class TestNested:
    def test_nested_source_reads_and_edits_inside_the_called_function(self, block, x):
        """op.source gives the ops of the function the op calls; reading and editing them
        works like any op."""
        model = NNsight(block)
        with model.trace(x):
            inner = model.source.scaled_scores_0.source
            names = nnsight_lite.save([op.name for op in inner])
            listed = nnsight_lite.save(inner.names)
            m = inner.torch_matmul_0.output.save()
            inner.torch_softmax_0.output[:] = 0.25
            out = model.output.save()
        assert names == ["k_transpose_0", "torch_matmul_0", "s_0", "torch_softmax_0"] == listed
        h = torch.relu(block.lin(x)) + torch.relu(-block.lin(x))
        torch.testing.assert_close(m, h @ h.T)
        torch.testing.assert_close(out, plain(block, x, scores=lambda s: torch.full_like(s, 0.25)))

    def test_nested_source_used_again_inside_the_same_call(self, block, x):
        """``op.source`` written out again after a read inside the called function (read an op,
        then edit another, each line spelling the whole path) reaches the call that runs now.
        Found by a docs hunt: the second ``.source`` waited for the op's input, which had
        passed, and raised OutOfOrderError, where nnsight 0.8.1 runs it."""
        model = NNsight(block)
        with model.trace(x):
            m = model.source.scaled_scores_0.source.torch_matmul_0.output.save()
            s = model.source.scaled_scores_0.source.torch_softmax_0.output.clone().save()
            model.source.scaled_scores_0.source.torch_softmax_0.output[:] = 0.25
            out = model.output.save()
        h = torch.relu(block.lin(x)) + torch.relu(-block.lin(x))
        torch.testing.assert_close(m, h @ h.T)
        torch.testing.assert_close(s, torch.softmax(h @ h.T * 0.5, dim=-1))
        torch.testing.assert_close(out, plain(block, x, scores=lambda s: torch.full_like(s, 0.25)))

    def test_a_later_trace_drills_from_its_start(self, block, x):
        """A nested ``.source`` a body used is drilled from the start of the model's later
        traces: a body there may read the outer operation's input first (which the nested
        ``.source`` would otherwise have to precede)."""
        model = NNsight(block)
        with model.trace(x):
            model.source.scaled_scores_0.source.torch_matmul_0.output.save()
        with model.trace(x):
            q = model.source.scaled_scores_0.input.save()
            model.source.scaled_scores_0.source.torch_softmax_0.output[:] = 0.25
            out = model.output.save()
        h = torch.relu(block.lin(x)) + torch.relu(-block.lin(x))
        torch.testing.assert_close(q, h)
        torch.testing.assert_close(out, plain(block, x, scores=lambda s: torch.full_like(s, 0.25)))

    def test_nested_source_of_a_callable_object_is_its_call(self, x):
        """An op that calls an object with a Python ``__call__`` (a diffusers-style attention
        processor) drills into that ``__call__``: its ops are read and edited like any."""
        class Processor:
            def __init__(self, scale):
                self.scale = scale

            def __call__(self, h):
                return torch.relu(h) * self.scale

        class WithProcessor(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(6, 6)
                self.processor = Processor(2.0)

            def forward(self, x):
                return self.processor(self.lin(x)).sum(-1)

        torch.manual_seed(0)
        net = WithProcessor()
        model = NNsight(net)
        with model.trace(x):
            inner = model.source.self_processor_0.source
            r = inner.torch_relu_0.output.clone().save()
            inner.torch_relu_0.output[:] = 1.0
            out = model.output.save()
        torch.testing.assert_close(r, torch.relu(net.lin(x)))
        torch.testing.assert_close(out, torch.full((4,), 12.0))

    def test_nested_source_of_a_module_call_is_refused(self, block, x):
        """Drilling into an op that calls a submodule raises SourceUnavailableError saying to
        use the submodule's own .source."""
        model = NNsight(block)
        with pytest.raises(SourceUnavailableError, match=r"calls a module \(Linear\)"):
            with model.trace(x):
                model.source.self_lin_0.source

    def test_nested_misspelled_name(self, block, x):
        """A misspelled op of a called function raises ModulePathError with near matches."""
        model = NNsight(block)
        with pytest.raises(ModulePathError, match=r"torch_softmax_0"):
            with model.trace(x):
                model.source.scaled_scores_0.source.torch_softmx_0


class TestCost:
    def test_only_traces_that_ask_run_the_instrumented_forward(self, block, x):
        """A trace that uses no op runs the original forward code; a trace that does runs the
        instrumented one (and so do the model's later traces); plain calls are original."""
        model = NNsight(block)
        original = Block.forward.__code__
        with model.trace(x):
            model.output.save()
        with model.trace(x):
            model.source.torch_relu_0.output.save()
        block(x)
        assert [c is original for c in block.frames] == [True, False, True]
        assert block.__dict__.get("forward") is None
        slot = model.__dict__["_plan"].slots[id(block)]
        assert slot.orig.__func__ is Block.forward  # no instrumented forward kept after it

    def test_closures_super_and_decorators_keep_working(self, x):
        """A forward using super(), a closure variable and a functools.wraps decorator: the
        instrumented forward still runs the decorator and sees the closure."""
        factor = 3.0

        def triple(fn):
            @functools.wraps(fn)
            def wrapper(self, *a, **k):
                return fn(self, *a, **k) * factor
            return wrapper

        class Base(torch.nn.Module):
            def forward(self, x):
                return x + 1

        class Child(Base):
            @triple
            def forward(self, x):
                return torch.relu(super().forward(x)) * factor

        model = NNsight(Child())
        assert [op.name for op in model.source] == ["super_forward_0", "torch_relu_0"]
        with model.trace(x):
            r = model.source.torch_relu_0.output.save()
            out = model.output.save()
        torch.testing.assert_close(r, torch.relu(x + 1))
        torch.testing.assert_close(out, torch.relu(x + 1) * 9)

    @pytest.mark.skipif(sys.version_info < (3, 11), reason="co_qualname is the ground truth")
    def test_a_wrappers_name_without_co_qualname_is_the_same(self):
        """The error above names the wrapper by its code's qualified name; Python 3.10's code
        objects have no co_qualname (the message then said just 'wrapper', and the test above
        failed there): instrument's fallback finds the same name through the code nesting it,
        for a wraps wrapper in a function, nested classes, a lambda and transformers' MoE
        experts' forward."""
        from transformers.models.mixtral import modeling_mixtral

        from nnsight_lite.instrument import _nested_name

        def dispatch(fn):
            @functools.wraps(fn)
            def wrapper(self, x):
                return fn(self, x)
            return wrapper

        class Outer:
            class Inner:
                def forward(self):
                    return lambda: 1

            @dispatch
            def forward(self, x):
                return x

        mixtral = modeling_mixtral.MixtralExperts.forward
        codes = [(Outer.forward.__code__, Outer.forward.__globals__),
                 (Outer.Inner.forward.__code__, globals()),
                 (Outer.Inner().forward().__code__, globals()),
                 (mixtral.__code__, mixtral.__globals__)]
        for code, globs in codes:
            assert _nested_name(code, globs) == code.co_qualname
        assert "dispatch.<locals>.wrapper" in Outer.forward.__code__.co_qualname

    def test_a_decorator_that_did_not_call_the_forward_is_named(self, x):
        """A wraps decorator that runs other code instead of the function it wraps (as
        transformers' MoE experts dispatch on a setting): reading a listed operation says
        that the wrapper did not call it (it said "a branch the forward did not take"); where
        the wrapper calls it, the operation is read as usual."""
        def dispatch(fn):
            @functools.wraps(fn)
            def wrapper(self, x):
                return x * 2 if self.fast else fn(self, x)
            return wrapper

        class Fast(torch.nn.Module):
            fast = True

            @dispatch
            def forward(self, x):
                return torch.relu(x) * 2

        net = Fast()
        model = NNsight(net)
        with pytest.raises(MissedModuleError, match=r"never ran in this forward: Fast.forward is "
                           r"wrapped by a decorator \([\w.<>]*dispatch.<locals>.wrapper, "
                           r"[^)]*test_source.py:\d+\) that did not call the function it wraps"):
            with model.trace(x):
                model.source.torch_relu_0.output.save()
        net.fast = False
        with model.trace(x):
            r = model.source.torch_relu_0.output.save()
        torch.testing.assert_close(r, torch.relu(x))

    def test_body_calling_the_module_itself_is_not_counted(self, block, x):
        """Calling the module from a body runs it plainly; the trace's op counts are untouched."""
        model = NNsight(block)
        with model.trace(x):
            extra = model(x * 0).save()
            r = model.source.torch_relu_0.output.save()
        torch.testing.assert_close(r, torch.relu(block.lin(x)))
        torch.testing.assert_close(extra, plain(block, x * 0))

    def test_scan_gives_op_shapes(self, block, x):
        """.scan runs the instrumented forward on fake tensors: op shapes without compute."""
        model = NNsight(block)
        with model.scan(x):
            shape = nnsight_lite.save(tuple(model.source.scaled_scores_0.output.shape))
        assert shape == (4, 4)


class TestReuse:
    """A forward instrumented once is kept for the model's later traces (its operations' slots
    count each trace afresh), as long as the module runs the same function."""

    def test_a_forward_replaced_between_traces_is_instrumented_anew(self, block, x):
        """An instance forward set between traces, then removed: each trace runs the function
        the module has then, and its operations are that function's."""
        import types

        def gated(self, x, branch=False):
            h = self.lin(x)
            return self.lin(torch.sigmoid(h)).sum(-1)

        model = NNsight(block)
        for _ in range(2):
            with model.trace(x):
                r = model.source.torch_relu_0.output.save()
            torch.testing.assert_close(r, torch.relu(block.lin(x)))
        block.forward = types.MethodType(gated, block)
        with model.trace(x):
            g = model.source.torch_sigmoid_0.output.clone().save()
            model.source.torch_sigmoid_0.output[:] = 0
            out = model.output.save()
        torch.testing.assert_close(g, torch.sigmoid(block.lin(x)))
        torch.testing.assert_close(out, block.lin(torch.zeros(4, 6)).sum(-1))
        with pytest.raises(ModulePathError, match="torch_relu_0"):
            with model.trace(x):
                model.source.torch_relu_0.output.save()
        del block.forward
        with model.trace(x):
            r = model.source.torch_relu_0.output.save()
            out = model.output.save()
        torch.testing.assert_close(r, torch.relu(block.lin(x)))
        torch.testing.assert_close(out, plain(block, x))

    def test_a_class_forward_replaced_between_traces(self, x):
        """The class's forward patched between traces (a library monkey-patching it): the next
        trace instruments the new function, and the old one's operations are gone."""

        class Patched(Block):
            pass

        torch.manual_seed(0)
        net = Patched()
        model = NNsight(net)
        with model.trace(x):
            r = model.source.torch_relu_0.output.save()
        torch.testing.assert_close(r, torch.relu(net.lin(x)))

        def doubled(self, x, branch=False):
            return self.lin(torch.tanh(self.lin(x))).sum(-1) * 2

        Patched.forward = doubled
        with model.trace(x):
            t = model.source.torch_tanh_0.output.save()
            out = model.output.save()
        torch.testing.assert_close(t, torch.tanh(net.lin(x)))
        torch.testing.assert_close(out, net.lin(torch.tanh(net.lin(x))).sum(-1) * 2)

    def test_one_operation_held_across_traces_counts_each_trace(self, block, x):
        """An OpEnvoy bound once and used by several traces, each with two invokes reading and
        editing their own rows: every trace addresses call 0 of its own forward."""
        model = NNsight(block)
        relu = model.source.torch_relu_0
        for k in range(3):
            with model.trace() as tracer:
                with tracer.invoke(x[:2]):
                    a = relu.output.clone().save()
                    relu.output[:] = float(k)
                    out_a = model.output.save()
                with tracer.invoke(x[2:]):
                    b = relu.output.clone().save()
                    out_b = model.output.save()
            out = torch.cat([out_a, out_b])
            torch.testing.assert_close(torch.cat([a, b]), torch.relu(block.lin(x)))


            def first_rows(t, k=k):
                t = t.clone()
                t[:2] = float(k)
                return t

            # (the Block's scores mix the batch's rows: the whole batch in one forward)
            torch.testing.assert_close(out, plain(block, x, relu0=first_rows))

    def test_a_replaced_submodule_whose_source_was_used_is_freed(self, x):
        """A submodule whose .source bodies read, replaced in the model: the next trace lets the
        old module go (the forward kept instrumented for it goes with its slot), without the
        garbage collector."""

        class Outer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.blk = Block()

            def forward(self, x):
                return self.blk(x)

        torch.manual_seed(0)
        net = Outer()
        model = NNsight(net)
        for _ in range(2):
            with model.trace(x):
                model.blk.source.torch_relu_0.output.save()
        old = weakref.ref(net.blk)
        gc.collect()
        gc.disable()
        try:
            net.blk = Block()
            with model.trace(x):
                r = model.blk.source.torch_relu_0.output.save()
            assert old() is None
        finally:
            gc.enable()
        torch.testing.assert_close(r, torch.relu(net.blk.lin(x)))


    def test_an_operation_of_a_dropped_model_used_in_another_models_trace(self, x):
        """An OpEnvoy kept after its model's wrapper was dropped (the module lives on in the
        op's view) and read in a trace of another model: OutsideTraceError naming the op and
        saying to take .source from the model being traced; the trace leaves no wrapper and
        the other model traces on as plain torch computes it."""
        torch.manual_seed(0)
        old_net, net = Block(), Block()
        model = NNsight(old_net)
        op = model.source.torch_relu_0
        module = weakref.ref(old_net)
        del model
        assert module() is not None and op._parent._envoy is None  # (the view holds it)
        other = NNsight(net)
        with pytest.raises(OutsideTraceError, match=r"torch_relu_0 belongs to a model that is "
                                                    r"gone.*take \.source from the model being "
                                                    r"traced"):
            with other.trace(x):
                op.output.save()
        assert leftovers(net) == leftovers(old_net) == []
        with other.trace(x):
            out = other.output.save()
        torch.testing.assert_close(out, net(x))


class TestAccelerateHooks:
    """A module carrying an accelerate hook (what `device_map=` dispatch adds; its `forward` is
    then a partial) still has `.source`: the forward the hook wraps is instrumented, and the
    hook's pre- and post-forward still run once each (nnsight's test_source)."""

    def test_source_under_an_accelerate_hook(self):
        """Names list, an op's value and an op edit equal plain torch; the hook runs once per
        call; after the trace the module's forward and `_old_forward` are what they were."""
        accelerate_hooks = pytest.importorskip("accelerate.hooks")
        calls = []

        class Counting(accelerate_hooks.ModelHook):
            def pre_forward(self, module, *args, **kwargs):
                calls.append("pre")
                return args, kwargs

            def post_forward(self, module, output):
                calls.append("post")
                return output

        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))

        class Mlp(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.net = net

            def forward(self, x):
                h = torch.relu(self.net[0](x))
                return self.net[2](h)

        model_ = Mlp()
        accelerate_hooks.add_hook_to_module(model_, Counting())
        forward, old = model_.__dict__["forward"], model_.__dict__["_old_forward"]
        model = NNsight(model_)
        assert "torch_relu_0" in repr(model.source)
        x = torch.randn(3, 4)
        calls.clear()
        with model.trace(x):
            relu = model.source.torch_relu_0.output.clone().save()
            model.source.torch_relu_0.output[:, 0] = 0
            out = model.output.save()
        assert calls == ["pre", "post"]
        want = torch.relu(net[0](x))
        torch.testing.assert_close(relu, want)
        edited = want.clone()
        edited[:, 0] = 0
        torch.testing.assert_close(out, net[2](edited))
        assert model_.__dict__["forward"] is forward and model_.__dict__["_old_forward"] is old


_CELL = '''
import torch

class Cell(torch.nn.Module):
    TABLE = torch.zeros(100_000)  # a class attribute (400 kB)

    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Linear(6, 6)

    def forward(self, x):
        h = self.mlp(x)
        return torch.relu(h) + x
'''


def _define_cell_class(filename):
    """The class of ``_CELL``, defined anew (a new code object each time) under ``filename``,
    whose source is registered in linecache: a notebook cell run again."""
    import linecache

    linecache.cache[filename] = (len(_CELL), None, _CELL.splitlines(True), filename)
    scope = {"__name__": "__cell__"}
    exec(compile(_CELL, filename, "exec"), scope)
    return scope["Cell"]


def _zeroed_mlp(module, x):
    """Cell's forward with mlp's output zeroed, written out by hand."""
    return torch.relu(torch.zeros_like(module.mlp(x))) + x


class TestRedefinedClasses:
    """A notebook runs a cell that defines a class again: a new class whose forward's code is a
    new code object, equal (==) to the old one, since code objects compare without their file.
    The instrumented forwards are cached per code object."""

    def test_source_of_a_class_defined_again_after_the_old_one_was_freed(self):
        """Tracing ``.source`` of the new class worked only while the old class lived: once it
        was freed, the cache entry of the instrumented code (kept alive by its own value) was
        taken over by the new class's, then dropped with the old code, and the next lookup
        compiled the instrumented forward itself (SyntaxError: duplicate argument
        '__nnsight_op__'; a cell re-run a third time in IPython)."""
        filename = "<nnsight-lite-test-cell-again>"
        x = torch.randn(2, 6)
        try:
            for _ in range(3):
                cls = _define_cell_class(filename)
                module = cls()
                model = NNsight(module)
                with model.trace(x):
                    model.source.self_mlp_0.output[:] = 0
                    out = model.output.save()
                torch.testing.assert_close(out, _zeroed_mlp(module, x))
                del cls, module, model
                gc.collect()
        finally:
            import linecache

            linecache.cache.pop(filename, None)

    def test_a_dropped_class_leaves_no_instrumented_code(self):
        """Once a class whose ``.source`` was traced is dropped, its instrumented code goes
        too: it stayed in the cache, whose entry for the instrumented code kept that code
        alive by its own value (the record of the operations holds the code), one entry per
        class a notebook defines again. Nothing of the class itself is held."""
        from nnsight_lite.instrument import compiled

        filename = "<nnsight-lite-test-cell-dropped>"
        x = torch.randn(2, 6)
        try:
            cls = _define_cell_class(filename)
            model = NNsight(cls())
            with model.trace(x):
                model.source.self_mlp_0.output[:] = 0
                out = model.output.save()
            comp = compiled(cls.forward)
            assert comp.names == ("self_mlp_0", "h_0", "torch_relu_0")
            refs = [weakref.ref(comp.code), weakref.ref(cls), weakref.ref(cls.TABLE),
                    weakref.ref(cls.forward.__code__)]
            del cls, model, out, comp
            gc.collect()
            assert [r() for r in refs] == [None] * len(refs)
        finally:
            import linecache

            linecache.cache.pop(filename, None)
