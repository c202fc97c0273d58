"""``tracer.cache(...)``: every (or the chosen) module's outputs and inputs recorded during a
trace. Ground truth: plain forward hooks and pre-hooks on the same model and input."""

from __future__ import annotations

import pickle

import pytest
import torch

import nnsight_lite
from nnsight_lite import CacheError, ModulePathError, NNsight, OutsideTraceError
from tests.helpers import record


def reached(model: torch.nn.Module, *args, inputs=False, **kwargs):
    """Plain hooks on every module: (names in the order first reached, {name: [outputs]},
    {name: [(args, kwargs)]}). With ``inputs``, a module is reached at its input stage."""
    order, outs, ins, handles = [], {}, {}, []
    for name, mod in model.named_modules():
        def pre(m, a, k, name=name):
            ins.setdefault(name, []).append((a, k))
            if inputs and name not in order:
                order.append(name)

        def post(m, a, o, name=name):
            outs.setdefault(name, []).append(o)
            if name not in order:
                order.append(name)

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post))
    try:
        model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return order, outs, ins


def key(name):
    return "model." + name if name else "model"


def assert_same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    else:
        assert a == b


class TestRecords:
    """What a cache holds equals what plain hooks see, in the order the run reaches it."""

    def test_every_module_equals_plain_hooks(self, net, x8):
        """With no modules=, every module the run reaches has an entry whose output equals the
        plain hook's; a module called twice has a list of both; an unused one is absent."""
        model = NNsight(net)
        with model.trace(x8) as tracer:
            cache = tracer.cache()
        order, outs, _ = reached(net, x8)
        assert list(cache.keys()) == [key(n) for n in order]
        assert "model.unused" not in cache
        for name, values in outs.items():
            entry = cache[key(name)]
            assert len(entry) == len(values)
            assert_same(entry.output, values[0] if len(values) == 1 else values)
        assert isinstance(cache["model.shared"].output, list)
        assert isinstance(cache["model.block"].output, tuple)
        assert cache["model.layers.0"].inputs is None and cache["model.layers.0"].input is None

    def test_include_inputs(self, net, x8):
        """include_inputs=True adds (args, kwargs) per call and .input (the first argument);
        with inputs the run reaches a parent before its children."""
        model = NNsight(net)
        with model.trace(x8, scale=3.0) as tracer:
            cache = tracer.cache(include_inputs=True)
        order, _, ins = reached(net, x8, inputs=True, scale=3.0)
        assert list(cache.keys()) == [key(n) for n in order]
        for name, values in ins.items():
            entry = cache[key(name)]
            got = entry.inputs if len(values) > 1 else [entry.inputs]
            assert_same([(tuple(a), dict(k)) for a, k in got], [(a, k) for a, k in values])
        assert torch.equal(cache["model"].input, x8)
        assert cache["model"].inputs[1] == {"scale": 3.0}
        torch.testing.assert_close(cache["model.layers.1"].input, ins["layers.1"][0][0][0])
        assert len(cache["model.shared"].input) == 2

    def test_inputs_only(self, seq):
        """include_output=False, include_inputs=True: inputs, and .output is None."""
        x = torch.randn(2, 6)
        model = NNsight(seq)
        with model.trace(x) as tracer:
            cache = tracer.cache(include_output=False, include_inputs=True)
        assert cache["model.0"].output is None
        assert torch.equal(cache["model.0"].input, x)

    def test_values_after_an_edit_earlier_in_the_body(self, net, x8):
        """The cache sees each value after the body's edits: an in-place zero and a
        replacement show in the edited modules and in everything computed from them."""
        model = NNsight(net)
        with model.trace(x8) as tracer:
            cache = tracer.cache(modules=["model.layers.0", "model.layers.1", "model.head"])
            model.layers[0].output[:, :2] = 0
            model.layers[1].output = model.layers[1].output * 3

        def zero(call, out):
            out = out.clone()
            out[:, :2] = 0
            return out

        seen, _ = record(net, ["layers.0", "layers.1", "head"], x8,
                         edits={"layers.0": zero, "layers.1": lambda c, o: o * 3})
        for name in ("layers.0", "layers.1", "head"):
            torch.testing.assert_close(cache[key(name)].output, seen[(name, 0)])
        assert (cache["model.layers.0"].output[:, :2] == 0).all()

    def test_subset_by_envoy_and_string_in_reached_order(self, net, x8):
        """modules= takes Envoys and path strings (with or without "model.", with [i]); the
        keys come in the order the run reaches them, not the order given."""
        model = NNsight(net)
        with model.trace(x8) as tracer:
            cache = tracer.cache(modules=[model.head, "layers[2]", model.layers[0], "model.inp"])
        assert list(cache.keys()) == ["model.inp", "model.layers.0", "model.layers.2",
                                      "model.head"]
        seen, _ = record(net, ["inp", "layers.0", "layers.2", "head"], x8)
        for name in ("inp", "layers.0", "layers.2", "head"):
            torch.testing.assert_close(cache[key(name)].output, seen[(name, 0)])

    def test_a_container_stands_for_the_modules_it_holds(self, net, x8):
        """A ModuleList is never called itself: modules=[model.layers] (or "layers") caches the
        layers it holds, as one means it; containers inside containers are opened too."""
        model = NNsight(net)
        names = ["layers.0", "layers.1", "layers.2"]
        seen, _ = record(net, names, x8)
        for given in (model.layers, "layers", "model.layers"):
            with model.trace(x8) as tracer:
                cache = tracer.cache(modules=[given, model.head])
            assert list(cache.keys()) == [key(n) for n in names] + ["model.head"]
            for name in names:
                torch.testing.assert_close(cache[key(name)].output, seen[(name, 0)])

        class Grouped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.groups = torch.nn.ModuleDict({
                    "a": torch.nn.ModuleList([torch.nn.Linear(4, 4)]),
                    "b": torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])})

            def forward(self, x):
                for group in self.groups.values():
                    for layer in group:
                        x = layer(x)
                return x

        grouped = Grouped()
        model = NNsight(grouped)
        x = torch.randn(2, 4)
        with model.trace(x) as tracer:
            cache = tracer.cache(modules=[model.groups])
        assert list(cache.keys()) == ["model.groups.a.0", "model.groups.b.0", "model.groups.b.1"]
        torch.testing.assert_close(cache["model.groups.b.1"].output, grouped(x))

    def test_an_empty_container_inside_a_container_is_passed_over(self):
        """A container holding, beside its layers, an empty ModuleList or a module with
        parameters only (nothing there is ever called) caches its layers: found by session
        18's second review, it raised ModulePathError naming the outer container as empty."""
        class Grouped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                gain = torch.nn.Module()
                gain.weight = torch.nn.Parameter(torch.ones(4))
                self.groups = torch.nn.ModuleDict({
                    "a": torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]),
                    "extra": torch.nn.ModuleList(), "gain": gain})

            def forward(self, x):
                for layer in self.groups["a"]:
                    x = layer(x)
                return x * self.groups["gain"].weight

        grouped = Grouped()
        model = NNsight(grouped)
        x = torch.randn(2, 4)
        with model.trace(x) as tracer:
            cache = tracer.cache(modules=[model.groups])
        assert list(cache.keys()) == ["model.groups.a.0", "model.groups.a.1"]
        seen, _ = record(grouped, ["groups.a.0", "groups.a.1"], x)
        torch.testing.assert_close(cache["model.groups.a.1"].output, seen[("groups.a.1", 0)])

    def test_stop_ends_the_record(self, seq):
        """After tracer.stop() the modules that did not run are not in the cache."""
        model = NNsight(seq)
        with model.trace(torch.randn(2, 6)) as tracer:
            cache = tracer.cache()
            model[1].output.save()
            tracer.stop()
        assert "model.0" in cache
        assert "model.2" not in cache and "model.3" not in cache and "model" not in cache

    def test_two_caches_and_the_next_trace(self, seq):
        """Two caches in one body both record; a later trace leaves them as they were and a
        trace without a cache records nothing anywhere."""
        x = torch.randn(2, 6)
        model = NNsight(seq)
        with model.trace(x) as tracer:
            a = tracer.cache(modules=[model[0]])
            b = tracer.cache(modules=["model.0", "model.3"])
        with model.trace(x):
            out = model.output.save()
        assert list(a.keys()) == ["model.0"] and list(b.keys()) == ["model.0", "model.3"]
        assert len(a["model.0"]) == len(b["model.0"]) == 1
        assert torch.equal(a["model.0"].output, b["model.0"].output)
        torch.testing.assert_close(b["model.3"].output, out)


