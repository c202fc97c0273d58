"""The namespace a captured body runs in, and binding its saved names back in the caller.

    Scope                  the body's own names, falling back to the caller's
    caller_scope(frame)    a fresh Scope for a body whose with-statement sits in ``frame``
    write_back(frame, d)   put saved names back into the caller's scope
"""

from __future__ import annotations

import builtins
import ctypes
import sys
import weakref
from collections import ChainMap
from itertools import islice
from types import FrameType

from .rewrite import (GRAD_NAME, INLINE_NAME, ITER_BLOCK_NAME, ITER_END_NAME, NAME_NAME, SAVE_NAME,
                      SET_GRAD_NAME, IterationEnd)

_PY313 = sys.version_info >= (3, 13)
_CO_OPTIMIZED = 0x0001


class Scope(dict):
    """The namespace a body runs in.

    The body's own assignments live in this dict; names it does not define are looked up, at
    the moment they are read, in the caller's locals, then its globals, then builtins. Each
    invoke of a trace runs in a ``child`` of the trace's Scope, so it sees the trace body's
    names and what other invokes publish there, while its own bindings stay its own. A name
    an earlier invoke's body binds (``_awaited``) is waited for before the caller's scopes are
    asked: the later invoke's code comes after the earlier one's, so a value of that name left
    around the trace (by an earlier cell) is not the one it means.
    """

    __slots__ = ("_up", "_locals", "_globals", "_builtins", "_on_missing", "_base", "_awaited",
                 "_local_names")

    def __init__(self, caller_locals, caller_globals, runtime: dict, on_missing):
        # (dict.__init__ is not called: with no arguments it does nothing)
        self._up = None  # for a child: the Scope it was made from, looked in first
        self._on_missing = on_missing
        self._awaited = None  # for an invoke's: the names earlier invokes' bodies bind
        self._locals = caller_locals
        self._local_names = None  # (3.13+, a function's frame: see caller_scope)
        self._globals = caller_globals
        b = caller_globals.get("__builtins__", builtins)
        module = caller_globals.get("__name__")
        if module.__class__ is not str:
            module = None
        key = (id(runtime), id(b), module)
        cached = _bases.get(key)
        if cached is None or cached[0] is not runtime or cached[1] is not b or \
                len(cached[3]) != len(runtime) + 2 + (module is not None):
            # the entries every body needs: builtins, and what the body rewrites call (kept for
            # the usual builtins, which nearly every body has; never written to), and the
            # caller's module name: a class statement in the body takes its __module__ from
            # the globals dict itself (LOAD_NAME does not ask __missing__), else from builtins
            base = {"__builtins__": b, ITER_END_NAME: IterationEnd, **runtime}
            if module is not None:
                base["__name__"] = module
            cached = (runtime, b, b if isinstance(b, dict) else vars(b), base)
            if b is builtins or b is _BUILTINS:
                _bases[key] = cached
        self._builtins = cached[2]
        self._base = cached[3]
        dict.update(self, cached[3])

    def __missing__(self, name):
        up = self._up
        while up is not None:  # a child: the names of the Scopes it was made from come first
            value = dict.get(up, name, _ABSENT)
            if value is not _ABSENT:
                return value
            up = up._up
        if self._awaited is not None and name in self._awaited:
            try:  # an earlier invoke still running binds it later: wait for its value
                return self._on_missing(self, name, True)
            except KeyError:  # (no invoke before this one can bind it any more)
                pass
        loc = self._locals
        # a plain dict (a module's or a function's locals) is asked without raising KeyError;
        # a function frame's FrameLocalsProxy (3.13+) only for the function's own variables
        # (other names are never there, and asking raises KeyError inside: ~0.6 µs a name);
        # other mappings (a Scope with its own fallbacks, a class body's ChainMap) by indexing
        if loc.__class__ is dict:
            value = loc.get(name, _ABSENT)
        elif self._local_names is not None:
            value = _get(loc, name) if name in self._local_names else _ABSENT
        else:
            value = _get(loc, name)
        if value is _ABSENT:
            glob = self._globals
            if glob is not loc:
                value = glob.get(name, _ABSENT) if glob.__class__ is dict else _get(glob, name)
            if value is _ABSENT:
                value = self._builtins.get(name, _ABSENT)
                if value is _ABSENT:
                    return self._on_missing(self, name)  # an earlier invoke may still bind it
        return value

    def child(self, names: dict) -> "Scope":
        """A Scope holding ``names`` whose lookups fall back to this one's own names (and its
        parents'), then to where this one's fall back, asked directly: one ``__missing__`` call
        per name read, however deep the chain."""
        c = Scope.__new__(Scope)
        c._on_missing = self._on_missing
        c._awaited = None
        c._up = self
        c._locals = self._locals
        c._local_names = self._local_names
        c._globals = self._globals
        c._builtins = self._builtins
        c._base = self._base
        dict.update(c, self._base)
        dict.update(c, names)
        return c

    def reset(self) -> None:
        """Drop every name the body bound (and the tensors they hold); keep the base entries,
        so functions defined in the body still find builtins and the runtime names."""
        dict.clear(self)
        dict.update(self, self._base)

    def knows(self, name: str) -> bool:
        """Whether ``name`` is bound here or in an enclosing Scope (another body's names)."""
        scope = self
        while isinstance(scope, Scope):
            if dict.__contains__(scope, name):
                return True
            scope = scope._locals if scope._up is None else scope._up
        return False

    def bound_items(self):
        """The names bound here after the base entries (each Scope starts with those, in
        order): the body's own, and for a child the names it was made with."""
        return islice(dict.items(self), len(self._base), None)

    def own_items(self):
        """The names the body itself bound (not the two internal entries)."""
        for k, v in dict.items(self):
            if k not in _INTERNAL:
                yield k, v


