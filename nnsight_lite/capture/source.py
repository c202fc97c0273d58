"""Finding a with-statement's source, and proving it is the code that is running.

    find_with(frame, what)   the ``ast.With`` the frame is entering and the lines it came from

Where the source comes from, in order (the first that proves to be the running code wins):

1. for code compiled from a body, the source that body was compiled from (already proven);
2. ``linecache`` (files, modules, Jupyter/IPython cells, anything registered there), as cached;
3. the file on disk again, if linecache held an older copy of it (a module reloaded after an
   edit);
4. the ``python -c`` program, for code named ``<string>`` in a ``-c`` run (``sys.orig_argv``);
5. for a function IPython's ``%autoreload`` recompiled from its definition alone (its line
   numbers count from that text), the definition rebuilt from the file (reloaded.py);
6. the cell of an enclosing IPython cell magic (``%%time``, ``%%timeit``: they compile the
   cell under names such as ``<timed exec>`` that linecache does not know).

The proof (proof.py): the with-statement found in the candidate source is compiled on its own and its
bytecode compared with the instructions on the same lines of the frame's code object. The
comparison is exact in what runs (operations, names, attributes, constants, nested functions)
and ignores only what the enclosing scope changes (a name loaded as a global, a local or a
closure cell; jump offsets; the implicit ``return None``), so a body written in a module, a
function, a class body or a template (``%%timeit`` wraps the cell in a function) is recognised,
and so is one whose enclosing function an import hook rewrote elsewhere (pytest's asserts).
A file edited after import, or an ``exec`` string that shares a filename and line with other
source, fails it and gives ``SourceUnavailableError``; nothing else is ever compiled. The check
runs once per call site (bodies are cached per code object and instruction, see body.py).
"""

from __future__ import annotations

import __future__
import ast
import dis
import linecache
import os
import sys
import warnings
from collections import OrderedDict
from types import CodeType, FrameType

from ..errors import NoSourceError, SourceUnavailableError, WithBlockNotFoundError
from .parsing import parse
from .proof import code_signature, compiled_variants
from .reloaded import reloaded_defs
from .weak import keep_weakly

#: the future-feature bits of ``co_flags``, which compile() takes as flags
_FUTURE_FLAGS = 0
for _name in __future__.all_feature_names:
    _FUTURE_FLAGS |= getattr(__future__, _name).compiler_flag

_trees: OrderedDict = OrderedDict()  # (filename, source) -> parsed tree (or the SyntaxError)
_TREES = 32


def _parse(source: str, filename: str):
    key = (filename, source)
    tree = _trees.get(key)
    if tree is None:
        try:
            with warnings.catch_warnings():  # the import already showed the user any
                warnings.simplefilter("ignore")  # SyntaxWarning (say, an invalid escape)
                tree = parse(source, filename)
        except SyntaxError as exc:
            tree = exc
        _trees[key] = tree
        if len(_trees) > _TREES:
            _trees.popitem(last=False)
    return tree


def with_at(tree: ast.AST, lineno: int):
    """The innermost ``with`` statement whose header spans ``lineno``."""
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and node.lineno <= lineno:
            header_end = max(node.lineno, node.body[0].lineno - 1)
            if lineno <= header_end and (best is None or node.lineno >= best.lineno):
                best = node
    return best


def find_with(frame: FrameType, what: str):
    """The ``ast.With`` statement ``frame`` is entering, and the source lines it was found in,
    proven to be the code that runs (see the module docstring); else SourceUnavailableError."""
    code = frame.f_code
    filename = code.co_filename
    lineno = frame.f_lineno
    tried = []  # (where the candidate came from, why it is not the running code)
    for origin, lines, proof in _candidates(frame, filename):
        why = _why_not(lines, frame, filename, lineno, proof)
        if not isinstance(why, str):
            return why, lines
        tried.append((origin, why))
    if not _entered_by_with(frame):
        raise WithBlockNotFoundError(
            f"`...{what}(...)` was entered at {filename}:{lineno} by calling __enter__() "
            f"directly; nnsight_lite runs the body of a with-statement, so use it as one: "
            f"`with ...{what}(...):` followed by the indented code to run."
        )
    raise _unavailable(filename, lineno, what, tried, frame.f_globals)


#: the instructions that enter a context manager for a with-statement (3.10: SETUP_WITH)
_WITH_OPS = frozenset(dis.opmap[n] for n in ("BEFORE_WITH", "SETUP_WITH", "BEFORE_ASYNC_WITH",
                                             "SETUP_ASYNC_WITH") if n in dis.opmap)


