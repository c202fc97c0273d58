"""How a replica takes requests: one at a time, or gathered into one batched forward.

    Batcher.submit(payload)   queue one request (wire bytes); its reply (wire bytes)
    handle(model, payload)    run one request alone: unpickle, execute, pickle the reply

Without a window each request runs alone on the replica's serving thread, in arrival order.
"""

from __future__ import annotations

import asyncio

from ..errors import RemoteError, ResultTooLargeError
from . import wire
from .execute import describe, execute

try:  # the opt-in allow-list policy (written separately; absent means no policy available)
    from .policy import check_body
except ImportError:  # pragma: no cover - until policy.py lands
    check_body = None


def _policy(option):
    """The check a deployment's ``policy`` option asks for, or None."""
    if not option:
        return None
    if check_body is None:
        raise RemoteError("this deployment asks for a body policy, but nnsight_lite.remote."
                          "policy is not available in this installation")
    allow = option if isinstance(option, frozenset) else None
    return lambda source, filename, line: check_body(source, filename, line, allow)


def _limit(server, client):
    if server is None:
        return client
    if client is None:
        return server
    return min(server, client)


def handle(model, payload: bytes, options: dict) -> bytes:
    """Run one request alone and return its reply as wire bytes."""
    try:
        request = wire.loads(payload, model)
    except Exception as exc:  # noqa: BLE001 - a value the server cannot rebuild
        err = RemoteError(f"the server could not unpickle the request's values: {exc!r} (a "
                          "value from a module the server cannot import? install it there)")
        return wire.dumps({"error": describe(err, "", ""), "stdout": "", "saved": {}}, model)
    reply = execute(request, request["values"],
                    time_limit=_limit(options.get("time_limit"), request.get("time_limit")),
                    policy=_policy(options.get("policy")))
    return finish(model, reply, _limit(options.get("max_bytes"), request.get("max_bytes")),
                  request["filename"])


def finish(model, reply: dict, max_bytes, filename: str) -> bytes:
    """Pickle ``reply``; an error reply instead if that fails or exceeds ``max_bytes``."""
    try:
        data = wire.dumps(reply, model)
    except Exception as exc:  # noqa: BLE001
        err = RemoteError(f"a saved value could not be pickled to send back: {exc!r}")
        return wire.dumps(dict(reply, saved={}, result=None,
                               error=describe(err, "", filename)), model)
    if max_bytes is not None and len(data) > max_bytes:
        sizes = ", ".join(f"{k}: {len(wire.dumps(v, model))} B"
                          for k, v in reply["saved"].items())
        err = ResultTooLargeError(
            f"the values this remote body saved are {len(data)} bytes, over the request's cap "
            f"of {max_bytes} bytes ({sizes}); save less (a slice, a reduction) or raise the cap")
        data = wire.dumps(dict(reply, saved={}, result=None,
                               error=describe(err, "", filename)), model)
    return data


class Batcher:
    """The replica's request queue (see the module docstring)."""

    def __init__(self, model, thread, options: dict):
        self.model = model
        self.thread = thread
        self.options = options

    async def submit(self, payload: bytes) -> bytes:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.thread, handle, self.model, payload, self.options)
