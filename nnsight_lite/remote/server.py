"""Serving a model on a Ray cluster: replicas that load the weights once and run requests.

    serve(model, name=..., replicas=..., ...)   start the replicas (Ray actors) and return
                                                their handles; they stay up (detached)
    stop(name)                                  end a served model's replicas
    served()                                    the names served on the connected cluster
    load(spec, **kwargs)                        what a replica loads: an ``NNsight``

Example::

    import ray
    from nnsight_lite import remote

    ray.init()                                         # or ray.init(address="auto")
    remote.serve("smollm2", replicas=2, num_cpus=2)    # or a hub id / path, or "pkg.mod:factory"

Each replica is a Ray actor named ``nnsight_lite:<name>:<i>`` in the ``nnsight_lite``
namespace, restarted by Ray if it dies (``max_restarts``). A replica runs one request's trace at
a time on its own serving thread; requests arriving meanwhile queue, and compatible ones can be
run together as invokes of one batched forward (``batch_window``; see batching.py).
"""

from __future__ import annotations

import asyncio
import importlib
import os
from concurrent.futures import ThreadPoolExecutor

NAMESPACE = "nnsight_lite"
PREFIX = "nnsight_lite:"
SMOLLM2 = "smollm2"


def actor_name(name: str, i: int) -> str:
    return f"{PREFIX}{name}:{i}"


def default_name(spec: str) -> str:
    """The name a model is served under unless given one (what a client's model maps to)."""
    if spec == SMOLLM2:
        from ..models import SMOLLM2_DIR

        return SMOLLM2_DIR
    if _is_factory(spec):
        return spec.rsplit(":", 1)[1]
    return os.path.basename(os.path.normpath(spec)) if os.path.isdir(spec) else spec


def _is_factory(spec: str) -> bool:
    mod, sep, fn = spec.partition(":")
    return bool(sep) and fn.isidentifier() and all(p.isidentifier() for p in mod.split("."))


def load(spec: str, **kwargs):
    """What a replica serves: ``"smollm2"``, ``"pkg.mod:factory"`` (called with ``kwargs``,
    returning an NNsight) or a Hugging Face id / local path (a LanguageModel, dispatched)."""
    if spec == SMOLLM2:
        from ..models import smollm2

        return smollm2(dispatch=True, **kwargs)
    if _is_factory(spec) and not os.path.exists(spec):
        mod, _, fn = spec.partition(":")
        model = getattr(importlib.import_module(mod), fn)(**kwargs)
        from ..model import NNsight

        if not isinstance(model, NNsight):
            raise TypeError(f"the factory {spec} returned {type(model).__name__}, not an NNsight")
        return model
    from ..language import LanguageModel

    return LanguageModel(spec, dispatch=True, **kwargs)


class Replica:
    """One loaded copy of a model, as a Ray actor (async: requests queue on its event loop;
    traces run one at a time on a serving thread)."""

    def __init__(self, spec: str, load_kwargs: dict, options: dict):
        self.model = load(spec, **load_kwargs)
        self.options = options
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="nnsight-serve")
        from .batching import Batcher

        self._batcher = Batcher(self.model, self._thread, options)
        self.pid = os.getpid()

    def info(self) -> dict:
        return {"pid": os.getpid(), "options": self.options, "runs": self._batcher.runs}

    async def run(self, payload: bytes) -> bytes:
        """Run one request (wire bytes in, wire bytes out)."""
        return await self._batcher.submit(payload)

    async def ping(self) -> int:
        await asyncio.sleep(0)
        return os.getpid()


def serve(model: str, *, name: str | None = None, replicas: int = 1, num_cpus: float = 1,
          num_gpus: float = 0, device_map=None, dtype=None, time_limit: float | None = 600,
          max_bytes: int | None = 1 << 30, batch_window: float | None = None,
          policy=False, max_restarts: int = -1, detached: bool = True, wait: bool = True,
          load_kwargs: dict | None = None) -> list:
    """Start ``replicas`` Ray actors serving ``model``; return their handles.

    Example::

        ray.init()
        remote.serve("tests.remote.models:tiny_gpt2", name="gpt2", replicas=2, num_cpus=1)

    - ``model``: ``"smollm2"``, a Hugging Face id or local path, or ``"pkg.mod:factory"``.
    - ``name``: what clients ask for (default: the path's last part, the id, or the factory).
    - ``num_cpus`` / ``num_gpus``: Ray resources per replica; ``device_map`` / ``dtype`` go to
      loading (with ``num_gpus`` set and no ``device_map``, the replica loads onto its GPU).
    - ``time_limit`` (seconds) and ``max_bytes``: the most any request may use; a client may
      ask for less. ``batch_window`` (seconds): gather single-input traces arriving together
      into one batched forward (None: one request at a time).
    - ``policy``: True (or a frozenset of allowed names) refuses, before running, bodies that
      import, touch dunders or call names outside the allow-list (see policy.py).
    """
    import ray

    kwargs = dict(load_kwargs or {})
    if dtype is not None:
        kwargs["dtype"] = dtype
    if device_map is not None:
        kwargs["device_map"] = device_map
    elif num_gpus and not _is_factory(model):
        kwargs["device_map"] = "cuda"
    name = name or default_name(model)
    options = {"time_limit": time_limit, "max_bytes": max_bytes, "batch_window": batch_window,
               "policy": policy, "name": name}
    cls = ray.remote(Replica)
    handles = []
    for i in range(replicas):
        opts = dict(name=actor_name(name, i), namespace=NAMESPACE, max_restarts=max_restarts,
                    num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=64)
        if detached:
            opts["lifetime"] = "detached"
        handles.append(cls.options(**opts).remote(model, kwargs, options))
    if wait:
        ray.get([h.ping.remote() for h in handles])  # loaded (raises if loading failed)
    return handles


def _connected(what: str) -> None:
    """Raise unless this process has joined a Ray cluster: Ray's own functions would start a
    new, empty local one instead (and find nothing served there)."""
    import ray

    if not ray.is_initialized():
        from ..errors import RemoteError

        raise RemoteError(f"{what} needs a Ray cluster, and this process has not joined one (or "
                          "left it: ray.shutdown()); call nnsight_lite.remote.connect(address) "
                          "or ray.init(address=...) first")


def served() -> list:
    """The names of the models served on the connected cluster (sorted)."""
    import ray.util

    _connected("remote.served()")
    names = set()
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor.get("namespace") == NAMESPACE and actor["name"].startswith(PREFIX):
            names.add(actor["name"][len(PREFIX):].rsplit(":", 1)[0])
    return sorted(names)


def replicas_of(name: str) -> list:
    """The actor handles serving ``name`` (empty if it is not served)."""
    import ray
    import ray.util

    _connected("finding the replicas of a served model")
    out = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        full = actor["name"]
        if actor.get("namespace") == NAMESPACE and full.startswith(PREFIX) and \
                full[len(PREFIX):].rsplit(":", 1)[0] == name:
            out.append(ray.get_actor(full, namespace=NAMESPACE))
    return out


def stop(name: str) -> int:
    """End every replica serving ``name``; return how many there were."""
    import ray

    _connected(f"remote.stop({name!r})")
    handles = replicas_of(name)
    for h in handles:
        ray.kill(h, no_restart=True)
    return len(handles)
