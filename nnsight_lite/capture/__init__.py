"""Turn the body of a ``with`` statement into code that runs later, and write results back.

One job per module:

    source.py   find the with-statement's source
    parsing.py  ``parse``: ast.parse that threads can call at once (CPython 3.11.0-3.11.7)
    proof.py    prove that source is the running code (its bytecode against the frame's)
    rewrite.py  what a body is compiled into (``x.save()``, ``x.grad``, nested with-blocks)
    body.py     ``find_body(frame)``: the compiled body of a call site (cached); ``names_read``
    skip.py     skipping the body's inline execution (line tracer, or a flag in compiled bodies)
    scope.py    ``Scope``, the namespace a body runs in, and ``write_back`` into the caller
    weak.py     ``keep_weakly``: cache entries keyed by a code object's identity, held weakly

The names below are what the rest of the package uses.
"""

from .body import Body, find_body, names_read
from .rewrite import (
    GRAD_NAME,
    INLINE_NAME,
    ITER_BLOCK_NAME,
    ITER_END_NAME,
    NAME_NAME,
    SAVE_NAME,
    SET_GRAD_NAME,
    IterationEnd,
    class_body_name,
)
from .scope import Scope, caller_scope, let_go_of_locals, write_back
from .skip import (
    SkipBody,
    body_runs_inline,
    cancel_inline_skip,
    restore_tracing,
    skip_body,
    skip_inline,
)

__all__ = [
    "Body", "find_body", "names_read", "GRAD_NAME", "INLINE_NAME", "ITER_BLOCK_NAME",
    "ITER_END_NAME", "NAME_NAME", "SAVE_NAME",
    "SET_GRAD_NAME", "IterationEnd", "class_body_name", "Scope", "caller_scope", "write_back",
    "let_go_of_locals",
    "SkipBody", "body_runs_inline", "cancel_inline_skip", "restore_tracing", "skip_body",
    "skip_inline",
]
