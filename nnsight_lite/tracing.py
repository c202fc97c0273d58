"""The contexts users open: ``model.trace(...)``, ``tracer.invoke(...)``, ``model.scan(...)``.

    Tracer      ``with model.trace(*inputs) as tracer:`` - one batched forward, bodies interleaved
    Invoker     ``with tracer.invoke(*inputs):`` - one body with its own rows of the batch

A trace given inputs is one invoke whose body is the trace's body. A trace given none runs its
body first, in the caller's greenlet, to collect ``tracer.invoke`` blocks; then it batches their
inputs and runs the model once with every invoke body interleaved. Keywords of such a trace that
are not inputs (``model.trace(use_cache=False)``, a LanguageModel's) go to that batched forward;
an invoke's keyword of the same name yields to them, with a warning where the values differ.
"""

from __future__ import annotations

import contextvars
import weakref

import torch

from . import backward  # noqa: F401  (registers grad/set_grad in RUNTIME, patches backward)
from .context import BodyContext, body_job
from .invoke_scopes import add_invokes
from .errors import InputError, InvokeError, NNsightError
from .interleaver import Interleaver
from .invoke_kwargs import _yield_to
from .mediator import _MISSING, _collecting, current_mediator
from .messages import backward_block_error, in_backward_block
from .remote.hook import take_backend
from .scan import _run_fake
from .sessions import _add_edits
from .steps import _iterate, _IterIndexer
from .waits import Barrier, StopTrace
from .workers import RUNNER, _getcurrent, _note, _take_worker, switch_job, user_location

_CPU = torch.device("cpu")


