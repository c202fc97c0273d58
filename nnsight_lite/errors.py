"""Exceptions raised by nnsight_lite, and how they reach the user.

Every exception the library raises on purpose derives from :class:`NNsightError` and also from
the builtin it resembles, so ``except LookupError`` keeps working for code that does not know
about us.

Error flow: a mistake made inside a trace body (reading a module out of order, a module that
never runs) is raised *inside the body's greenlet*, at the line that asked, so the traceback
points at the user's own code. Exceptions the user's code raises are never wrapped: they reach
the caller unchanged, after the trace has removed its hooks and finished every body. Context is
added as notes (``add_note``): which invoke's body raised, where a trace runs several; that a
persistent edit's body raised (named by its ``with model.edit(...)`` line); and, on an error the
model's own forward raises, each earlier replacement of a value by one of another shape, dtype
or device (module path, invoke, line, both values: tracebacks.record_reshape).

    NNsightError
    ├── OutOfOrderError        (RuntimeError)   a value requested after its module already ran
    ├── MissedModuleError      (RuntimeError)   a requested module never ran (or ran fewer times)
    ├── ModulePathError        (AttributeError) no such submodule or attribute; lists near matches
    ├── OutsideTraceError      (RuntimeError)   .output / .input read where no trace is running
    ├── SourceUnavailableError (RuntimeError)   the with-block's source cannot be found
    ├── BodySyntaxError        (SyntaxError)    return / yield / break at the top of a body
    ├── BatchingError          (ValueError)     invoke inputs that cannot form one batch
    ├── InvokeError            (RuntimeError)   tracer.invoke(...) opened where none can be added
    ├── ReusedContextError     (RuntimeError)   a trace/invoke/edit object entered a second time
    ├── InputError             (TypeError, ValueError)  a prompt or option a wrapper cannot use
    ├── InferenceModeSwitchError (RuntimeError) waiting for a value inside torch.inference_mode()
    ├── GradientError          (RuntimeError)   .grad / backward misuse (outside a backward block...)
    ├── CacheError             (ValueError)     tracer.cache() where it cannot record everything
    │   └── CacheKeyError      (KeyError, AttributeError)  a key a cache view does not hold
    ├── PolicyError            (PermissionError) a remote body the deployment's allow-list refuses
    └── RemoteError            (RuntimeError)   a remote run failed outside the body (see remote/)
        ├── RemoteTimeoutError (TimeoutError)   the body ran past the request's time limit
        └── ResultTooLargeError (ValueError)    the saved values exceed the request's byte cap
"""

from __future__ import annotations


class NNsightError(Exception):
    """Root of every exception nnsight_lite raises on purpose."""


class OutOfOrderError(NNsightError, RuntimeError):
    """A body asked for a module value whose moment has already passed in this forward."""


class MissedModuleError(OutOfOrderError, ValueError):
    """A body waited for a module call that did not happen before the forward ended (the
    forward ran past it: an OutOfOrderError, as nnsight 0.8 raises after a skip or a stop, and
    a ValueError, as it raises for a module that never runs)."""


class ModulePathError(NNsightError, AttributeError):
    """An attribute or submodule name that the wrapped module does not have."""


class OutsideTraceError(NNsightError, RuntimeError, ValueError):
    """A module value (``.output``, ``.input``, ...) was read where no trace body is running
    (a ValueError too, as nnsight 0.8 raises)."""


class SourceUnavailableError(NNsightError, RuntimeError):
    """The source of a ``with model.trace(...)`` block cannot be found, so it cannot be run."""


class NoSourceError(SourceUnavailableError):
    """There is no source at all for a block (bare REPL before 3.13, piped stdin, ``exec`` of a
    plain string): a trace given inputs and a backward block then run in place (nosource.py)."""


class WithBlockNotFoundError(SourceUnavailableError):
    """``model.trace(...)`` (or another body context) was entered without a with-statement,
    by calling ``__enter__()`` itself (the name nnsight 0.8 gives this error)."""


class BodySyntaxError(NNsightError, SyntaxError):
    """A statement that cannot live at the top level of a trace body (``return``, ``yield``)."""


class BatchingError(NNsightError, ValueError):
    """The inputs of several invokes cannot be combined into one batch."""


class InvokeError(NNsightError, RuntimeError, ValueError):
    """``tracer.invoke(...)`` opened where no invoke can be added: in a trace given inputs,
    inside another invoke's body while the model runs, or after the trace (a ValueError too,
    as nnsight 0.8 raises)."""


class ReusedContextError(NNsightError, RuntimeError):
    """A ``model.trace(...)`` (``generate``, ``scan``), ``tracer.invoke(...)`` or ``model.edit()``
    object entered by a second with-statement: each runs one block (a session may run again)."""


class InputError(NNsightError, TypeError, ValueError):
    """An input a model wrapper cannot use: a prompt of the wrong type, an empty prompt, token
    ids outside the vocabulary, a missing required option (``max_new_tokens``)."""


class NotAContainerError(NNsightError, TypeError):
    """``len()``, iteration or unpacking of an Envoy whose module holds no list of modules."""


class InferenceModeSwitchError(NNsightError, RuntimeError):
    """A body waited for a module value while inside its own ``torch.inference_mode()`` block."""


class GradientError(NNsightError, RuntimeError):
    """A gradient was asked for where none can exist (no grad, not in graph, wrong context)."""


class CacheError(NNsightError, ValueError):
    """``tracer.cache()`` called where it cannot record what it was asked to (after the body
    already read a model value, in a trace body that only sets up invokes, ...)."""


class CacheKeyError(CacheError, KeyError, AttributeError):
    """A cache view (or entry) indexed by a key it does not hold. A ``KeyError``, as a mapping's
    miss is (``view.get(key)``, ``key in view``), and an ``AttributeError``, as nnsight's is."""

    __str__ = BaseException.__str__  # (KeyError's would show the message in quotes)


class PolicyError(NNsightError, PermissionError):
    """A body sent to a deployment served with an allow-list policy does something the policy
    refuses (an import, a dunder, a call outside the list): nothing of it ran."""


class RemoteError(NNsightError, RuntimeError):
    """A remote trace could not run: no such served model, a replica died, a value could not
    cross the wire. (An exception the body itself raises arrives as its own type.)"""


class RemoteTimeoutError(RemoteError, TimeoutError):
    """A remote body ran past its request's time limit and was stopped."""


class ResultTooLargeError(RemoteError, ValueError):
    """The values a remote body saved are more bytes than the request may return."""
