"""How a cache key or an attribute reaches a module's entry (the view itself: cache_view.py).

    _key(name)          a cache key: the ``named_modules()`` path with ``model`` in front
    _dotted(key)        a key with its indexing written as dots (``h[0]`` -> ``h.0``)
    _native(root, key)  the ``named_modules()`` path a key names through the model's Envoys
                        (``rename=`` aliases, no leading ``model.``, ``h[0]``), or None
    _Node               a place in the model tree reached by attribute from a view
                        (``cache.h[0]``): ``.output``, ``.inputs``, ``.input``, ``keys()``

Both walk the model's Envoys, so whatever name reaches a module on the model reaches its
entry in a cache; only child modules and aliases are followed, never an Envoy property (a key
is no request for a value). cache.py (recording by path) and cache_view.py import from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .aliases import child_module
from .envoy import Envoy

if TYPE_CHECKING:
    from .cache_view import CacheView


def _key(name: str) -> str:
    """A cache key: ``named_modules()`` path with ``model`` in front."""
    return "model." + name if name else "model"


def _dotted(key: str) -> str:
    """A cache key with its indexing written as dots: ``h[0]`` -> ``h.0``, ``d['a']`` -> ``d.a``."""
    return key.replace("[", ".").replace("]", "").replace("'", "").replace('"', "")


def _native(root: "Envoy | None", key: str, base: str = "") -> "str | None":
    """The ``named_modules()`` path of the module ``key`` names through the model's Envoys, or
    None: a path through ``rename=`` aliases (``"model.layers.0.ffn"``), one without the
    leading ``model.`` (``"transformer.h.0"``), ``h[0]`` indexing, as nnsight resolves a cache
    key. ``base`` is the path ``key`` is relative to (an entry's own). Only child modules and
    aliases are followed, never an Envoy property (a key is no request for a value)."""
    if root is None:
        return None
    parts = _dotted(key).lstrip(".").split(".")  # ("[1]": the root's child 1)
    tries = [parts[1:], parts] if parts[0] == "model" and not base else [parts]
    for names in tries:
        env = root._get_path(base) if base else root
        for name in names:
            env = _step(env, name)
            if env is None:
                break
        else:
            return env._mpath
    return None


def _step(env: Envoy, name: str) -> "Envoy | None":
    """The Envoy of ``env``'s child module ``name`` or of its ``rename=`` alias ``name``."""
    if child_module(env._module, name) is not None:
        return env._sub(name)
    tree = env._tree
    rel = tree.alias(env._mpath, name) if tree.aliases else None
    if rel is None:
        return None
    for part in rel:
        env = env._sub(part)
    return env


class _Node:
    """A place in the model tree reached from a cache: ``cache.transformer.h[0]``."""

    __slots__ = ("_view", "_envoy", "_alt")

    def __init__(self, view: CacheView, envoy: Envoy, alt: Envoy | None):
        self._view = view
        self._envoy = envoy
        self._alt = alt  # the root, when ``cache.model`` reached a child named "model"

    def __getattr__(self, name: str, from_root: bool = False):
        if name in ("output", "inputs", "input"):
            return getattr(self._view._entry_for(self._envoy), name)
        if name.startswith("_"):
            raise AttributeError(name)
        envoy = self._envoy
        if from_root and name == "model":  # `cache.model...`: the root, as in the keys
            child = _child(envoy, name)
            return _Node(self._view, child if child is not None else envoy,
                         envoy if child is not None else None)
        child = _child(envoy, name)
        if child is None and self._alt is not None:
            child = _child(self._alt, name)
        if child is None:
            raise AttributeError(
                f"{envoy._path} has no submodule {name!r} to look up in the cache; "
                f"cache keys: {', '.join(list(self._view)[:8])}"
            )
        return _Node(self._view, child, None)

    def __getitem__(self, key):
        child = self._envoy[key]
        if not isinstance(child, Envoy):
            raise TypeError(f"{self._envoy._path}[{key!r}] is not a module")
        return _Node(self._view, child, None)

    def __len__(self) -> int:
        return len(self._view._entry_for(self._envoy))

    def keys(self) -> list:
        """The cache keys of this module's subtree (see :meth:`Entry.keys`)."""
        return self._view._entry_for(self._envoy).keys()

    def __repr__(self) -> str:
        return f"<cache node {self._envoy._path}>"


def _child(envoy: Envoy, name: str):
    """The child Envoy ``envoy.<name>`` (aliases included), or None if it is not a module."""
    try:
        got = envoy._reach(name)
    except AttributeError:
        return None
    return got if isinstance(got, Envoy) else None