class Tracer(BodyContext):
    """``with model.trace(*inputs, **kwargs) as tracer:`` runs the body interleaved with one forward.

    Example::

        with model.trace(x) as tracer:
            h = model.layer1.output.save()
            tracer.stop()            # modules after this point do not run

    ``tracer.invoke(...)`` adds an invoke (when the trace itself has no inputs); ``tracer.iter[i]``
    / ``tracer.all()`` loop over a module's repeated calls; ``tracer.stop()`` ends the forward;
    ``tracer.result`` in a body is what the traced call returns (``out = tracer.result.save()``).
    """

    _inter = None  # the running trace's Interleaver (only while it runs)
    _result = _MISSING  # what the traced call returned, where it outlives the trace (generate)
    _stopped_at = None  # where a tracer.stop() ended the call ("file:line"), once it ran
    _call_name = "model.trace"  # (how messages name the call that made this tracer)

    @property
    def _made_by(self) -> str:
        return "model.scan(...)" if self._scan else f"{self._call_name}(...)"

    def __init__(self, model, args: tuple, kwargs: dict, *, scan: bool = False,
                 forward: dict | None = None):
        if "tracer_cls" in kwargs or forward and "tracer_cls" in forward:
            raise InputError(
                "tracer_cls=... (nnsight's hook for a Tracer subclass of your own) is not "
                "supported: nnsight_lite's tracer runs the block's body itself; put what the "
                "subclass would add in the body, or in a function the body calls")
        self._model = model
        self._model_ref = weakref.ref(model)
        self._args = args
        self._kwargs = kwargs
        # keywords of a trace given no inputs, for the forward of the batch its invokes make
        self._forward_kwargs = forward or {}
        self._scan = scan
        self._invokes: list = []
        self._collecting = False
        self.iter = _IterIndexer()
        # remote=True / backend=...: the block runs on a served model (nnsight_lite/remote)
        given = kwargs or self._forward_kwargs
        self._backend = take_backend(given) if given else None

    @property
    def model(self):
        """The model this traces (held weakly once the block is over: see _let_go)."""
        model = self._model
        return model if model is not None else self._model_ref()

    def _let_go(self) -> None:
        self._model = None
        self._args, self._kwargs, self._forward_kwargs = (), {}, {}

    # ---- user API

    def invoke(self, *args, **kwargs) -> "Invoker":
        """A body with its own inputs, batched with the other invokes of this trace."""
        if not self._collecting:
            raise self._misplaced_invoke()
        return Invoker(self, args, kwargs)

    def _misplaced_invoke(self) -> InvokeError:
        where = user_location()
        if self._args or self._kwargs:
            why = (f"{self._call_name}(...) itself was given inputs, so its body is the one "
                   "invoke; pass the inputs to each tracer.invoke(...) instead (with "
                   f"`with {self._call_name}() as tracer:`)")
        elif self._inter is not None:
            why = ("it is inside another invoke's body, while the model runs; invokes sit "
                   "directly in the trace's body, one after another: end the enclosing "
                   "`with tracer.invoke(...):` block before opening the next")
        else:
            why = "its trace is not running; open invokes inside `with model.trace() as tracer:`"
        return InvokeError(f"tracer.invoke(...) at {where} cannot add an invoke here: {why}")

    def stop(self) -> None:
        """End the model's forward here. Values saved so far are kept; later modules do not run,
        and a read of one by another invoke raises ``MissedModuleError`` saying so. Called in a
        ``with loss.backward():`` block it ends that backward pass only, and the code after the
        block runs."""
        where = user_location()
        if self._collecting:
            raise InvokeError(
                f"tracer.stop() at {where} is in the body of a trace given no inputs, which "
                "only sets up its invokes before the model runs, so it would end the trace "
                "before any invoke ran. Call tracer.stop() inside an invoke's body, after the "
                "reads it should come after."
            )
        if self._inter is None and not in_backward_block():  # (in a backward
            raise NNsightError(  # block it ends that backward, whichever tracer says so)
                f"tracer.stop() at {where} was called on a trace that is not running (its "
                "block has ended, or not begun): it has no forward to end. Call stop() inside "
                "the body of the trace it should end (`with model.trace(...) as tracer:`)."
            )
        raise StopTrace(self, where)

    def cond(self, *args, **kwargs):
        """Old nnsight idiom: bodies run eagerly here, so a plain ``if`` does the job."""
        raise NNsightError(
            "tracer.cond(...) is not needed in nnsight_lite: bodies run eagerly on real tensors, "
            "so write a plain `if model.layer.output.sum() > 0:` instead"
        )

    def barrier(self, n: int) -> Barrier:
        """nnsight's cross-invoke barrier: ``b = tracer.barrier(2)``, then each call ``b()`` in
        an invoke body waits until ``n`` bodies have called it (see waits.Barrier). An
        invoke reading a name an earlier one has not bound yet waits by itself; the barrier
        is for names rebound round by round (one per layer in a loop)."""
        return Barrier(n)

    def all(self):
        """Loop over every call of the modules a body reads: ``for step in tracer.all():``."""
        return _iterate(slice(None), "tracer.all()")

    def next(self, step: int = 1) -> "Tracer":
        """Address the next call of every module this body reads from here on (generation
        step 1, then 2, ...); ``module.next()`` is the same. Inside a ``tracer.iter`` loop it
        moves the rest of the current step only. Returns the tracer.

        Example::

            with model.generate("Hello", max_new_tokens=3) as tracer:
                h0 = model.lm_head.output.save()        # step 0
                tracer.next()
                h1 = model.lm_head.output.save()        # step 1
        """
        current_mediator(None, "tracer.next()", "called").move(step)
        return self

    def log(self, *values) -> None:
        """Older nnsight code's way to print from a body; bodies run eagerly here, so this is
        ``print(*values)``."""
        print(*values)

    @property
    def result(self):
        """What the traced call returns: the model's output in a trace, the generated ids in a
        generate. Inside a body it waits for the call to finish, like ``model.output``.

        Example::

            with model.trace(x) as tracer:
                out = tracer.result.save()      # the same value as model.output
        """
        inter = self._inter
        if inter is not None:
            med = getattr(_getcurrent(), "mediator", None)
            if med is not None and med.interleaver is inter:
                return self._result_envoy().output
        if self._result is not _MISSING:
            return self._result
        if inter is not None and in_backward_block():
            raise backward_block_error("tracer.result", "read `out = tracer.result` in the "
                                       "trace body, before the `with loss.backward():` line")
        if self._collecting or inter is not None:
            raise NNsightError(
                "tracer.result was read in the body of a trace that was given no inputs, which "
                "only sets up invokes; read it inside a `with tracer.invoke(...):` block"
            )
        if self._stopped_at:
            raise NNsightError(
                f"tracer.result: tracer.stop() at {self._stopped_at} ended {self._call_name}"
                "(...) before it returned, so there is no result; save what you need in the "
                "body before stopping (the values read by then)"
            )
        raise NNsightError(
            "tracer.result is only readable inside the trace's body (it waits for the model's "
            "output there); values do not outlive a trace unless saved: write "
            "`out = tracer.result.save()` in the body and use `out` afterwards"
        )

    def _result_envoy(self):
        """The Envoy whose output ``tracer.result`` is: the model's root."""
        return self._model

    def cache(self, modules=None, *, device=_CPU, dtype=None, detach: bool = True,
              include_output: bool = True, include_inputs: bool = False,
              non_blocking: bool = False):
        """Record every module's output (or those in ``modules``) during this trace.

        Example::

            with model.trace(x) as tracer:
                cache = tracer.cache(modules=[model.layer1, "model.layer2"])
            cache["model.layer1"].output            # or cache.layer1.output

        Call it in the body before any ``.output``/``.input`` access; inside an invoke it
        records that invoke's rows. ``device`` (CPU unless None), ``dtype`` and ``detach``
        apply to what is stored; ``include_inputs=True`` adds ``.inputs``/``.input``. Returns a
        :class:`~nnsight_lite.cache_view.CacheView`, already saved. See ``nnsight_lite/cache.py``.
        """
        from .cache import open_cache

        return open_cache(self, modules, device=device, dtype=dtype, detach=detach,
                          include_output=include_output, include_inputs=include_inputs,
                          non_blocking=non_blocking)

    # ---- running

    def _on_exit(self, frame):
        if self._backend is not None:
            from .remote.client import run_remote

            return run_remote(self, frame, self._model)
        self._run_in_scope(frame, self._run)

    def _no_source(self, err):
        # a trace given inputs (not generate, which attaches modules around its run) runs in
        # place; a remote one ships its source, so it has none to run
        if (self._args or self._kwargs) and type(self)._run is Tracer._run and \
                self._backend is None:
            from .nosource import enter_inline_trace

            enter_inline_trace(self)
            return
        super()._no_source(err)

    def _exit_no_source(self, exc_type, exc) -> bool:
        from .nosource import exit_inline_trace

        return exit_inline_trace(self, exc_type, exc)

    def _run(self, scope):
        model = self._model
        if self._args or self._kwargs:  # the usual trace: one invoke, the trace's own body
            args, kwargs, sizes = model._batch_inputs(
                [model._prepare_inputs(*self._args, **self._kwargs)])
            return self._run_own_body(scope, sum(sizes), args, kwargs)
        self._collecting = True
        _collecting.depth = getattr(_collecting, "depth", 0) + 1
        try:
            exec(self._body.code, scope)
        except StopTrace as exc:
            if not exc.ends(self):  # an enclosing trace's tracer.stop(): it goes there
                raise
            return
        finally:
            self._collecting = False
            _collecting.depth -= 1
            invokes, self._invokes = self._invokes, []
        call = self._call_kwargs()
        if call:  # (the call's keywords apply to the whole batch: an invoke's same ones yield)
            for inv in invokes:
                if inv._kwargs:
                    inv._kwargs = _yield_to(call, inv, self._call_name)
        if not invokes:
            raise InputError(
                f"{self._made_by[:-5]}() at {self._body.filename}:{self._body.lineno} was given no "
                "inputs and its body opened no invoke, so there is nothing to run the model on; "
                f"pass inputs to {self._made_by} or open `with tracer.invoke(inputs):` blocks in it"
            )
        prepared = []
        given = []  # the invokes with inputs, in the order of `prepared`
        for inv in invokes:
            if inv._args or inv._kwargs:
                try:
                    prepared.append(model._prepare_inputs(*inv._args, **inv._kwargs))
                except Exception as err:  # (raised at the trace's line: say which invoke)
                    _note_invoke(err, invokes, inv)
                    raise
                given.append(inv)
        if not prepared:
            raise InputError(
                "none of this trace's invokes has an input, so there is nothing to run the "
                "model on; pass inputs to model.trace(...) or to at least one tracer.invoke(...)"
            )
        try:
            args, kwargs, sizes = model._batch_inputs(prepared)
        except Exception as err:
            if len(prepared) > 1:  # an invoke's own input (a token id outside the vocabulary)?
                for inv, one in zip(given, prepared):
                    try:
                        model._batch_inputs([one])
                    except Exception:  # noqa: BLE001 - (only which invoke raises is asked)
                        _note_invoke(err, invokes, inv)
                        break
            raise
        if self._forward_kwargs:
            kwargs = {**kwargs, **self._forward_kwargs}
        inter = Interleaver(model._module, sum(sizes), model.__dict__)
        made = _add_edits(inter, model) if model._edits else []
        add_invokes(inter, invokes, sizes, scope, made)
        self._interleave(inter, made, args, kwargs)

    def _run_own_body(self, scope, total: int, args: tuple, kwargs: dict):
        """Run the trace's own body, over the whole batch of ``total`` rows, with the model's
        persistent edits, on the forward of ``args``/``kwargs``."""
        model = self._model
        inter = Interleaver(model._module, total, model.__dict__)
        made = _add_edits(inter, model) if model._edits else []
        inter.add(body_job(self._body.code, scope), None, scope)
        return self._interleave(inter, made, args, kwargs)

    def _call_kwargs(self) -> dict:
        """The keywords of the call itself that an invoke's keyword of the same name yields
        to (a trace's forward keywords; generate's in a generate)."""
        return self._forward_kwargs

    def _interleave(self, inter: Interleaver, made: list, args: tuple, kwargs: dict):
        """Run the forward with the bodies ``inter`` holds; then clear the scopes in ``made``
        (the invokes' and edits' own: functions bound in them refer back to them)."""
        self._inter = inter
        try:
            if self._scan:
                _on_runner(lambda: _run_fake(inter, self._model, args, kwargs))
            else:
                _on_runner(lambda: inter.run(lambda: self._forward(inter, args, kwargs)))
        finally:
            self._inter = None
            self._stopped_at = inter.stopped_early
            for made_scope in made:
                made_scope.reset()

    def _forward(self, inter: Interleaver, args: tuple, kwargs: dict):
        """What runs under the interleaver: the model's forward (``model.generate`` runs HF
        generate instead; see generation.py)."""
        return self._model._run_forward(args, kwargs)


