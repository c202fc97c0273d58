"""What ``tracer.cache(...)`` gives back (the recording side is cache.py).

    CacheView   the mapping users get: ``cache["model.layer1"].output``, ``cache.layer1.output``,
                ``cache.keys()`` in reached order
    Entry       one module's record: ``.output``, ``.inputs``, ``.input``, ``len()``, and its
                submodules' entries (``e["fc"]``)
    (resolving a key through the model's Envoys, ``_native``, and the places reached by
    attribute, ``_Node``: cache_paths.py)

Both pickle without the model (a view loaded from a pickle answers by path only).
"""

from __future__ import annotations

import difflib
import itertools
import weakref
from collections.abc import Mapping

from .cache_paths import _key, _native, _Node
from .envoy import Envoy
from .errors import CacheKeyError
from .mediator import _MISSING


def _has_key(self, key) -> bool:
    """``key in`` a view or an entry: whether indexing it by that (string) key finds an entry."""
    if not isinstance(key, str):
        return False
    try:
        self[key]
    except KeyError:
        return False
    return True


class Entry:
    """What a cache recorded for one module.

    Example::

        with model.trace(x) as tracer:
            cache = tracer.cache(include_inputs=True)
        e = cache["model.layer1"]
        e.output, e.inputs, e.input, len(e)     # value, (args, kwargs), first argument, visits
        e.keys()                                # its subtree's keys: ["model.layer1.fc", ...]
        e["fc"].output                          # a submodule's entry, by relative key

    With one visit (one forward) each attribute is the value itself; with several (a module
    called more than once, generation steps) it is a list with one value per visit.
    """

    __slots__ = ("_module_ref", "_kind", "_outputs", "_inputs", "_view", "_name")

    def __init__(self, module):
        self._module = module
        self._kind = type(module).__name__
        self._outputs = []
        self._inputs = []
        self._view = None  # a weak reference to the view that last gave it out, and its
        self._name = None  # path there: set by CacheView.__getitem__

    @property
    def _module(self):
        """The module recorded, while it lives (held weakly: a kept entry keeps the values it
        recorded, not the model), else None."""
        ref = self._module_ref
        return ref() if ref is not None else None

    @_module.setter
    def _module(self, module):
        self._module_ref = weakref.ref(module) if module is not None else None

    # ---- the module's subtree (nnsight's cache[key] is a view of it)

    def keys(self) -> list:
        """The cache keys of this module and the modules inside it, in the order the run
        reached them (each submodule's before this module's own, as in the whole view)."""
        records, name = self._records()
        return [_key(n) for n in records if _within(n, name)]

    __contains__ = _has_key

    def __getitem__(self, key) -> "Entry":
        """A submodule's entry by its key relative to this module (``e["fc"]``,
        ``e["0.mlp"]``) or by its full cache key (``e["model.layer1.fc"]``)."""
        if not isinstance(key, str):
            raise TypeError(
                f"cache entries are indexed by a module's key (a string such as \"0\" or "
                f"\"model.layer1.0\"), not {type(key).__name__}")
        records, name = self._records()
        full = key[len("model."):] if key.startswith("model.") else ("" if key == "model"
                                                                      else None)
        # relative first: below an HF causal LM's root, "model" is its child `model`
        tries = (f"{name}.{key}" if name else key,) + ((full,) if full is not None else ())
        # then through aliases (e["ffn"]), relative first, as nnsight's navigation resolves it
        # (walked only where the plain paths miss)
        root = self._view()._root
        for n in itertools.chain(tries, (_native(root, key, base) for base in (name, ""))):
            if n is not None and _within(n, name) and n in records:
                return self._view().__getitem__(_key(n))
        raise CacheKeyError(f"{key!r} is not a module inside {_key(name)} in this cache; its "
                            f"keys: {', '.join(self.keys()[:8])}")

    def _records(self):
        view = self._view() if self._view is not None else None
        if view is None:
            raise TypeError(
                "this cache entry is not part of a live cache view (the view was dropped, or "
                "the entry was pickled on its own), so it cannot reach its submodules; keep "
                "the view and take the entry from it (cache[\"model.layer1\"])")
        return view._records, self._name

    @property
    def output(self):
        """The module's output (a list of them when it ran more than once)."""
        return _unwrap(self._outputs)

    @property
    def inputs(self):
        """``(args, kwargs)`` of the call (a list of them when it ran more than once); None
        unless the cache was opened with ``include_inputs=True``."""
        return _unwrap(self._inputs)

    @property
    def input(self):
        """The first argument (or first keyword value) of the call; a list when it ran more
        than once; None unless ``include_inputs=True``."""
        firsts = [_first(args, kwargs) for args, kwargs in self._inputs]
        return _unwrap(firsts)

    def __len__(self) -> int:
        return max(len(self._outputs), len(self._inputs))

    def __repr__(self) -> str:
        return f"<cache entry: {self._kind}, {len(self)} visit(s)>"

    def __getstate__(self):
        return {"_outputs": self._outputs, "_inputs": self._inputs}

    def __setstate__(self, state):
        self._module = None
        self._kind = "NoneType"  # (as before: a loaded entry does not know its module)
        self._outputs = state["_outputs"]
        self._inputs = state["_inputs"]
        self._view = self._name = None


def _within(name: str, root: str) -> bool:
    """Whether the module at path ``name`` is the one at ``root`` or inside it."""
    return not root or name == root or name.startswith(root + ".")


def _unwrap(values: list):
    if not values:
        return None
    return values[0] if len(values) == 1 else list(values)


def _first(args, kwargs):
    if args:
        return args[0]
    if kwargs:
        return next(iter(kwargs.values()))
    return None


