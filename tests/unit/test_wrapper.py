"""The wrapper as a torch user holds it: freed when dropped, torch methods keep the wrapper,
``tracer.result``, ``modules()``, ``rename=`` aliases and ``envoys=`` classes."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

import nnsight_lite
from nnsight_lite import Envoy, NNsight
from nnsight_lite.errors import NNsightError
from tests.helpers import record


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


class TestFreed:
    """A model, its layers and parameters go when the user drops the wrapper and the module."""

    @pytest.mark.parametrize("traced", [False, True])
    def test_many_recreations_leave_nothing_alive(self, traced):
        """As in a notebook cell re-run 20 times: every old model is freed, by reference
        counting alone (the collector off) and after gc.collect()."""
        refs = []
        x = torch.randn(2, 4)
        gc.disable()
        try:
            for i in range(20):
                net = _net(i)
                model = NNsight(net)
                refs += [weakref.ref(net), weakref.ref(net[0]), weakref.ref(net[0].weight),
                         weakref.ref(model)]
                if traced:
                    with model.trace(x):
                        h = model[0].output.save()
                        model[2].output[:, 0] = 0
                        first = model.output.save()
                    with model.trace() as tracer:
                        with tracer.invoke(x):
                            a = model[0].output
                        with tracer.invoke(x):
                            model[0].output[:] = a
                            out = model.output.save()
                    with first.sum().backward():
                        g = h.grad.save()
                    del h, out, g, first, tracer  # a tracer holds its model
                del net, model
            alive_without_gc = sum(r() is not None for r in refs)
        finally:
            gc.enable()
        gc.collect()
        assert sum(r() is not None for r in refs) == 0
        assert alive_without_gc == 0

    def test_models_used_with_source_cache_and_aliases_go_without_the_collector(self):
        """`.source` (instrumented forwards are cached per function, not per model),
        `tracer.cache()` and `rename=` keep no model alive."""
        refs = []
        x = torch.randn(2, 4)
        gc.disable()
        try:
            for _ in range(3):
                top = Top()
                model = NNsight(top, rename={"transformer.h": "layers"})
                with model.trace(x) as tracer:
                    cache = tracer.cache()
                    model.layers[0].source.self_mlp_0.output[:] = 0
                    out = model.output.save()
                refs += [weakref.ref(top), weakref.ref(model), weakref.ref(top.head.weight),
                         weakref.ref(top.transformer.h[0]), weakref.ref(top.transformer.h[0].mlp)]
                del top, model, tracer, cache, out
            alive = sum(r() is not None for r in refs)
        finally:
            gc.enable()
        assert alive == 0

    @pytest.mark.parametrize("where", ["root", "child", "print"])
    def test_a_module_whose_source_was_used_goes_without_the_collector(self, where):
        """The module whose ``.source`` was used (in a body, or printed) goes with the model,
        by reference counting: the Envoy kept its Source view and the view its Envoy, a cycle
        that kept the module and its weights alive until the collector ran (a notebook
        re-creating a LanguageModel whose attention's .source it read kept every old
        attention). Found by session 18's second review."""
        x = torch.randn(2, 4)
        gc.disable()
        try:
            top = Top()
            model = NNsight(top)
            env = model if where == "root" else model.transformer.h[0]
            if where == "print":
                str(env.source)
            else:
                with model.trace(x):
                    h = env.source.self_mlp_0.output.save() if where == "child" else \
                        env.source.self_head_0.output.save()
                    out = model.output.save()
                del h, out
            refs = [weakref.ref(top), weakref.ref(top.transformer.h[0]),
                    weakref.ref(top.transformer.h[0].mlp.weight), weakref.ref(model)]
            del top, model, env
            alive = [r() is not None for r in refs]
        finally:
            gc.enable()
        assert alive == [False] * 4

    def test_a_held_source_view_keeps_its_names(self):
        """A Source view held by the user (after its wrapper was dropped, too) still lists and
        resolves its operations, and the same view comes back while it is held."""
        top = Top()
        model = NNsight(top)
        src = model.transformer.h[0].source
        assert model.transformer.h[0].source is src
        assert src.self_mlp_0 is model.transformer.h[0].source.self_mlp_0
        names = [op.name for op in NNsight(Top()).transformer.h[0].source]
        assert names == src.names and "self_mlp_0" in names

    @pytest.mark.parametrize("inplace", [False, True])
    def test_edited_models_go_without_the_collector(self, inplace):
        """An edit body that names the edited model does not make the model hold itself."""
        net = _net()
        model = NNsight(net)
        x = torch.randn(1, 4)
        with model.edit(inplace=inplace) as edited:
            edited[0].output[:] = 0
        with edited.trace(x):
            out = edited.output.save()
        assert torch.equal(out, net[2](net[1](torch.zeros(1, 8))))
        refs = [weakref.ref(net), weakref.ref(edited)]
        gc.disable()
        try:
            del net, model, edited
            assert [r() for r in refs] == [None, None]
        finally:
            gc.enable()


