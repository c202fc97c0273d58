"""Several invokes in one batched forward, against separate plain runs as ground truth."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import nnsight_lite
from nnsight_lite import BatchingError, NNsight, OutOfOrderError
from nnsight_lite.errors import InputError, InvokeError, MissedModuleError, OutsideTraceError
from tests.helpers import record


class Masked(torch.nn.Module):
    """forward(x, mask, flag): a per-row mask and a non-batched flag."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x, mask=None, flag=True):
        h = self.a(x)
        if mask is not None:
            h = h * mask
        if flag:
            h = h + 1
        return self.b(h)


class TestBatching:
    def test_each_invoke_sees_its_rows(self, seq):
        model = NNsight(seq)
        x1, x2 = torch.randn(1, 6), torch.randn(3, 6)
        with model.trace() as tracer:
            with tracer.invoke(x1):
                a = model[1].output.save()
            with tracer.invoke(x2):
                b = model[1].output.save()
        torch.testing.assert_close(a, seq[1](seq[0](x1)))
        torch.testing.assert_close(b, seq[1](seq[0](x2)))

    @pytest.mark.parametrize("form", ["dict", "tuple"])
    def test_inputs_in_a_dict_or_tuple_batch_member_by_member(self, form):
        """Invokes whose input is a dict or a tuple of tensors (a batch dict, an RNN's (x, h0))
        batch each member along dim 0, as top-level tensors do (it raised BatchingError
        printing every tensor in full); each invoke reads its own rows and an edit in one
        stays in its rows. A member that is no tensor and differs raises a short message."""
        torch.manual_seed(0)

        class Takes(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Linear(4, 3)
                self.b = torch.nn.Linear(2, 3)

            def forward(self, batch):
                x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
                return self.a(x) + self.b(y)

        net = Takes()
        model = NNsight(net)
        xs = [torch.randn(2, 4), torch.randn(3, 4)]
        ys = [torch.randn(2, 2), torch.randn(3, 2)]
        make = (lambda x, y: {"x": x, "y": y}) if form == "dict" else (lambda x, y: (x, y))
        with model.trace() as tracer:
            with tracer.invoke(make(xs[0], ys[0])):
                a = model.output.save()
            with tracer.invoke(make(xs[1], ys[1])):
                model.a.output[:] = 0
                b = model.output.save()
        torch.testing.assert_close(a, net(make(xs[0], ys[0])))
        torch.testing.assert_close(b, net.b(ys[1]))
        with pytest.raises(BatchingError, match=r"positional input 0\['tag'\] is not a tensor "
                                                r"and differs between invoke 0 \('a'\) and "
                                                r"invoke 1 \('b'\)"):
            with model.trace() as tracer:
                with tracer.invoke({"x": xs[0], "y": ys[0], "tag": "a"}):
                    pass
                with tracer.invoke({"x": xs[1], "y": ys[1], "tag": "b"}):
                    pass

    def test_invokes_opened_by_a_helper_function_in_the_body(self, seq):
        """A function defined in the trace body may open the invokes (one per call)."""
        model = NNsight(seq)
        xs = [torch.randn(1, 6), torch.randn(2, 6), torch.randn(1, 6)]
        with model.trace() as tracer:
            outs = nnsight_lite.save([])

            def add(x, scale):
                with tracer.invoke(x):
                    model[1].output[:] *= scale
                    outs.append(model.output)

            for i, x in enumerate(xs):
                add(x, i + 1)
        for i, x in enumerate(xs):
            h = seq[1](seq[0](x)) * (i + 1)
            torch.testing.assert_close(outs[i], seq[3](seq[2](h)))

    def test_edits_touch_only_own_rows(self, seq):
        model = NNsight(seq)
        x1, x2 = torch.randn(2, 6), torch.randn(2, 6)
        with model.trace() as tracer:
            with tracer.invoke(x1):
                model[1].output[:] = 0
                o1 = model.output.save()
            with tracer.invoke(x2):
                model[2].output = model[2].output * 3
                o2 = model.output.save()
        torch.testing.assert_close(o1, seq[3](seq[2](torch.zeros(2, 6))))
        torch.testing.assert_close(o2, seq[3](seq[2](seq[1](seq[0](x2))) * 3))

    def test_invoke_without_input_sees_whole_batch(self, seq):
        model = NNsight(seq)
        x1, x2 = torch.randn(1, 6), torch.randn(2, 6)
        with model.trace() as tracer:
            with tracer.invoke(x1):
                pass
            with tracer.invoke(x2):
                pass
            with tracer.invoke():
                everything = model.output.save()
        torch.testing.assert_close(everything, seq(torch.cat([x1, x2])))

    def test_later_invoke_uses_earlier_value_at_same_module(self, seq):
        model = NNsight(seq)
        clean, corrupt = torch.randn(1, 6), torch.randn(1, 6)
        with model.trace() as tracer:
            with tracer.invoke(clean):
                emb = model[0].output
            with tracer.invoke(corrupt):
                model[0].output[:] = emb
                patched = model.output.save()
        torch.testing.assert_close(patched, seq(clean))

    def test_a_name_an_earlier_invoke_binds_wins_over_the_same_name_around_the_trace(self, seq):
        # `donor` left over from an earlier cell: invoke 1's code comes after invoke 0's, so it
        # means invoke 0's value (it once read the leftover silently)
        model = NNsight(seq)
        clean, corrupt = torch.randn(1, 6), torch.randn(1, 6)
        donor = torch.full((1, 6), 100.0)
        with model.trace() as tracer:
            with tracer.invoke(clean):
                donor = model[1].output
            with tracer.invoke(corrupt):
                model[1].output[:] = donor
                patched = model.output.save()
        torch.testing.assert_close(patched, seq(clean))

    def test_a_global_an_earlier_invoke_binds_is_waited_for_too(self, seq):
        global _leftover
        _leftover = torch.full((1, 6), 100.0)
        model = NNsight(seq)
        clean, corrupt = torch.randn(1, 6), torch.randn(1, 6)
        try:
            with model.trace() as tracer:
                with tracer.invoke(clean):
                    _leftover = model[2].output
                with tracer.invoke(corrupt):
                    model[2].output[:] = _leftover
                    patched = model.output.save()
        finally:
            del _leftover
        torch.testing.assert_close(patched, seq(clean))

    def test_a_name_the_earlier_invoke_does_not_bind_after_all_is_the_one_around(self, seq):
        model = NNsight(seq)
        clean, corrupt = torch.randn(1, 6), torch.randn(1, 6)
        donor = torch.full((1, 6), 100.0)
        bind = False
        with model.trace() as tracer:
            with tracer.invoke(clean):
                if bind:
                    donor = model[0].output
                model[0].output  # (then it ends: from model[1] on, it can bind nothing)
            with tracer.invoke(corrupt):
                model[1].output[:] = donor
                patched = model.output.save()
        torch.testing.assert_close(patched, seq[3](seq[2](donor)))

    def test_a_name_bound_only_in_an_earlier_invokes_comprehension_is_not_waited_for(self, seq):
        # the comprehension's `h` is its own; waiting for it would have run past model[0]
        model = NNsight(seq)
        clean, corrupt = torch.randn(1, 6), torch.randn(1, 6)
        h = torch.full((1, 6), 100.0)
        with model.trace() as tracer:
            with tracer.invoke(clean):
                sums = [h.sum() for h in [model[3].output]]
            with tracer.invoke(corrupt):
                model[0].output[:] = h
                patched = model.output.save()
        torch.testing.assert_close(patched, seq[1:](h))

    def test_trace_with_input_equals_one_invoke(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with model.trace(x):
            a = model[2].output.save()
        with model.trace() as tracer:
            with tracer.invoke(x):
                b = model[2].output.save()
        torch.testing.assert_close(a, b)

    def test_names_shared_and_saved_from_any_invoke(self, seq):
        model = NNsight(seq)
        with model.trace() as tracer:
            with tracer.invoke(torch.randn(1, 6)):
                first = model[0].output.save()
            with tracer.invoke(torch.randn(1, 6)):
                both = nnsight_lite.save([first.shape, model[0].output.shape])
        assert first.shape == (1, 6) and len(both) == 2

    def test_per_row_kwargs_batched(self):
        torch.manual_seed(0)
        net = Masked()
        model = NNsight(net)
        x1, x2 = torch.randn(2, 4), torch.randn(1, 4)
        m1, m2 = torch.ones(2, 4), torch.zeros(1, 4)
        with model.trace() as tracer:
            with tracer.invoke(x1, mask=m1):
                o1 = model.output.save()
            with tracer.invoke(x2, mask=m2):
                o2 = model.output.save()
        torch.testing.assert_close(o1, net(x1, mask=m1))
        torch.testing.assert_close(o2, net(x2, mask=m2))

    def test_non_batched_kwarg_must_agree(self):
        model = NNsight(Masked())
        with pytest.raises(BatchingError, match=r"'flag'.*invoke 0 \(True\).*invoke 1 \(False\)"):
            with model.trace() as tracer:
                with tracer.invoke(torch.randn(1, 4), flag=True):
                    pass
                with tracer.invoke(torch.randn(1, 4), flag=False):
                    pass

    def test_mismatched_shapes_error_before_forward(self, seq):
        model = NNsight(seq)
        ran = []
        h = seq[0].register_forward_hook(lambda *a: ran.append(1))
        try:
            with pytest.raises(BatchingError, match=r"invoke 0: \(1, 6\), invoke 1: \(1, 5\)"):
                with model.trace() as tracer:
                    with tracer.invoke(torch.randn(1, 6)):
                        pass
                    with tracer.invoke(torch.randn(1, 5)):
                        pass
        finally:
            h.remove()
        assert ran == []

    def test_mismatched_dtypes(self, seq):
        model = NNsight(seq)
        with pytest.raises(BatchingError, match="dtypes"):
            with model.trace() as tracer:
                with tracer.invoke(torch.randn(1, 6)):
                    pass
                with tracer.invoke(torch.randn(1, 6, dtype=torch.float64)):
                    pass

    @pytest.mark.parametrize("first, second, match", [
        ((0,), (1, 6), r"shapes invoke 0: \(0,\), invoke 1: \(1, 6\)"),  # torch.cat takes these
        ((), (1, 6), r"shapes invoke 0: \(\), invoke 1: \(1, 6\)"),
        ((1, 6), (2, 6, 1), r"shapes invoke 0: \(1, 6\), invoke 1: \(2, 6, 1\)"),
    ])
    def test_inputs_of_other_ranks_are_refused(self, seq, first, second, match):
        """Inputs batch only when every dimension but the first agrees, as the message says,
        even where torch.cat alone would accept them (a legacy empty 1-D tensor)."""
        model = NNsight(seq)
        with pytest.raises(BatchingError, match=match):
            with model.trace() as tracer:
                with tracer.invoke(torch.zeros(first)):
                    pass
                with tracer.invoke(torch.zeros(second)):
                    pass

    def test_batched_inputs_equal_one_stacked_forward(self, seq):
        """Many invokes of same-shaped inputs: each body's rows equal the model run on all of
        them stacked (one torch.cat), in invoke order."""
        model = NNsight(seq)
        xs = [torch.randn(n, 6) for n in (1, 2, 1, 3)]
        with model.trace() as tracer:
            outs = nnsight_lite.save([])
            for x in xs:
                with tracer.invoke(x):
                    outs.append(model.output)
        whole = seq(torch.cat(xs))
        assert [o.shape[0] for o in outs] == [1, 2, 1, 3]
        assert torch.equal(torch.cat(outs), whole)

    def test_failing_invoke_is_named_and_cleaned_up(self, seq):
        model = NNsight(seq)
        with pytest.raises(ValueError) as info:
            with model.trace() as tracer:
                with tracer.invoke(torch.randn(1, 6)):
                    a = model[2].output.save()
                with tracer.invoke(torch.randn(1, 6)):
                    model[1].output
                    raise ValueError("second invoke broke")
        notes = getattr(info.value, "__notes__", [])
        assert any("invoke 1" in n for n in notes), notes


def test_an_invokes_replacement_of_another_dtype_takes_the_batchs_dtype_in_its_rows():
    """With several invokes, a float32 value replacing a bfloat16 output is written into the
    invoke's rows of the batch tensor, so it is cast there (as the README says), where one
    invoke alone hands the model the float32 value itself; the result equals a hook that
    casts the replaced rows."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).to(torch.bfloat16)
    model = NNsight(net)
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    vec = torch.randn(4)  # float32

    def hook(m, i, o):
        o = o.clone()
        o[:1] = (o[:1].float() + vec).to(torch.bfloat16)
        return o

    handle = net[0].register_forward_hook(hook)
    try:
        expected = net(x)
    finally:
        handle.remove()
    with model.trace() as tracer:
        with tracer.invoke(x[:1]):
            model[0].output = model[0].output + vec
            a = model.output.save()
        with tracer.invoke(x[1:]):
            b = model.output.save()
    assert a.dtype is torch.bfloat16
    assert torch.equal(torch.cat([a, b]), expected)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_nested_tensor_inside_the_forward_reaches_every_invoke_whole():
    """nn.TransformerEncoder in eval mode with a padding mask runs its layers on a nested
    tensor, which has no sizes: two invokes raised torch's "NestedTensorImpl doesn't support
    sizes" from inside the forward. A nested value is not split by invoke (as any value whose
    first dimension is not the batch): each invoke reads the whole of it, and the padded
    output is still split into each invoke's rows."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 2).eval()
    model = NNsight(enc)
    x = torch.randn(2, 5, 16)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3:] = True
    with torch.no_grad():
        seen, ref = record(enc, ["layers.0"], x, src_key_padding_mask=mask)
        h_ref = seen[("layers.0", 0)]
        assert h_ref.is_nested  # (the fast path this is about)
        with model.trace() as tracer:
            with tracer.invoke(x[:1], src_key_padding_mask=mask[:1]):
                a = model.layers[0].output.save()
                out_a = model.output.save()
            with tracer.invoke(x[1:], src_key_padding_mask=mask[1:]):
                b = model.layers[0].output.save()
                out_b = model.output.save()
            with tracer.invoke():
                cache = tracer.cache(modules=[model.layers[0]])
    for h in (a, b, cache["model.layers.0"].output):
        assert h.is_nested
        assert torch.equal(h.to_padded_tensor(0.0), h_ref.to_padded_tensor(0.0))
    torch.testing.assert_close(torch.cat([out_a, out_b]), ref, equal_nan=True)


