"""What a user sees of an exception that leaves a body context: their own frames.

    user_traceback(tb)     ``tb`` without the runtime's frames (see below)
    clean(exc)             rewrite ``exc``'s traceback and context in place, unless
                           ``CONFIG.APP.DEBUG`` (or ``NNSIGHT_LITE_FULL_TRACEBACK=1`` at import)
                           asks for every frame, for debugging the runtime
    same_kind(a, b)        whether two tensors agree in shape, dtype and device (the check
                           before record_reshape, on every replacement)
    record_reshape(...)    a body replaced a module value with one of another shape, dtype or
                           device: remember who, where and both (on the replacement path only)
    record_skip(...)       a body skipped a module with a value of another shape than its input
    note_reshaped(exc, r)  an error the model's forward raised after such replacements gets a
                           note naming each (the module path, the invoke, the user's line)
    note_scope_limits(exc, frame)  a body's error from it not being the caller's code (a bare
                           super(), ``del`` of a caller's name) gets a note saying what to write;
                           autograd's "modified by an inplace operation" one saying how to set a
                           value instead of editing the model's tensor in place

An error in a body travels: the body's frames, the worker greenlet that ran it, the model's
forward that handed it a value, the interleaver, the ``with`` statement's ``__exit__``. Of
those the user wrote the body (and the functions it called) and the ``with`` line. Kept:

- frames of a body and of everything it called, up to where it called back into the runtime;
- frames of the model's own forward where the error happened inside it (a later layer failing
  on an edit a body made), but not the model frames that merely led to a body being resumed;
- never nnsight_lite's frames, nor torch's ``Module.__call__`` plumbing.

The ``SkipBody`` the with-statement was handling when the body ran is not shown as the error's
context ("During handling of the above exception..."); a context the user's own code made is.
"""

from __future__ import annotations

import linecache
import os
import sys
import types

import torch

from .compat import CONFIG
from .workers import _PACKAGE_DIR, _note, _worker_main, user_location

_WORKER = _worker_main.__code__
_TENSOR = torch.Tensor
_PLUMBING = frozenset({"_wrapped_call_impl", "_call_impl", "decorate_context"})
_TORCH_FILES = (os.sep + os.path.join("torch", "nn", "modules", "module.py"),
                os.sep + os.path.join("torch", "utils", "_contextlib.py"))


def _internal(code) -> bool:
    fn = code.co_filename
    if fn.startswith(_PACKAGE_DIR):
        return True
    return code.co_name in _PLUMBING and fn.endswith(_TORCH_FILES)


