"""Running one shipped request on the server, with the runtime as it is.

    execute(model, request, ...)   run the request's with-statement against ``model``; the
                                   reply: saved names, the traced call's result, printed text,
                                   or the error (type, message, the user's frames)
    compiled(block)                the shipped source compiled once, registered in linecache
                                   under a synthetic filename so capture finds it
    Deadline                       stops a body that runs past its time limit

The shipped with-statement is compiled as module-level code whose globals are the caller's
values (references to the model already resolved to the served model's Envoys). Running it
enters ``model.trace(...)`` exactly as the user's file did: capture finds the block's source in
linecache, the body runs interleaved with the forward, and write-back binds the saved names in
those globals, which are what the reply carries.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import copy
import ctypes
import hashlib
import io
import linecache
import threading
import traceback
import warnings
from collections import OrderedDict

from ..capture.body import forget_namespace
from ..capture.parsing import fix_locations, parse
from ..capture.rewrite import rewrite_body
from ..capture.source import remember_source, with_at
from ..errors import PolicyError, RemoteTimeoutError
from ..mediator import _MISSING
from ..tracebacks import _internal
from .hook import serving

_CODES: OrderedDict = OrderedDict()  # (filename, source) -> (code, synthetic filename)
_CODES_MAX = 256
_FRAMES_MAX = 64  # user frames an error's reply carries (the innermost; a deep recursion)
# what a body may raise, to go back to its client: exit() / sys.exit() and KeyboardInterrupt
# too (raised out of the replica's serving thread, they stopped its event loop: the request
# and every later one waited for ever)
USER_ERRORS = (Exception, SystemExit, KeyboardInterrupt)
_CHAIN_MAX = 4  # exceptions an error's reply carries from its chain (raise ... from ...)
_WARNINGS_MAX = 100  # distinct warnings a reply carries
_KEPT_MAX = 10_000  # distinct warnings a replica keeps while a request (or batch) runs


def compiled(source: str, filename: str):
    """``source`` compiled under a synthetic filename that names the user's file (cached)."""
    key = (filename, source)
    hit = _CODES.get(key)
    if hit is not None:
        _CODES.move_to_end(key)
        return hit
    digest = hashlib.sha1(f"{filename}\0{source}".encode()).hexdigest()[:10]
    synthetic = f"<remote {digest} {filename}>"
    # mtime None: linecache.checkcache keeps the entry (it has no file to compare with)
    linecache.cache[synthetic] = (len(source), None, source.splitlines(True), synthetic)
    code = compile(source, synthetic, "exec", dont_inherit=True)
    hit = _CODES[key] = (code, synthetic)
    if len(_CODES) > _CODES_MAX:
        _, (_, old) = _CODES.popitem(last=False)
        linecache.cache.pop(old, None)
    return hit


def compile_body(source: str, filename: str, lineno: int, tail: "list | None" = None):
    """The body of the with-statement at ``lineno`` of ``source``, compiled as capture compiles
    a body (``x.save()`` and nested blocks rewritten), plus the statements ``tail``."""
    tree = parse(source, filename)
    node = with_at(tree, lineno)
    stmts = rewrite_body(copy.deepcopy(node.body)) + list(tail or ())
    module = ast.Module(body=stmts, type_ignores=[])
    fix_locations(module)
    code = compile(module, filename, "exec", dont_inherit=True)
    remember_source(code, source.splitlines(True))
    return code


