"""Greenlet plumbing shared by every body: pooled workers, torch's thread-local state, and
locating the user's line.

    BodyGreenlet          a worker that runs bodies (invoke or backward), one job at a time
    _take_worker(level)   an idle worker (or a new one), parented to the current greenlet:
                          RUNNER for a forward, BODY for an invoke body, GRADS for a
                          backward body, each started further down the native stack
    _release_worker(w)    back to this thread's pool once its job has ended
    tls_state()           grad mode, inference mode, autocast: what greenlets do not carry
    set_tls_state(s, now) switch grad mode and autocast back to ``s``
    user_location(frame)  ``file:line`` of the innermost frame outside nnsight_lite

A worker runs ``job()`` and then switches to its parent with ``_FINISHED``; an exception the job
raised is left in ``worker.error`` for the parent to re-raise. Reusing workers makes starting a
body a switch instead of a greenlet creation plus its first switch.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from itertools import chain, starmap
from typing import TYPE_CHECKING

import greenlet
import torch

if TYPE_CHECKING:
    from .mediator import Mediator

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_getcurrent = greenlet.getcurrent
_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_is_inference = torch.is_inference_mode_enabled
_is_autocast = torch.is_autocast_enabled
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
_set_autocast = torch.set_autocast_enabled


#: worker levels: what a worker runs, and how far down the native stack it starts
RUNNER, BODY, GRADS = 0, 1, 2
_NURSERY_NAMES = ("runner_nursery", "nursery", "grads_nursery")
_POOL_NAMES = ("runners", "idle", "grads_idle")


class BodyGreenlet(greenlet.greenlet):
    """A worker greenlet that runs a model's forward, an invoke body or a backward body (its
    ``level``), one job at a time.

    ``mediator`` links it to the body it runs now (None while idle in the pool). Workers are
    reused across traces: handing a job to a waiting worker costs a switch, creating a greenlet
    and running it for the first time costs several microseconds more.
    """

    mediator: "Mediator | None" = None  # the invoke body it runs now
    level = BODY  # RUNNER, BODY or GRADS: what it runs, and which nursery and pool it belongs to
    grads = None  # or the backward.Backward whose body it runs now
    error: "BaseException | None" = None


_FINISHED = object()
_pool = threading.local()
_POOL_MAX = 64
#: every worker ever made and still alive, so tests can check none is left mid-body
_workers: "weakref.WeakSet[BodyGreenlet]" = weakref.WeakSet()


#: native frames a greenlet nnsight_lite starts goes down before its first function (see padded)
_PADDING = 68


def padded(fn):
    """``fn`` as the first function of a greenlet (a worker, nosource.py's), run some 80 native
    frames below the greenlet's base. torch records a C++ backtrace (up to 64 frames, unwound
    with libgcc) for every error it raises, even one a body catches: unwinding past a greenlet's
    base walks into stack memory that others have reused since, and can crash the process.
    Deeper than 64 frames, the walk ends first.

    The frames are ``itertools.chain`` iterators nested ``_PADDING`` deep around a ``starmap``
    that makes the call: one native frame of 32 bytes each, some 2 KiB in all. Every switch
    into or out of the greenlet copies its stack, padding included (Python-level recursion
    through ``next(map(...))`` took 8 KiB for as many frames)."""

    def entry():  # (started with no arguments: a greenlet holds those while it runs)
        it = starmap(_guarded, ((fn,),))
        for _ in range(_PADDING):
            it = chain(it)
        value, stop = next(it)
        if stop is not None:
            try:
                raise stop
            finally:
                stop = None  # (a local holding the exception it raises is a reference cycle)
        return value

    return entry


def _guarded(fn):
    """``(fn(), None)``, or ``(None, exc)`` for a StopIteration it raised, which the chain in
    ``padded`` would take for its own end and drop."""
    try:
        return fn(), None
    except StopIteration as exc:
        return None, exc


def _worker_main():
    # (no local holds this greenlet: its suspended frame would keep it alive, and a greenlet
    # kept by its own frame is never freed once its thread has ended)
    job = _getcurrent().parent.switch()  # (started empty by the nursery: jobs come by switches)
    while True:
        try:
            job()
        except BaseException as exc:  # handed to the parent, which re-raises it
            _getcurrent().error = exc
        job = None
        job = _getcurrent().parent.switch(_FINISHED)


def _take_worker(level: int = BODY) -> BodyGreenlet:
    """An idle worker parented to the current greenlet: one for a model's forward (RUNNER), an
    invoke body (BODY) or a backward body (GRADS), each level started further down the native
    stack than the one before (see _nursery)."""
    idle = getattr(_pool, _POOL_NAMES[level], None)
    if idle:
        w = idle.pop()
        w.parent = _getcurrent()
        return w
    return _new_worker(level)


def _new_worker(level: int = BODY) -> BodyGreenlet:
    """A new worker for ``level``, started by this thread's nursery for it (see _nursery)."""
    nursery = _nursery(level)
    here = _getcurrent()
    nursery.parent = here  # (where the nursery hands the worker back)
    w = nursery.switch()
    w.parent = here
    w.level = level
    name = _POOL_NAMES[level]
    if getattr(_pool, name, None) is None:  # (so _release_worker finds its list)
        setattr(_pool, name, [])
    return w