def user_traceback(tb):
    """``tb`` rebuilt from the frames a user needs (see the module docstring); None if none."""
    kept = []
    model = []  # model frames since the runtime last ran: dropped if they only led to a body
    in_body = False
    while tb is not None:
        code = tb.tb_frame.f_code
        if code is _WORKER:
            model = []
            in_body = True
        elif _internal(code):
            in_body = False
        elif in_body:
            kept.append(tb)
        else:
            model.append(tb)
        tb = tb.tb_next
    kept.extend(model)
    new = None
    for entry in reversed(kept):
        new = types.TracebackType(new, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return new


_set_exc_info = None
if sys.version_info < (3, 11):  # (3.11+ re-raises the exception with its own traceback)
    try:
        import ctypes

        _obj = ctypes.py_object
        _set_exc_info = ctypes.PYFUNCTYPE(None, _obj, _obj, _obj)(
            ("PyErr_SetExcInfo", ctypes.pythonapi))
        _incref = ctypes.PYFUNCTYPE(None, _obj)(("Py_IncRef", ctypes.pythonapi))
    except (ImportError, AttributeError, OSError):  # no C API to call: a frame more shows
        _set_exc_info = None


def handled_as_is(exc: BaseException) -> bool:
    """Python 3.10: make ``exc``, with the traceback it has now, the exception the caller's
    ``except`` clause is handling, so that the clause's bare ``raise`` re-raises it without
    adding the caller's frame. 3.10's bare ``raise`` takes the traceback saved when the clause
    was entered (the unfiltered one), and ``raise exc`` adds the raising frame (an
    nnsight_lite ``__exit__``/``__enter__`` line above the user's). False where this cannot
    be done (no C API through ctypes): the caller writes ``raise exc``."""
    if _set_exc_info is None:
        return False
    tb = exc.__traceback__
    for obj in (type(exc), exc, tb):  # PyErr_SetExcInfo takes over one reference to each
        _incref(obj)
    _set_exc_info(type(exc), exc, tb)
    return True


def clean(exc: BaseException, skip_type) -> None:
    """Give ``exc`` the user's traceback, and drop the with-statement's ``skip_type`` exception
    from its context; the same for the error it was raised from (``raise ... from err``: a
    torch error the runtime explains keeps torch's frames, without the runtime's own)."""
    seen = 0
    while exc is not None and seen < 8:  # (a chain is short; a cycle cannot hold it)
        if isinstance(exc.__context__, skip_type):
            exc.__context__ = None
        if not CONFIG.APP.DEBUG:
            exc.__traceback__ = user_traceback(exc.__traceback__)
        exc = exc.__cause__
        seen += 1


def note_scope_limits(exc: BaseException, frame) -> None:
    """Note on ``exc``, raised by a body's own code, where it comes from the body running as
    its own block of code rather than as lines of ``frame`` (the code around the block):
    zero-argument ``super()`` (no class or self there) and ``del`` of a name of ``frame``."""
    if type(exc) is RuntimeError and str(exc) == "super(): no arguments":
        code = frame.f_code
        cls = _locals_of(frame).get("__class__")
        first = code.co_varnames[0] if code.co_argcount else "self"
        written = f"super({cls.__name__}, {first})" if isinstance(cls, type) else \
            "super(TheClass, self)"
        _note(exc, "nnsight_lite: a `with` block's body runs as its own block of code, so a "
              "zero-argument super() there has no class or self to go by: write "
              f"{written} in the body, or call it before the block.")
    elif type(exc) is NameError and getattr(exc, "name", None) in _locals_of(frame):
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        line = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno) if tb else ""
        if line.lstrip().startswith("del "):
            _note(exc, f"nnsight_lite: {exc.name!r} is a variable of the code around the `with` "
                  "block; its body reads it, but runs as its own block of code and cannot "
                  f"unbind it. Write `del {exc.name}` after the block.")
    elif type(exc) is NameError and getattr(exc, "name", None):
        _note_unsaved(exc, frame)
    elif type(exc) is RuntimeError and _INPLACE in str(exc):
        _note(exc, "nnsight_lite: autograd saved that tensor for the backward pass, and it was "
              "changed in place after the forward used it. In a trace that is usually a body's "
              "in-place edit of a module's value (`model.layer.output[:] = 0`, "
              "`model.layer.output[0][:, -1] += v`): the edit changes the model's own tensor. Set "
              "a new value instead, which leaves that tensor as autograd saved it: "
              "`model.layer.output = torch.zeros_like(model.layer.output)`, or edit a clone "
              "(`h = model.layer.output.clone(); h[:, -1] += v; model.layer.output = h`).")


_INPLACE = "modified by an inplace operation"  # autograd's message for a changed saved tensor