def test_nnsight_barrier_idiom_still_works(seq):
    """nnsight's barrier example runs unchanged: invoke 1 patches in invoke 0's value."""
    model = NNsight(seq)
    clean, corrupt = torch.randn(1, 6), torch.randn(1, 6)
    with model.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(clean):
            emb = model[0].output
            barrier()
        with tracer.invoke(corrupt):
            barrier()
            model[0].output[:] = emb
            patched = model.output.save()
    torch.testing.assert_close(patched, seq(clean))


def test_a_barrier_hands_over_a_name_rebound_round_by_round(seq):
    """A name the earlier invoke rebinds at every layer (``h = layer.output; b()``) reaches the
    later invoke at the same round of the barrier: round i gives layer i's output of the clean
    input (plain hooks are the ground truth), and patching it in at every layer gives the
    clean output."""
    model = NNsight(seq)
    clean, corrupt = torch.randn(1, 6), torch.randn(1, 6)
    with model.trace() as tracer:
        b = tracer.barrier(2)
        with tracer.invoke(clean):
            for i in range(3):
                h = model[i].output
                b()
        with tracer.invoke(corrupt):
            got = []
            for i in range(3):
                b()
                got.append(h.clone())
                model[i].output[:] = h
            got = nnsight_lite.save(got)
            patched = model.output.save()
    seen, _ = record(seq, ["0", "1", "2"], clean)
    for i in range(3):
        torch.testing.assert_close(got[i], seen[(str(i), 0)])
    torch.testing.assert_close(patched, seq(clean))


