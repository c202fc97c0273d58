"""The Envoy tree mirrors the module: children, indexing, iteration, attributes, printing."""

from __future__ import annotations

import copy
import gc
import pickle
import traceback
import weakref

import pytest
import torch

import nnsight_lite
from nnsight_lite import (Envoy, MissedModuleError, ModulePathError, NNsight, NNsightError,
                          OutOfOrderError)
from tests.helpers import record


class TestTree:
    def test_children_and_indexing(self, net):
        model = NNsight(net)
        assert isinstance(model.layers, Envoy)
        assert model.layers[0]._module is net.layers[0]
        assert model.layers[-1]._module is net.layers[2]
        assert model.layers[-1]._path == "model.layers[2]"
        # (labelled by the child's index whichever index reached it first: one Envoy, one name)
        again = NNsight(net)
        assert again.layers[2] is again.layers[-1] and again.layers[2]._path == "model.layers[2]"
        assert [e._module for e in model.layers] == list(net.layers)
        assert len(model.layers) == 3
        assert [e._module for e in model.layers[0:2]] == list(net.layers[0:2])

    def test_path_is_the_dotted_module_name_that_keys_the_cache(self, net, x8):
        """``envoy.path`` is nnsight's name for a module: "model" and its ``named_modules()``
        name (a negative index resolved), the key under which ``tracer.cache()`` files it."""
        model = NNsight(net)
        names = {m: n for n, m in net.named_modules()}
        assert model.path == "model"
        assert model.layers[-1].path == "model." + names[net.layers[2]] == "model.layers.2"
        assert model.block.path == "model.block"
        seen = []
        h = net.layers[1].register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
        try:
            net(x8)
        finally:
            h.remove()
        with model.trace(x8) as tracer:
            cache = tracer.cache(modules=[model.layers[1]])
        assert torch.equal(cache[model.layers[1].path].output, seen[0])

    def test_parent_root_and_devices(self, net, x8):
        """``.parent`` is the Envoy one level up (reached through an alias too), ``.root`` the
        model's; ``.devices`` the set of the module's parameter devices. A child module named
        ``parent`` comes first, as a module's own names do. Both survive pickling, and the
        back reference keeps nothing alive (the wrapper is freed by reference counting)."""
        model = NNsight(net, rename={"layers": "blocks"})
        assert model.parent is None and model.root is model
        assert model.blocks[1].parent is model.layers and model.layers.parent is model
        assert model.layers[2].root is model and model.block.parent is model
        assert model.layers[0].devices == {torch.device("cpu")} == model.devices
        assert NNsight(torch.nn.ReLU()).devices == set()
        with model.trace(x8):  # read through a parent inside a body
            h = model.layers[1].parent[1].output.save()
        torch.testing.assert_close(h, net.layers[1](net.act(net.layers[0](
            net.block(net.shared(net.act(net.inp(x8))))[0]))))
        plain = NNsight(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)])))
        assert plain[0][0].parent is plain[0]
        again = pickle.loads(pickle.dumps(plain))  # (a module of torch classes: picklable)
        assert again[0][0].parent is again[0] and again[0][0].root is again
        shallow = copy.copy(plain)  # (shares the children: they keep their parent)
        assert plain[0].parent is plain and shallow[0] is plain[0]

        class Holder(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.parent = torch.nn.Linear(2, 2)

        held = NNsight(torch.nn.Sequential(Holder()))
        assert held[0].parent._module is held._module[0].parent
        ref = weakref.ref(model)
        leaf = weakref.ref(model.layers[0])
        gc.disable()
        try:
            del model, h
            assert ref() is None and leaf() is None
        finally:
            gc.enable()

    def test_a_submodule_and_a_bare_envoy_trace_on_their_own(self, seq):
        """``model[1].trace(h)`` runs that module alone (nnsight's Envoy.trace): its children
        are read through the model's Envoys; ``Envoy(module).trace(x)`` works as nnsight's
        tests use it; ``model[1].edit()`` is replayed by that module's own traces only."""
        torch.manual_seed(0)
        inner = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU())
        net = torch.nn.Sequential(torch.nn.Linear(6, 6), inner, torch.nn.Linear(6, 2))
        model = NNsight(net)
        h = torch.randn(3, 6)
        with model[1].trace(h):
            a = model[1][0].output.save()
            out = model[1].output.save()
        torch.testing.assert_close(a, inner[0](h))
        torch.testing.assert_close(out, inner(h))
        bare = Envoy(net)
        with bare.trace(h):
            last = bare[2].output.save()
        torch.testing.assert_close(last, net(h))
        with model[1].edit(inplace=True):
            model[1][0].output[:] = 0
        with model[1].trace(h):
            edited = model[1].output.save()
        with model.trace(h):
            whole = model.output.save()
        torch.testing.assert_close(edited, torch.zeros(3, 6))
        torch.testing.assert_close(whole, net(h))  # the root's trace does not replay it
        model[1].clear_edits()
        with model[1].trace(h):
            again = model[1].output.save()
        torch.testing.assert_close(again, inner(h))
        assert all("forward" not in m.__dict__ for m in net.modules())

    @pytest.mark.parametrize("through", ["model", "layer"])
    def test_a_submodule_edit_lets_the_model_go(self, through):
        """A submodule's edit whose body reads the model (or the submodule's own Envoy) does
        not keep the model alive: dropped, it is freed by reference counting."""
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 4),
                                  torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
        model = NNsight(net)
        layer = model[1]
        if through == "model":
            with model[1].edit(inplace=True):
                model[1][0].output[:] = 0
        else:
            with layer.edit(inplace=True):
                layer[0].output[:] = 0
        x = torch.randn(2, 4)
        with layer.trace(x):
            out = layer.output.save()
        torch.testing.assert_close(out, torch.zeros(2, 4))
        refs = [weakref.ref(net), weakref.ref(net[1]), weakref.ref(model)]
        gc.disable()
        try:
            del net, model, layer, out
            assert [r() for r in refs] == [None, None, None]
        finally:
            gc.enable()

    def test_sequential_root(self, seq):
        model = NNsight(seq)
        assert len(model) == 4 and model[2]._module is seq[2]
        assert model[1] is model[1]  # cached

    def test_module_dict(self):
        """A ModuleDict's Envoy indexes by key; a loop over it gives the children's Envoys (as
        nnsight's does: ``[blk.output for blk in model.blocks]``), ``.keys()`` the keys, and
        ``in`` asks for a key."""
        torch.manual_seed(0)
        md = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
        model = NNsight(torch.nn.Sequential(md))
        assert model[0]["a"]._module is md["a"]
        assert list(model[0]) == [model[0]["a"], model[0]["b"]]
        assert list(model[0].keys()) == ["a", "b"] and "a" in model[0] and "c" not in model[0]

        class Two(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = md

            def forward(self, x):
                return self.blocks["b"](self.blocks["a"](x))

        net = Two()
        wrapped = NNsight(net)
        x = torch.randn(3, 2)
        with wrapped.trace(x):
            outs = nnsight_lite.save([blk.output for blk in wrapped.blocks])
        torch.testing.assert_close(outs[0], md["a"](x))
        torch.testing.assert_close(outs[1], net(x))

    def test_other_attributes_pass_through(self, net):
        model = NNsight(net)
        assert model.inp.weight is net.inp.weight
        assert model.inp.in_features == 8
        assert model.training is True
        model.eval()
        assert net.training is False
        assert list(model.parameters()) == list(net.parameters())

    def test_setattr_passes_to_module(self, net):
        model = NNsight(net)
        new = torch.nn.Linear(8, 2)
        model.head = new
        assert net.head is new
        assert model.head._module is new

    def test_children_swapped_between_traces_are_read_where_they_are_now(self, x8):
        """Two children swapped on the torch module (``net.a, net.b = net.b, net.a``) after
        traces that read both through their Envoys: the next trace's ``model.a`` reads the
        module now called ``a`` (ground truth: hooks), and so does an Envoy read outside a
        trace."""
        torch.manual_seed(0)

        class Two(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Linear(8, 8)
                self.b = torch.nn.Linear(8, 8)

            def forward(self, x):
                return self.b(torch.relu(self.a(x)))

        net = Two()
        model = NNsight(net)
        for _ in range(2):
            with model.trace(x8):
                model.a.output.save()
                model.b.output.save()
        net.a, net.b = net.b, net.a
        assert model.a._module is net.a and model.b._module is net.b
        seen = {}
        hooks = [m.register_forward_hook(lambda m, i, o, n=n: seen.setdefault(n, o.clone()))
                 for n, m in (("a", net.a), ("b", net.b))]
        try:
            net(x8)
        finally:
            for h in hooks:
                h.remove()
        for _ in range(2):
            with model.trace(x8):
                a = model.a.output.save()
                b = model.b.output.save()
            assert torch.equal(a, seen["a"]) and torch.equal(b, seen["b"])

    def test_an_edited_copy_made_in_a_trace_follows_the_module(self, net, x8):
        """``model.edit()`` made inside a trace body, after the body read ``model.inp``: the
        copy does not keep the Envoy that trace held, so once ``net.inp`` is replaced the
        copy's ``inp`` is the new module."""
        model = NNsight(net)
        with model.trace(x8):
            model.inp.output.save()
            editor = nnsight_lite.save(model.edit())
        copy = editor._target
        new = torch.nn.Linear(8, 8)
        net.inp = new
        assert copy.inp._module is new

    @pytest.mark.parametrize("name", ["trace", "scan", "session", "edit", "clear_edits"])
    def test_a_child_named_like_a_wrapper_method_comes_first(self, name):
        """Below the root, a child module named ``scan`` (a state-space block, say) is that
        child's Envoy, read like any; a module without one gets the method."""
        torch.manual_seed(0)
        block = torch.nn.Module()
        block.add_module(name, torch.nn.Linear(4, 4))
        block.forward = lambda x: getattr(block, name)(x)  # (an instance forward: any works)
        net = torch.nn.Sequential(block)
        model = NNsight(net)
        child = getattr(model[0], name)
        assert isinstance(child, Envoy) and child._module is getattr(block, name)
        x = torch.randn(2, 4)
        with model.trace(x):
            out = getattr(model[0], name).output.save()
        torch.testing.assert_close(out, getattr(block, name)(x))
        other = NNsight(torch.nn.Sequential(torch.nn.Linear(4, 4)))
        assert not isinstance(getattr(other[0], name), Envoy) and callable(getattr(other[0], name))

    def test_a_child_named_like_an_envoy_method(self, x8):
        """A submodule called ``next`` (an Envoy method's name) is reached by its alias,
        listed by ``children()`` and ``modules()``, read in a remote-shaped trace through
        an Envoy held from before, and found in ``tracer.cache()`` by its own name;
        ``envoy.next`` stays the method."""
        torch.manual_seed(0)

        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.next = torch.nn.Linear(8, 8)
                self.fc = torch.nn.Linear(8, 8)

            def forward(self, x):
                return self.fc(self.next(x))

        net = torch.nn.Sequential(Layer())
        model = NNsight(net, rename={"next": "nxt"})
        nxt = model[0].nxt
        assert nxt._module is net[0].next
        assert [e._module for e in model[0].children()] == [net[0].next, net[0].fc]
        assert [e._module for e in model.modules()] == list(net.modules())
        assert callable(model[0].next) and not isinstance(model[0].next, Envoy)
        want = net[0].next(x8)
        with model.trace(x8, remote="local"):
            h = nxt.output.save()
        torch.testing.assert_close(h, want)
        with model.trace(x8) as tracer:
            cache = tracer.cache()
        torch.testing.assert_close(cache.model[0].next.output, want)

    @pytest.mark.parametrize("key, error", [(3, IndexError), (-4, IndexError),
                                            ([0, 1], TypeError), ("x", TypeError)])
    def test_a_bad_index_names_the_envoy_and_the_container(self, net, key, error):
        """A bad index on a ModuleList Envoy raises torch's own error type, with the Envoy's
        path, the key and the container's class and length in the message (an unhashable key
        such as a list included)."""
        model = NNsight(net)
        model.layers[0]  # (a cached index first: the cache must not change what a miss says)
        with pytest.raises(error) as info:
            model.layers[key]
        assert f"model.layers[{key!r}]" in str(info.value)
        assert "ModuleList of length 3" in str(info.value)

    def test_a_child_replaced_on_the_module_is_the_one_reached(self, net, x8):
        """``net.inp = new`` on the torch module (not through the Envoy), after the Envoy of
        the old child was reached: ``model.inp`` (and a ``rename=`` alias of it) is the new
        module's Envoy, and a trace reads the new module's output (ground truth: a hook)."""
        model = NNsight(net, rename={"inp": "first"})
        old = model.inp
        assert model.first is old
        for _ in range(2):  # (the second trace holds the Envoy from its start)
            with model.trace(x8):
                model.inp.output.save()
        assert "inp" not in vars(model)  # (a trace's fast path holds child Envoys until its end)
        new = torch.nn.Linear(8, 8)
        net.inp = new
        assert model.inp._module is new and model.first._module is new
        assert model.inp.weight is new.weight
        seen = []
        h = new.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
        try:
            net(x8)
        finally:
            h.remove()
        with model.trace(x8):
            a = model.inp.output.save()
            b = model.first.output.save()
        assert torch.equal(a, seen[0]) and torch.equal(b, seen[0])
        del net.inp
        with pytest.raises(ModulePathError, match="no submodule or attribute 'inp'"):
            model.inp

    def test_print_shows_module_tree(self, net):
        assert repr(NNsight(net)) == repr(net)

    def test_dir_lists_children(self, net):
        assert {"layers", "inp", "head", "trace"} <= set(dir(NNsight(net)))

    def test_wrapping_a_non_module(self):
        with pytest.raises(TypeError, match="torch.nn.Module"):
            NNsight(lambda x: x)

    def test_calling_envoy_calls_module(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        torch.testing.assert_close(model[0](x), seq[0](x))


class TestMisspelledNames:
    """A name an Envoy does not have raises ModulePathError (an AttributeError) naming the
    Envoy's path, the user's line, and close matches among the Envoy's own names (output,
    inputs, source, ...), the module's children, its rename= aliases and its attributes."""

    @pytest.mark.parametrize("typo, meant", [
        ("ouput", "output"), ("inptus", "inputs"), ("sorce", "source"), ("nxt", "next"),
    ])
    def test_envoy_properties_are_suggested(self, net, typo, meant):
        model = NNsight(net)
        with pytest.raises(ModulePathError) as info:
            getattr(model.layers[0], typo)
        msg = str(info.value)
        assert msg.startswith(f"model.layers[0] (Linear) has no submodule or attribute {typo!r} "
                              f"(at {__file__}:")
        assert f"Did you mean {meant!r}" in msg
        assert isinstance(info.value, AttributeError)
        assert not hasattr(model.layers[0], typo)

    def test_children_aliases_and_attributes_are_suggested(self, net):
        model = NNsight(net, rename={"layers": "blocks"})
        with pytest.raises(ModulePathError, match=r"Did you mean 'layers'"):
            model.layrs
        with pytest.raises(ModulePathError, match=r"Did you mean 'blocks'"):
            model.blcks
        with pytest.raises(ModulePathError, match=r"Did you mean 'weight'"):
            model.inp.wieght

    def test_in_a_trace_body(self, net, x8):
        """Inside a body the same error points at the body's line; the model is left clean."""
        model = NNsight(net)
        with pytest.raises(ModulePathError, match=r"'ouput'.*Did you mean 'output'") as info:
            with model.trace(x8):
                h = model.layers[0].ouput  # typo
        assert any(f.line.endswith("# typo") for f in traceback.extract_tb(info.value.__traceback__))
        with model.trace(x8):
            out = model.output.save()
        torch.testing.assert_close(out, net(x8))


class TestSkip:
    def test_skip_uses_value_instead_of_running(self):
        ran = []

        class Recording(torch.nn.Linear):
            def forward(self, x):
                ran.append(1)
                return super().forward(x)

        torch.manual_seed(0)
        seq = torch.nn.Sequential(torch.nn.Linear(6, 6), Recording(6, 6), torch.nn.Linear(6, 6))
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with model.trace(x):
            model[1].skip(torch.ones(2, 6))
            out = model.output.save()
        assert ran == []
        torch.testing.assert_close(out, seq[2](torch.ones(2, 6)))

    def test_a_child_of_a_skipped_module_is_an_out_of_order_error(self):
        """A skipped module's children never run: reading one raises MissedModuleError saying
        which skip kept it from running, and nnsight code catches it as the OutOfOrderError
        nnsight raises there (and as ValueError)."""
        torch.manual_seed(0)
        inner = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU())
        seq = torch.nn.Sequential(torch.nn.Linear(6, 6), inner, torch.nn.Linear(6, 6))
        model = NNsight(seq)
        for catch in (OutOfOrderError, ValueError, MissedModuleError):
            with pytest.raises(catch, match=r"model\[1\]\[0\]\.output .*is inside model\[1\], "
                                            r"which a body skipped with \.skip\(\)"):
                with model.trace(torch.randn(2, 6)):
                    model[1].skip(torch.ones(2, 6))
                    model[1][0].output.save()

    def test_input_after_skip_is_an_out_of_order_error(self, seq):
        """After ``m.skip(v)`` the body is past ``m``'s input for that call: reading or setting
        ``m.input`` raises (as nnsight does), instead of editing what may be the very tensor
        given to skip (here ``model[0].output`` is ``model[1]``'s input). Reading the input
        first works, a second skip replaces the first, and ``m.output`` is the skip value."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        for edit in ("read", "in place", "assign"):
            with pytest.raises(OutOfOrderError, match=r"used model\[1\]\.input \(or \.inputs\) at .*"
                                                      r"after model\[1\]\.skip\(\.\.\.\)"):
                with model.trace(x):
                    h0 = model[0].output
                    model[1].skip(h0)
                    if edit == "read":
                        model[1].input.save()
                    elif edit == "in place":
                        model[1].input[:] = 0
                    else:
                        model[1].input = torch.zeros(2, 6)
        with model.trace(x):
            h0 = model[0].output
            seen = model[1].input.clone().save()
            model[1].skip(torch.zeros(2, 6))
            model[1].skip(h0)
            skipped = model[1].output.save()
            out = model.output.save()
        torch.testing.assert_close(seen, seq[0](x))
        assert skipped is not None and torch.equal(skipped, seq[0](x))
        torch.testing.assert_close(out, seq[3](seq[2](seq[0](x))))


class TestAutocastState:
    def test_autocast_in_body_does_not_leak_into_model(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with model.trace(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                a = model[0].output
            out = model[3].output.save()
        assert out.dtype == torch.float32
        assert not torch.is_autocast_enabled("cpu")


class TestOldIdioms:
    def test_value_attribute_explains(self, seq):
        model = NNsight(seq)
        with pytest.raises(AttributeError, match=r"drop `\.value`"):
            with model.trace(torch.randn(1, 6)):
                h = model[0].output.value

    def test_tracer_cond_explains(self, seq):
        model = NNsight(seq)
        with pytest.raises(NNsightError, match="plain `if model"):
            with model.trace(torch.randn(1, 6)) as tracer:
                with tracer.cond(model[0].output.sum() > 0):
                    pass


def test_an_envoy_is_truthy_like_its_module_list(net):
    """``if model:`` / ``model or other`` work on any Envoy: True for a module that holds no
    list of modules (where len() raises), and for a container the truth of its length (an
    empty Sequential's Envoy is False), as for the modules themselves in plain Python."""
    model = NNsight(net)
    assert bool(model) and bool(model.head) and bool(model.layers)
    assert (model or None) is model
    assert not NNsight(torch.nn.Sequential()) and not bool(torch.nn.Sequential())


def test_unpacking_a_model_that_is_no_container_says_what_to_write(seq, net):
    """``len()``/loops/unpacking work on container Envoys as on their modules (ground truth:
    the modules themselves); on another module they raise NotAContainerError (a TypeError)
    saying so."""
    from nnsight_lite.errors import NotAContainerError

    model = NNsight(seq)
    assert len(model) == len(seq)
    assert [e._module for e in model] == list(seq)
    other = NNsight(net)
    with pytest.raises(NotAContainerError, match="not a container of modules") as info:
        first, second = other
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize("container", [True, False])
def test_an_edit_unpacked_as_tracer_and_edited_works_as_in_nnsight_08(seq, net, container):
    """nnsight 0.8's ``with model.edit() as (tracer, edited):`` binds the edited model (a
    container model's too, not its children); a trace of it runs the edit (ground truth: a
    plain forward with the first child's output zeroed by a hook), the model itself is left
    unedited, and a later unpacking of the model is its ordinary one."""
    module = seq if container else net
    model = NNsight(module)
    first = next(iter(module.children()))
    name = next(iter(module._modules))
    with model.edit() as (tracer, edited):
        getattr(edited, name).output[:] = 0
    x = torch.randn(2, first.in_features)
    with edited.trace(x):
        out = edited.output.save()
    handle = first.register_forward_hook(lambda m, i, o: torch.zeros_like(o))
    try:
        expected = module(x)
    finally:
        handle.remove()
    torch.testing.assert_close(out, expected)
    with model.trace(x):
        plain = model.output.save()
    torch.testing.assert_close(plain, module(x))
    assert "_unpacking" not in edited.__dict__
    if container:
        assert [e._module for e in model] == list(seq)


def test_device_get_and_model_as_nnsight_has_them(net, x8):
    """``model.device`` (the first parameter's device, or an HF model's own), ``model.get(path)``
    (a dotted path of submodules and attributes, values too inside a body) and the older
    ``model._model``."""
    model = NNsight(net)
    assert model.device == torch.device("cpu") and model.layers[0].device == torch.device("cpu")
    assert NNsight(torch.nn.ReLU()).device is None  # no parameter, no buffer
    assert model.get("layers.1") is model.layers[1]
    assert model.get("layers.1.weight") is net.layers[1].weight
    assert model._model is net
    with model.trace(x8.to(model.device)):
        out = model.get("layers.1.output").save()
    seen, _ = record(net, ["layers.1"], x8)
    torch.testing.assert_close(out, seen[("layers.1", 0)])


def test_a_modules_own_device_and_get_come_first(x8):
    """A module's own ``device`` attribute or ``get`` method, and children named ``device``
    or ``get``, are what the Envoy gives for those names (before the Envoy's own ``device``
    and ``get(path)``), in a trace too."""

    class Own(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.device = "meant-for-elsewhere"

        def get(self, key):
            return {"a": 1}[key]

        def forward(self, x):
            return self.lin(x)

    class Named(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.device = torch.nn.Linear(8, 8)
            self.parts = torch.nn.ModuleDict({"get": torch.nn.Linear(8, 8)})

        def forward(self, x):
            return self.parts["get"](self.device(x))

    own = NNsight(Own())
    assert own.device == "meant-for-elsewhere" and own.get("a") == 1
    net = Named()
    named = NNsight(net)
    assert named.device._module is net.device and named.parts.get._module is net.parts["get"]
    with named.trace(x8):
        first = named.device.output.save()
        second = named.parts.get.output.save()
    torch.testing.assert_close(first, net.device(x8))
    torch.testing.assert_close(second, net(x8))


def test_a_property_giving_one_of_the_models_modules_gives_its_envoy():
    """A property of a module that returns one of the model's modules (HF's `base_model`, a
    custom `first`) gives that module's Envoy, so `model.first.output` reads it in a trace
    (it gave the torch module: AttributeError on `.output`); a property giving a module
    outside the model still gives the module itself."""
    torch.manual_seed(0)
    outside = torch.nn.Linear(4, 4)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)])

        @property
        def first(self):
            return self.layers[0]

        @property
        def stray(self):
            return outside

        def forward(self, x):
            return self.layers[1](torch.relu(self.layers[0](x)))

    net = Net()
    model = NNsight(net)
    x = torch.randn(3, 4)
    assert model.first is model.layers[0] and model.first.path == "model.layers.0"
    assert model.stray is outside
    with model.trace(x):
        h = model.first.output.save()
    torch.testing.assert_close(h, net.layers[0](x))


def test_indexing_a_compiled_model_indexes_the_model_it_compiled():
    """``NNsight(torch.compile(net))[0]``: torch's OptimizedModule hands attributes and len()
    on to the model it compiled but not indexing, so it said "'OptimizedModule' object is not
    subscriptable (OptimizedModule of length 3)". It reaches ``_orig_mod[0]`` (nnsight does the
    same), reads equal the plain modules', and a bad index names the real container."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    model = NNsight(torch.compile(net, backend="eager"))
    x = torch.randn(2, 4)
    with model.trace(x):
        h = model[0].output.save()
        out = model.output.save()
    torch.testing.assert_close(h, net[0](x))
    torch.testing.assert_close(out, net(x))
    assert model[0]._module is net[0] and len(model) == 3
    with pytest.raises(IndexError, match=r"index 7 is out of range \(Sequential of length 3\)"):
        model[7]


def test_a_child_named_root_does_not_hide_the_model_from_the_runtime():
    """A module with a child called ``root``: ``envoy.root`` is that child (a module's own
    names come first), but the runtime's walks to the whole model must not take it for the
    model: a property giving one of the model's modules (``base_model`` style) still gives
    that module's Envoy, which reads like any other."""
    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.root = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        @property
        def last(self):
            return self.b

        def forward(self, x):
            return self.b(self.root(x))

    net = torch.nn.Sequential(Inner())
    model = NNsight(net)
    x = torch.randn(2, 4)
    assert model[0].root._module is net[0].root
    with model.trace(x):
        h = model[0].last.output.save()
    torch.testing.assert_close(h, net(x))


class _ScriptedInner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.l(x))


class _WithTorchScript(torch.nn.Module):
    """A plain model holding a scripted module, a scripted Sequential and a traced module."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.inner = torch.jit.script(_ScriptedInner())
        self.seq = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()))
        self.traced = torch.jit.trace(_ScriptedInner(), torch.randn(2, 8))
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.traced(self.seq(self.inner(self.inp(x)))))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (torch 2.13 deprecates torch.jit)
class TestTorchScriptSubmodules:
    """Submodules made with ``torch.jit.script``/``torch.jit.trace``. Their ``_modules`` is
    TorchScript's ``OrderedModuleDict``, which has no ``get``: ``model.inner.l`` raised
    "AttributeError: 'OrderedModuleDict' object has no attribute 'get'", a scripted Sequential's
    ``model.seq[0]`` gave an Envoy of the Python Linear it was scripted from (its reads said the
    module had been replaced), and a read of a module inside one crashed building its message.
    The scripted modules' own values read and edit as plain torch computes them."""

    def test_the_envoys_are_the_scripted_children(self):
        torch.manual_seed(0)
        net = _WithTorchScript()
        model = NNsight(net)
        assert model.inner.l._module is net.inner.l
        assert model.seq[0]._module is net.seq._modules["0"]
        assert model.seq[-1]._module is net.seq._modules["1"]
        assert [e._module for e in model.seq] == list(net.seq._modules._python_modules.values())
        assert model.traced.l._module is net.traced.l
        assert model.get("inner.l")._module is net.inner.l

    def test_the_scripted_modules_values_read_and_edit_as_plain_torch(self):
        torch.manual_seed(0)
        net = _WithTorchScript()
        model = NNsight(net)
        x = torch.randn(2, 4)
        h = net.inp(x)
        a = net.inner(h)
        b = net.seq(a)
        with model.trace(x):
            got_in = model.inner.input.save()
            got_a = model.inner.output.save()
            got_b = model.seq.output.save()
            model.traced.output = model.traced.output * 0
            out = model.output.save()
        torch.testing.assert_close(got_in, h)
        torch.testing.assert_close(got_a, a)
        torch.testing.assert_close(got_b, b)
        torch.testing.assert_close(out, net.out(torch.zeros(2, 8)))
        torch.testing.assert_close(net(x), net.out(net.traced(b)))  # the model as it was

    @pytest.mark.parametrize("path", ["inner.l", "seq.0", "traced.l"])
    def test_a_module_inside_one_is_missed_with_the_reason(self, path):
        torch.manual_seed(0)
        net = _WithTorchScript()
        model = NNsight(net)
        outer = path.split(".")[0]
        with pytest.raises(MissedModuleError, match=rf"runs inside model\.{outer}, a TorchScript "
                                                    rf"module .* Read model\.{outer}\.output"):
            with model.trace(torch.randn(2, 4)):
                model.get(path).output.save()
