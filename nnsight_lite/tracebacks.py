"""What a user sees of an exception that leaves a body context: their own frames.

    user_traceback(tb)     ``tb`` without the runtime's frames (see below)
    clean(exc)             rewrite ``exc``'s traceback and context in place, unless
                           ``CONFIG.APP.DEBUG`` (or ``NNSIGHT_LITE_FULL_TRACEBACK=1`` at import)
                           asks for every frame, for debugging the runtime

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

import os
import types

from .compat import CONFIG
from .workers import _PACKAGE_DIR, _worker_main

_WORKER = _worker_main.__code__
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


def clean(exc: BaseException, skip_type) -> None:
    """Give ``exc`` the user's traceback, and drop the with-statement's ``skip_type`` exception
    from its context."""
    if isinstance(exc.__context__, skip_type):
        exc.__context__ = None
    if not CONFIG.APP.DEBUG:
        exc.__traceback__ = user_traceback(exc.__traceback__)