class TestTorchMethodsKeepTheWrapper:
    """Module methods that return the module return the wrapper (``model = NNsight(net).to(..)``)."""

    @pytest.mark.parametrize("call", [
        lambda m: m.to(torch.float64), lambda m: m.double(), lambda m: m.float(),
        lambda m: m.cpu(), lambda m: m.eval(), lambda m: m.train(False),
        lambda m: m.requires_grad_(False), lambda m: m.to("cpu"), lambda m: m.type(torch.float64),
    ])
    def test_returns_the_wrapper(self, call):
        model = NNsight(_net())
        assert call(model) is model

    def test_traced_after_to_matches_the_plain_forward(self):
        net = _net()
        model = NNsight(net).to(torch.float64)
        x = torch.randn(2, 4, dtype=torch.float64)
        with model.trace(x):
            out = model.output.save()
        assert out.dtype == torch.float64
        assert torch.equal(out, net(x))

    def test_eval_sets_the_module_mode(self):
        net = torch.nn.Sequential(torch.nn.Dropout(0.5))
        model = NNsight(net).eval()
        assert not net.training
        x = torch.ones(4, 4)
        with model.trace(x):
            out = model.output.save()
        assert torch.equal(out, x)  # dropout off in eval mode

    def test_child_methods_return_the_child_envoy(self):
        model = NNsight(_net())
        assert model[0].double() is model[0]

    def test_other_methods_return_what_torch_returns(self):
        model = NNsight(_net())
        assert list(model.parameters()) == list(model._module.parameters())
        assert model.state_dict().keys() == model._module.state_dict().keys()


class TestResult:
    """``tracer.result`` in a body waits for the traced call and is its output."""

    def test_in_a_body_equals_the_plain_forward(self):
        net = _net()
        x = torch.randn(2, 4)
        with NNsight(net).trace(x) as tracer:
            out = tracer.result.save()
        assert torch.equal(out, net(x))

    def test_reflects_edits(self):
        net = _net()
        model = NNsight(net)
        x = torch.randn(2, 4)
        with model.trace(x) as tracer:
            model[0].output[:] = 0
            out = tracer.result.save()
        assert torch.equal(out, net[2](torch.zeros(2, 8)))

    def test_in_invokes_each_sees_its_rows(self):
        net = _net()
        model = NNsight(net)
        x1, x2 = torch.randn(1, 4), torch.randn(2, 4)
        with model.trace() as tracer:
            with tracer.invoke(x1):
                a = tracer.result.save()
            with tracer.invoke(x2):
                b = tracer.result.save()
        assert torch.allclose(a, net(x1), atol=1e-6) and torch.allclose(b, net(x2), atol=1e-6)

    def test_after_the_trace_says_to_save_it(self):
        model = NNsight(_net())
        with model.trace(torch.randn(1, 4)) as tracer:
            pass
        with pytest.raises(NNsightError, match=r"tracer.result.save\(\)"):
            tracer.result

    def test_after_a_stop_says_the_stop_ended_the_call(self):
        """After ``tracer.stop()`` the call never returned: the error names the stop's line
        instead of saying to save ``tracer.result`` in the body (which would never come)."""
        model = NNsight(_net())
        with model.trace(torch.randn(1, 4)) as tracer:
            h = model[0].output.save()
            tracer.stop()
        stop_line = f"{__file__}:{sys._getframe().f_lineno - 1}"
        assert h.shape == (1, 8)
        with pytest.raises(NNsightError, match="tracer.stop") as info:
            tracer.result
        assert stop_line in str(info.value) and "save()" not in str(info.value)

    def test_in_a_collecting_body_says_to_use_an_invoke(self):
        model = NNsight(_net())
        with pytest.raises(NNsightError, match=r"inside a `with tracer.invoke"):
            with model.trace() as tracer:
                tracer.result
                with tracer.invoke(torch.randn(1, 4)):
                    pass