def _note_invoke(err: BaseException, invokes: list, inv) -> None:
    """Note on ``err``, raised on the inputs of ``inv`` when the trace's block ends (at the
    trace's `with` line), which of several invokes it was and where."""
    if len(invokes) > 1:
        body = inv._body
        _note(err, f"nnsight_lite: raised on the inputs of invoke {invokes.index(inv)} "
              f"(tracer.invoke(...) at {body.filename}:{body.lineno})")


def _on_runner(job) -> None:
    """Run ``job()`` (the forward with the bodies interleaved) on a worker greenlet: here the
    with-statement's exit is handling the skipped body's ``SkipBody``, and Python would chain
    to it every error the model's code raises and catches (HF raises hundreds of
    AttributeErrors a generate step); in the worker no exception is being handled."""
    worker = _take_worker(RUNNER)
    worker.gr_context = contextvars.copy_context()
    switch_job(worker, job)


class Invoker(BodyContext):
    """``with tracer.invoke(*inputs):`` - one body that sees only its own rows of the batch.

    Example::

        with model.trace() as tracer:
            with tracer.invoke(x1):
                a = model.layer1.output.save()
            with tracer.invoke(x2):
                model.layer1.output[:] = a      # invoke 1 reads what invoke 0 saw
    """

    _what = "invoke"
    _made_by = "tracer.invoke(...)"
    __slots__ = ("_tracer", "_args", "_kwargs", "_snapshot", "_home")

    def __init__(self, tracer: Tracer, args: tuple, kwargs: dict):
        self._tracer = tracer
        self._args = args
        self._kwargs = kwargs

    def _on_exit(self, frame):
        # The trace body's names as they are now (a loop variable's current value, say): this
        # invoke's body will see these, not what the names hold when the collecting ends.
        self._snapshot = dict(frame.f_locals)
        # None when written in the trace body itself; else the helper's frame, held until the
        # trace's _run groups the invokes by it (see there)
        self._home = None if frame.f_code is self._tracer._body.code else frame
        self._tracer._invokes.append(self)


__all__ = ["Tracer", "Invoker"]