class CacheView(Mapping):
    """What ``tracer.cache(...)`` returns: module path → :class:`Entry`, in the order the run
    reached the modules. Already saved: it exists after the trace without ``.save()``.

    Example::

        with model.trace(x) as tracer:
            cache = tracer.cache()                      # every module's output
        cache["model.layer1"].output                    # by path (named_modules() + "model.")
        cache.layer1.output                             # by attribute, as on the model
        cache.model.layer1.output                       # the same, from the root
        list(cache.keys())                              # ["model.layer1", ..., "model"]

    Navigation goes through the model's Envoys, so whatever name reaches a module on the model
    reaches its entry here. It needs the model, which the view holds weakly (a kept cache keeps
    the values, not the model): once the model is dropped, or in a view loaded from a pickle,
    it answers by path only.
    """

    def __init__(self, model: Envoy | None):
        self._root = model
        self._records: dict[str, Entry] = {}  # named_modules() path -> Entry
        self._include_inputs = False

    @property
    def _root(self) -> "Envoy | None":
        """The model's Envoy while it lives (held weakly); where that wrapper is gone but its
        module lives (a helper made ``NNsight(net)`` and returned the cache), a plain Envoy
        of the module with the wrapper's aliases; else None."""
        ref = self._root_ref
        if ref is None:
            return None
        root = ref()
        if root is None:
            module = self._module_ref()
            if module is not None:
                root = Envoy(module, "model", self._tree)
        return root

    @_root.setter
    def _root(self, model: "Envoy | None") -> None:  # (`view._root = model` re-attaches one)
        self._root_ref = weakref.ref(model) if model is not None else None
        self._module_ref = weakref.ref(model._module) if model is not None else None
        self._tree = model._tree if model is not None else None  # (names only, no module)

    # ---- mapping by path

    def __getitem__(self, key):
        if isinstance(key, str):
            name = key[len("model."):] if key.startswith("model.") else (
                "" if key == "model" else _MISSING)
            if name is not _MISSING and name in self._records:
                return self._give(name)
            name = _native(self._root, key)  # a path through aliases, or without "model."
            if name is not None and name in self._records:
                return self._give(name)
            raise CacheKeyError(self._missing(key, name))
        return _Node(self, self._need_root(), None)[key]  # cache[0]: as model[0] (Sequential)

    def __iter__(self):
        return (_key(n) for n in self._records)

    def __len__(self) -> int:
        return len(self._records)

    __contains__ = _has_key

    def _give(self, name: str) -> Entry:
        """The entry at path ``name``, knowing this view and its path (for its ``keys()``)."""
        entry = self._records[name]
        if entry._view is None or entry._view() is not self:
            entry._view = weakref.ref(self)  # (weak: the view holds its entries)
            entry._name = name
        return entry

    def _missing(self, key, native=None) -> str:
        keys = list(self)
        if native is not None:  # a module of the model, under another name: say which
            return (f"{key!r} ({_key(native)}) is not in this cache: the run did not reach it, "
                    f"or it was not among the modules= asked for (the cache holds {len(keys)} "
                    "module(s))")
        near = difflib.get_close_matches(str(key), keys, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(repr(n) for n in near)}?" if near else ""
        return (f"{key!r} is not in this cache{hint} (it holds the {len(keys)} module(s) the "
                "run reached among those asked for; keys look like \"model.layer1\", or a "
                "path through the model's rename= aliases)")

    # ---- navigation by attribute

    def __getattr__(self, name: str):
        if name == "_cache":  # nnsight re-attaches a loaded view with `view._cache.model = model`
            return _Attach(self)
        if name.startswith("_"):
            raise AttributeError(name)
        return _Node(self, self._need_root(), None).__getattr__(name, from_root=True)

    def _need_root(self) -> Envoy:
        root = self._root
        if root is None:
            why = ("was loaded without its model" if self._root_ref is None else
                   "outlived its model (the model is gone: a cache holds it weakly)")
            raise AttributeError(
                f"this cache {why}, so attribute navigation cannot work; "
                "index it by path (cache[\"model.layer1\"]) or set cache._root = model"
            )
        return root

    def _entry_for(self, envoy: Envoy) -> Entry:
        module = envoy._module
        for name, entry in self._records.items():
            if entry._module is module:
                return self._give(name)
        # a view loaded from a pickle knows its entries by path only
        root = self._root
        for name, mod in root._module.named_modules() if root is not None else ():
            if mod is module:
                entry = self._records.get(name)
                if entry is not None and entry._module is None:
                    return self._give(name)
                break
        raise AttributeError(
            f"{envoy._path} is not in this cache: the run did not reach it, or it was not "
            "among the modules= asked for"
        )

    def __repr__(self) -> str:
        return f"<CacheView of {len(self)} module(s): {', '.join(list(self)[:6])}" + (
            ", ...>" if len(self) > 6 else ">")

    def __getstate__(self):
        return {"_records": self._records, "_include_inputs": self._include_inputs}

    def __setstate__(self, state):
        self._root = None
        self._records = state["_records"]
        self._include_inputs = state["_include_inputs"]
        for name in self._records:  # (its entries reach their subtrees through it again)
            self._give(name)


class _Attach:
    """``view._cache``: nnsight's name for what holds the view's model, so that its idiom
    ``view._cache.model = model`` re-attaches a loaded view (as ``view._root = model`` does)."""

    __slots__ = ("_view",)

    def __init__(self, view: CacheView):
        self._view = view

    @property
    def model(self) -> "Envoy | None":
        return self._view._root

    @model.setter
    def model(self, model: "Envoy | None") -> None:
        self._view._root = model


__all__ = ["CacheView", "Entry"]