class TestModules:
    def test_modules_are_envoys_in_named_modules_order(self):
        net = _net()
        model = NNsight(net)
        envs = model.modules()
        assert all(isinstance(e, Envoy) for e in envs)
        assert [e._module for e in envs] == list(net.modules())
        # nnsight's paths ("model" + the torch path), which are also the cache's keys
        assert [p for p, _ in model.named_modules()] == [
            "model" + (f".{p}" if p else "") for p, _ in net.named_modules()]
        assert [p for p, _ in model[0].named_modules()] == ["model.0"]
        x = torch.randn(2, 4)
        h0 = net[0](x)
        want = {"model.0": h0, "model.1": h0.relu(), "model.2": net[2](h0.relu())}
        want["model"] = want["model.2"]
        with model.trace(x) as tracer:
            cache = tracer.cache()
        for path, env in model.named_modules():
            assert env.path == path
            torch.testing.assert_close(cache[path].output, want[path])
        assert [c._module for c in model.children()] == list(net.children())

    def test_include_fn_and_reading_outputs_of_the_envoys(self):
        net = _net()
        model = NNsight(net)
        linears = model.modules(include_fn=lambda e: isinstance(e._module, torch.nn.Linear))
        x = torch.randn(2, 4)
        with model.trace(x):
            outs = nnsight_lite.save([e.output for e in linears])
        seen, _ = record(net, ["0", "2"], x)
        assert torch.equal(outs[0], seen[("0", 0)]) and torch.equal(outs[1], seen[("2", 0)])


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(x + self.mlp(x))


