"""``parse``: ``ast.parse`` that two threads can call at once on every Python we support;
``fix_locations``: ``ast.fix_missing_locations`` that leaves no garbage.

CPython 3.11.0-3.11.7 (and 3.12.0-3.12.1 builds of the same code) keep the depth counter of
the C-to-Python AST conversion in state shared by all threads; when the garbage collector runs
Python code part way through one thread's ``ast.parse`` (a gc callback, a ``__del__``), another
thread's parse moves that counter and the first fails with a spurious ``SystemError: AST
constructor recursion depth mismatch`` (CPython gh-106905, fixed in 3.11.8 and 3.12.2). Two
threads making their first traces at once both parse their source here, so nnsight_lite's own
parses take turns under a lock, and a parse that still meets the error (another library
parsing on another thread meanwhile) is made again: parsing is pure.
"""

from __future__ import annotations

import ast
from threading import RLock

# (reentrant: a gc callback in this thread that parses, through nnsight_lite, must not wait on
# its own parse)
_lock = RLock()
_TRIES = 5


def parse(source, filename: str = "<unknown>", mode: str = "exec", **kwargs) -> ast.AST:
    """``ast.parse(source, filename, mode, **kwargs)``, safe to call from several threads."""
    for attempt in range(_TRIES):
        try:
            with _lock:
                return ast.parse(source, filename, mode, **kwargs)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc) or attempt == _TRIES - 1:
                raise
    raise AssertionError("unreachable")  # (the last attempt returns or raises)


_SPANS = (("lineno", False), ("col_offset", False), ("end_lineno", True),
          ("end_col_offset", True))


def fix_locations(node: ast.AST) -> ast.AST:
    """What ``ast.fix_missing_locations`` does (each node without a location takes its
    parent's), walked with a stack: the standard one recurses through a nested function that
    refers to itself, a reference cycle per call that only the garbage collector frees (the
    first trace at each new call site compiled its body with it)."""
    todo = [(node, (1, 0, 1, 0))]
    while todo:
        item, inherited = todo.pop()
        here = list(inherited)
        fields = item._attributes
        for i, (name, optional) in enumerate(_SPANS):
            if name in fields:
                value = getattr(item, name, None)
                if value is None and (optional or not hasattr(item, name)):
                    setattr(item, name, here[i])
                else:
                    here[i] = value
        here = tuple(here)
        todo.extend((child, here) for child in ast.iter_child_nodes(item))
    return node

