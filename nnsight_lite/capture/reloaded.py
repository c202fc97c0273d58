"""The source of a function IPython's ``%autoreload`` recompiled on its own.

    reloaded_defs(code, lines)   candidate sources for ``code``: its definition in ``lines``
                                 (the module file as it is now), as ``%autoreload`` compiled it

IPython 9's ``%autoreload 2`` (its "deduperreload", the default where an edit changed only
function bodies) patches an edited function in place with code compiled from
``ast.unparse`` of the new definition alone, under the module's filename. The running code's
line numbers then count from that text (line 1 is the ``def``, or its first decorator), not
from the file, so the file at those lines is other code. A method is compiled the same way
inside ``class __autoreload_class__:``. The text is rebuilt here from the file in the same
way; source.py proves it against the running code like every other candidate, so a definition
that is not the running code (the file edited again since the reload) is never used.
"""

from __future__ import annotations

import ast
import textwrap
import warnings

from .parsing import parse

_CLASS = "__autoreload_class__"  # the class IPython compiles an edited method in


def reloaded_defs(code, lines):
    """``(text lines)`` for each definition in ``lines`` that ``%autoreload`` could have
    compiled ``code`` (or the function around it) from; nothing where none can be."""
    qualname = getattr(code, "co_qualname", code.co_name)  # (3.10: no qualname, try both)
    parts = qualname.split(".")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = parse("".join(lines))
    except (SyntaxError, ValueError):
        return
    if parts[0] != _CLASS:
        for node in tree.body:
            if _is_def(node, parts[0]):
                yield _text(node).splitlines(True)
    method = parts[1] if parts[0] == _CLASS and len(parts) > 1 else parts[0]
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef):
            for node in cls.body:
                if _is_def(node, method):
                    text = f"class {_CLASS}:\n" + textwrap.indent(_text(node), "    ")
                    yield text.splitlines(True)


def _is_def(node, name: str) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name


def _text(node) -> str:
    """The definition as ``%autoreload`` writes it before compiling it."""
    return textwrap.dedent(ast.unparse(node))
