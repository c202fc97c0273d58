"""The module tree users touch inside trace bodies.

    Envoy       a proxy for one module: .output .input .inputs .next() .skip(), children,
                indexing, iteration and every other attribute of the module itself
    save(obj)   keep ``obj`` after the trace (saving.py's, with ``tensor.save()``)

An Envoy holds no state of a trace: reading ``.output`` asks the body's Mediator (found from
the running greenlet) for the value, which waits until the model produces it.

Envoy takes two groups of its names from mixins in modules of their own, since neither
touches a trace's values: envoy_containers.py (``envoy[i]``, loops, ``len``, ``modules()``,
``children()``) and envoy_names.py (``device``, ``parent``, ``root``, ``get``, and ``trace``
of a module on its own: names a module's own child or attribute comes before).
"""

from __future__ import annotations

import difflib
import functools
import re
import weakref

import torch

from .aliases import Tree, child_module, tree_repr
from .envoy_containers import Containers
from .envoy_names import ModuleFirst
from .errors import InputError, ModulePathError, OutOfOrderError
from .mediator import INPUT, OUTPUT, current_mediator
from .saving import save, save_in_body
from .workers import _getcurrent, user_location


class Envoy(ModuleFirst, Containers):
    """A module as seen from a trace body.

    Example::

        model = NNsight(net)
        with model.trace(x):
            h = model.layer1.output.save()      # read
            model.layer1.output[:, 0] = 0       # edit in place
            model.layer2.output = model.layer2.output * 2   # replace

    Attribute access returns child Envoys for submodules (and for their ``rename=`` aliases)
    and the module's own attribute for everything else; ``envoy[i]``, ``len(envoy)`` and
    iteration work for ModuleList/Sequential. Calling an Envoy calls the module (inside a body,
    this extra call is not traced). A module method that returns the module itself (``to``,
    ``cuda``, ``eval``, ``requires_grad_``, ...) returns the Envoy instead, so
    ``model = NNsight(net).to("cuda")`` keeps the wrapper.
    """

    _OWN = frozenset({"output", "input", "inputs"})

    def __init__(self, module: torch.nn.Module, path: str = "model", tree: "Tree | None" = None,
                 mpath: str = ""):
        d = self.__dict__
        d["_module"] = module
        d["_path"] = path  # as the user reached it: model.layers[0].mlp
        d["_mpath"] = mpath  # its named_modules() path: layers.0.mlp
        d["_tree"] = tree if tree is not None else _EMPTY_TREE
        d["_items"] = {}  # envoy[key] -> (child Envoy, its name, the container's length)
        d["_subs"] = {}  # child name -> its Envoy (checked against the module at every use)
        d["_parent"] = None  # a weak reference to the Envoy this one was reached from

    # ---- values

    @property
    def output(self):
        """The module's output at the current call (waits for it inside a body)."""
        return current_mediator(self, "output").get(self, OUTPUT)

    @output.setter
    def output(self, value):
        current_mediator(self, "output", "set").set(self, OUTPUT, value)

    @property
    def inputs(self):
        """``(args, kwargs)`` the module is called with, at the current call."""
        try:
            return current_mediator(self, "inputs").get(self, INPUT)
        except OutOfOrderError as exc:  # (the input stage is named .input: say what was read)
            exc.args = tuple(re.sub(rf"(for {re.escape(self._path)})\.input\b", r"\1.inputs",
                                    a, count=1) if isinstance(a, str) else a for a in exc.args)
            raise

    @inputs.setter
    def inputs(self, value):
        if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict)):
            raise InputError(
                f"{self._path}.inputs must be set to an (args, kwargs) pair, got "
                f"{type(value).__name__} (at {user_location()}); to replace the first argument "
                "set .input instead"
            )
        current_mediator(self, "inputs", "set").set(self, INPUT, (tuple(value[0]), value[1]))

    @property
    def input(self):
        """The first argument the module is called with (first keyword value if none)."""
        args, kwargs = current_mediator(self, "input").get(self, INPUT)
        if args:
            return args[0]
        if kwargs:
            return next(iter(kwargs.values()))
        return None

    @input.setter
    def input(self, value):
        med = current_mediator(self, "input", "set")
        args, kwargs = med.get(self, INPUT)
        if args:
            med.set(self, INPUT, ((value,) + tuple(args[1:]), kwargs))
        elif kwargs:
            kwargs = dict(kwargs)
            kwargs[next(iter(kwargs))] = value
            med.set(self, INPUT, ((), kwargs))
        else:
            med.set(self, INPUT, ((value,), kwargs))

    @property
    def path(self) -> str:
        """nnsight's name for this module: ``"model"`` and its ``named_modules()`` name,
        dotted (``model.transformer.h[-1].path == "model.transformer.h.11"``), the key of its
        entry in a ``tracer.cache()``: ``cache[model.transformer.h[5].path].output``."""
        mpath = self._mpath
        return f"model.{mpath}" if mpath else "model"

    def _get_path(self, path: str):
        env = self
        for part in path.split(".") if path else ():  # (a digit names a container's child)
            env = env._reach(part) if isinstance(env, Envoy) else getattr(env, part)
        return env

    def next(self, step: int = 1) -> "Envoy":
        """Move every later read of this body to the next call (generation step), as
        ``tracer.next()`` does: nnsight 0.5+'s alias. ``model.shared.next().output`` is a reused
        module's second call. Returns self."""
        current_mediator(self, "next()", "called").move(step, self)
        return self

    @property
    def iter(self):
        """nnsight 0.5-0.8's alias of ``tracer.iter`` (deprecated there): ``model.iter[1:3]``."""
        from .steps import _IterIndexer

        return _IterIndexer()

    def all(self):
        """nnsight 0.5-0.8's alias of ``tracer.all()`` (deprecated there): ``model.all()``."""
        from .steps import _iterate

        return _iterate(slice(None), "model.all()")

    def skip(self, value) -> None:
        """Do not run this module at its current call; use ``value`` as its output."""
        current_mediator(self, "skip()", "called").skip(self, value)

    @property
    def source(self):
        """The operations inside this module's forward, by name (see :class:`source.Source`).

        Example::

            print(model.transformer.h[0].attn.source)   # the forward with each op's name
            with model.trace("Hello"):
                w = model.transformer.h[0].attn.source.attention_interface_0.output.save()
        """
        return _source_of(self)

    # ---- the module tree

    def __getattr__(self, name: str):
        # Child Envoys are kept in ``_subs``, not as instance attributes, where a read would
        # skip this and give the Envoy of a module replaced since (``net.mlp = MyMLP()``):
        # every read checks that the module there is still the one the cached Envoy holds.
        # Inside a trace body the tree stays as the trace found it, and the Envoy is also put
        # in the instance dict until the trace ends (Interleaver.hold): later reads of it in
        # the trace, and in the model's next traces while its tree is the same, are a dict hit
        # (a miss costs ~7K instructions on Python 3.11, which builds and drops an
        # AttributeError before calling this).
        d = self.__dict__
        try:
            module = d["_module"]
        except KeyError:  # (an Envoy being unpickled has no state yet)
            raise AttributeError(name) from None
        try:
            sub = module._modules.get(name)
        except AttributeError:  # a TorchScript module's children
            sub = child_module(module, name)
        if sub is not None:
            env = d["_subs"].get(name)
            if env is None or env._module is not sub:
                env = self._sub(name)
            med = getattr(_getcurrent(), "mediator", None)
            if med is not None:
                med.interleaver.hold(self, name, env)
            return env
        if name[:2] == "E_" and hasattr(Envoy, name[2:]) and not hasattr(module, name) and \
                child_module(module, name[2:]) is not None:
            return self._sub(name[2:])  # (nnsight 0.8.1's name of a child an Envoy name hides)
        rel = d["_tree"].alias(d["_mpath"], name) if d["_tree"].aliases else None
        if rel is not None:  # a rename= alias: the very Envoy its real path gives
            env = self
            for part in rel:
                env = env._sub(part)
            return env
        try:
            value = getattr(module, name)
        except AttributeError:
            if name.startswith("__"):
                raise
            raise self._no_such(name) from None
        if getattr(value, "__self__", None) is module and callable(value):
            return self._method(name, value)
        if isinstance(value, torch.nn.Module):  # a property giving one of the model's modules
            env = self._envoy_of(value)  # (HF's `base_model`): that module's Envoy
            if env is not None:
                return env
        return value

    def _envoy_of(self, module: torch.nn.Module) -> "Envoy | None":
        """The Envoy of ``module`` in this model's tree (found by identity), or None."""
        root = self._top()
        for path, m in root.__dict__["_module"].named_modules():
            if m is module:
                return root._get_path(path)
        return None

    def _sub(self, name: str, path: "str | None" = None) -> "Envoy":
        """The Envoy of the child module ``name`` (cached; also when ``name`` is one of the
        Envoy's own properties, ``output`` say, which attribute access would read instead).
        ``envoy[0]``, ``getattr(envoy, "0")`` and aliases all give this one Envoy."""
        d = self.__dict__
        sub = child_module(d["_module"], name)
        subs = d["_subs"]
        env = subs.get(name)
        if env is not None and env._module is sub:
            return env
        if sub is None:
            raise self._no_such(name)
        if path is None:
            path = f"{d['_path']}[{name}]" if name.isdigit() else f"{d['_path']}.{name}"
        env = subs[name] = self._child(sub, name, path)
        return env

    def _reach(self, name: str):
        """``getattr(self, name)``, except that a child module named like one of the Envoy's
        own attributes (``next``, ``skip``, ``output``) gives the child's Envoy: what a path
        of module names (a cache key, a pickled Envoy's path) means by ``name``."""
        if child_module(self.__dict__["_module"], name) is not None:
            return self._sub(name)
        return getattr(self, name)

    def _child(self, sub: torch.nn.Module, name: str, path: str) -> "Envoy":
        """The Envoy for child module ``sub`` (named ``name`` here), of the class ``envoys=``
        picks for it."""
        d = self.__dict__
        tree = d["_tree"]
        mpath = f"{d['_mpath']}.{name}" if d["_mpath"] else name
        cls = tree.envoy_class(sub, mpath, Envoy) if tree.classes else Envoy
        env = cls(sub, path, tree, mpath)
        env.__dict__["_parent"] = weakref.ref(self)  # (weak: no cycle, freed by refcount)
        return env

    def _method(self, name: str, method):
        """``method`` of the module, returning this Envoy where it would return the module.
        On a model whose weights are not loaded yet, a method that changes the module or hands
        out its tensors loads them first (see ``_load_first``)."""
        if self._load_first(name):
            method = getattr(self._module, name)
        module = self._module

        @functools.wraps(method)
        def call(*args, **kwargs):
            out = method(*args, **kwargs)
            return self if out is module else out

        return call

    def _load_first(self, method: "str | None" = None) -> bool:
        """Load the model's weights now if it defers them and ``method`` (None: an attribute
        set, or this module traced on its own) needs them (a ``LanguageModel`` still on the
        meta device: loading builds a new module tree, which would drop a change made to the
        placeholder, silently); True if they were loaded, so this Envoy's module is new."""
        root = self._top()
        load = getattr(type(root), "_load_deferred", None)
        return load is not None and load(root, method)

    def _no_such(self, name: str) -> ModulePathError:
        children = list(self._module._modules)
        aliases = list(self._tree.aliases.get(self._mpath, ()))
        # the Envoy's own names (output, input, inputs, next, source, trace, ...) and the module's
        own = [a for a in dir(type(self)) if not a.startswith("_")]
        attrs = [a for a in dir(self._module) if not a.startswith("_")]
        known = list(dict.fromkeys(children + aliases + own + attrs))
        near = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f" Did you mean {', '.join(repr(n) for n in near)}?" if near else ""
        kids = ", ".join(children[:12]) + (", ..." if len(children) > 12 else "")
        return ModulePathError(
            f"{self._path} ({type(self._module).__name__}) has no submodule or attribute "
            f"{name!r} (at {user_location()}).{hint} Its submodules are: {kids or 'none'}."
        )

    def __setattr__(self, name: str, value) -> None:
        if name == "output" and self.__class__ is Envoy:  # (the setter below, in line: common)
            current_mediator(self, "output", "set").set(self, OUTPUT, value)
            return
        if name in Envoy._OWN or name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        self._load_first()  # (a value set on a placeholder module would be dropped at loading)
        setattr(self._module, name, value)
        if isinstance(self.__dict__.get(name), Envoy):  # a child Envoy held for a trace
            del self.__dict__[name]

    def __call__(self, *args, hook: bool = False, **kwargs):
        """Call the module. From a body this is an ordinary call, not one of the traced
        model's (``model.lm_head(h)`` in a logit lens takes nobody's place); with ``hook=True``
        the trace sees it: the module and its submodules count the call and serve it to the
        bodies waiting there (an attached SAE applied in an edit: see hooked.py)."""
        if hook:
            from .hooked import call_from_body

            return call_from_body(self, args, kwargs)
        return self._module(*args, **kwargs)

    def __repr__(self) -> str:
        tree = self._tree
        if tree.aliases:
            return tree_repr(self._module, tree, self._mpath)
        return repr(self._module)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._module._modules) | set(dir(self._module)))

    # pickling/copying an Envoy copies the wrapper around the same module reference
    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_plan", None)  # per-process trace machinery (wrapper functions)
        state.pop("_parent", None)  # (a weak reference: set again by the parent's setstate)
        state.pop("_source_view", None)  # (a weak reference: made again on first use)
        return state

    def __setstate__(self, state):
        d = self.__dict__
        d.update(state)
        subs = d.setdefault("_subs", {})
        for name, value in list(d.items()):  # (pickled when children were instance attributes)
            if not name.startswith("_") and isinstance(value, Envoy):
                subs.setdefault(name, d.pop(name))
        d.setdefault("_parent", None)
        for sub in subs.values():  # (children a shallow copy shares keep their own parent)
            ref = sub.__dict__.get("_parent")
            if ref is None or ref() is None:
                sub.__dict__["_parent"] = weakref.ref(self)



def _source_of(envoy):
    """source.source_of, imported at the first use (source.py imports this module); then this
    name is that function (an import statement in the property ran the import machinery at
    every ``.source``)."""
    global _source_of
    from .source import source_of

    _source_of = source_of
    return source_of(envoy)


_EMPTY_TREE = Tree(torch.nn.Module())


__all__ = ["Envoy", "save", "save_in_body"]  # (save: saving.py's, also reached from here)