#: (id(runtime), id(builtins), module name) -> (runtime, builtins, builtins as a dict, base
#: entries) for the usual builtins
_bases: dict = {}
_BUILTINS = vars(builtins)

_ABSENT = object()


def _get(mapping, name):
    """``mapping[name]``, or _ABSENT where it raises KeyError (any mapping type)."""
    try:
        return mapping[name]
    except KeyError:
        return _ABSENT


_INTERNAL = frozenset({"__builtins__", "__name__", ITER_END_NAME, SAVE_NAME, GRAD_NAME, SET_GRAD_NAME,
                       INLINE_NAME, NAME_NAME, ITER_BLOCK_NAME})


def caller_scope(frame: FrameType, runtime: dict, on_missing) -> Scope:
    """A fresh Scope for a body whose ``with`` statement sits in ``frame``.

    ``runtime`` maps the names the body rewrites use (SAVE_NAME, GRAD_NAME, SET_GRAD_NAME) to
    their functions; ``on_missing(scope, name)`` is asked for names found nowhere (and
    ``on_missing(scope, name, True)`` for an awaited name, which may be found around).
    """
    f_locals = frame.f_locals
    code = frame.f_code
    if code.co_freevars and not (code.co_flags & _CO_OPTIMIZED) and frame.f_back is not None:
        # A class body: its free variables (the enclosing function's locals) are not in
        # f_locals, but the frame that runs the class statement holds them.
        outer = frame.f_back.f_locals
        free = {n: outer[n] for n in code.co_freevars if n in outer}
        f_locals = ChainMap(f_locals, free)
    scope = Scope(f_locals, frame.f_globals, runtime, on_missing)
    if _PY313 and code.co_flags & _CO_OPTIMIZED:  # (a function's frame: a FrameLocalsProxy)
        scope._local_names = _names_of(code)
    return scope


def _names_of(code) -> frozenset:
    """The variables of a function's code object: the only names its frame's f_locals holds
    (names a body binds there are among them, assigned in the function's own source)."""
    names = _code_names.get(code)
    if names is None:
        names = _code_names[code] = frozenset(
            code.co_varnames + code.co_cellvars + code.co_freevars)
    return names


#: code object -> its variables' names (weakly: a notebook redefines its functions)
_code_names: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


_locals_to_fast = None
if not _PY313:  # pragma: no cover - exercised on 3.10-3.12
    _locals_to_fast = ctypes.pythonapi.PyFrame_LocalsToFast
    _locals_to_fast.argtypes = (ctypes.py_object, ctypes.c_int)
    _locals_to_fast.restype = None


def write_back(frame: FrameType, values: dict, f_locals=None) -> None:
    """Bind ``values`` in the scope of ``frame`` (module, class body, function, or a Scope).
    ``f_locals``: ``frame.f_locals`` where the caller has just read it (saves a second read)."""
    if f_locals is None:
        f_locals = frame.f_locals
    code = frame.f_code
    if isinstance(f_locals, Scope) or not (code.co_flags & _CO_OPTIMIZED):
        f_locals.update(values)
        return
    local, cells, free = code.co_varnames, code.co_cellvars, code.co_freevars
    for k in values:
        if k not in local and k not in cells and k not in free:  # declared `global` in the
            values = _bind_globals(frame, values)  # function: bound in its module
            break
    if _PY313:  # PEP 667: f_locals is a write-through proxy
        for name, value in values.items():
            f_locals[name] = value
        return
    if values:
        f_locals.update(values)
        _locals_to_fast(frame, 0)
    f_locals.clear()  # (see let_go_of_locals)


def _bind_globals(frame: FrameType, values: dict) -> dict:
    """Bind in ``frame``'s module the names of ``values`` that are none of its function's
    variables (it declared them ``global``); return the others."""
    code = frame.f_code
    own = set(code.co_varnames) | set(code.co_cellvars) | set(code.co_freevars)
    glob = frame.f_globals
    for k, v in values.items():
        if k not in own:
            glob[k] = v
    return {k: v for k, v in values.items() if k in own}


def let_go_of_locals(frame: FrameType) -> None:
    """Before 3.13, ``f_locals`` of a function frame is a snapshot dict cached on the frame:
    left filled, it keeps every local it was read with (the model, saved tensors) alive after
    the user deletes them. Empty it once a block has read it (write_back does, and so must a
    block that ends with an error or keeps only a copy). Emptying it is safe: the next
    ``f_locals`` access fills it again."""
    if not _PY313 and frame.f_code.co_flags & _CO_OPTIMIZED:
        frame.f_locals.clear()