class TestStorage:
    """device, dtype and detach apply to what is stored."""

    def test_defaults_detach_and_keep_on_cpu(self, seq):
        """By default values are detached (no grad) and on the CPU."""
        model = NNsight(seq)
        with model.trace(torch.randn(2, 6)) as tracer:
            cache = tracer.cache()
        out = cache["model.1"].output
        assert not out.requires_grad and out.device.type == "cpu"

    def test_dtype_casts_floats_only(self, net, x8):
        """dtype= casts floating-point tensors; other values are kept as they are."""
        model = NNsight(net)
        with model.trace(x8, scale=2.0) as tracer:
            cache = tracer.cache(dtype=torch.float64, include_inputs=True)
        assert cache["model.head"].output.dtype == torch.float64
        assert cache["model"].inputs[1] == {"scale": 2.0}

    def test_gradients_through_an_undetached_cache(self, seq):
        """detach=False, device=None: the stored values are the graph's, and backward from
        one fills the parameters' grads exactly as from the plain forward's activation."""
        x = torch.randn(2, 6)
        model = NNsight(seq)
        with model.trace(x) as tracer:
            cache = tracer.cache(modules=[model[1]], detach=False, device=None)
        cache["model.1"].output.sum().backward()
        got = seq[0].weight.grad.clone()
        seq.zero_grad()
        seq[1](seq[0](x)).sum().backward()
        torch.testing.assert_close(got, seq[0].weight.grad)
        seq.zero_grad()