def test_a_barrier_waits_at_each_call(seq):
    """Each call of one barrier is a round of its own: the later invoke reads each value the
    earlier one bound before its matching call (nnsight's reusable-barrier example)."""
    model = NNsight(seq)
    x, y = torch.randn(1, 6), torch.randn(1, 6)
    with model.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(x):
            a1 = model[1].output
            barrier()
            a3 = model[3].output
            barrier()
        with tracer.invoke(y):
            barrier()
            first = a1.save()
            barrier()
            second = a3.save()
    seen, _ = record(seq, ["1", "3"], x)
    torch.testing.assert_close(first, seen[("1", 0)])
    torch.testing.assert_close(second, seen[("3", 0)])


def test_a_barrier_nobody_else_can_reach_says_so(seq):
    """``tracer.barrier(3)`` called by two invokes cannot fill: the waiting body gets an error
    naming the barrier, its n and the line, instead of hanging; nothing is left behind. Called
    outside an invoke body, or with a bad n, it says what to do."""
    model = NNsight(seq)
    x = torch.randn(1, 6)
    with pytest.raises(MissedModuleError, match=r"tracer\.barrier\(3\) at .*test_invokes.*"
                       r"this trace has only 2 invokes, so 3 can never reach it") as info:
        with model.trace() as tracer:
            b = tracer.barrier(3)
            with tracer.invoke(x):
                model[0].output
                b()
            with tracer.invoke(x):
                b()
    # (it said "only 1 invoke body(ies) reached it ... and no other can any more", while
    # invoke 1 was still to come)
    assert "no other can any more" not in str(info.value)
    with pytest.raises(OutsideTraceError, match="outside an invoke body"):
        with model.trace() as tracer:
            b = tracer.barrier(1)
            b()
    with pytest.raises(InputError, match="positive int"):
        with model.trace() as tracer:
            tracer.barrier(0)