def _entered_by_with(frame: FrameType) -> bool:
    """Whether ``frame``'s last instruction entered a with-statement (True where this Python's
    instructions are not known: 3.14 enters one with a plain call)."""
    if sys.version_info >= (3, 14) or not _WITH_OPS:
        return True
    code = frame.f_code.co_code
    i = frame.f_lasti
    return not 0 <= i < len(code) or code[i] in _WITH_OPS


#: id(compiled body, or a function in it) -> (weak reference to that code, the proven source
#: lines it was compiled from): a with-block nested in a body runs in a worker greenlet, whose
#: frames do not lead back to the caller's (an IPython magic's cell, say), so the body
#: remembers its source. Keyed by identity: code objects compare equal without their file, so
#: a body compiled again from the same text elsewhere (a function defined again in another
#: cell or file) would read, and replace, another body's entry, which then went with that body.
_body_sources: "dict[int, tuple]" = {}


def remember_source(code: CodeType, lines: list) -> None:
    """Record that ``code`` (a compiled body) and the code objects in it come from ``lines``."""
    stack = [code]
    while stack:
        c = stack.pop()
        keep_weakly(_body_sources, id(c), c, lines)
        stack.extend(k for k in c.co_consts if isinstance(k, CodeType))


def body_source(code: CodeType) -> "list | None":
    """The source lines ``code`` (a compiled body, or a function in it) was compiled from, or
    None where it is not a compiled body."""
    entry = _body_sources.get(id(code))
    if entry is None or entry[0]() is not code:
        return None
    return entry[1]


def _candidates(frame: FrameType, filename: str):
    remembered = body_source(frame.f_code)
    if remembered is not None:
        yield "body", remembered, None
    program = _dash_c_program() if filename == "<string>" else None
    lines = linecache.getlines(filename, frame.f_globals)
    if lines and program is not None and _same_text(lines, program):
        # Python 3.13+ registers the -c program there itself; exec'd strings are named
        # '<string>' too, so it is still a guess: tried below as the -c program (if it is
        # not the running code, the code has no source and may run in place: NoSourceError)
        lines = []
    if lines:
        yield "linecache", lines, None
    if lines and not (filename.startswith("<") and filename.endswith(">")):
        linecache.checkcache(filename)  # an older copy of a file since edited: read it again
        fresh = linecache.getlines(filename, frame.f_globals)
        if fresh and fresh != lines:
            yield "file", fresh, None
        for text in reloaded_defs(frame.f_code, fresh or lines):
            yield "autoreload", text, None
    if program is not None:
        yield "-c", program.splitlines(True), None
    for cell, proof in _magic_cells(frame):
        yield "magic", cell.splitlines(True), proof


def _dash_c_program():
    """The program of ``python -c PROGRAM``, or None when this process was not started so."""
    argv = getattr(sys, "orig_argv", None)  # 3.10+
    if not argv or sys.argv[:1] != ["-c"]:
        return None
    args = iter(argv[1:])
    for arg in args:
        if arg == "-c":
            return next(args, None)
        if not arg.startswith("-") or arg in ("-", "--") or arg.startswith("--"):
            return None
        letters = arg[1:]
        for i, letter in enumerate(letters):
            if letter in "WX":  # an option taking a value: the rest of the word, or the next one
                if i == len(letters) - 1:
                    next(args, None)
                break
            if letter == "c":
                return letters[i + 1:] or next(args, None)
            if letter == "m":
                return None
    return None


def _same_text(lines: list, text: str) -> bool:
    """Whether ``lines`` hold ``text``, up to line endings and trailing blank lines (Python
    3.13 registers a -c program in linecache with a newline added)."""
    a, b = "".join(lines).splitlines(), text.splitlines()
    while a and not a[-1]:
        a.pop()
    while b and not b[-1]:
        b.pop()
    return a == b


def _magic_cells(frame: FrameType):
    """``(text, proof)`` for each enclosing IPython cell magic (``%%time``, ``%%timeit``...):
    the cell as IPython transformed it and raw, for code those magics compiled under a name of
    their own. ``proof`` is the parsed cell the magic compiled ``frame``'s code from, when that
    is known (``%%timeit``), else None."""
    if "IPython" not in sys.modules:
        return
    f = frame.f_back
    depth = 0
    while f is not None and depth < 64:
        depth += 1
        if "IPython" in f.f_code.co_filename and "cell" in f.f_code.co_varnames:
            f_locals = f.f_locals
            cell = f_locals.get("cell")
            if isinstance(cell, str):
                proof = None
                compiled = f_locals.get("code")
                if (isinstance(compiled, CodeType) and frame.f_code in compiled.co_consts
                        and isinstance(f_locals.get("ast_stmt"), ast.Module)):
                    # %%timeit wraps the parsed cell (ast_stmt) in a function template whose
                    # own statements share line numbers with the cell's: prove by the tree
                    proof = f_locals["ast_stmt"]
                expr = f_locals.get("expr")
                if isinstance(expr, str):
                    yield expr, proof
                try:
                    from IPython import get_ipython

                    shell = get_ipython()
                    if shell is not None:
                        yield shell.transform_cell(cell), proof
                except Exception:  # pragma: no cover - IPython's own failure: try the raw cell
                    pass
                yield cell, proof
        f = f.f_back


