"""The client side: connect to a cluster, ship a captured block, bind what comes back.

    connect(address, ...)   join a Ray cluster; return a Backend (the default for remote=True)
    Backend                 where remote traces run: a served model's replicas, with limits
    LocalBackend            ``remote="local"``: shipped and answered in this process
    run_remote(ctx, frame)  what a trace / session with a backend does at the end of its block

Example::

    from nnsight_lite import remote
    from nnsight_lite.models import smollm2

    remote.connect("auto")                          # the cluster `ray start --head` made
    model = smollm2()                               # meta device: no weights here
    with model.trace("The Eiffel Tower is in the city of", remote=True):
        logits = model.lm_head.output.save()        # computed on a replica; only this returns
"""

from __future__ import annotations

import itertools
import sys
import threading
import types

import torch

from ..errors import RemoteError, RemoteTimeoutError
from ..mediator import _MISSING
from ..workers import _note
from . import wire
from .server import NAMESPACE, default_name, replicas_of, served

_default: "Backend | None" = None
_SLACK = 30.0  # seconds the client waits past the time limit before giving up on a reply


class Backend:
    """Where remote traces run: the replicas serving ``name`` on the connected Ray cluster.

    Example::

        backend = remote.Backend("gpt2", time_limit=30)
        with model.trace(x, backend=backend):
            h = model.transformer.h[0].output.save()

    ``name``: the served model (default: the name the traced model maps to: a LanguageModel's
    directory name or hub id). ``time_limit`` (seconds) and ``max_bytes`` ask for less than the
    deployment allows. Requests go to the replicas in turn.
    """

    def __init__(self, name: str | None = None, *, time_limit: float | None = None,
                 max_bytes: int | None = None):
        self.name = name
        self.time_limit = time_limit
        self.max_bytes = max_bytes
        self._replicas: dict = {}
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self.last_sent = self.last_received = 0  # bytes of the last request and its reply
        self.last_batch = 0  # how many requests shared the last request's forward

    local = False  # runs on this process's model (LocalBackend)

    def __repr__(self):
        return f"{type(self).__name__}({self.name!r})"

    def name_for(self, model) -> str:
        if self.name is not None:
            return self.name
        source = model.__dict__.get("_source") if model is not None else None
        if source:
            return default_name(source)
        raise RemoteError(
            f"which served model should this {type(model).__name__} run on? Name it: "
            "remote.connect(..., name='served-name') or backend=remote.Backend('served-name') "
            f"(served now: {served()})")

    def send(self, model, payload: bytes, block) -> bytes:
        """Run the request ``payload`` (wire bytes) on a replica; its reply (wire bytes)."""
        import ray
        import ray.exceptions

        name = self.name_for(model)
        if not ray.is_initialized():  # (a call on a kept handle would start a new local Ray)
            self._replicas.clear()
            raise RemoteError(
                f"the block at {block.filename}:{block.lineno} was to run on model {name!r}, but "
                "this process is not connected to a Ray cluster (it never joined one, or "
                "ray.shutdown() ran since): call nnsight_lite.remote.connect(address) first")
        replica = self.replica(name)
        wait = None if self.time_limit is None else self.time_limit + _SLACK
        try:
            return ray.get(replica.run.remote(payload), timeout=wait)
        except ray.exceptions.GetTimeoutError:
            raise RemoteTimeoutError(
                f"no reply from model {name!r} within {wait:g} s for the block at "
                f"{block.filename}:{block.lineno}") from None
        except ray.exceptions.ActorDiedError as exc:  # for good: stopped, or out of restarts
            self._replicas.pop(name, None)  # the next request looks the replicas up again
            raise RemoteError(
                f"the replica of {name!r} that the block at {block.filename}:{block.lineno} "
                f"was sent to has ended and will not restart ({type(exc).__name__}: stopped, or "
                f"out of restarts); served now: {served()}. Run the block again once the model "
                "is served (the next request looks its replicas up again)") from None
        except ray.exceptions.RayActorError as exc:
            raise RemoteError(
                f"the replica serving {name!r} died during the request for the block at "
                f"{block.filename}:{block.lineno} ({type(exc).__name__}); Ray restarts it: run "
                "the block again") from None

    def replica(self, name: str):
        """The next replica serving ``name`` (round robin)."""
        with self._lock:
            handles = self._replicas.get(name)
            if not handles:
                handles = self._replicas[name] = replicas_of(name)
        if not handles:
            raise RemoteError(
                f"no model named {name!r} is served on this Ray cluster; served: {served()}. "
                f"Start it with `python -m nnsight_lite.remote serve ... --name {name}`")
        return handles[next(self._turn) % len(handles)]


