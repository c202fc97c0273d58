"""Names older nnsight code reaches for, kept so it runs after changing the import.

    apply(fn, *args, **kwargs)   ``fn(*args, **kwargs)``: bodies run eagerly, no graph node needed
    CONFIG                       nnsight's settings object: ``CONFIG.APP.DEBUG`` (full tracebacks
                                 from bodies, like ``NNSIGHT_LITE_FULL_TRACEBACK=1``); the
                                 remote-API settings are stored and otherwise unused here
    NNsightDeprecationWarning    nnsight's warning category, for code that filters it (nothing
                                 here warns with it: the older forms simply work)
    log(*args)                   ``print``, as nnsight 0.5's ``nnsight.log`` (gone in 0.8)
    list, dict, tuple, ...       nnsight's graph-era container constructors, which nnsight 0.5
                                 kept as (deprecated) aliases of the builtins: the builtins
                                 (``nnsight.list().save()`` in a body is a saved ``[]``)
    stop(), session(), trace     nnsight 0.5's other legacy names: the innermost trace's
                                 ``tracer.stop()``, a session of no model, a no-op decorator
    cond, iter, local            graph-era forms nnsight 0.5 refused too: an error showing the
                                 plain Python that replaces them

Example::

    import nnsight_lite as nnsight
    with model.trace(x):
        n = nnsight.apply(len, model.layer.output)     # the same as len(...)
"""

from __future__ import annotations

import builtins
import os


def apply(fn, *args, **kwargs):
    """Call ``fn(*args, **kwargs)`` now. nnsight's graph-era bodies needed ``apply`` to put a
    call into the intervention graph; here bodies are ordinary Python, so it is a plain call.

    Example::

        with model.trace(x):
            top = nnsight_lite.apply(torch.topk, model.output, 3).indices.save()
    """
    return fn(*args, **kwargs)


def stop() -> None:
    """nnsight 0.5's ``nnsight.stop()``: ``tracer.stop()`` of the innermost trace whose body
    calls it (a backward block's: that backward pass)."""
    from .errors import InvokeError, NNsightError
    from .mediator import _collecting
    from .messages import in_backward_block
    from .waits import StopTrace
    from .workers import _getcurrent, user_location

    where = user_location()
    if getattr(_getcurrent(), "mediator", None) is None and not in_backward_block():
        if getattr(_collecting, "depth", 0):
            raise InvokeError(
                f"nnsight_lite.stop() at {where} is in the body of a trace given no inputs, "
                "which only sets up its invokes before the model runs; call it inside an "
                "invoke's body, after the reads it should come after")
        raise NNsightError(
            f"nnsight_lite.stop() at {where} was called outside the body of a running trace, "
            "so there is no forward to end; call it (or tracer.stop()) inside the body of the "
            "trace it should end")
    raise StopTrace(None, where)


def session():
    """nnsight 0.5's ``nnsight.session()``: ``with nnsight_lite.session():`` runs traces (of
    any models) in a row that share their values without ``.save()``, as ``model.session()``
    does; only saved values leave it."""
    from .sessions import Session

    return Session()


def trace(fn):
    """nnsight 0.5's ``@nnsight.trace`` decorator: the function itself (bodies may call any
    function already)."""
    return fn


def _refused(name: str, instead: str):
    def refused(*args, **kwargs):
        from .errors import NNsightError

        raise NNsightError(f"nnsight.{name}(...) is a graph-era form that nnsight 0.5 refused "
                           f"as well; bodies here run eagerly on real tensors: {instead}")

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"nnsight's graph-era ``{name}``: raises, showing what replaces it."
    return refused


cond = _refused("cond", "write a plain `if model.layer.output.sum() > 0:`")
iter = _refused("iter", "loop over generation steps with `for step in tracer.iter[...]:`")
local = _refused("local", "a body's code runs where its trace runs; compute the value in the "
                          "body, or save it and compute after the block")


def log(*args, **kwargs) -> None:
    """nnsight 0.5's ``nnsight.log(message)`` (0.8.1 has none): ``print`` (as ``tracer.log``)."""
    print(*args, **kwargs)


#: nnsight 0.5 kept its graph-era constructors (``nnsight.list()``, ``nnsight.dict()``, ...)
#: as deprecated aliases of the builtins, so code using them runs there: here they are the
#: builtins themselves (not exported by ``import *``, which would shadow nothing new)
LEGACY_BUILTINS = ("bool", "bytes", "bytearray", "complex", "dict", "float", "int", "list",
                   "str", "tuple")
legacy_builtins = {name: getattr(builtins, name) for name in LEGACY_BUILTINS}


class NNsightDeprecationWarning(FutureWarning):
    """nnsight's category for deprecated forms, so ``warnings.filterwarnings("ignore",
    category=nnsight.NNsightDeprecationWarning)`` runs; nnsight_lite never warns with it."""


class _Section:
    """A settings namespace: attributes read and set like a plain object."""

    def __init__(self, **values):
        self.__dict__.update(values)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"{type(self).__name__}({inner})"


class _Config:
    """``nnsight_lite.CONFIG``: the fields nnsight code commonly reads or sets.

    Example::

        nnsight_lite.CONFIG.APP.DEBUG = True    # tracebacks from bodies keep the runtime frames
    """

    def __init__(self):
        full = any(os.environ.get(name, "") not in ("", "0")  # (NNSIGHT_DEBUG: nnsight's name)
                   for name in ("NNSIGHT_LITE_FULL_TRACEBACK", "NNSIGHT_DEBUG"))
        self.APP = _Section(DEBUG=full, REMOTE_LOGGING=False, PYMOUNT=True, CROSS_INVOKER=True,
                            TRACE_CACHING=False, GLOBAL_TRACING=False)
        self.API = _Section(HOST="", SSL=True, APIKEY=None, FORMAT="json")

    def set_default_api_key(self, key: str) -> None:
        """Stored for code that sets it; nnsight_lite sends nothing to NDIF."""
        self.API.APIKEY = key

    def save(self) -> None:
        """nnsight writes its config file here; nnsight_lite keeps settings in memory only."""

    def __repr__(self) -> str:
        return f"CONFIG(APP={self.APP!r}, API={self.API!r})"


CONFIG = _Config()