def _note_unsaved(exc: NameError, frame) -> None:
    """Where the name ``exc`` misses is one that another with-block of ``frame``'s code binds
    (its body was compiled here: capture.body's cache), or at the top level another block of
    the same namespace (a notebook's other cell), say it was dropped unsaved."""
    from .capture.body import _bodies, top_blocks

    name = exc.name
    code = frame.f_code
    here = frame.f_lineno
    found = None  # (filename, line) of the block
    for ref, body in list(_bodies.values()):
        kept = body.kept  # (None: its last run raised, and dropped every name, saved or not)
        if name in body.binds and kept is not None and name not in kept and ref() is code \
                and not body.lineno <= here <= body.end_lineno and (found is None or abs(body.lineno - here) < abs(found[1] - here)):
            found = (body.filename, body.lineno)  # (the nearest such block of this code)
    if found is None and code.co_name == "<module>":
        top = id(frame.f_globals)
        for (namespace, filename, line), dropped in reversed(list(top_blocks.items())):
            if namespace == top and name in dropped and filename != code.co_filename:
                found = (filename, line)  # (another cell's: the latest compiled; this cell's
                break  # own blocks are the ones above)
    if found is not None:
        _note(exc, f"nnsight_lite: {name!r} is bound in the body of the `with` block at "
              f"{found[0]}:{found[1]}, but a block keeps only the names it saved, so "
              f"it was dropped when that block ended. Save it there (`{name} = ....save()`), "
              "or put both blocks in `with model.session():`, which hands every name on to "
              "the next block.")


def _locals_of(frame) -> dict:
    """``frame.f_locals`` copied, its snapshot emptied again (capture.let_go_of_locals)."""
    from .capture import let_go_of_locals

    names = dict(frame.f_locals)
    let_go_of_locals(frame)
    return names


def same_kind(a, b) -> bool:
    """Whether tensors ``a`` and ``b`` agree in shape, dtype and device (what the layers after
    a replaced value depend on: a float32 steering vector added to a bfloat16 activation makes
    the next matmul fail on dtypes, far from the line that did it)."""
    return a.shape == b.shape and a.dtype is b.dtype and a.device == b.device


def _shape_change(old, new, depth: int = 2):
    """``(where, old, new)`` for the first tensor of ``new`` whose shape, dtype or device
    differs from the one at the same place in ``old`` (``where`` an index path like ``[0][1]``);
    None if none. Looks ``depth`` levels into tuples, lists and dicts (an input is
    ``(args, kwargs)``)."""
    if old is new:
        return None
    if isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor):
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) \
                and same_kind(old, new):
            return None
        return "", old, new
    if depth and isinstance(old, (tuple, list)) and isinstance(new, (tuple, list)):
        pairs = enumerate(zip(old, new))
    elif depth and isinstance(old, dict) and isinstance(new, dict):
        pairs = ((k, (old[k], new[k])) for k in old if k in new)
    else:
        return None
    for key, (a, b) in pairs:
        found = _shape_change(a, b, depth - 1)
        if found is not None:
            return f"[{key!r}]{found[0]}", found[1], found[2]
    return None


def _what(v, other=None) -> str:
    """``v`` in a note; its dtype and device too where they differ from ``other``'s."""
    if not isinstance(v, torch.Tensor):
        return f"a {type(v).__name__}"
    known = isinstance(other, torch.Tensor)
    dtype = f"{str(v.dtype).removeprefix('torch.')} " if known and v.dtype is not other.dtype \
        else ""
    device = f" on {v.device}" if known and v.device != other.device else ""
    return f"a {dtype}tensor of shape {tuple(v.shape)}{device}"


