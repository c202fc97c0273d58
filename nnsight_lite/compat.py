"""Names older nnsight code reaches for, kept so it runs after changing the import.

    apply(fn, *args, **kwargs)   ``fn(*args, **kwargs)``: bodies run eagerly, no graph node needed
    CONFIG                       nnsight's settings object: ``CONFIG.APP.DEBUG`` (full tracebacks
                                 from bodies, like ``NNSIGHT_LITE_FULL_TRACEBACK=1``); the
                                 remote-API settings are stored and otherwise unused here
    NNsightDeprecationWarning    nnsight's warning category, for code that filters it (nothing
                                 here warns with it: the older forms simply work)
    log(*args)                   ``print``, as nnsight 0.5's ``nnsight.log`` (gone in 0.8)
    list, dict, tuple, ...       nnsight's graph-era container constructors, which nnsight 0.5+
                                 keeps as (deprecated) aliases of the builtins: the builtins
                                 (``nnsight.list().save()`` in a body is a saved ``[]``)

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
        full = os.environ.get("NNSIGHT_LITE_FULL_TRACEBACK", "") not in ("", "0")
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