class LocalBackend(Backend):
    """``remote="local"`` (nnsight 0.5.16+'s simulation): the block and the values it reads are
    pickled as for a cluster, run by the server's code on this process's model, and the reply
    is pickled back; so a block that would fail to ship fails here, without a cluster.

    Example::

        with model.trace("Hello", remote="local"):
            h = model.transformer.h[0].output.save()
    """

    local = True
    # requests take turns, as on a replica's one serving thread: each swaps sys.stdout,
    # sys.stderr and the warnings hooks process-wide while it runs (two at once: the later to
    # end put back the other's capture, and the process's output went there from then on)
    _turns = threading.RLock()

    def __init__(self):
        super().__init__("local")

    def send(self, model, payload: bytes, block) -> bytes:
        from .batching import handle

        with self._turns:
            return handle(model, payload, {})


def connect(address: str | None = "auto", *, name: str | None = None,
            time_limit: float | None = None, max_bytes: int | None = None,
            default: bool = True, **ray_init) -> Backend:
    """Join the Ray cluster at ``address`` (if this process has not) and return a Backend;
    with ``default=True`` it is what ``remote=True`` uses.

    Example::

        remote.connect("auto")                       # `ray start --head` ran on this machine
        remote.connect("ray://head:10001")           # Ray Client, from elsewhere
    """
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, **ray_init)
    backend = Backend(name, time_limit=time_limit, max_bytes=max_bytes)
    if default:
        global _default
        _default = backend
    return backend


def resolve_backend(backend):
    """The Backend that ``remote=True`` / ``backend=...`` in a trace's keywords means."""
    if isinstance(backend, Backend):
        return backend
    if isinstance(backend, str):
        base = _default
        return Backend(backend, time_limit=base.time_limit if base else None,
                       max_bytes=base.max_bytes if base else None)
    if backend is not None:
        raise TypeError(f"backend= takes a remote.Backend or a served name, got {backend!r}")
    if _default is None:
        import ray

        if not ray.is_initialized():
            raise RemoteError("remote=True needs a cluster: call nnsight_lite.remote.connect("
                              "address) first (or pass backend=remote.Backend(name))")
        return Backend()
    return _default