def test_a_barrier_deadlock_names_what_the_other_invoke_waits_for(seq):
    """Invokes waiting on each other (invoke 1 reads a name invoke 0 binds only after the
    barrier; two barriers called in opposite orders) get an error naming what the other
    invoke waits for and where, and the fix; it blamed the barrier's count."""
    model = NNsight(seq)
    x = torch.randn(1, 6)
    with pytest.raises(MissedModuleError, match=r"invoke 0 waited at tracer\.barrier\(2\) .*the "
                       r"others are blocked: invoke 1 waits at .*test_invokes\.py:\d+ for the "
                       r"name 'a', which no invoke has bound\..*must be bound before") as info:
        with model.trace() as tracer:
            b = tracer.barrier(2)
            with tracer.invoke(x):
                h = model[0].output
                b()
                a = h * 2
            with tracer.invoke(x):
                c = a + 1
                b()
    assert "the same number of times" not in str(info.value)
    with pytest.raises(MissedModuleError, match=r"invoke 1 waits at another tracer\.barrier\(2\) "
                       r"at .*test_invokes\.py:\d+\..*the barriers in the same order"):
        with model.trace() as tracer:
            b1, b2 = tracer.barrier(2), tracer.barrier(2)
            with tracer.invoke(x):
                b1()
                b2()
            with tracer.invoke(x):
                b2()
                b1()