def _why_not(lines, frame: FrameType, filename: str, lineno: int, proof=None):
    """The with node when ``lines`` are the running code at ``lineno``; else a reason (str).

    ``proof``: the tree the frame's code was compiled from, when known: then the parsed
    ``lines`` must equal it, line numbers included."""
    source = "".join(lines)
    tree = _parse(source, filename)
    if isinstance(tree, SyntaxError):
        return f"it does not parse ({tree.msg}, line {tree.lineno})"
    node = with_at(tree, lineno)
    if node is None:
        return f"it has no `with` statement at line {lineno}"
    if node.body[0].lineno == node.lineno:  # refused later with its own error (body.py)
        return node
    if proof is not None:
        if ast.dump(tree, include_attributes=True) == ast.dump(proof, include_attributes=True):
            return node
        return "it is not the cell the magic compiled"
    code = frame.f_code
    end = node.end_lineno or node.lineno
    running = code_signature(code, node.lineno, end)
    flags = code.co_flags & _FUTURE_FLAGS
    rewritten = any(n.startswith("__nnsight_lite_") for n in code.co_names)
    try:
        for compiled in compiled_variants(tree, source, node, filename, flags, rewritten,
                                           frame.f_globals):
            if compiled is not None and code_signature(compiled, node.lineno, end) == running:
                return node
    except SyntaxError:  # `return`, `yield`, `break` in the body: body.py refuses it clearly
        return node
    return f"its `with` statement at lines {node.lineno}-{end} is not the code that is running"


# --------------------------------------------------------------------------- the error


def _unavailable(filename: str, lineno: int, what: str, tried,
                 module_globals=None) -> SourceUnavailableError:
    head = f"cannot run this `with ...{what}(...)` block at {filename}:{lineno}: "
    if all(origin in ("-c", "magic") for origin, _ in tried):  # only guesses, none right
        return NoSourceError(
            head + f"there is no source for {filename!r}. nnsight_lite reads the block's source "
            "to run it interleaved with the model, and code typed into a bare Python REPL "
            "(before 3.13), piped through stdin or passed to exec() as a plain string leaves "
            "none. Put the code in a file, a Jupyter/IPython cell or a `python -c` program, or "
            "compile it with a filename registered in linecache."
            + "".join(f" (The {_GUESSES[origin]} was tried: {why}.)" for origin, why in tried)
        )
    reasons = "; ".join(f"{origin}: {why}" for origin, why in tried if origin != "autoreload")
    if filename.startswith("<ipython-input") or _is_ipykernel_cell(filename):
        todo = ("The cell was changed after this code was compiled from it: re-run the cell "
                "(and the cells that define the functions it calls).")
    elif os.path.exists(filename):
        todo = ("The file was edited after the module was imported: reload the module "
                "(importlib.reload, or restart the program/kernel) so the running code and the "
                "file agree.")
    elif _loaded_for(filename, module_globals):
        todo = (f"No file {filename!r} exists: linecache took for it the source of module "
                f"{module_globals.get('__name__')!r} (through the __loader__ of the globals this "
                "code runs with, as when exec() is given a module's globals), which is other "
                "code. Register the code's own source in linecache under that filename, write "
                "it to that file, or run it with globals that have no __loader__.")
    else:
        todo = (f"Other source is registered under the same name {filename!r}: compile each "
                "piece of code under a filename of its own (and register that source in "
                "linecache), or put the code in a file.")
    return SourceUnavailableError(
        head + f"the source found for it is not the code that is running ({reasons}), so its "
        f"body cannot be compiled from it without running a different block. {todo}"
    )


def _loaded_for(filename: str, module_globals) -> bool:
    """Whether linecache's lines for ``filename``, a file that does not exist, may be another
    module's: read through the ``__loader__`` of the globals the code runs with (linecache
    asks it for the source of ``__name__``, whatever the filename)."""
    if not module_globals or "__name__" not in module_globals:
        return False
    loader = module_globals.get("__loader__")
    if loader is None:
        spec = module_globals.get("__spec__")
        loader = getattr(spec, "loader", None)
    return hasattr(loader, "get_source") and module_globals.get("__file__") != filename


_GUESSES = {"-c": "`python -c` program", "magic": "cell of the enclosing IPython magic"}


def _is_ipykernel_cell(filename: str) -> bool:
    return "ipykernel_" in filename and filename.endswith(".py")