def run_remote(ctx, frame, model) -> None:
    """Ship ``ctx``'s with-block to a replica; bind what it saved in ``frame``; raise its
    error as the same exception type and arguments, with the user's frames in its traceback."""
    backend = ctx._backend
    block = wire.shipped_block(ctx._body)
    values = wire.caller_values(frame, block.names)
    request = {"source": block.source, "filename": block.filename, "lineno": block.lineno,
               "values": values, "time_limit": backend.time_limit,
               "max_bytes": backend.max_bytes, "inputs": _batch_inputs(ctx, model, block),
               "model": type(model._module).__qualname__}  # (the server checks it serves one)
    module = sys.modules.get(frame.f_globals.get("__name__", ""))
    by_value = module if module is not None and module.__name__ != "__main__" and \
        not module.__name__.startswith(("nnsight_lite", "torch")) else None
    try:
        payload = wire.dumps(request, model, by_value)
    except RemoteError:
        raise
    except Exception as exc:
        raise RemoteError(f"the values the remote block at {block.filename}:{block.lineno} "
                          f"reads could not be pickled: {exc!r}"
                          f"{wire.unpicklable(values, model, by_value)}") from None
    data = backend.send(model, payload, block)
    backend.last_sent, backend.last_received = len(payload), len(data)
    reply = wire.loads(data, model)
    backend.last_batch = reply.get("batch", 1)
    if reply.get("stdout"):
        sys.stdout.write(reply["stdout"])
    if reply.get("stderr"):
        sys.stderr.write(reply["stderr"])
    if reply.get("warnings"):
        warn_again(reply["warnings"], frame, block.filename)
    if reply.get("error") is not None:
        error = rebuild(reply["error"], frame.f_code.co_name)
        context = error.__context__
        try:
            raise error
        finally:  # (raise made the with-statement's own exception, being handled, its context)
            error.__context__ = context
    result = reply.get("result", _MISSING)
    if result is not _MISSING:
        ctx._result = result
    from ..capture import write_back
    from ..saving import _saved_stack

    _mark_leaves(reply["saved"].values(), 3)
    stack = _saved_stack()
    if stack:  # a block nested in a local body (a session's): saved there too, as locally
        stack[-1].update({id(v): v for v in reply["saved"].values()})
    write_back(frame, reply["saved"])


def _mark_leaves(values, depth: int) -> None:
    """Remember the saved tensors that require grad (in containers ``depth`` deep): a
    backward from them here says that their graph stayed on the server."""
    from ..backward_errors import remote_leaf

    for v in values:
        if isinstance(v, torch.Tensor):
            if v.requires_grad:
                remote_leaf(v)
        elif depth and isinstance(v, (list, tuple, dict)):
            _mark_leaves(v.values() if isinstance(v, dict) else v, depth - 1)


def _batch_inputs(ctx, model, block):
    """A plain single-input trace's inputs (it may share a forward with other requests), or
    None (it runs alone)."""
    from ..tracing import Tracer

    if type(ctx) is not Tracer or ctx._scan or block.alone or model._edits:
        return None
    if not (ctx._args or ctx._kwargs):
        return None
    return (ctx._args, ctx._kwargs)


def rebuild(error: dict, caller: str = "<module>") -> BaseException:
    """The exception a remote body raised, as the same type with the same arguments, its
    traceback the user's frames on the replica (the body's line, the functions it called),
    its cause and context rebuilt alike; ``caller``: the name of the function the block is
    in (its body's frames show it)."""
    exc = None
    if error["pickled"] is not None:
        try:
            exc = wire.loads(error["pickled"], None)
        except Exception:  # noqa: BLE001 - a type this side cannot import
            exc = None
    if exc is None and error.get("parts") is not None:
        exc = _from_parts(error["parts"])
    where = error["location"]
    if exc is None:
        message = error["message"]
        if where and where not in message:
            message = f"{message} (remote body, {where})"
        exc = _same_type(error, message)
    if error.get("traceback"):  # (3.10, which has no add_note: __notes__ set by hand)
        _note(exc, "remote traceback (on the replica):\n" + error["traceback"].rstrip())
    frames = error.get("frames")
    if frames:
        exc.__traceback__ = _user_frames(exc, [(f, n, name or caller) for f, n, name in frames])
    if error.get("cause") is not None:
        exc.__cause__ = rebuild(error["cause"], caller)
    context = error.get("context")
    if context is not None:
        exc.__context__ = exc.__cause__ if context == "cause" else rebuild(context, caller)
    exc.__suppress_context__ = error.get("suppress_context", False)
    return exc


def _from_parts(parts: bytes):
    """An exception whose pickle cannot rebuild it (``__init__(self, a, b)`` called with its
    one message), from its class, args and attributes, without calling ``__init__``; or None."""
    try:
        cls, args, state = wire.loads(parts, None)
        exc = cls.__new__(cls, *args)
        exc.args = args
        exc.__dict__.update(state)
        return exc
    except Exception:  # noqa: BLE001 - a type this side cannot import, a __new__ of its own
        return None