def test_values_collected_per_layer_patch_a_later_invoke_layer_by_layer(seq):
    """The README's pattern: invoke 0 appends each layer's output as it comes; invoke 1 asks
    for its own layer output first, then copies invoke 0's in, so its output equals the clean
    input's plain forward. A list built by a comprehension over all layers is bound only after
    the last layer, too late for invoke 1's first layer: OutOfOrderError, nothing left behind."""
    model = NNsight(seq)
    clean, corrupt = torch.randn(1, 6), torch.randn(1, 6)
    acts = []
    with model.trace() as tracer:
        with tracer.invoke(clean):
            for i in range(len(seq)):
                acts.append(model[i].output)
        with tracer.invoke(corrupt):
            for i in range(len(seq)):
                h = model[i].output
                h[:] = acts[i]
            out = model.output.save()
    torch.testing.assert_close(out, seq(clean))
    # (the tutorial's shape: invoke 1 waits for a list invoke 0 completes only after the last
    # module, so model[0] runs while it waits: the error says so, not "move this line up")
    with pytest.raises(OutOfOrderError, match=r"invoke 1 asked for model\[0\].output at "
                       r".*test_invokes.py:\d+, but model\[0\] had already run that call"
                       r".*: before it, the body waited at .*test_invokes.py:\d+ for `every`, "
                       r"which an earlier invoke bound only after that(.|\n)*session"):
        with model.trace() as tracer:
            with tracer.invoke(clean):
                every = [model[i].output for i in range(len(seq))]
            with tracer.invoke(corrupt):
                first = every[0]
                model[0].output[:] = first
    with pytest.raises(OutOfOrderError, match=r"has already run that call.*move this line"):
        with model.trace() as tracer:  # (a read in between: the body's own order is to blame)
            with tracer.invoke(clean):
                every = [model[i].output for i in range(len(seq))]
            with tracer.invoke(corrupt):
                first = every[0]
                out = model.output
                model[0].output[:] = first
    torch.testing.assert_close(model(corrupt), seq(corrupt))


def _room():
    """How many more nested Python calls fit here."""
    n = 0

    def f():
        nonlocal n
        n += 1
        f()

    try:
        f()
    except RecursionError:
        pass
    return n


def test_traces_with_more_invokes_than_the_pool_holds_keep_their_depth(seq):
    """A trace with more invokes than the worker pool keeps makes new workers every time; they
    start in the thread's nursery greenlet, not inside the worker running the forward, so
    repeating such a trace does not eat into the recursion limit (nor the native stack)."""
    from nnsight_lite import workers

    room = _room
    model = NNsight(seq)
    x = torch.randn(1, 6)
    rooms = []
    for _ in range(4):
        with model.trace() as tracer:
            for i in range(workers._POOL_MAX + 6):
                with tracer.invoke(x):
                    model[0].output
                    if i == workers._POOL_MAX + 5:
                        r = nnsight_lite.save(room())
        rooms.append(r)
    assert rooms == [rooms[0]] * 4


def test_nested_traces_that_make_workers_keep_their_depth(seq):
    """The same for workers first needed deep down: a trace nested in a body, with more invokes
    than the pool keeps, run again and again."""
    from nnsight_lite import workers

    model = NNsight(seq)
    x = torch.randn(1, 6)
    n = workers._POOL_MAX + 6
    rooms = []
    for _ in range(4):
        with model.trace(x):
            model[0].output
            with model.trace() as inner:
                for i in range(n):
                    with inner.invoke(x):
                        model[0].output
                        if i == n - 1:
                            r = nnsight_lite.save(_room())
            r = nnsight_lite.save(r)
        rooms.append(r)
    assert rooms == [rooms[0]] * 4


class TestTraceWithoutInputs:
    """nnsight's test_batching: a trace with no inputs and no invoke, and an invoke opened inside
    another, raise a ValueError saying what to write (nnsight 0.8 raises ValueError too)."""

    def test_no_inputs_and_no_invoke_raises_and_runs_nothing(self, seq):
        """`with model.trace(): pass` (and a body that opens no invoke) raises InputError, a
        ValueError naming the trace's line; the model's forward never runs."""
        model = NNsight(seq)
        calls = []
        handle = seq.register_forward_hook(lambda m, i, o: calls.append(1))
        try:
            with pytest.raises(ValueError, match=r"no inputs.*no invoke.*tracer\.invoke") as err:
                with model.trace():
                    pass
            assert isinstance(err.value, InputError)
            assert f"{__file__}:" in str(err.value)
            with pytest.raises(InputError, match="nothing to run"):
                with model.trace() as tracer:
                    n = 1  # noqa: F841
        finally:
            handle.remove()
        assert calls == []
        x = torch.randn(2, 6)
        with model.trace(x):  # the model traces normally afterwards
            out = model.output.save()
        torch.testing.assert_close(out, seq(x))

    def test_an_invoke_inside_an_invoke_raises_a_value_error(self, seq):
        """Opening `tracer.invoke` inside another invoke's body raises InvokeError (a ValueError,
        as nnsight 0.8's) saying it is inside another invoke's body, at the user's line."""
        model = NNsight(seq)
        with pytest.raises(ValueError, match="inside another invoke's body") as err:
            with model.trace() as tracer:
                with tracer.invoke(torch.randn(1, 6)):
                    with tracer.invoke(torch.randn(1, 6)):
                        pass
        assert isinstance(err.value, InvokeError)
        assert "test_invokes.py" in str(err.value)


