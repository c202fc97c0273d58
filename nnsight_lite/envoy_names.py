"""The Envoy's own names that a module's child or attribute of the same name comes before.

    ModuleFirst           the mixin Envoy takes them from:
      device, devices       where the module's parameters and buffers are
      parent, root          the Envoys above this one
      get(path)             the Envoy (or value) at a dotted path below this one
      trace, scan, session, edit, clear_edits
                            this module wrapped on its own, as a model (``_alone``)
    _module_first         makes such a property: the module's own ``name`` first
    _NOT_OWN              ``ModuleFirst._own``'s answer where the module has no such name

Apart from envoy.py because none of these touch a trace's values: they answer from the module
tree alone, and each gives way to what the module itself has (``model.blk.scan`` is the child
named ``scan`` where there is one). They reach the tree only through Envoy's ``_sub``,
``_get_path`` and ``__dict__``, so this module imports nothing of envoy.py.
"""

from __future__ import annotations

import itertools

from .aliases import child_module

_NOT_OWN = object()  # ModuleFirst._own: the module has no such child or attribute


def _module_first(fn):
    """An Envoy property that a module's own child or attribute of the same name comes before
    (``model.blk.scan`` is the child named ``scan`` where there is one): ``fn(envoy)`` only
    where the module has none."""
    name = fn.__name__

    def get(self):
        own = self._own(name)
        return fn(self) if own is _NOT_OWN else own

    get.__doc__ = fn.__doc__
    return property(get)


class ModuleFirst:
    """What :class:`~nnsight_lite.envoy.Envoy` answers for a name only where its module has
    no child or attribute of that name (see ``_module_first``)."""

    @_module_first
    def device(self):
        """The module's own ``device`` where it has one (an HF model, a module that sets
        ``self.device``; a child module named ``device`` gives its Envoy), else the device of
        its first parameter or buffer (None for a module with neither): ``x.to(model.device)``."""
        module = self._module
        for t in itertools.chain(module.parameters(), module.buffers()):
            return t.device
        return None

    # ---- a module traced on its own (nnsight's Envoy.trace on any module)

    def _alone(self):
        """This module wrapped on its own (made once, kept here): what ``trace``, ``scan``,
        ``session``, ``edit`` and ``clear_edits`` of an Envoy below the model's run. A model
        still on the meta device (a ``LanguageModel`` not yet used) loads its weights first, as
        its own trace would: this module runs (or keeps its edits) on the loaded tree."""
        self._load_first()
        d = self.__dict__
        alone = d.get("_wrapped_alone")
        if alone is None or alone._module is not d["_module"]:
            from .model import NNsight

            alone = d["_wrapped_alone"] = NNsight(d["_module"])
            for name in ("_batch_size", "_batch"):  # an Envoy subclass's batching (nnsight's)
                own = getattr(type(self), name, None)
                if own is not None:
                    alone.__dict__[name] = own.__get__(self)
        return alone

    @_module_first
    def trace(self):
        """Trace this module on its own, as a model: ``with model.transformer.h[0].mlp.trace(h):``.
        Bodies read its modules through any Envoy of them (``model.transformer.h[0].mlp.c_fc``
        or the ones of the trace's own ``tracer.model``). A child module named ``trace`` comes
        first, as for ``scan``, ``session``, ``edit`` and ``clear_edits``."""
        return self._alone().trace

    @_module_first
    def scan(self):
        """``scan`` of this module on its own (see ``trace``)."""
        return self._alone().scan

    @_module_first
    def session(self):
        """``session`` of this module on its own (see ``trace``)."""
        return self._alone().session

    @_module_first
    def edit(self):
        """A persistent edit of this module on its own: replayed by its own ``trace`` (as in
        nnsight, a trace of the whole model does not run it)."""
        return self._alone().edit

    @_module_first
    def clear_edits(self):
        """Remove the edits recorded with this module's own ``edit``."""
        return self._alone().clear_edits

    @_module_first
    def devices(self) -> set:
        """The devices of the module's parameters and buffers (``{device(type='cpu')}``)."""
        module = self._module
        return {t.device for t in itertools.chain(module.parameters(), module.buffers())}

    @_module_first
    def parent(self):
        """The Envoy of the module this one is a child of (None for the model itself)."""
        ref = self.__dict__["_parent"]
        return ref() if ref is not None else None

    @_module_first
    def root(self):
        """The Envoy of the whole model (``model``) this one belongs to."""
        return self._top()

    def _top(self):
        """``root`` for the runtime's own use: a module's child or attribute named ``root``
        comes before the property, not before this."""
        env = self
        while (ref := env.__dict__["_parent"]) is not None and ref() is not None:
            env = ref()
        return env

    @_module_first
    def get(self):
        """``model.get(path)``: the Envoy (or attribute, or value) at the dotted ``path`` under
        this one, as nnsight's ``Envoy.get``: ``model.get("transformer.h.0.mlp")``, and in a
        body ``model.get("transformer.h.0.mlp.output")``; digits index containers. A module's
        own ``get`` (a method, a child module named so) comes first."""
        return self._get_path

    def _own(self, name: str):
        """What ``name`` is on the module itself, a child module's Envoy first (_NOT_OWN where
        it is neither a child nor an attribute): Envoy names that a module may also have
        (see ``_module_first``)."""
        module = self.__dict__["_module"]
        if child_module(module, name) is not None:
            return self._sub(name)
        try:
            return getattr(module, name)
        except AttributeError:
            return _NOT_OWN


__all__ = ["ModuleFirst"]
