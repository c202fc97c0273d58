"""``keep_weakly``: a table entry that goes when the object it was made for does.

Several caches are keyed by a code object's identity (code objects compare equal without their
file, so equal code from another cell or file would read another's entry): body.py's compiled
bodies, source.py's body sources, instrument.py's instrumented forwards, with_calls.py's
with-call offsets. Each holds its code weakly, as ``(weak reference, value)``: a look-up checks
``entry[0]() is code`` in line (they are on hot paths), and the entry is dropped when the code
goes, unless the key holds another code's entry by then (an id reused).
"""

from __future__ import annotations

import weakref


class _KeyedRef(weakref.ref):
    __slots__ = ("key", "table")


def _forget(ref: _KeyedRef) -> None:
    """Drop the entry of an object that is gone (the weak reference's callback)."""
    table = ref.table
    entry = table.get(ref.key)
    if entry is not None and entry[0] is ref:
        del table[ref.key]


def keep_weakly(table: dict, key, obj, value) -> None:
    """``table[key] = (weak reference to obj, value)``, removed when ``obj`` is freed."""
    ref = _KeyedRef(obj, _forget)
    ref.key = key
    ref.table = table
    table[key] = (ref, value)