class TestInvokesInHelpers:
    """Invokes share the names of the code they are written in: a helper function's invokes do
    not see names another helper's invokes bind (nnsight's test_batching::TestInvokeFromHelper)."""

    def test_a_name_bound_in_another_helpers_invoke_stays_there(self, seq):
        """`secret` bound in one helper's invoke is a NameError in another helper's invoke, while
        a global of the same name is what the second helper reads when there is one."""
        model = NNsight(seq)
        seen = {}

        def binds(tracer, x):
            with tracer.invoke(x):
                secret = model[0].output.sum()  # noqa: F841
                shared_name = "from binds"  # noqa: F841

        def reads(tracer, x):
            with tracer.invoke(x):
                model[1].output  # past where the other invoke binds
                try:
                    seen["secret"] = secret  # noqa: F821
                except NameError:
                    seen["secret"] = "NameError"
                seen["global"] = shared_name

        x1, x2 = torch.randn(1, 6), torch.randn(1, 6)
        with model.trace() as tracer:
            binds(tracer, x1)
            reads(tracer, x2)
        assert seen == {"secret": "NameError", "global": "module global"}

    def test_invokes_of_one_helper_call_and_of_the_trace_body_still_share(self, seq):
        """Two invokes written in one helper hand a value over as invokes in a trace body do;
        the values are the plain model's."""
        model = NNsight(seq)

        def patch(tracer, clean, corrupt, out):
            with tracer.invoke(clean):
                h = model[1].output
            with tracer.invoke(corrupt):
                model[1].output[:] = h
                out["patched"] = model.output

        x1, x2 = torch.randn(1, 6), torch.randn(1, 6)
        with model.trace() as tracer:
            out = nnsight_lite.save({})
            patch(tracer, x1, x2, out)
        want = seq[3](seq[2](seq[1](seq[0](x1))))
        torch.testing.assert_close(out["patched"], want)


shared_name = "module global"


class DictBlock(torch.nn.Module):
    """Returns ``{"h": lin(x), "aux": x.sum(-1)}`` (or a list ``[h, aux]``)."""

    def __init__(self, as_list=False):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.as_list = as_list

    def forward(self, x):
        h = self.lin(x)
        return [h, x.sum(-1)] if self.as_list else {"h": h, "aux": x.sum(-1)}


class DictNet(torch.nn.Module):
    def __init__(self, as_list=False):
        super().__init__()
        self.block = DictBlock(as_list)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        out = self.block(x)
        h = out[0] if isinstance(out, list) else out["h"]
        return {"logits": self.head(h), "h": h}


class TestMembersSetInOneInvoke:
    """Setting a member of a dict or list output (`out["h"] = x`, a model output's
    `out.logits = x`) in one invoke of several changes that invoke's rows of the model's value
    (nnsight's test_apply_modeloutput contract; was: lost, since the invoke's copy was narrowed)."""

    @pytest.mark.parametrize("as_list", [False, True])
    def test_a_member_set_in_a_middle_module_reaches_the_rest_of_the_forward(self, as_list):
        """Invoke 0 sets its `h` to zeros: its logits are head(0), invoke 1's are untouched."""
        torch.manual_seed(0)
        net = DictNet(as_list)
        model = NNsight(net)
        x0, x1 = torch.randn(2, 4), torch.randn(3, 4)
        key = 0 if as_list else "h"
        with model.trace() as tracer:
            with tracer.invoke(x0):
                model.block.output[key] = torch.zeros(2, 4)
                a = model.output["logits"].save()
            with tracer.invoke(x1):
                b = model.output["logits"].save()
        torch.testing.assert_close(a, net.head(torch.zeros(2, 4)))
        torch.testing.assert_close(b, net(x1)["logits"])

    def test_a_root_member_set_in_one_invoke_is_seen_by_the_whole_batch(self):
        """`model.output["logits"] = ones` in invoke 0: an empty invoke (the whole batch) sees
        ones in invoke 0's rows and invoke 1's own logits in the rest."""
        torch.manual_seed(0)
        net = DictNet()
        model = NNsight(net)
        x0, x1 = torch.randn(2, 4), torch.randn(3, 4)
        with model.trace() as tracer:
            with tracer.invoke(x0):
                model.output["logits"] = torch.ones(2, 2)
            with tracer.invoke(x1):
                pass
            with tracer.invoke():
                whole = model.output["logits"].save()
        torch.testing.assert_close(whole[:2], torch.ones(2, 2))
        torch.testing.assert_close(whole[2:], net(x1)["logits"])


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    hidden: torch.Tensor


