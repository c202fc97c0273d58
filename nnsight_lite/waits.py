"""What a body can wait on besides a module's value, and the exception that ends a forward.

    StopTrace     raised by ``tracer.stop()``; ends the forward (or a backward pass), not an error
    NameWait      a body's request to wait until an earlier invoke binds a name
    Barrier       ``tracer.barrier(n)``: bodies wait at each call until ``n`` have called it
    BarrierWait   a body's request to wait at a barrier
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import InputError, MissedModuleError, NNsightError, OutsideTraceError
from .messages import backward_block_error, in_backward_block
from .workers import _getcurrent, user_location

if TYPE_CHECKING:
    from .mediator import Mediator


class StopTrace(BaseException):
    """Raised by ``tracer.stop()`` to end the forward early. Not an error; never escapes a trace.

    It derives from BaseException so that a model's own ``except Exception`` does not swallow it.
    ``tracer`` is the Tracer whose forward it ends (None: the innermost), so that ``outer.stop()``
    in the body of a trace nested in ``outer``'s passes through the inner trace.
    """

    def __init__(self, tracer=None, where: str = "<unknown>"):
        super().__init__()
        self.tracer = tracer
        self.where = where  # the user's line that called stop()

    def ends(self, tracer) -> bool:
        """Whether this stop is ``tracer``'s to take."""
        return self.tracer is None or self.tracer is tracer


class NameWait:
    """A body's request to wait until an earlier invoke binds ``name`` in the shared scope
    (``around``: or until none can, where the caller's scopes hold a value of that name)."""

    __slots__ = ("name", "around")

    def __init__(self, name: str, around: bool = False):
        self.name = name
        self.around = around


class BarrierWait(NameWait):
    """A body's wait at a ``tracer.barrier(n)`` until ``n`` bodies have called it this round."""

    __slots__ = ("barrier", "round", "where")

    def __init__(self, barrier: "Barrier", where: str):
        self.name = None
        self.around = False
        self.barrier = barrier
        self.round = barrier.round
        self.where = where


class Barrier:
    """What ``tracer.barrier(n)`` returns: each call from an invoke body waits until ``n``
    bodies have called it, then all of them go on (and the next call starts a new round).

    Invokes run in order at every module, so an earlier invoke's value reaches a later one by
    name without it; a barrier matters when a name is rebound round by round::

        b = tracer.barrier(2)
        with tracer.invoke(clean):
            for layer in model.model.layers:
                h = layer.output
                b()                           # round i: h is layer i's output ...
        with tracer.invoke(corrupt):
            for layer in model.model.layers:
                b()                           # ... here, in the same round
                layer.output[:] = h
    """

    def __init__(self, n: int):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InputError(f"tracer.barrier(n) takes the number of invokes that call it, a "
                             f"positive int; got {n!r}")
        self.n = n
        self.round = 0
        self.arrived: list = []  # the mediators waiting in this round

    def __call__(self) -> None:
        med = getattr(_getcurrent(), "mediator", None)
        if med is None:
            if in_backward_block():
                raise backward_block_error(
                    "tracer.barrier()", "call it in the invoke body, before or after the "
                    "`with loss.backward():` block")
            raise OutsideTraceError(
                f"a tracer.barrier() was called outside an invoke body (at {user_location()}); "
                "call it inside the `with tracer.invoke(...):` blocks it synchronises")
        self.arrived.append(med)
        if len(self.arrived) >= self.n:  # the last to arrive: everyone goes on
            self.round += 1
            self.arrived = []
            return
        med.parent.switch(BarrierWait(self, user_location()))

    def fillable(self, inter) -> bool:
        """Whether bodies enough to fill this round may still arrive."""
        if inter.finished:
            return False
        waiting = self.arrived
        others = sum(1 for m in inter.mediators if not m.done and m not in waiting)
        return len(waiting) + others >= self.n

    def short_error(self, med: "Mediator", wait: BarrierWait) -> NNsightError:
        inter = med.interleaver
        bodies = len(inter.mediators) - len(inter.edits)  # (the trace's own invokes)
        if self.n > bodies:
            return MissedModuleError(
                f"{med.label()} waited at tracer.barrier({self.n}) at {wait.where}, but this "
                f"trace has only {bodies} invoke{'s' if bodies != 1 else ''}, so {self.n} can "
                "never reach it. Pass tracer.barrier(n) the number of invokes that call it.")
        others = [m for m in med.interleaver.mediators if m is not med and not m.done
                  and isinstance(m.pending, NameWait) and m not in self.arrived]
        if others:  # the bodies that could come are waiting themselves: a deadlock
            fix = []
            if any(isinstance(m.pending, BarrierWait) for m in others):
                fix.append("call the barriers in the same order in every invoke")
            if any(not isinstance(m.pending, BarrierWait) for m in others):
                fix.append("a name another invoke reads before its barrier call must be bound "
                           "before this invoke's barrier call, not after it")
            return MissedModuleError(
                f"{med.label()} waited at tracer.barrier({self.n}) at {wait.where}, but only "
                f"{len(self.arrived)} invoke body(ies) reached it in this round, and the "
                f"others are blocked: {'; '.join(_waiting_on(m) for m in others)}. The invokes "
                f"wait on each other: {' and '.join(fix)}.")
        return MissedModuleError(
            f"{med.label()} waited at tracer.barrier({self.n}) at {wait.where}, but only "
            f"{len(self.arrived)} invoke body(ies) reached it in this round and no other can any "
            "more (the rest have ended, or the forward is over). Pass tracer.barrier(n) the "
            "number of invokes that call it, and call it the same number of times in each.")


def _waiting_on(med: "Mediator") -> str:
    """What ``med``, suspended at a name or a barrier, waits for, and where (for messages)."""
    g = med.greenlet
    where = user_location(g.gr_frame) if g is not None and g.gr_frame is not None else "<unknown>"
    req = med.pending
    if isinstance(req, BarrierWait):
        return f"{med.label()} waits at another tracer.barrier({req.barrier.n}) at {req.where}"
    return f"{med.label()} waits at {where} for the name {req.name!r}, which no invoke has bound"