def execute(request: dict, values: dict, *, time_limit: float | None = None, policy=None) -> dict:
    """Run one request; return ``{"saved", "result", "stdout", "stderr", "error"}`` (see the
    module docstring)."""
    source, filename = request["source"], request["filename"]
    out, err = io.StringIO(), io.StringIO()
    reply = {"saved": {}, "result": _MISSING, "stdout": "", "stderr": "", "error": None}
    caught: list = []
    synthetic = filename
    scope = None
    try:
        if policy is not None:
            policy(source, filename, values)
        code, synthetic = compiled(source, filename)
        scope = {"__builtins__": builtins, "__name__": "__nnsight_remote__", **values}
        before = dict(scope)
        # (stderr: warnings, logging's last-resort handler. The Deadline innermost: a stop
        # delivered as the block ends lands in its __exit__ or before it, never in another
        # manager's __exit__, which would then not restore what it changed: sys.stderr left
        # redirected to this request's buffer on the replica)
        with serving(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                kept_warnings(caught), Deadline(time_limit):
            exec(code, scope)
        reply["saved"], reply["result"] = _collect(scope, before)
    except _Stopped as exc:
        stopped = RemoteTimeoutError(
            f"the remote body ran past its time limit of {time_limit:g} s and was stopped; "
            "the replica is serving other requests again (raise the limit with "
            "connect(..., time_limit=...) up to the deployment's, or do less per request)")
        stopped.__traceback__ = exc.__traceback__
        reply["error"] = describe(stopped, synthetic, filename)
    except USER_ERRORS as exc:  # every failure goes back to the client
        reply["error"] = describe(exc, synthetic, filename)
    finally:
        if scope is not None:  # (its blocks: a later request's dict may get its id)
            forget_namespace(scope)
    reply["stdout"], reply["stderr"] = out.getvalue(), err.getvalue()
    reply["warnings"] = warning_records(caught, synthetic, filename)
    if reply["result"] is _MISSING:  # (a sentinel: pickled, it would arrive as another object)
        del reply["result"]
    return reply


@contextlib.contextmanager
def kept_warnings(into: list):
    """Record in ``into`` the warnings issued while the block runs, each as ``(invoke,
    category, message, filename, line)``, once (at most ``_KEPT_MAX`` distinct ones): every
    one, whatever the replica's filters (the client's filters decide what shows;
    see ``warning_records`` and client.warn_again); ``invoke`` is the number of the invoke
    whose body issued it (None: the model's code, outside any body)."""
    from greenlet import getcurrent

    seen = set()  # (a warning in a loop: kept once, so a long request's records stay small)

    def keep(message, category, filename, lineno, file=None, line=None):
        body = getattr(getcurrent(), "mediator", None)
        invoke = None if body is None else body.index - len(body.interleaver.edits)
        record = (invoke, category, str(message), filename, lineno)
        if record not in seen and len(seen) < _KEPT_MAX:
            seen.add(record)
            into.append(record)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = keep  # (put back as it was by catch_warnings)
        yield


def warning_records(caught: list, synthetic: str, filename: str, invoke=None) -> list:
    """``caught`` (kept_warnings) as a reply carries them: ``(category's module, its qualname,
    message, filename, line)``, the body's under the user's filename; with ``invoke``, only
    that invoke's and the model's own (a request run as one invoke of a shared forward);
    repeats of one warning at one place once, at most ``_WARNINGS_MAX``."""
    records: dict = {}
    for owner, cat, message, where, line in caught:
        if invoke is not None and owner is not None and owner != invoke:
            continue
        where = filename if where == synthetic else where
        records.setdefault((cat.__module__, cat.__qualname__, message, where, line))
        if len(records) == _WARNINGS_MAX:
            break
    return list(records)


def _collect(scope: dict, before: dict):
    from ..context import BodyContext

    saved = {}
    result = _MISSING
    for name, value in scope.items():
        if isinstance(value, BodyContext):
            got = getattr(value, "_result", _MISSING)
            if got is not _MISSING:
                result = got
            continue
        if name.startswith("__") or before.get(name, _MISSING) is value:
            continue
        saved[name] = value
    return saved, result


def describe(exc: BaseException, synthetic: str, filename: str, _depth: int = 0) -> dict:
    """What the client needs to raise ``exc`` again: the exception itself (pickled if it can
    be), its type's name, its message, the user's file:line where the body raised it, the
    user's frames from the body down (the client's traceback shows them; the body's own
    frames unnamed: they are named after the function the with-statement is in), and the
    exceptions it was raised from or while handling (``cause``, ``context``), described alike."""
    line, frames = _frames(exc.__traceback__, synthetic, filename)
    text = ""
    if not _depth and not isinstance(exc, PolicyError):  # (refused before anything ran: the
        # replica's frames are noise; a chained exception is in its chain's text already)
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    message = str(exc)
    if synthetic:
        text = text.replace(synthetic, filename)
        message = message.replace(synthetic, filename)
        _fix_args(exc, synthetic, filename)
    cause, context = exc.__cause__, exc.__context__
    exc.__traceback__ = None
    exc.__context__ = exc.__cause__ = None
    import cloudpickle

    pickled = parts = None
    try:
        pickled = cloudpickle.dumps(exc)
        cloudpickle.loads(pickled)
    except Exception:  # noqa: BLE001 - one pickle cannot rebuild (an __init__ of its own)
        try:  # its class, args and attributes, for the client to put together without __init__
            parts = cloudpickle.dumps((type(exc), exc.args, dict(getattr(exc, "__dict__", {}))))
        except Exception:  # noqa: BLE001 - what it holds cannot be pickled: type and text
            parts = None
    described = {
        "pickled": pickled,
        "parts": parts,
        "module": type(exc).__module__,
        "qualname": type(exc).__qualname__,
        "message": message,
        "location": f"{filename}:{line}" if line is not None else None,
        "frames": frames,
        "traceback": text,
        "suppress_context": exc.__suppress_context__,
    }
    if _depth < _CHAIN_MAX:
        if cause is not None:
            described["cause"] = describe(cause, synthetic, filename, _depth + 1)
        if context is not None:
            described["context"] = "cause" if context is cause else \
                describe(context, synthetic, filename, _depth + 1)
    return described


def _frames(tb, synthetic: str, filename: str):
    """The user's last line in the shipped block, and the user's frames in ``tb`` from the
    body down as (file, line, function), not the shipped with-statement's own frame."""
    line = None
    frames = []
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        if code.co_filename == synthetic:
            line = tb.tb_lineno
            top = frame.f_back is not None and frame.f_back.f_code is execute.__code__
            if not top:  # (the body's frames are named after the caller's function)
                frames.append((filename, tb.tb_lineno,
                               None if code.co_name == "<module>" else code.co_name))
        elif frames and not _internal(code):
            frames.append((code.co_filename, tb.tb_lineno, code.co_name))
        tb = tb.tb_next
    return line, frames[-_FRAMES_MAX:]


def _fix_args(exc, synthetic, filename):
    """Messages the runtime wrote name the synthetic file: name the user's instead."""
    args = getattr(exc, "args", ())
    if args and isinstance(args[0], str) and synthetic in args[0]:
        exc.args = (args[0].replace(synthetic, filename),) + tuple(args[1:])


# --------------------------------------------------------------------------- time limit

# raise an exception in a thread (never called with NULL to cancel one: see Deadline)
_set_async_exc = ctypes.pythonapi["PyThreadState_SetAsyncExc"]
_set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)