class _DataclassBlock(torch.nn.Module):
    """Returns ``_Out`` (a dataclass); ``extra`` (a keyword) scales its hidden state, and its
    second output is a tuple ``(h, {"aux": ...})`` when ``nested``."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, scale=None):
        h = self.lin(x)
        if scale is not None:
            h = h * scale
        return _Out(logits=h * 2, hidden=h), (h, {"aux": h + 1})


class _DataclassNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.sub = _DataclassBlock()
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        out, (h, extra) = self.sub(x, scale=torch.ones(x.shape[0], 1))
        return self.head(out.logits) + out.hidden.sum(-1, keepdim=True) + extra["aux"][:, :2]


@pytest.mark.parametrize("edit", ["attribute", "whole", "skip", "kwarg_item", "nested_item"])
def test_edits_of_dataclass_and_nested_members_in_one_invoke_of_two(edit):
    """A module returning a dataclass (and a tuple holding a dict), two invokes, invoke 1
    edits: an attribute of the dataclass (`out.logits = z`; lost), the whole dataclass or a
    skip with one (invoke 1's rows replaced the whole batch, so invoke 0 got invoke 1's data),
    a keyword's item in `.inputs` and an item of a dict inside the output tuple (both lost).
    Each now changes invoke 1's rows only: both invokes equal plain forwards with the same
    edit made by a hook on invoke 1's input alone."""
    torch.manual_seed(0)
    net = _DataclassNet()
    model = NNsight(net)
    x0, x1 = torch.randn(2, 4), torch.randn(3, 4)
    zeros = torch.zeros(3, 4)

    def plain(x, edited):
        hook = None
        if edited and edit == "kwarg_item":
            hook = net.sub.register_forward_pre_hook(
                lambda m, a, k: (a, {**k, "scale": torch.full((3, 1), 2.0)}), with_kwargs=True)
        elif edited:
            def hook_fn(m, i, o):
                out, (h, extra) = o
                if edit == "nested_item":
                    return out, (h, {"aux": torch.zeros_like(extra["aux"])})
                return _Out(logits=zeros, hidden=out.hidden), (h, extra)
            hook = net.sub.register_forward_hook(hook_fn)
        try:
            return net(x)
        finally:
            if hook is not None:
                hook.remove()

    with model.trace() as tracer:
        with tracer.invoke(x0):
            a = model.output.save()
        with tracer.invoke(x1):
            if edit == "attribute":
                model.sub.output[0].logits = zeros
            elif edit == "whole":
                out, rest = model.sub.output
                model.sub.output = (_Out(logits=zeros, hidden=out.hidden), rest)
            elif edit == "skip":
                args, kwargs = model.sub.inputs
                h = net.sub.lin(args[0])
                model.sub.skip((_Out(logits=zeros, hidden=h), (h, {"aux": h + 1})))
            elif edit == "kwarg_item":
                model.sub.inputs[1]["scale"] = torch.full((3, 1), 2.0)
            else:
                model.sub.output[1][1]["aux"] = torch.zeros(3, 4)
            b = model.output.save()
    torch.testing.assert_close(a, plain(x0, False))
    torch.testing.assert_close(b, plain(x1, True))
    assert not torch.allclose(b, plain(x1, False))


@pytest.mark.parametrize("stack_kib", [128, 256])
def test_a_thread_with_a_small_stack_runs_traces(seq, stack_kib):
    """Body workers start some way below the forward's runner (workers._below); in a thread
    whose stack was made small (``threading.stack_size``) they go down only a part of it, so
    traces there still run (too far down would crash the process, not raise); so do backward
    bodies, which start further down still. Values match a plain forward and backward."""
    import threading

    model = NNsight(seq)
    x = torch.randn(3, 6)
    got = {}

    def run():
        for _ in range(3):  # (later traces take pooled workers)
            with model.trace() as tracer:
                for i in range(3):
                    with tracer.invoke(x[i:i + 1]):
                        h = model[0].output.save()
                        out = model.output.save()
                        with out.sum().backward(retain_graph=True):  # (one graph: a batch)
                            g = h.grad.save()
                        got[i] = (h, out, g)
            with out.sum().backward():  # standalone, on a saved tensor
                got["standalone"] = h.grad.save()

    old = threading.stack_size(stack_kib * 1024)
    try:
        t = threading.Thread(target=run)
        t.start()
        t.join()
        # (reading it with threading.stack_size() would have reset it to the default)
        assert threading.stack_size(old) == stack_kib * 1024, "the setting was changed"
    finally:
        threading.stack_size(old)
    standalone = got.pop("standalone")
    assert sorted(got) == [0, 1, 2]
    h_all = seq[0](x)  # (the invokes ran as one batch of 3)
    h_all.retain_grad()
    out_all = seq[1:](h_all)
    out_all.sum().backward()
    for i, (h, out, g) in got.items():
        assert torch.equal(h, h_all[i:i + 1]) and torch.equal(out, out_all[i:i + 1])
        assert torch.allclose(g, h_all.grad[i:i + 1])
    assert torch.allclose(standalone, h_all.grad[2:3])


@pytest.mark.parametrize("libc", [True, False])
def test_the_stack_size_is_read_from_the_thread_and_left_as_set(monkeypatch, libc):
    """The body nurseries' descent is sized from the running thread's own stack (the C
    library's record of it; without one, the size set for new threads). Reading it must not
    change the size later threads get."""
    import ctypes
    import threading

    from nnsight_lite import workers

    if not libc:  # (as on a platform without pthread_getattr_np)
        def no_libc(*args, **kwargs):
            raise OSError("no C library here")

        monkeypatch.setattr(ctypes, "CDLL", no_libc)
    seen = {}

    def run():
        seen["size"] = workers._stack_bytes()

    old = threading.stack_size(384 * 1024)
    try:
        t = threading.Thread(target=run)
        t.start()
        t.join()
        assert threading.stack_size(old) == 384 * 1024
    finally:
        threading.stack_size(old)
    assert seen["size"] == 384 * 1024