def _nursery(level: int) -> greenlet.greenlet:
    """This thread's nursery for ``level``, started the first time it is needed.

    The runners' nursery starts where a forward first needs one; the bodies' ``_DESCENT``
    below the point where a body first needs one; the backward bodies' ``_DESCENT`` below the
    bodies'. A switch copies aside the part of the running greenlet's stack that lies where
    the greenlet switched to will run: a body started level with the forward's runner would
    have the whole depth of the forward (tens of KiB in an HF model, several times a serve)
    copied out and back at every value served. Started below it, only the body's own few KiB
    move. The same holds one level down: a backward body is switched into from gradient hooks
    that fire inside autograd's engine, which runs in an invoke body (or, standalone, wherever
    the user is, above the bodies)."""
    name = _NURSERY_NAMES[level]
    nursery = getattr(_pool, name, None)
    if nursery is None or nursery.dead:
        here = _getcurrent()
        if level == GRADS:  # started by the bodies' nursery, from its depth
            bodies = _nursery(BODY)
            bodies.parent = here
            nursery = bodies.switch(_NEXT_LEVEL)
        else:
            nursery = greenlet.greenlet(_below(_nursery_main) if level else _nursery_main)
            nursery.switch()  # (it waits for its first request)
        setattr(_pool, name, nursery)
    return nursery


_NEXT_LEVEL = object()  # a request to a nursery: start the next level's nursery, from here


#: native frames a nursery goes down (the bodies' below where first needed, the backward
#: bodies' below the bodies') before it starts workers: ``itertools.chain``
#: frames of ~32 bytes, some 128 KiB in all (deeper than a forward's stack in the models tried:
#: tiny GPT-2 ~10 KiB below its runner's start); made once per thread, in ~1 ms. A thread with
#: a small stack goes down an eighth of it at most (see _descent).
_DESCENT = 4096
_FRAME_BYTES = 32


