"""Whether a call's result is entered by a ``with`` statement, read from the caller's bytecode.

    _called_as_context(frame)   whether the call running in ``frame`` is ``with <call>:``'s

The patched ``Tensor.backward`` (backward.py) asks it to tell ``with loss.backward():`` from a
plain ``loss.backward()``, and ``LanguageModel.generate`` (language.py) ``with
model.generate(...):`` from ``ids = model.generate(...)``. The call is immediately followed by
the with-statement's setup instruction. The look-up is cached per code object (held weakly), so
a plain call pays about a microsecond.
"""

from __future__ import annotations

import dis

from .capture.weak import keep_weakly

_CALLS = frozenset({"CALL", "CALL_KW", "CALL_FUNCTION", "CALL_METHOD", "CALL_FUNCTION_KW",
                    "CALL_FUNCTION_EX", "PRECALL"})
_WITH = frozenset({"BEFORE_WITH", "SETUP_WITH"})
#: id(code) -> (weak reference to that code, its offsets): the code is held weakly, as plain
#: backward keeps nothing of its caller (a step function a notebook defines again goes)
_with_calls: dict = {}


def _with_call_offsets(code) -> frozenset:
    """Offsets of call instructions whose result is entered as a context manager.

    Every offset from the call up to the with-setup is included: while the call runs, the
    frame's ``f_lasti`` may point at one of the call's inline cache entries (3.11+).
    """
    found = set()
    prev = None
    for ins in dis.get_instructions(code):
        if ins.opname in _WITH and prev is not None:
            found.update(range(prev, ins.offset, 2))
        prev = ins.offset if ins.opname in _CALLS else None
    return frozenset(found)


def _called_as_context(frame) -> bool:
    """Whether the call ``frame`` is making (at ``f_lasti``) is entered by a with statement."""
    code = frame.f_code
    entry = _with_calls.get(id(code))
    if entry is not None and entry[0]() is code:
        return frame.f_lasti in entry[1]
    if len(_with_calls) > 4096:
        _with_calls.clear()
    offsets = _with_call_offsets(code)
    keep_weakly(_with_calls, id(code), code, offsets)
    return frame.f_lasti in offsets
