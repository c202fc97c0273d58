"""The seam between the tracing contexts and remote execution (imports nothing heavy).

    take_backend(kwargs)   pop ``remote=`` / ``backend=`` from a context's keywords: the backend
                           to run on, or None to run here (``remote="local"``: a LocalBackend)
    serving()              a context manager the server runs requests under: there ``remote=``
                           in a shipped header means "here"

A trace that does not name either keyword pays two dict look-ups.
"""

from __future__ import annotations

import contextlib
import threading

_state = threading.local()


def take_backend(kwargs: dict):
    """Pop ``remote``/``backend`` from ``kwargs``; return the backend to run on, or None."""
    remote = kwargs.pop("remote", False)
    backend = kwargs.pop("backend", None)
    if not remote and backend is None:
        return None
    if getattr(_state, "serving", False):  # a shipped header evaluated on the server
        return None
    if remote == "local" and backend is None:  # nnsight's simulation: pickled, run here
        from .client import LocalBackend

        return LocalBackend()
    from .client import resolve_backend

    return resolve_backend(backend)


def wants_remote(kwargs: dict) -> bool:
    """Whether ``kwargs`` ask for a remote run (a LanguageModel then keeps its meta weights)."""
    remote = kwargs.get("remote")
    return (bool(remote) and remote != "local") or kwargs.get("backend") is not None


@contextlib.contextmanager
def serving():
    """Run requests under this on the server: nested ``remote=True`` headers run in place."""
    before = getattr(_state, "serving", False)
    _state.serving = True
    try:
        yield
    finally:
        _state.serving = before