def _advice(target: str, was, now) -> str:
    """What to do about a replacement of another shape, or of the same shape but another
    dtype or device (``.to(...)`` with what the model had there)."""
    if isinstance(was, torch.Tensor) and isinstance(now, torch.Tensor) \
            and was.shape == now.shape:
        if was.is_quantized and was.dtype is not now.dtype and was.qscheme() in (
                torch.per_tensor_affine, torch.per_tensor_symmetric):  # (.to() cannot quantize)
            return (f"Quantize it as the model's was: `torch.quantize_per_tensor(value, "
                    f"{was.q_scale()}, {was.q_zero_point()}, {was.dtype})`.")
        to = [repr(str(was.device))] if was.device != now.device else []
        if was.dtype is not now.dtype:
            to.append(str(was.dtype))
        return (f"Convert it to what the model produced there (`.to({', '.join(to)})`), or "
                f"edit the value in place (`{target}[:] = ...` converts it).")
    if isinstance(was, (tuple, list)) and not isinstance(now, type(was)):
        # (an attention module's (out, weights) set to its tensor: the caller unpacks a tuple)
        form = type(was).__name__
        first = (f"{target}[0][:] = ..." if was and isinstance(was[0], torch.Tensor) else None)
        made = "(new, *{0}[1:])" if isinstance(was, tuple) else "[new, *{0}[1:]]"
        return (f"The model produced a {form} of {len(was)} there: set a {form} of the same "
                f"form (`{target} = {made.format(target)}`)"
                + (f", or edit its tensor in place (`{first}`)." if first else "."))
    if isinstance(was, torch.Tensor) and not isinstance(now, torch.Tensor):
        return (f"The model produced a tensor there: set a tensor of that shape, or edit the "
                f"value in place (`{target}[:] = ...`).")
    return (f"Give it the shape the model produced there, or edit the value in place "
            f"(`{target}[:] = ...`).")


def record_reshape(med, envoy, kind: str, old, new) -> None:
    """Called when ``med``'s body sets ``envoy``'s ``kind`` (``"output"``/``"input"``) to
    ``new`` where the model produced ``old``: if a tensor in it changes shape, keep a line
    saying so on the trace's interleaver, for :func:`note_reshaped`. (Mediator.set calls it
    only where the value is not a plain tensor of the old one's kind, see :func:`same_kind`.)"""
    found = _shape_change(old, new)
    if found is None:
        return
    where, was, now = found
    if kind == "input":  # (args, kwargs): the first argument is what `.input` names
        name = ".input" if where == "[0][0]" else f".inputs{where}"
    else:
        name = f".{kind}{where}"
    target = envoy._path + name
    _keep(med, f"nnsight_lite: this may come from a replaced value: {target}{_call(med)} was "
          f"set by {med.label()} at {user_location()} to {_what(now, was)} in place of "
          f"{_what(was, now)}. {_advice(target, was, now)}")


def record_skip(med, envoy, value) -> None:
    """Called when ``med``'s body skips ``envoy`` with ``value`` as its output: a skipped module
    mostly passes its input's shape, dtype and device on, so where ``value`` (or its first
    member) is a tensor that differs from the module's first input in any of them, keep a line
    saying so for note_reshaped."""
    args, kwargs = med.cur_value
    first = args[0] if args else next(iter(kwargs.values()), None)
    out = value[0] if isinstance(value, (tuple, list)) and value else value
    if not (isinstance(first, _TENSOR) and isinstance(out, _TENSOR)) or same_kind(first, out):
        return
    _keep(med, f"nnsight_lite: this may come from a skipped module: {envoy._path}{_call(med)} "
          f"was skipped by {med.label()} at {user_location()} with {_what(out, first)} as its "
          f"output, where its input was {_what(first, out)}. Give .skip() a value of the shape, "
          "dtype and device the module returns.")


def _call(med) -> str:
    call = med.cur_key[2] if med.cur_key is not None else 0
    return f" (call {call})" if call else ""


def _keep(med, line: str) -> None:
    inter = med.interleaver
    if not inter.reshaped:
        inter.reshaped = []
    inter.reshaped.append(line)


def note_reshaped(exc: BaseException, reshaped: list) -> None:
    """Note on ``exc``, an error from the model's forward, the replacements that changed a
    value's shape before it (none if ``exc`` came from a body: the body's line says enough)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is _WORKER:
            return
        tb = tb.tb_next
    for line in reshaped[:3]:
        _note(exc, line)
    if len(reshaped) > 3:
        _note(exc, f"nnsight_lite: ... and {len(reshaped) - 3} more replacement(s) of another shape")
