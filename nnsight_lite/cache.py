"""``tracer.cache(...)``: record many modules' outputs (and inputs) during one trace.

    open_cache(tracer, ...)   what ``tracer.cache(...)`` does: attach an observer, return the view
    _Observer                 what records: waits where bodies wait, after every body

The view users get, ``CacheView`` and its ``Entry`` records, is in cache_view.py; resolving a
module's key through the model's Envoys (``_native``), in cache_paths.py.

How it is built: the cache is an observer waiting in the same tables a body waits in
(``slot.wait_in`` / ``slot.wait_out``), for every call of every module it watches. It sorts
after every invoke (its ``index`` is larger than any invoke's), so it sees each value after all
bodies have edited it, records its rows, and waits for the module's next call. The counting
wrapper needs no change for it: a trace without a cache pays nothing.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
from bisect import insort

import torch

from . import batching, tiles
from .envoy import Envoy, save
from .errors import CacheError, ModulePathError, OutsideTraceError
from .mediator import _MISSING, INPUT, OUTPUT
from .messages import backward_block_error, in_backward_block
from .cache_paths import _dotted, _key, _native
from .cache_view import CacheView, Entry
from .calls import Slot
from .workers import _getcurrent, user_location

#: Observers sort after every invoke body in a wait table (bodies are numbered from 0).
_OBSERVER_BASE = 1 << 40
_counter = itertools.count()


def open_cache(tracer, modules=None, *, device=torch.device("cpu"), dtype=None,
               detach: bool = True, include_output: bool = True, include_inputs: bool = False,
               non_blocking: bool = False) -> "CacheView":
    """Attach a cache to the body running now (see ``Tracer.cache``); return its view, saved."""
    med = getattr(_getcurrent(), "mediator", None)
    if med is None:
        if getattr(tracer, "_collecting", False):
            raise CacheError(
                f"tracer.cache() was called at {user_location()}, in the body of a trace that "
                "was given no inputs: that body only sets up invokes. Call it inside a `with "
                "tracer.invoke(...):` block (it records that invoke's rows; an empty "
                "`with tracer.invoke():` records the whole batch)."
            )
        if in_backward_block():
            raise backward_block_error("tracer.cache()", "call it first in the trace body, "
                                       "before any .output/.input access")
        raise OutsideTraceError(
            f"tracer.cache() was called outside a trace body (at {user_location()}); a cache "
            "records values while the model runs. Call it inside `with model.trace(...) as "
            "tracer:` (or `model.generate(...)`), before the body reads or edits a model value."
        )
    inter = med.interleaver
    if inter.root is not tracer.model._module:
        raise CacheError(
            f"tracer.cache() at {user_location()} belongs to a trace of "
            f"{type(tracer.model._module).__name__}, but the body running now is a trace of "
            f"{type(inter.root).__name__}; call the cache method of that trace's tracer"
        )
    modules = _check_options(modules, device, dtype)
    if inter.position is not None or inter.finished:
        # The model's forward has begun (bodies only run again once it serves them a value),
        # so calls that already happened would be missing from the cache.
        raise CacheError(
            f"tracer.cache() was called at {user_location()}, after this body had already "
            "read or edited a model value, so modules that ran before would be missing. "
            "Call tracer.cache(...) first in the body, before any .output/.input access."
        )
    if not (include_output or include_inputs):
        raise CacheError(
            "tracer.cache(include_output=False, include_inputs=False) would record nothing; "
            "set include_output=True and/or include_inputs=True"
        )
    slots = _select(tracer.model, inter, modules)
    view = CacheView(tracer.model)
    observer = _Observer(view._records, inter, med.batch, device, dtype, detach, non_blocking)
    for slot in slots:
        if include_inputs:
            observer.wait(inter.wait_table(slot, INPUT), 0)
        if include_output:
            observer.wait(inter.wait_table(slot, OUTPUT), 0)
    view._include_inputs = include_inputs
    return save(view)


def _check_options(modules, device, dtype):
    """Refuse here, at the body's line, what would otherwise fail inside the model's forward
    (where the observer stores a value) or be misread as a late call: ``modules`` holding a
    module's value instead of the module, a ``dtype`` that is not a torch.dtype, a device this
    torch cannot put tensors on. Returns ``modules`` (an iterator made a list)."""
    if modules is not None and not isinstance(modules, (str, Envoy, torch.nn.Module)):
        modules = list(modules)
        for m in modules:
            if not isinstance(m, (str, Envoy, torch.nn.Module)):
                value = " (a module's value? pass the module itself, model.layer1, not " \
                        "model.layer1.output)" if isinstance(m, torch.Tensor) else ""
                raise TypeError(
                    f"tracer.cache(modules=...) at {user_location()} takes Envoys "
                    f"(model.layer1) or path strings (\"model.layer1\"), got "
                    f"{type(m).__name__}{value}"
                )
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"tracer.cache(dtype=...) at {user_location()} takes a torch.dtype "
            f"(dtype=torch.float16) or None, got {dtype!r}"
        )
    if device is not None and torch.device(device).type != "cpu":
        try:
            torch.empty(0, device=device)
        except Exception as err:  # noqa: BLE001 - torch says why (no CUDA, no such index)
            raise CacheError(
                f"tracer.cache(device={device!r}) at {user_location()}: this process cannot "
                f"put tensors on that device ({type(err).__name__}: {err}). Pass a device "
                "it has (the default keeps them on the CPU; device=None leaves them where the "
                "model made them)."
            ) from err
    return modules


def _select(model: Envoy, inter, modules) -> list:
    """The slots of the modules asked for (every module when ``modules`` is None)."""
    if modules is None:
        return list(inter.slots.values())
    if isinstance(modules, (str, Envoy, torch.nn.Module)):
        modules = [modules]
    named = None
    out = []
    for m in modules:
        if isinstance(m, Envoy):
            module = m._module
            where = m._path
        elif isinstance(m, torch.nn.Module):
            module, where = m, type(m).__name__
        elif isinstance(m, str):
            if named is None:
                named = dict(inter.root.named_modules())
            module = _by_path(named, m, model)
            where = m
        else:
            raise TypeError(
                f"tracer.cache(modules=...) takes Envoys (model.layer1) or path strings "
                f"(\"model.layer1\"), got {type(m).__name__}"
            )
        if id(module) not in inter.slots:
            raise ModulePathError(
                f"tracer.cache(modules=...): {where} is not a module of the model being traced "
                f"(at {user_location()})"
            )
        for module in _called(module, where):
            slot = inter.slots[id(module)]
            if slot not in out:
                out.append(slot)
    return out


def _called(module: torch.nn.Module, where: str) -> list:
    """``module``, or where it is a container that is never called itself (a ModuleList,
    ModuleDict, a plain Module with no forward) the modules it holds, containers opened in
    turn: ``modules=[model.layers]`` caches every layer, as a researcher means it."""
    held = _held(module)
    if not held:
        raise ModulePathError(
            f"tracer.cache(modules=...): {where} is a {type(module).__name__} with no forward "
            f"and no modules of its own, so it is never called and has nothing to cache (at "
            f"{user_location()}). Cache the module whose code uses its parameters instead"
        )
    return held


def _held(module: torch.nn.Module) -> list:
    """``module`` where it has a forward, else the modules with one that it holds (an empty
    container or a parameter-only module inside another holds none: it is passed over, the
    others are still cached)."""
    if type(module).forward is not torch.nn.Module.forward:
        return [module]
    return [m for child in module.children() for m in _held(child)]


def _by_path(named: dict, path: str, model: Envoy) -> torch.nn.Module:
    """The module at ``path``: ``"model.layer1"`` (a cache key), ``"layer1"``, ``"h[0]"``, or a
    path through ``rename=`` aliases (``"layers.0.ffn"``)."""
    clean = _dotted(path)
    tries = []
    if clean == "model":
        tries.append("")
    elif clean.startswith("model."):
        tries.append(clean[len("model."):])
    tries.append(clean)
    for t in tries + [_native(model, path)]:
        if t in named:
            return named[t]
    keys = [_key(n) for n in named]
    near = difflib.get_close_matches(path, keys, n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(repr(n) for n in near)}?" if near else ""
    raise ModulePathError(
        f"tracer.cache(modules=...): the model has no module at {path!r} (at "
        f"{user_location()}).{hint} Paths are written like \"model.transformer.h.0\"; "
        "cache.keys() after a trace lists them."
    )


class _Observer:
    """Waits in the wait tables like a body, but only records; sorts after every body."""

    __slots__ = ("index", "records", "by_slot", "names", "total", "factors", "rows", "device",
                 "dtype", "detach", "non_blocking", "skip_value", "inter")

    switches = False  # it records in place: serving it switches to no body (see Interleaver)

    def __init__(self, records, inter, rows, device, dtype, detach, non_blocking):
        self.index = _OBSERVER_BASE + next(_counter) % _OBSERVER_BASE
        self.records = records  # the view's: named_modules() path -> Entry, in reached order
        self.by_slot = {}  # the same entries by Slot
        self.names = {}  # Slot -> its named_modules() path, each worked out once (_name_of)
        self.total = inter.total
        self.factors = inter.row_factors  # (a generate's beams: see batching.narrow)
        self.inter = inter  # (whose wait tables it waits in; they hold it until the trace ends)
        self.rows = rows  # (start, size) of the invoke that opened it, or None (whole batch)
        self.device = torch.device(device) if device is not None else None
        self.dtype = dtype
        self.detach = detach
        self.non_blocking = non_blocking
        self.skip_value = _MISSING  # read by the interleaver after serving an input stage

    def wait(self, table: dict, call: int) -> None:
        waiting = table.get(call)
        if waiting is None:
            table[call] = [self]
        elif waiting[-1].index < self.index:
            waiting.append(self)
        else:
            insort(waiting, self, key=_index)

    def serve(self, key, value, parent_state=None):
        """Called by the interleaver where a body would be served: record, wait for the next
        call, hand ``value`` on unchanged."""
        slot, kind, call = key
        entry = self.by_slot.get(slot)
        if entry is None:
            entry = self.by_slot[slot] = self.records[self._name_of(slot)] = Entry(slot.module)
        if kind is OUTPUT:
            entry._outputs.append(self._take(value))
            self.wait(self.inter.wait_table(slot, OUTPUT), call + 1)
        else:
            args, kwargs = value
            entry._inputs.append((self._take(tuple(args)), self._take(dict(kwargs))))
            self.wait(self.inter.wait_table(slot, INPUT), call + 1)
        return value

    def _name_of(self, slot) -> str:
        """``slot.name`` (a walk up to the root each time) with every path kept: a cache of
        every module works each out once, from its parent's."""
        name = self.names.get(slot)
        if name is None:
            if slot.parent is None or slot.__class__ is not Slot:
                name = slot.name
            else:
                up = self._name_of(slot.parent)
                name = f"{up}.{slot.attr}" if up else slot.attr
            self.names[slot] = name
        return name

    def _take(self, value):
        """``value`` as stored: this invoke's rows, detached, moved and cast as asked."""
        if isinstance(value, torch.Tensor):
            rows = self.rows
            if rows is not None:
                if batching._is_batch_tensor(value, self.total):
                    value = value[rows[0]:rows[0] + rows[1]]
                elif self.factors:
                    grown = batching._expanded_rows(value, *rows, self.total, self.factors)
                    if grown.__class__ is list:  # (spans in several blocks: tiles.Tiles)
                        value = tiles.gather(value, grown)
                    elif grown is not None:
                        value = value[grown[0]:grown[0] + grown[1]]
            if self.detach:
                value = value.detach()
            dtype = self.dtype if self.dtype is not None and value.is_floating_point() else None
            if (self.device is not None and value.device != self.device) or (
                    dtype is not None and value.dtype != dtype):  # (.to() that changes nothing
                # returns the tensor itself, after a dispatch: ~1 µs a module saved)
                value = value.to(device=self.device, dtype=dtype, non_blocking=self.non_blocking)
            return value
        if isinstance(value, (tuple, list, dict)) or (
                dataclasses.is_dataclass(value) and not isinstance(value, type)):
            return batching._map(value, self._take)
        return value


def _index(obj) -> int:
    return obj.index


__all__ = ["CacheView", "Entry", "open_cache"]