class TestInvokes:
    """A cache opened in an invoke holds that invoke's rows; an empty invoke's, the batch."""

    def test_rows_per_invoke_and_whole_batch(self, net):
        """Invoke 1's cache equals the plain forward of invoke 1's input alone; the cache of
        an invoke with no input equals the plain forward of the whole batch."""
        torch.manual_seed(3)
        a, b = torch.randn(2, 8), torch.randn(3, 8)
        model = NNsight(net)
        with model.trace() as tracer:
            with tracer.invoke(a):
                pass
            with tracer.invoke(b):
                mine = tracer.cache(modules=[model.layers[1], model.head])
            with tracer.invoke():
                whole = tracer.cache(modules=[model.head])
        seen_b, _ = record(net, ["layers.1", "head"], b)
        seen_ab, _ = record(net, ["head"], torch.cat([a, b]))
        torch.testing.assert_close(mine["model.layers.1"].output, seen_b[("layers.1", 0)])
        torch.testing.assert_close(mine["model.head"].output, seen_b[("head", 0)])
        torch.testing.assert_close(whole["model.head"].output, seen_ab[("head", 0)])

    def test_sees_edits_of_other_invokes(self, seq):
        """An empty invoke's cache sees what the earlier invokes wrote into their rows."""
        x = torch.randn(4, 6)
        model = NNsight(seq)
        with model.trace() as tracer:
            with tracer.invoke(x[:2]):
                model[0].output[:] = 0
            with tracer.invoke(x[2:]):
                pass
            with tracer.invoke():
                cache = tracer.cache(modules=["model.0"])
        out = cache["model.0"].output
        assert (out[:2] == 0).all() and torch.equal(out[2:], seq[0](x[2:]).detach())


class TestSkip:
    def test_skipped_module_holds_the_skip_value_and_its_children_are_absent(self, net, x8):
        """A module skipped with .skip(value) has value as its output in the cache; its
        submodules did not run, so they have no entry."""
        model = NNsight(net)
        with model.trace(x8) as tracer:
            cache = tracer.cache()
            h = model.shared.output
            model.block.skip((h, h.sum(-1)))
        assert "model.block.lin" not in cache
        out, total = cache["model.block"].output
        torch.testing.assert_close(out, cache["model.shared"].output[0])
        torch.testing.assert_close(total, out.sum(-1))


