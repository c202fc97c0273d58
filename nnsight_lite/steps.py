"""Step loops in a body: ``for step in tracer.iter[...]:`` and ``tracer.all()``.

A loop's steps are the model's later calls: each step moves the body's reads to the next call
(``Mediator.iteration``), and an open loop (``tracer.all()``, ``tracer.iter[k:]``) ends when a
read finds no further call. The older block form ``with tracer.iter[...] as step:`` is compiled
into the loop (capture/rewrite.py, through ``RUNTIME[ITER_BLOCK_NAME]``).
"""

from __future__ import annotations

import itertools
import warnings

from .capture import ITER_BLOCK_NAME
from .context import RUNTIME
from .errors import InputError, NNsightError
from .mediator import current_mediator
from .workers import user_location


class _IterIndexer:
    """``tracer.iter[i]``, ``tracer.iter[a:b]``, ``tracer.iter[[i, j]]``."""

    def __getitem__(self, item):
        return _iterate(item, "tracer.iter[...]")


def _iterate(item, form: str):
    med = current_mediator(None, form, "used")
    ends = (item.start, item.stop) if isinstance(item, slice) else \
        (item,) if isinstance(item, int) else tuple(item)
    bad = [i for i in ends if i is not None and i < 0]
    if bad:
        raise InputError(
            f"tracer.iter step cannot be negative ({bad[0]}, at {user_location()}): steps count "
            "from the first call (0); the number of steps is not known while the model runs. "
            "Use tracer.all() (or tracer.iter[k:]) and keep what the last step gives."
        )
    if isinstance(item, int):
        steps = iter((item,))
    elif isinstance(item, slice):
        start = item.start or 0
        step = item.step or 1
        stop = item.stop
        if stop is None:  # open: as many steps as the model makes (generate: max_new_tokens,
            stop = med.interleaver.steps  # so a step that reads nothing cannot loop for ever)
            if stop is not None and start >= stop:
                warnings.warn(
                    f"nnsight_lite: {form} at {user_location()} starts at step {start}, but "
                    f"this run makes only {stop} step(s) (0..{stop - 1}: one per new token, "
                    "max_new_tokens), so the loop runs none of them.", UserWarning, stacklevel=3)
        steps = iter(range(start, stop, step)) if stop is not None else \
            itertools.count(start, step)
    else:
        steps = iter(list(item))
    bounded = not (isinstance(item, slice) and item.stop is None)  # the user gave its last step
    return _Steps(_iteration(med, steps, form if type(steps) is itertools.count else None,
                             bounded), form)


class _Steps:
    """What ``tracer.iter[...]`` / ``tracer.all()`` return: iterate it with ``for``. The older
    block form ``with tracer.iter[...] as step:`` written in a body is compiled into that loop
    (capture/rewrite.py); entered any other way (a function defined outside the body) it
    raises an error showing the ``for`` form."""

    __slots__ = ("_steps", "_form")

    def __init__(self, steps, form: str):
        self._steps = steps
        self._form = form

    def __iter__(self):
        return self._steps

    def __enter__(self):
        what = self._form
        raise NNsightError(
            f"`with {what}:` (nnsight's older block form) runs only where a body's own code "
            f"opens it as `with tracer.iter[...]:` or `with tracer.all():`; here (at "
            f"{user_location()}) loop over the steps instead:\n"
            f"    for step in {what}:\n        ...  # runs once per step, `step` is the step index"
        )

    def __exit__(self, *exc):  # pragma: no cover - __enter__ always raises
        return False


def _block_steps(steps, bind: bool):
    """What ``with <x>.iter[...] [as step]:`` in a body loops over (capture/rewrite.py): the
    steps of ``tracer.iter``/``tracer.all()`` (``()`` for each where nothing is bound), or, for
    any other object that merely reads like one, a single pass inside ``with steps``."""
    if isinstance(steps, _Steps):
        return steps if bind else map(_nothing, steps)
    return _once(steps, bind)


def _nothing(_step):
    return ()


def _once(manager, bind: bool):
    with manager as value:
        yield value if bind else ()


RUNTIME[ITER_BLOCK_NAME] = _block_steps


def _iteration(med, steps, open_form=None, bounded=False):
    """The steps of a ``tracer.iter`` / ``tracer.all()`` loop. An open one (``open_form``: how
    the user wrote it) ends when a read finds no further call; a body whose steps read nothing
    never gets there, so after ``_IDLE_STEPS`` such steps in a row it raises instead of
    spinning (generate bounds its open loops by max_new_tokens instead). ``bounded``: the user
    wrote its last step (the error for a read after a loop the forward ended says so)."""
    prev = (med.iteration, med.iter_depth, med.loop_bounded)
    med.iter_depth += 1
    med.loop_bounded = bounded
    med.iter_cut = None
    idle = 0
    done = 0  # steps whose code ran to the end
    try:
        for i in steps:
            med.iteration = i
            med.pending_envoy = None  # (set again by each read that waits for the model)
            yield i
            done += 1
            if open_form is not None:
                idle = idle + 1 if med.pending_envoy is None else 0
                if idle >= _IDLE_STEPS:
                    raise NNsightError(
                        f"`for step in {open_form}:` ran {idle:,} steps in a row without "
                        f"reading a module value (at {user_location()}). An open loop over a "
                        "module's calls ends when a read finds no further call, so steps "
                        "that read nothing never reach the end: bound the loop "
                        "(tracer.iter[:n], tracer.iter[k]) or read a module in every step."
                    )
    finally:
        cut, med.iter_cut = med.iter_cut, None
        if cut is not None and not done:  # the forward ended before the loop's first step
            slot, call = cut
            warnings.warn(
                f"nnsight_lite: a step loop (`for step in tracer.iter[...]`/`tracer.all()`) "
                f"ran none of its steps: its first step, call {call} of {slot.label()}, never "
                f"happened ({slot.label()} was called {slot.calls} time(s) in this run, steps "
                f"0..{slot.calls - 1}). Start the loop at a step the run makes (in a generate, "
                "one per new token: max_new_tokens), or in a trace read the call directly.",
                UserWarning, stacklevel=2)
        med.iteration, med.iter_depth, med.loop_bounded = prev
        med.after_loop = med.after_loop or (done > 0 and not prev[1])


_IDLE_STEPS = 10_000_000  # read-less steps in a row that end an open loop with an error (~1 s)
