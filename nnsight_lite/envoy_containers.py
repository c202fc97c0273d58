"""Envoys of containers (ModuleList, Sequential, ModuleDict) and walks of the module tree.

    Containers            the mixin Envoy takes them from:
      envoy[key]            a child's Envoy by index, key, slice or ``rename=`` alias
      iter, in, len, bool   as torch's containers give them, over the children's Envoys
      modules()             every Envoy of the subtree (``named_modules()``: with paths)
      children()            the Envoys of the direct children
      _not_a_container, _bad_index
                            the errors for indexing, ``len()`` or a loop that cannot work

Apart from envoy.py because none of this touches a trace's values: it is the tree's shape
only. It reaches children through Envoy's ``_sub`` and ``_child``, so this module imports
nothing of envoy.py.
"""

from __future__ import annotations

import torch

from .aliases import child_module
from .errors import NotAContainerError
from .workers import user_location


class Containers:
    """Indexing, iteration and tree walks of :class:`~nnsight_lite.envoy.Envoy`: ``model.h[0]``,
    ``for blk in model.h``, ``len(model.h)``, ``model.modules()``."""

    def modules(self, include_fn=None, names: bool = False) -> list:
        """Every Envoy in this subtree, this one first, in ``torch.nn.Module.modules()`` order
        (``names=True``: ``(path, envoy)`` pairs, each path the Envoy's ``.path``, nnsight's
        ``"model.transformer.h.0"``, which is also its key in a ``tracer.cache()``).
        ``include_fn(envoy)`` filters.

        Example::

            linears = [e for e in model.modules() if isinstance(e._module, torch.nn.Linear)]
        """
        out = []
        seen = set()
        stack = [self]
        while stack:
            env = stack.pop()
            if id(env._module) in seen:
                continue
            seen.add(id(env._module))
            if include_fn is None or include_fn(env):
                out.append((env.path, env) if names else env)
            stack.extend(reversed([env._sub(n) for n, m in env._module._modules.items()
                                   if m is not None]))
        return out

    def named_modules(self, *args, **kwargs) -> list:
        """``modules(names=True)``: ``(path, envoy)`` pairs for this subtree, paths as
        ``.path`` gives them (``"model.transformer.h.0"``, the ``tracer.cache()`` keys)."""
        return self.modules(*args, names=True, **kwargs)

    def children(self) -> list:
        """The Envoys of this module's direct children."""
        return [self._sub(n) for n, m in self._module._modules.items() if m is not None]

    def __getitem__(self, key):
        items = self._items
        try:
            hit = items.get(key)  # (slices are never kept there)
        except TypeError:  # an unhashable key: a slice before Python 3.12
            hit = None
        if hit is not None:  # still the same module at that position?
            env, name, length = hit
            children = self._module._modules
            if len(children) == length:
                try:
                    now = children.get(name)
                except AttributeError:  # a TorchScript module's children (no get)
                    now = child_module(self._module, name)
                if now is env._module:
                    return env
        if isinstance(key, str) and self._tree.alias(self._mpath, key) is not None:
            return getattr(self, key)  # an alias of a ModuleList entry: h["second_layer"]
        try:
            sub = self._module[key]
            if isinstance(self._module, torch.jit.ScriptModule) and isinstance(sub, torch.nn.Module):
                sub = _script_item(self._module, key)
        except (IndexError, KeyError, TypeError) as exc:
            if "_orig_mod" in self._module._modules:  # torch.compile's OptimizedModule hands
                return self._sub("_orig_mod")[key]  # attributes and len() on, not indexing
            raise self._bad_index(key, exc) from None
        if isinstance(key, slice):
            return [self[i] for i in range(len(self._module))[key]]
        if not isinstance(sub, torch.nn.Module):
            return sub
        children = self._module._modules
        name = next((n for n, m in children.items() if m is sub), None)
        if name is not None:  # (an int key is labelled by the child's own index: h[-1] and
            # h[11] are one Envoy, named model.h[11] whichever the body wrote first)
            label = name if isinstance(key, int) and name.isdigit() else repr(key)
            env = self._sub(name, f"{self._path}[{label}]")
        else:
            env = self._child(sub, str(key), f"{self._path}[{key!r}]")
        if name is not None:
            items[key] = (env, name, len(children))
        return env

    def __iter__(self):
        editor = self.__dict__.pop("_unpacking", None)
        if editor is not None:  # `with model.edit() as (tracer, edited):` (sessions.Editor)
            return iter((editor, self))
        module = self._module
        if isinstance(module, torch.nn.ModuleDict):  # its children's Envoys, as in nnsight
            return (self[k] for k in list(module.keys()))  # (torch's loop gives the keys)
        return (self[i] for i in range(len(self)))

    def __contains__(self, item) -> bool:
        """A key of a ModuleDict (as torch's ``in``); else whether ``item`` is one of the
        children's Envoys or modules."""
        module = self._module
        if isinstance(module, torch.nn.ModuleDict) and isinstance(item, str):
            return item in module
        return any(item is env or item is env._module for env in self)

    def __bool__(self) -> bool:
        """True, as for any module; an empty ModuleList/Sequential/ModuleDict's Envoy is False
        (``if model:`` and ``model or default`` do not go through ``len()``)."""
        try:
            return len(self._module) > 0
        except TypeError:
            return True

    def __len__(self) -> int:
        try:
            return len(self._module)
        except TypeError:
            pass
        raise self._not_a_container("len(), loops and unpacking work")

    def _not_a_container(self, works: str, child: str = "a child by its name (print(model) "
                         "lists them)", lead: str = "") -> NotAContainerError:
        return NotAContainerError(
            f"{lead}{self._path} ({type(self._module).__name__}) is not a container of modules: "
            f"{works} on the Envoys of ModuleList, Sequential and ModuleDict; reach {child}.")

    def _bad_index(self, key, exc: Exception) -> Exception:
        """Why ``envoy[key]`` failed: a key the container does not have, or no container."""
        module = self._module
        try:
            length = len(module)
        except TypeError:
            child = (f"it as {self._path}.{key}" if isinstance(key, str) and key in module._modules
                     else "a child as an attribute, by its name (print(model) lists them)")
            return self._not_a_container("indexing works", child,
                                         f"{self._path}[{key!r}] at {user_location()}: ")
        where = user_location()
        if isinstance(exc, KeyError):  # (a ModuleDict: name the keys it has)
            keys = ", ".join(map(str, list(module._modules)[:12])) or "none"
            return KeyError(f"{self._path}[{key!r}] at {where}: no module under {key!r} "
                            f"({type(module).__name__} of length {length}; its keys: {keys})")
        return type(exc)(f"{self._path}[{key!r}] at {where}: {exc} ({type(module).__name__} of "
                         f"length {length})")


def _script_item(module, key):
    """The child at ``key`` of a scripted ``Sequential``/``ModuleList`` (an int key: a position)
    or ``ModuleDict`` (a name), where its own indexing gives the Python module it was scripted
    from, which the scripted code never calls."""
    if isinstance(key, slice):  # (the caller indexes each position in turn)
        return module
    if isinstance(key, int):
        return list(module._modules.items())[key][1]
    return module._modules[key]


__all__ = ["Containers"]