def _descent() -> int:
    """How many frames _below goes down in this thread: ``_DESCENT``, or fewer where the
    thread's stack is small (a thread made after ``threading.stack_size(n)``, a main thread
    under a small ``ulimit -s``), so that bodies keep nearly all of it. Found once per thread."""
    frames = getattr(_pool, "descent", None)
    if frames is None:
        size = _stack_bytes()
        frames = _DESCENT if size <= 0 else min(_DESCENT, size // 8 // _FRAME_BYTES)
        _pool.descent = frames
    return frames


def _stack_bytes() -> int:
    """The size of the running thread's native stack, or 0 where it cannot be told."""
    if threading.current_thread() is threading.main_thread():
        try:
            import resource  # (not on Windows)

            size = resource.getrlimit(resource.RLIMIT_STACK)[0]
            return 0 if size == resource.RLIM_INFINITY else size
        except (ImportError, OSError, ValueError):
            return 0
    try:  # the thread's own stack, as the C library made it
        import ctypes

        libc = ctypes.CDLL(None)
        libc.pthread_self.restype = ctypes.c_void_p
        me = ctypes.c_void_p(libc.pthread_self())
        if sys.platform == "darwin":
            libc.pthread_get_stacksize_np.restype = ctypes.c_size_t
            return libc.pthread_get_stacksize_np(me)
        attr = ctypes.create_string_buffer(256)  # (a pthread_attr_t: 56 or 64 bytes)
        if libc.pthread_getattr_np(me, attr) != 0:
            raise OSError
        size = ctypes.c_size_t(0)
        try:
            libc.pthread_attr_getstacksize(attr, ctypes.byref(size))
        finally:
            libc.pthread_attr_destroy(attr)
        return size.value
    except (ImportError, OSError, AttributeError, TypeError, ValueError):  # (Windows: no libc)
        # the size new threads get: a guess for this one. (threading.stack_size() with no
        # argument also resets it to the default, so it is put back.)
        size = threading.stack_size()
        threading.stack_size(size)
        return size


def _below(fn):
    """``fn`` run some frames below where its greenlet starts (see padded and _descent)."""

    def entry():
        it = starmap(fn, ((),))
        for _ in range(_descent()):
            it = chain(it)
        next(it, None)

    return entry


def _nursery_main() -> None:
    """A greenlet that starts workers, one per switch into it, and hands each back.

    A greenlet starts at the depth of the code that first switches into it, native stack and
    Python recursion count both, and keeps it for good. Workers are asked for deep down: inside
    the worker running a forward, inside a body running a nested trace or a backward. Started
    there, a pooled worker that later runs a forward would make its own new workers deeper
    still, a little more each generation, until a RecursionError or a native stack overflow.
    Started here, every worker starts at this greenlet's depth, fixed when the thread first
    needed one.

    A greenlet also holds the arguments of its first switch for as long as its first function
    runs, which for a pooled worker is for good: so a worker is started with none, and waits
    for its jobs like any pooled worker (_worker_main); so is a nursery."""
    req = _getcurrent().parent.switch()  # (no local holds this greenlet: see _worker_main)
    while True:
        if req is _NEXT_LEVEL:
            made = greenlet.greenlet(_below(_nursery_main), _getcurrent())
            made.switch()
        else:
            made = BodyGreenlet(padded(_worker_main), _getcurrent())
            made.switch()
            _workers.add(made)
        req = _getcurrent().parent.switch(made)
        made = None


def _release_worker(w: BodyGreenlet) -> None:
    w.mediator = None
    w.grads = None
    w.gr_context = None  # (the copy of the caller's context its job ran in, and what it holds)
    # (its thread's list, made with the worker: a worker never leaves its thread. The worker
    # does not hold the list, which holds it: a cycle of greenlets is not freed once their
    # thread ends)
    idle = getattr(_pool, _POOL_NAMES[w.level])
    if len(idle) < _POOL_MAX:
        idle.append(w)


def switch_job(w: BodyGreenlet, value=None, throw: BaseException | None = None):
    """Switch into worker ``w`` (sending ``value``, or throwing ``throw``); return what its job
    switched out with. When the job has ended the worker goes back to the pool and this returns
    ``_FINISHED``, or raises the exception the job ended with."""
    req = w.switch(value) if throw is None else w.throw(throw)
    if req is _FINISHED:
        throw = None
        job_ended(w)
    return req


def job_ended(w: BodyGreenlet) -> None:
    """``w`` switched out with ``_FINISHED``: give it back to the pool, and raise the exception
    its job ended with, if any (what ``switch_job`` does after the switch, for callers that
    switch themselves)."""
    err, w.error = w.error, None
    _release_worker(w)
    if err is not None:
        # raising it here would make whatever this greenlet is handling (the SkipBody of the
        # with-statement) its context: keep the context the body's own code gave it
        context, suppress = err.__context__, err.__suppress_context__
        try:
            raise err
        finally:  # a local holding an exception that passes through its own frame is a
            err.__context__, err.__suppress_context__ = context, suppress
            err = context = None  # reference cycle (exception -> traceback -> frame -> it)


def attached(w: "BodyGreenlet | None", owner) -> bool:
    """Whether worker ``w`` is alive and still attached to ``owner`` (a Mediator or a
    Backward): its job is running or suspended, or it ended but was not yet given back to the
    pool (an interrupt between the two). Such a worker must be unwound."""
    return w is not None and not w.dead and (w.mediator is owner or w.grads is owner)


def unwind(w: BodyGreenlet) -> bool:
    """End the job of a worker suspended mid-body: throw ``GreenletExit`` in (the body's
    ``finally`` blocks run) until the job returns, and free the worker. A body that keeps
    catching it is given up on after three tries (returns False)."""
    for _ in range(3):
        try:
            if w.throw(greenlet.GreenletExit) is _FINISHED:
                w.error = None
                _release_worker(w)
                return True
        except BaseException:  # a body's cleanup failing must not mask the real outcome
            pass
        if w.dead:  # it had already ended its job and was waiting to be given back
            w.mediator = w.grads = w.error = None
            return True
    return False


# --------------------------------------------------------------------------- thread-local state


def tls_state() -> int:
    """Grad mode (bit 1), inference mode (2), CPU autocast (4), CUDA autocast (8), as a small
    int: compared at every switch, and an int costs no allocation."""
    s = _is_grad_enabled() | (_is_inference() << 1)
    if _any_autocast():
        s |= (_is_autocast("cpu") << 2) | (_is_autocast("cuda") << 3)
    return s


INFERENCE_BIT = 2


def set_tls_state(state: int, now: int) -> None:
    """Switch grad mode and autocast from ``now`` to ``state`` (inference mode cannot be set)."""
    diff = state ^ now
    if diff & 1:
        _set_grad_enabled(bool(state & 1))
    if diff & 4:
        _set_autocast("cpu", bool(state & 4))
    if diff & 8:
        _set_autocast("cuda", bool(state & 8))


# --------------------------------------------------------------------------- locating user code


def user_location(frame=None) -> str:
    """``file:line`` of the innermost frame outside nnsight_lite (the user's line)."""
    f = frame if frame is not None else sys._getframe(1)
    while f is not None:
        fn = f.f_code.co_filename
        if not os.path.abspath(fn).startswith(_PACKAGE_DIR) and "greenlet" not in fn:
            return f"{fn}:{f.f_lineno}"
        f = f.f_back
    return "<unknown>"


def _note(exc: BaseException, text: str) -> None:
    """Add ``text`` to ``exc``'s notes once. On 3.10, which has no ``add_note``, the list is
    set by hand: tracebacks there do not print it, but tools that read ``__notes__`` do."""
    notes = getattr(exc, "__notes__", None)
    if notes is not None and text in notes:
        return
    if hasattr(exc, "add_note"):
        exc.add_note(text)
        return
    try:  # pragma: no cover - Python 3.10
        if notes is None:
            exc.__notes__ = notes = []
        notes.append(text)
    except (AttributeError, TypeError):  # pragma: no cover - an exception type without a dict
        pass