def _quantized_net():
    """A statically quantized Linear-ReLU-Linear (torch.ao.quantization's prepare/convert),
    which passes quint8 tensors with one scale for the whole batch."""
    quant = pytest.importorskip("torch.ao.quantization")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = quant.QuantStub()
            self.a = torch.nn.Linear(4, 8)
            self.b = torch.nn.Linear(8, 3)
            self.dq = quant.DeQuantStub()

        def forward(self, x):
            return self.dq(self.b(torch.relu(self.a(self.q(x)))))

    torch.manual_seed(0)
    net = Net().eval()
    net.qconfig = quant.get_default_qconfig("x86")
    prepared = quant.prepare(net)
    prepared(torch.randn(16, 4))
    return quant.convert(prepared)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("quantized_value", [True, False])
def test_a_replacement_in_a_quantized_batch_leaves_the_other_invokes_rows_exact(first,
                                                                                quantized_value):
    """An invoke replacing a quantized output with a quantized tensor of another scale, as the
    first invoke, made torch.cat requantize every row of the batch to the replacement's scale,
    so the other invoke's result changed; replacing it with a float tensor raised torch's
    "empty_strided not supported on quantized tensors". The rows written are quantized as the
    batch's tensor is (as a replacement takes the batch tensor's dtype), and the other invoke's
    rows are left exact."""
    qnet = _quantized_net()
    x = torch.randn(4, 4)
    seen, ref = record(qnet, ["a"], x)
    h = seen[("a", 0)]
    zeros = torch.zeros(2, 8)
    value = torch.quantize_per_tensor(zeros, 0.1, 0, torch.quint8) if quantized_value else zeros
    edited = qnet.dq(qnet.b(torch.relu(
        torch.quantize_per_tensor(zeros, h.q_scale(), h.q_zero_point(), torch.quint8))))
    model = NNsight(qnet)
    with model.trace() as tracer:
        with tracer.invoke(x[:2]):
            if first:
                model.a.output = value
            y0 = model.output.save()
        with tracer.invoke(x[2:]):
            if not first:
                model.a.output = value
            y1 = model.output.save()
    kept, changed = (y1, y0) if first else (y0, y1)
    assert torch.equal(kept, ref[2:] if first else ref[:2])
    assert torch.equal(changed, edited)


class _Quantize(torch.nn.Module):
    """Quantizes its input as quint8 with a fixed scale and zero point, for the whole batch."""

    def forward(self, x):
        return torch.quantize_per_tensor(x, 0.1, 10, torch.quint8)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_a_replacement_of_another_quantized_dtype_in_a_batch():
    """An invoke replacing a quint8 output with a qint8 tensor of the same scale and zero point:
    batching.merge took it as already quantized as the batch is (it compared the scheme, scale
    and zero point, not the dtype), and torch.cat raised "All dtypes must be the same". Its rows
    are quantized as the batch's tensor is, like any other replacement's, and the other
    invoke's rows are left exact."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), _Quantize(), torch.nn.Identity())
    x = torch.randn(3, 4)
    with torch.no_grad():
        ref = net(x).dequantize()
    value = torch.quantize_per_tensor(torch.full((1, 4), 0.5), 0.1, 10, torch.qint8)
    edited = torch.quantize_per_tensor(value.dequantize(), 0.1, 10, torch.quint8)
    model = NNsight(net)
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(x[:1]):
            model[1].output = value
            y0 = model.output.save()
        with tracer.invoke(x[1:]):
            y1 = model.output.save()
    assert y0.dtype == y1.dtype == torch.quint8
    assert torch.equal(y0.dequantize(), edited.dequantize())
    assert torch.equal(y1.dequantize(), ref[1:])


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_a_float_replacement_of_a_quantized_output_is_told_how_to_quantize_it():
    """One invoke replacing a quint8 output with a float tensor: the next quantized module
    fails, and the note said to write `.to(torch.quint8)`, which torch cannot do (it raises
    "empty_strided not supported on quantized tensors"). It gives the quantize call with the
    model's scale and zero point, which runs as the plain model would on that value."""
    qnet = _quantized_net()
    x = torch.randn(4, 4)
    seen, _ = record(qnet, ["a"], x)
    h = seen[("a", 0)]
    model = NNsight(qnet)
    with pytest.raises(NotImplementedError) as info:
        with model.trace(x):
            model.a.output = torch.zeros(4, 8)
    note = "\n".join(getattr(info.value, "__notes__", []))
    advice = (f"torch.quantize_per_tensor(value, {h.q_scale()}, {h.q_zero_point()}, "
              "torch.quint8)")
    assert advice in note and ".to(" not in note
    value = torch.quantize_per_tensor(torch.zeros(4, 8), h.q_scale(), h.q_zero_point(),
                                      torch.quint8)
    with model.trace(x):
        model.a.output = value
        out = model.output.save()
    assert torch.equal(out, qnet.dq(qnet.b(torch.relu(value))))