class Backbone(torch.nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.h = torch.nn.ModuleList([Block() for _ in range(n)])

    def forward(self, x):
        for b in self.h:
            x = b(x)
        return x


class Top(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.transformer = Backbone()
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.transformer(x))


class TestRename:
    """``rename=`` aliases reach the very Envoys of the real paths, in bodies too."""

    def test_forms(self):
        model = NNsight(Top(), rename={
            "transformer.h": "layers", "mlp": "ffn", "transformer": ["backbone", "mdl"],
        })
        assert model.layers is model.transformer.h
        assert model.layers[1] is model.transformer.h[1]
        assert model.transformer.h[2].ffn is model.transformer.h[2].mlp
        assert model.backbone is model.transformer and model.mdl is model.transformer

    def test_leading_dot_star_and_class_keys(self):
        m = NNsight(Top(), rename={".h": "blocks"})
        assert m.transformer.blocks is m.transformer.h
        with pytest.raises(AttributeError):
            m.blocks
        m = NNsight(Top(), rename={"*.h": "blocks"})
        assert m.blocks is m.transformer.h
        m = NNsight(Top(), rename={torch.nn.LayerNorm: "ln"})
        assert m.transformer.h[0].ln is m.transformer.h[0].norm

    def test_aliases_in_a_body_equal_plain_hooks(self):
        top = Top()
        model = NNsight(top, rename={"transformer.h": "layers", "mlp": "ffn"})
        x = torch.randn(2, 4)
        with model.trace(x):
            a = model.layers[1].ffn.output.clone().save()
            model.layers[1].ffn.output[:] = 0
            out = model.output.save()
        seen, ref = record(top, ["transformer.h.1.mlp"], x,
                           edits={"transformer.h.1.mlp": lambda c, o: torch.zeros_like(o)})
        plain, _ = record(top, ["transformer.h.1.mlp"], x)
        assert torch.equal(a, plain[("transformer.h.1.mlp", 0)])
        assert torch.equal(out, ref)

    def test_a_dotted_alias_is_bound_where_its_leading_names_lead(self):
        """``{"transformer.h": "transformer.blocks"}`` (nnsight's form, ``{"attn.c_proj":
        "attn.o_proj"}``) names ``h`` ``blocks`` on ``transformer``; a key resolved below the
        root (``"h.1.norm"``) the same way; a dotted alias whose leading names are not the
        key's is refused, saying what to write."""
        top = Top()
        model = NNsight(top, rename={"transformer.h": "transformer.blocks", "h.1.norm": "h.1.ln"})
        assert model.transformer.blocks is model.transformer.h
        assert model.transformer.h[1].ln is model.transformer.h[1].norm
        with pytest.raises(AttributeError):
            model.transformer.h[0].ln
        x = torch.randn(2, 4)
        with model.trace(x):
            a = model.transformer.blocks[1].ln.output.save()
        seen, _ = record(top, ["transformer.h.1.norm"], x)
        assert torch.equal(a, seen[("transformer.h.1.norm", 0)])
        with pytest.raises(ValueError, match=r"rename=\{'transformer.h': 'head.blocks'\}: a "
                                             r"dotted alias names the same modules as its key "
                                             r".*'transformer.blocks'"):
            NNsight(Top(), rename={"transformer.h": "head.blocks"})

    def test_a_key_naming_nothing_is_skipped(self):
        model = NNsight(Top(), rename={"self_attn": "att", "layers": "blocks"})
        assert not model._tree.aliases

    @pytest.mark.parametrize("rename,match", [
        ({"head": "output"}, r"'output' for 'head' would hide an attribute of nnsight_lite's Envoy"),
        ({"head": "transformer"}, r"would hide a child module of that name on model"),
        ({"mlp": "training"}, r"'training' for 'mlp' would hide an attribute of the Block "
                              r"module on model.transformer.h.0"),
        ({"head": "x", "transformer": "x"}, r"alias 'x' an earlier key already gave to head"),
        ({"mlp": "not a name"}, r"an alias is a Python name"),
    ])
    def test_clashes_are_refused_when_built(self, rename, match):
        with pytest.raises((ValueError, TypeError), match=match):
            NNsight(Top(), rename=rename)

    def test_two_keys_reaching_one_tied_module_may_share_an_alias(self):
        """Two names of one module (a tied or shared child) given the same alias bind it once,
        as nnsight does; the alias reads that module's output."""
        class Tied(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.head = torch.nn.Linear(4, 4)
                self.tied = self.head

            def forward(self, x):
                return self.tied(x)

        torch.manual_seed(0)
        net, x = Tied(), torch.randn(2, 4)
        model = NNsight(net, rename={"head": "out", "tied": "out"})
        assert model.out._module is net.head
        with model.trace(x):
            out = model.out.output.save()
        torch.testing.assert_close(out, net.head(x))

    def test_class_key_matching_two_children_is_refused(self):
        class Two(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.LayerNorm(2)
                self.b = torch.nn.LayerNorm(2)

        with pytest.raises(ValueError, match=r"matches 2 children of model \(a, b\)"):
            NNsight(Two(), rename={torch.nn.LayerNorm: "ln"})

    def test_a_submodule_named_output_is_reachable_by_an_alias(self):
        """BERT-style ``layer.output`` submodules hide behind Envoy.output; an alias reaches them."""
        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.output = torch.nn.Linear(4, 4)

            def forward(self, x):
                return self.output(x) * 2

        layer = Layer()
        model = NNsight(torch.nn.Sequential(layer), rename={"output": "out_proj"})
        x = torch.randn(2, 4)
        with model.trace(x):
            inner = model[0].out_proj.output.save()
            outer = model[0].output.save()
        assert torch.equal(inner, layer.output(x)) and torch.equal(outer, layer(x))

    def test_a_submodule_named_output_is_E_output_as_in_nnsight_081(self):
        """nnsight 0.8.1 mounts a child that an Envoy property hides (BERT's ``layer.output``)
        at ``E_output``; code written for it reads and edits the child there, in bodies and in
        cache navigation (here it raised ModulePathError), and ``.output`` stays the module's."""
        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.output = torch.nn.Linear(4, 4)
                self.inputs = torch.nn.Linear(4, 4)

            def forward(self, x):
                return self.output(self.inputs(x)) * 2

        layer = Layer()
        model = NNsight(torch.nn.Sequential(layer))
        x = torch.randn(2, 4)
        with model.trace(x) as tracer:
            cache = tracer.cache()
            model[0].E_inputs.output[:] = 0
            inner = model[0].E_output.output.save()
            outer = model[0].output.save()
        with torch.no_grad():
            want = layer.output(torch.zeros(2, 4))
        torch.testing.assert_close(inner, want)
        torch.testing.assert_close(outer, want * 2)
        torch.testing.assert_close(cache[0].E_output.output, want)
        assert model[0].E_output._module is layer.output
        with pytest.raises(AttributeError, match="E_outptu"):
            model[0].E_outptu

    def test_repr_shows_aliases(self):
        model = NNsight(Top(), rename={"transformer": "backbone", "transformer.h": "layers"})
        text = repr(model)
        assert "(backbone/transformer): Backbone(" in text
        assert "(layers): ModuleList(-> transformer.h)" in text
        assert "(mlp): Linear(in_features=4, out_features=4, bias=True)" in text


class Doubling(Envoy):
    """A custom Envoy: ``.doubled`` is twice the module's output."""

    @property
    def doubled(self):
        return self.output * 2


class TestEnvoyClasses:
    def test_by_class_and_by_path_suffix(self):
        model = NNsight(Top(), envoys={torch.nn.LayerNorm: Doubling, "h.*.mlp": Doubling})
        assert type(model.transformer.h[0].norm) is Doubling
        assert type(model.transformer.h[2].mlp) is Doubling
        assert type(model.head) is Envoy and type(model.transformer) is Envoy

    def test_suffix_through_an_alias(self):
        model = NNsight(Top(), rename={"transformer.h": "layers"}, envoys={"layers.*": Doubling})
        assert type(model.layers[1]) is Doubling

    def test_custom_property_in_a_body(self):
        top = Top()
        model = NNsight(top, envoys={torch.nn.LayerNorm: Doubling})
        x = torch.randn(2, 4)
        with model.trace(x):
            d = model.transformer.h[0].norm.doubled.save()
        assert torch.equal(d, top.transformer.h[0](x) * 2)

    def test_value_must_be_an_envoy_class(self):
        with pytest.raises(TypeError, match=r"must be an Envoy subclass"):
            NNsight(Top(), envoys={torch.nn.Linear: dict})
        with pytest.raises(TypeError, match=r"envoys= takes an Envoy subclass .* got \[<class"):
            NNsight(Top(), envoys=[Doubling])
        with pytest.raises(TypeError, match=r"envoys= takes an Envoy subclass .* got <class 'int'>"):
            NNsight(Top(), envoys=int)

    def test_one_class_for_every_module(self):
        """``envoys=MyEnvoy`` (one class, as nnsight takes it) is every child module's Envoy."""
        top = Top()
        model = NNsight(top, envoys=Doubling)
        assert type(model.transformer) is Doubling and type(model.transformer.h[1].mlp) \
            is Doubling and type(model.head) is Doubling
        x = torch.randn(2, 4)
        with model.trace(x):
            d = model.head.doubled.save()
        assert torch.equal(d, top(x) * 2)


def test_cache_navigation_follows_aliases():
    """`tracer.cache()` keys are real paths; navigation through aliases reaches the same entry."""
    top = Top()
    model = NNsight(top, rename={"transformer.h": "layers", "mlp": "ffn"})
    x = torch.randn(2, 4)
    with model.trace(x) as tracer:
        cache = tracer.cache()
    plain, _ = record(top, ["transformer.h.1.mlp"], x)
    assert torch.equal(cache.layers[1].ffn.output, plain[("transformer.h.1.mlp", 0)])
    assert torch.equal(cache["model.transformer.h.1.mlp"].output, cache.layers[1].ffn.output)


class TestReviewFindings:
    def test_a_deep_alias_and_an_index_alias_are_the_same_envoys(self):
        model = NNsight(Top(), rename={"transformer.h.1.mlp": "my_mlp", "1": "second"})
        assert model.my_mlp is model.transformer.h[1].mlp
        assert model.transformer.h["second"] is model.transformer.h[1]
        assert model.transformer.h[1] is getattr(model.transformer.h, "1")
        assert model.transformer.h[1]._path == "model.transformer.h[1]"

    def test_star_error_names_where_it_matched(self):
        with pytest.raises(ValueError, match=r"matches 3 children of model.transformer.h "
                                             r"\(0, 1, 2\)"):
            NNsight(Top(), rename={"transformer.h.*": "block"})

    @pytest.mark.parametrize("key", ["h.*", "*.mlp", "h.*.mlp"])
    def test_a_star_key_below_the_root_resolves_there_and_refuses_several(self, key):
        """A ``*`` key that names nothing from the root resolves below it, as a dotted key
        does (nnsight 0.8.1: its rename page's `{"h.*": "block"}` raises on a stack of
        blocks); here it bound nothing, silently. One match binds there."""
        with pytest.raises(ValueError, match=r"matches 3 children of model.transformer.h "):
            NNsight(Top(), rename={key: "block"})
        model = NNsight(torch.nn.Sequential(Backbone(n=1)), rename={key: "only"})
        where, want = {"h.*": (model[0], model[0].h[0]), "*.mlp": (model[0].h, model[0].h[0].mlp),
                       "h.*.mlp": (model[0], model[0].h[0].mlp)}[key]
        assert where.only is want

    def test_calling_an_envoy_with_hook_is_an_ordinary_call(self):
        top = Top()
        model = NNsight(top)
        x = torch.randn(2, 4)
        with model.trace(x):
            again = model.head(model.transformer.output, hook=True).save()
            out = model.output.save()
        assert torch.equal(again, out) and torch.equal(out, top(x))

    def test_negative_iter_steps_are_refused(self):
        model = NNsight(Top())
        with pytest.raises(nnsight_lite.InputError, match=r"tracer.iter step cannot be negative"):
            with model.trace(torch.randn(1, 4)) as tracer:
                for step in tracer.iter[-1]:
                    model.head.output
