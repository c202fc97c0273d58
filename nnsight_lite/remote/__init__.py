"""Run traces where the model lives: models served by Ray actors, bodies shipped to them.

    serve(model, ...)     start replicas of a model on the Ray cluster (server.py)
    stop(name)            end them; served() lists what is served
    connect(address)      join a cluster; ``remote=True`` then runs traces there (client.py)
    Backend(name)         a served model to run on: ``model.trace(x, backend=Backend("gpt2"))``
    register(module)      send a module of yours by value, for replicas that cannot import it

Example::

    import ray
    from nnsight_lite import remote

    ray.init()
    remote.serve("smollm2")                          # loads the weights once, on a replica
    remote.connect()
    model = smollm2()                                # the client's copy stays on meta
    with model.trace("Hello", remote=True):
        h = model.model.layers[3].output.save()

Modules: hook.py (the seam in tracing.py), wire.py (what is pickled; model references),
execute.py (running one request on the server), batching.py (the replica's queue), server.py
(replicas), client.py (connect, Backend, shipping), testing.py (small models for tests),
``python -m nnsight_lite.remote`` (the command line). Needs the ``remote`` extra (ray,
cloudpickle).
"""

from __future__ import annotations

_LAZY = {
    "serve": "server", "stop": "server", "served": "server", "load": "server",
    "connect": "client", "Backend": "client",
}


def register(module) -> None:
    """Send ``module``'s functions and classes with the requests that use them, by value, so
    replicas that cannot import it (a module of yours, not installed on the cluster) rebuild
    them (nnsight's ``nnsight.register``). ``module``: the module or its name. The module a
    with-statement is written in is sent so already."""
    import importlib

    try:
        import cloudpickle
    except ImportError:
        raise ImportError("nnsight_lite.register needs cloudpickle: install the remote extra "
                          "(pip install 'nnsight_lite[remote]')") from None
    from .wire import _BY_VALUE

    if isinstance(module, str):
        module = importlib.import_module(module)
    with _BY_VALUE:  # (not while a trace being pickled sends it by value for the moment: it
        cloudpickle.register_pickle_by_value(module)  # would take it out of the registry after)


def __getattr__(name):  # ray is imported only when a remote feature is used
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nnsight_lite.remote' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = sorted([*_LAZY, "register"])