class _Stopped(RemoteTimeoutError):
    """Raised into the serving thread when the deadline passes (created without arguments)."""

    def __init__(self, *args):
        super().__init__(*(args or ("the remote body ran past the request's time limit and "
                                    "was stopped",)))


class Deadline:
    """``with Deadline(seconds):`` raises RemoteTimeoutError in this thread when time is up.

    The exception is raised asynchronously (at the next bytecode the thread runs, in whatever
    body or forward is running), so pure-Python loops stop too; the trace then cleans up as
    after any error in a body. A pending exception not yet delivered when the block ends is
    taken there (``_take_pending``), so it never reaches the next request.

    Nothing is cancelled with ``PyThreadState_SetAsyncExc(thread, NULL)``: on CPython 3.11 that
    call raises the interpreter's "async exception pending" flag even though no exception is
    pending, and only delivering a real one lowers it again. With the flag stuck, every Python
    function entered while a trace function is set (``sys.settrace``: a with-statement's header
    after a trace's ``__enter__`` set its body skipper, ``with model.trace(x), other():``, or a
    debugger or coverage) spins forever in the eval loop on its first instruction, holding the
    GIL; so every request after the first on a replica with a time limit could hang."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self._lock = threading.Lock()
        self._running = False
        self._fired = False
        self._timer = None

    def __enter__(self):
        if self.seconds is None:
            return self
        self._thread = threading.get_ident()
        self._running = True
        self._timer = threading.Timer(self.seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def _fire(self):
        with self._lock:
            if self._running:
                self._fired = True
                _set_async_exc(self._thread, _Stopped)

    def __exit__(self, *exc):
        if self._timer is None:
            return False
        with self._lock:
            self._running = False  # (the timer cannot fire from here on)
            if self._fired:  # its _Stopped may not have been delivered yet
                _take_pending(self._thread)
        self._timer.cancel()
        return False


class _Taken(BaseException):
    """What ``_take_pending`` raises in its own thread, and catches at once."""


def _take_pending(thread: int) -> None:
    """Drop an async exception ``thread`` (this one) may have pending: replace it with
    ``_Taken`` and let it be delivered here, which also lowers the interpreter's pending flag.

    Nothing is cancelled with ``PyThreadState_SetAsyncExc(thread, NULL)``, which leaves CPython
    3.11's flag raised, after which the replica spins (see Deadline). The eval loop delivers a
    pending async exception at every backward jump, so the loop below ends at its first;
    should it ever run to its end, RuntimeError says so (the exception may then still be
    pending) instead of a cancel that would hang the replica."""
    try:
        if not _set_async_exc(thread, _Taken):
            return  # (no such thread: nothing of ours can be pending in it)
        for _ in range(1_000_000):  # delivered at the first backward jump
            pass
    except _Taken:
        return
    raise RuntimeError(  # pragma: no cover - see the docstring
        "the time limit's stop was not delivered to the request's thread; it may still be "
        "pending there (PyThreadState_SetAsyncExc)"
    )