class TestNavigation:
    """cache.<path> reaches the same entries as cache["model.<path>"]."""

    def test_attributes_and_indices(self, net, x8):
        model = NNsight(net)
        with model.trace(x8) as tracer:
            cache = tracer.cache(include_inputs=True)
        assert cache.layers[1].output is cache["model.layers.1"].output
        assert cache.model.layers[1].output is cache["model.layers.1"].output
        assert cache.block.lin.input is cache["model.block.lin"].input
        assert cache.output is cache["model"].output
        assert len(cache.shared) == 2

    def test_integer_index_on_a_sequential(self, seq):
        """cache[i] on a Sequential's cache is cache.model[i], as model[i] is on the model."""
        model = NNsight(seq)
        with model.trace(torch.randn(2, 6)) as tracer:
            cache = tracer.cache()
        assert cache[2].output is cache["model.2"].output
        assert 2 not in cache and "model.2" in cache

    def test_an_entry_reaches_its_subtree(self, net, x8):
        """``cache[key].keys()`` lists that module's subtree (its submodules first, in the order
        the run reached them, as plain hooks see it), ``in`` and ``[relative or full key]`` reach
        a submodule's entry (nnsight's cache[key] is a view of the subtree); the root's is
        every key."""
        model = NNsight(net)
        with model.trace(x8) as tracer:
            cache = tracer.cache()
        order, outs, _ = reached(net, x8)
        block = cache["model.block"]
        inside = [n for n in order if n.startswith("block.")] + ["block"]
        assert block.keys() == [f"model.{n}" for n in inside] == cache.block.keys()
        assert cache["model"].keys() == list(cache.keys())
        assert "lin" in block and "model.block.lin" in block and "model.head" not in block
        assert block["lin"] is cache["model.block.lin"] is block["model.block.lin"]
        assert torch.equal(block["lin"].output, outs["block.lin"][0])
        with pytest.raises(KeyError, match="'head' is not a module inside model.block"):
            block["head"]
        with pytest.raises(TypeError, match="indexed by a module's key"):
            block[0]
        back = pickle.loads(pickle.dumps(cache))  # (a loaded view's entries reach theirs)
        assert back["model.block"].keys() == block.keys()
        assert torch.equal(back["model.block"]["lin"].output, outs["block.lin"][0])
        del cache, back
        with pytest.raises(TypeError, match="not part of a live cache view"):
            block.keys()
        with pytest.raises(TypeError, match="not part of a live cache view"):
            "lin" in block  # noqa: B015

    def test_a_relative_key_comes_before_a_full_one(self):
        """Below a root whose child is named ``model`` (an HF causal LM's layout),
        ``cache["model"]["model"]`` is that child's entry, not the root's."""
        torch.manual_seed(0)

        class Causal(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
                self.head = torch.nn.Linear(4, 2)

            def forward(self, x):
                return self.head(self.model(x))

        net = Causal()
        model = NNsight(net)
        x = torch.randn(2, 3)
        with model.trace(x) as tracer:
            cache = tracer.cache()
        inner = cache["model"]["model"]
        assert inner is cache["model.model"] and torch.equal(inner.output, net.model(x))
        assert cache["model"]["model.head"] is cache["model.head"]

    def test_keys_through_aliases_and_short_paths(self, net, x8):
        """A string key written through ``rename=`` aliases, without the leading ``model.``, or
        with ``[i]`` indexing reaches the module's entry, in ``cache[...]``, ``in``, an entry's
        ``[...]`` and ``tracer.cache(modules=...)``, as nnsight resolves cache keys through the
        model's Envoys. A key that names a module of the model the cache does not hold says so.
        Found by a hunt: each of these raised CacheKeyError / ModulePathError."""
        model = NNsight(net, rename={"layers": "blocks", "lin": "proj"})
        _, outs, _ = reached(net, x8)
        with model.trace(x8) as tracer:
            cache = tracer.cache()
        layer1, lin = outs["layers.1"][0], outs["block.lin"][0]
        for k in ("model.blocks.1", "blocks.1", "layers.1", "blocks[1]", "model.layers[1]"):
            assert k in cache and torch.equal(cache[k].output, layer1), k
        assert cache["model.blocks.1"] is cache["model.layers.1"]
        for k in ("model.block.proj", "block.proj", "block.lin"):
            assert torch.equal(cache[k].output, lin), k
        block = cache["block"]
        assert block is cache["model.block"] and block["proj"] is cache["model.block.lin"]
        assert block["model.block.proj"] is cache["model.block.lin"]
        with pytest.raises(KeyError, match="'blocks.7' is not in this cache"):
            cache["blocks.7"]
        with model.trace(x8) as tracer:
            some = tracer.cache(modules=["blocks.1", "model.block.proj", "blocks[2]"])
        assert list(some.keys()) == ["model.block.lin", "model.layers.1", "model.layers.2"]
        assert torch.equal(some["blocks.1"].output, layer1)
        with pytest.raises(KeyError, match=r"'blocks.0' \(model.layers.0\) is not in this cache"):
            some["blocks.0"]
        seq = NNsight(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()))
        with seq.trace(x8) as tracer:
            one = tracer.cache(modules=["[1]"])
        assert list(one.keys()) == ["model.1"] and one["[1]"] is one["model.1"]
        assert torch.equal(one["1"].output, torch.relu(seq[0]._module(x8)))

    def test_missing_names(self, net, x8):
        """A name that is no module, or a module not cached, raises AttributeError; an unknown
        key raises KeyError with near matches."""
        model = NNsight(net)
        with model.trace(x8) as tracer:
            cache = tracer.cache(modules=[model.head])
        with pytest.raises(AttributeError, match="has no submodule 'haed'"):
            cache.haed
        with pytest.raises(AttributeError, match=r"model.inp is not in this cache"):
            cache.inp.output
        with pytest.raises(KeyError, match=r"did you mean .{0,3}model\.head"):
            cache["model.haed"]
        # nnsight's miss is an AttributeError: code catching that works too, and the message
        # is shown without KeyError's quotes; a mapping's get() and `in` still answer
        with pytest.raises(AttributeError) as info:
            cache["model.haed"]
        assert str(info.value).startswith("'model.haed' is not in this cache")
        assert cache.get("model.haed") is None and "model.haed" not in cache
        assert cache.get("model.head") is cache["model.head"]

    def test_survives_without_save_and_pickles(self, seq):
        """The view exists after the trace without .save(); pickled, it keeps its entries
        by path (the model is not pickled) and refuses navigation with a clear error."""
        model = NNsight(seq)
        with model.trace(torch.randn(2, 6)) as tracer:
            cache = tracer.cache()
        back = pickle.loads(pickle.dumps(cache))
        assert list(back.keys()) == list(cache.keys())
        assert torch.equal(back["model.2"].output, cache["model.2"].output)
        with pytest.raises(AttributeError, match="loaded without its model"):
            back.output

    def test_loaded_view_reattached_as_nnsight_writes_it(self, seq):
        """nnsight's cache docs re-attach a loaded view with ``view._cache.model = model``;
        then navigation works again and gives the values plain hooks see."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with model.trace(x) as tracer:
            cache = tracer.cache()
        _, outs, _ = reached(seq, x)
        back = pickle.loads(pickle.dumps(cache))
        assert back._cache.model is None
        back._cache.model = model
        assert back._cache.model is model
        assert_same(back[1].output, outs["1"][0])
        assert_same(back.model[2].output, outs["2"][0])


class TestErrors:
    def test_after_a_model_value_was_read(self, seq):
        """tracer.cache() after the body read a module value raises CacheError saying to call
        it first."""
        model = NNsight(seq)
        with pytest.raises(CacheError, match=r"after this body had already read or edited a "
                                             r"model value.*Call tracer.cache\(...\) first"):
            with model.trace(torch.randn(2, 6)) as tracer:
                model[0].output.save()
                tracer.cache()

    def test_outside_the_body(self, seq):
        model = NNsight(seq)
        with model.trace(torch.randn(2, 6)) as tracer:
            pass
        with pytest.raises(OutsideTraceError, match=r"tracer.cache\(\) was called outside a "
                                                    r"trace body .*test_cache.py"):
            tracer.cache()

    def test_in_a_trace_body_that_only_sets_up_invokes(self, seq):
        model = NNsight(seq)
        with pytest.raises(CacheError, match=r"only sets up invokes.*empty `with "
                                             r"tracer.invoke\(\):` records the whole batch"):
            with model.trace() as tracer:
                tracer.cache()
                with tracer.invoke(torch.randn(2, 6)):
                    pass

    def test_unknown_path_and_foreign_module(self, seq):
        model = NNsight(seq)
        other = NNsight(torch.nn.Linear(6, 6))
        with pytest.raises(ModulePathError, match=r"no module at 'model.7'"):
            with model.trace(torch.randn(2, 6)) as tracer:
                tracer.cache(modules=["model.7"])
        with pytest.raises(ModulePathError, match="not a module of the model being traced"):
            with model.trace(torch.randn(2, 6)) as tracer:
                tracer.cache(modules=[other])
        with pytest.raises(TypeError, match="takes Envoys"):
            with model.trace(torch.randn(2, 6)) as tracer:
                tracer.cache(modules=[3])

    def test_a_module_with_no_forward_and_no_modules(self):
        """A plain Module that only holds parameters is never called: nothing to cache."""
        class Scaled(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 4)
                self.gain = torch.nn.Module()
                self.gain.weight = torch.nn.Parameter(torch.ones(4))

            def forward(self, x):
                return self.lin(x) * self.gain.weight

        model = NNsight(Scaled())
        with pytest.raises(ModulePathError, match=r"model.gain is a Module with no forward and "
                                                  r"no modules of its own"):
            with model.trace(torch.randn(2, 4)) as tracer:
                tracer.cache(modules=[model.gain])

    def test_nothing_to_record(self, seq):
        model = NNsight(seq)
        with pytest.raises(CacheError, match="would record nothing"):
            with model.trace(torch.randn(2, 6)) as tracer:
                tracer.cache(include_output=False)

    def test_options_it_cannot_use_raise_at_the_cache_line(self, seq):
        """A device this torch cannot put tensors on, a dtype that is not a torch.dtype, and a
        module's value (``model[0].output``) in ``modules=`` raise at the tracer.cache(...)
        line, naming the option. The first two failed inside the model's forward, where the
        cache stores a value (torch's "Torch not compiled with CUDA enabled" / to()'s argument
        error, at a line of the model's code, naming no cache); the third said the cache was
        called after the body read a value, about the value it was given as a module."""
        import traceback

        model = NNsight(seq)
        x = torch.randn(2, 6)

        def at_line(exc, text):
            return any(fs.filename == __file__ and text in (fs.line or "")
                       for fs in traceback.extract_tb(exc.__traceback__))

        with pytest.raises(CacheError, match=r"tracer\.cache\(device='cuda:99'\) at "
                           r".*test_cache\.py:\d+: this process cannot put tensors on that "
                           r"device") as info:
            with model.trace(x) as tracer:
                tracer.cache(device="cuda:99")  # no such device
        assert at_line(info.value, "no such device")
        with pytest.raises(TypeError, match=r"tracer\.cache\(dtype=\.\.\.\) at .*test_cache"
                           r"\.py:\d+ takes a torch\.dtype .*got 'float16'") as info:
            with model.trace(x) as tracer:
                tracer.cache(dtype="float16")  # a string
        assert at_line(info.value, "a string")
        with pytest.raises(TypeError, match=r"got Tensor \(a module's value\? pass the module "
                           r"itself") as info:
            with model.trace(x) as tracer:
                tracer.cache(modules=[model[0].output])  # the value
        assert at_line(info.value, "the value")
        with model.trace(x) as tracer:
            cache = tracer.cache(modules=iter([model[1]]), dtype=torch.float64, device="meta")
            out = model.output.save()
        torch.testing.assert_close(out, seq(x))
        assert cache["model.1"].output.device.type == "meta"
        assert cache["model.1"].output.dtype == torch.float64
        assert list(cache.keys()) == ["model.1"]

    def test_is_a_value_error(self):
        assert issubclass(CacheError, ValueError) and issubclass(CacheError, nnsight_lite.NNsightError)


def test_readme_cache_example_runs(tmp_path, capsys):
    """The README's tour example and its "Caching many modules at once" example run as
    written, one after the other, and print the keys in reached order."""
    import re
    import runpy
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    tour = re.search(r"```python\n(.*?)```", readme.split("## A tour", 1)[1], re.S).group(1)
    section = readme.split("### Caching many modules at once", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "readme_cache.py"
    script.write_text(tour + code)
    ns = runpy.run_path(str(script))
    assert list(ns["cache"].keys()) == ["model.0", "model.1", "model.2", "model"]
    assert (ns["cache"]["model.1"].output[:, 0] == 0).all()
    assert "['model.0', 'model.1', 'model.2', 'model']" in capsys.readouterr().out


def test_a_cache_returned_by_a_helper_navigates_while_the_module_lives(seq):
    """A helper that wraps the module itself and returns the cache (``model = NNsight(net)``
    inside it): the NNsight wrapper is gone once it returns, but the user still holds the
    module, so navigation by attribute works, as it did before the view held its model weakly
    (it said "the model is gone"). Ground truth: the module's plain outputs."""

    def run_with_cache(net, x):
        model = NNsight(net)
        with model.trace(x) as tracer:
            cache = tracer.cache()
        return cache

    x = torch.randn(2, 6)
    cache = run_with_cache(seq, x)
    torch.testing.assert_close(cache.model[1].output, seq[:2](x))
    torch.testing.assert_close(cache.output, seq(x))
    torch.testing.assert_close(cache["model.0"].output, seq[0](x))