def _user_frames(exc: BaseException, frames):
    """A traceback of ``frames`` ((file, line, function), outermost first) ending in ``exc``:
    each entry is a one-statement code object at that file and line that raises ``exc``, as
    Jinja2's debug.py shows template lines (its columns span the line: no carets drawn)."""
    import ast
    import linecache

    tb = None
    for filename, lineno, name in reversed(frames):
        if not isinstance(lineno, int) or lineno < 1:  # (a frame with no line: not shown)
            continue
        text = linecache.getline(filename, lineno)
        start, end = len(text) - len(text.lstrip()), len(text.rstrip())
        at = {"lineno": lineno, "end_lineno": lineno, "col_offset": start,
              "end_col_offset": max(start, end)}
        tree = ast.Module([ast.Raise(exc=ast.Name("__exc__", ast.Load(), **at), **at)], [])
        exc.__traceback__ = None
        try:
            code = compile(tree, filename, "exec", dont_inherit=True).replace(co_name=name)
            exec(code, {"__exc__": exc})
        except BaseException as raised:  # noqa: BLE001 - exc itself, from the line above
            if raised is not exc:
                return tb
            entry = raised.__traceback__.tb_next  # (the first entry: this function's frame)
        tb = types.TracebackType(tb, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return tb


def _class_named(module: str, qualname: str):
    """The object at ``module``'s ``qualname`` in this process (a class sent by name), or None
    where the module cannot be imported or has no such name."""
    import importlib

    try:
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:  # noqa: BLE001 - a class this side does not have
        return None
    return found


def _same_type(error: dict, message: str) -> BaseException:
    import builtins

    cls = _class_named(error["module"], error["qualname"])
    if isinstance(cls, type) and issubclass(cls, BaseException):
        try:
            return cls(message)
        except Exception:  # noqa: BLE001
            pass
    base = getattr(builtins, error["qualname"], None)
    if isinstance(base, type) and issubclass(base, Exception):
        return base(message)
    return RemoteError(f"{error['module']}.{error['qualname']}: {message}")


def warn_again(records: list, frame, filename: str) -> None:
    """Issue here the warnings a remote block raised (execute.kept_warnings), under this
    process's filters, as if raised where they were: the body's at the user's line, in the
    with-statement's module. A category this side cannot import arrives as a UserWarning that
    names it."""
    import warnings

    files = None  # a module's file -> its globals, made at the first library warning
    for module, qualname, message, where, line in records:
        category = _class_named(module, qualname)
        if not (isinstance(category, type) and issubclass(category, Warning)):
            category, message = UserWarning, f"{module}.{qualname}: {message}"
        message = _instance(category, message, module, qualname)
        if where == filename:
            globs = frame.f_globals
        else:  # (a library's file: its module, as a warning raised there would name)
            if files is None:
                files = {m.__file__: m.__dict__ for m in list(sys.modules.values())
                         if isinstance(getattr(m, "__file__", None), str)
                         and isinstance(getattr(m, "__dict__", None), dict)}
            globs = files.get(where)
        warnings.warn_explicit(
            message, category, where, line,
            module=globs.get("__name__") if globs is not None else None,
            registry=globs.setdefault("__warningregistry__", {}) if globs is not None else None)


def _instance(category, message: str, module: str, qualname: str) -> Warning:
    """The warning to issue: ``category(message)``, as warnings.warn makes it from a string;
    for a category whose ``__init__`` takes other arguments (the body passed an instance), one
    made without calling it (its text is the message as the replica showed it)."""
    try:
        return category(message)
    except Exception:  # noqa: BLE001 - an __init__ of other arguments
        pass
    try:
        made = category.__new__(category, message)  # (BaseException's: args = (message,))
        if isinstance(made, category):
            return made
    except Exception:  # noqa: BLE001 - a __new__ of its own
        pass
    return UserWarning(f"{module}.{qualname}: {message}")
