"""How a replica takes requests: one at a time, or gathered into one batched forward.

    Batcher.submit(payload)   queue one request (wire bytes); its reply (wire bytes)
    handle(model, payload)    run one request alone: unpickle, execute, pickle the reply

Without a window each request runs alone on the replica's serving thread, in arrival order.
With ``batch_window`` (seconds), requests arriving within the window are taken together: the
plain single-input traces among them (no ``as`` target, no ``print``, no edits) whose inputs
batch without padding (a LanguageModel's prompts of one token length) run as the invokes of
ONE trace, each body with its own rows, its own caller values and its own saved names; the
others run alone. If the shared run raises, each of its requests runs again alone,
so one request's mistake fails only that request, with its own error and line.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Mapping

import torch

from ..capture.parsing import parse
from ..errors import RemoteError, ResultTooLargeError
from . import wire
from .execute import (USER_ERRORS, Deadline, compile_body, compiled, describe, execute,
                      kept_warnings, warning_records)
from .hook import serving

def _policy(option, model):
    """The check a deployment's ``policy`` option asks for, or None: the body's source (padded
    to the user's line numbers) and the caller values it reads, against the allow-list."""
    if not option:
        return None
    from ..envoy import Envoy
    from .policy import check_body

    allow = option if isinstance(option, frozenset) else None
    tokenizer = getattr(model, "tokenizer", None)
    refs = (Envoy,) if tokenizer is None else (Envoy, type(tokenizer))
    return lambda source, filename, values: check_body(source, filename, 1, allow,
                                                       values=values, value_types=refs)


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
        err = _other_model(model, request, options)
    except wire.MissingModuleError as exc:  # module paths the served model does not have
        err = _other_model(model, exc.loaded, options) or exc
    except Exception as exc:  # noqa: BLE001 - a value the server cannot rebuild
        err = RemoteError(f"the server could not unpickle the request's values: {exc!r} (a "
                          "value from a module the server cannot import? install it there, or "
                          "call nnsight_lite.register(module) before the trace to send its "
                          "code with the request)")
    if err is not None:
        return wire.dumps({"error": describe(err, "", ""), "stdout": "", "saved": {}}, model)
    reply = execute(request, request["values"],
                    time_limit=_limit(options.get("time_limit"), request.get("time_limit")),
                    policy=_policy(options.get("policy"), model))
    return finish(model, reply, _limit(options.get("max_bytes"), request.get("max_bytes")),
                  request["filename"])


_SAVE_DATA = ("Save data instead (tensors, numbers, strings, containers of those: list(gen), "
              "a dict of tensors), or leave it unsaved")


def _other_model(model, request: dict, options: dict):
    """The error for a request traced on another kind of model than this one (a client
    whose default backend names another served model), or None."""
    theirs = request.get("model") if isinstance(request, dict) else None
    ours = type(model._module).__qualname__
    if theirs is None or theirs == ours:
        return None
    return RemoteError(
        f"the block at {request['filename']}:{request['lineno']} traces a {theirs}, but the model "
        f"served as {options.get('name', '?')!r} is a {ours}; send it to the served model that "
        "matches: backend='name' or remote.Backend('name') in the trace, or "
        "remote.connect(..., name=...) for the default")


def finish(model, reply: dict, max_bytes, filename: str) -> bytes:
    """Pickle ``reply``; an error reply instead if that fails or exceeds ``max_bytes``."""
    try:
        data = wire.dumps(reply, model)
    except Exception as exc:  # noqa: BLE001
        err = RemoteError(f"a saved value could not be pickled to send back: {exc!r}"
                          f"{wire.unpicklable(reply['saved'], model, hint=_SAVE_DATA)}")
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


class _Invoke:
    """What Tracer._run reads of an invoke: inputs, body, the names it sees."""

    __slots__ = ("_args", "_kwargs", "_body", "_snapshot", "_home")

    def __init__(self, args, kwargs, body, snapshot):
        self._args, self._kwargs, self._body, self._snapshot = args, kwargs, body, snapshot
        self._home = None  # (no helper frame; nothing is published to the others anyway)


class _Body:
    """A request's body as an invoke body (``assigned`` and ``binds`` empty: nothing is
    published to the other requests' invokes, and none waits for another's names)."""

    __slots__ = ("code", "assigned")
    binds = frozenset()

    def __init__(self, code):
        self.code = code
        self.assigned = ()


_NOTHING = _Body(compile("pass", "<batched trace>", "exec"))
_COLLECT = "__nnsight_remote_collect__"


def run_batched(model, requests: list, time_limit) -> list:
    """Run ``requests`` (single-input traces) as the invokes of one trace; their replies."""
    from ..capture import Scope
    from ..context import RUNTIME, saved_only
    from ..saving import _saved_stack
    from ..mediator import wait_for_name
    from ..tracing import Tracer

    ends = [{} for _ in requests]
    invokes = []
    names = []  # each request's synthetic filename
    for request, end in zip(requests, ends):
        _, synthetic = compiled(request["source"], request["filename"])
        names.append(synthetic)
        tail = parse(f"{_COLLECT}(locals())").body
        code = compile_body(request["source"], synthetic, request["lineno"], tail)
        args, kwargs = request["inputs"]
        snapshot = dict(request["values"], **{_COLLECT: end.update})
        invokes.append(_Invoke(args, kwargs, _Body(code), snapshot))
    glb = {"__builtins__": builtins, "__name__": "__nnsight_remote__"}
    tracer = Tracer(model, (), {})
    tracer._body = _NOTHING
    tracer._invokes = invokes
    saved: dict = {}
    stack = _saved_stack()
    stack.append(saved)
    caught: list = []
    try:  # (the Deadline innermost: see execute.execute)
        with serving(), kept_warnings(caught), Deadline(time_limit):
            tracer._run(Scope({}, glb, RUNTIME, wait_for_name))
    finally:
        stack.pop()
    return [{"saved": saved_only(end.items(), saved),  # (the collector is never saved)
             "stdout": "", "error": None, "batch": len(requests),
             "warnings": warning_records(caught, name, request["filename"], i)}
            for i, (end, name, request) in enumerate(zip(ends, names, requests))]


def handle_group(model, payloads: list, options: dict) -> list:
    """Run the requests that arrived together: batchable ones in one forward (see above)."""
    if len(payloads) == 1:
        return [handle(model, payloads[0], options)]
    requests = []
    for p in payloads:
        try:
            requests.append(wire.loads(p, model))
        except Exception:  # noqa: BLE001 - handle() gives this request its error reply
            requests.append(None)
    together = [i for i, r in enumerate(requests) if r is not None and r.get("inputs")
                and not options.get("policy") and _other_model(model, r, options) is None]
    replies: list = [None] * len(payloads)
    groups: dict = {}
    for i in together:
        groups.setdefault(_alike(model, requests[i]["inputs"]), []).append(i)
    for key, group in groups.items():
        if key is None or len(group) < 2:
            continue
        batch = [requests[i] for i in group]
        limits = [_limit(options.get("time_limit"), r.get("time_limit")) for r in batch]
        limit = min((x for x in limits if x is not None), default=None)
        try:
            for i, reply in zip(group, run_batched(model, batch, limit)):
                r = requests[i]
                replies[i] = finish(model, reply, _limit(options.get("max_bytes"),
                                                         r.get("max_bytes")), r["filename"])
        except USER_ERRORS:  # one request's mistake: each runs again alone
            for i in group:
                replies[i] = None
    return [r if r is not None else handle(model, p, options) for r, p in zip(replies, payloads)]


def _alike(model, inputs):
    """What requests must share to run as invokes of one forward and each get what it gets
    alone: the dtype and shape past the first dimension of every tensor of its inputs as the
    model batches them (a LanguageModel's token ids: prompts of other lengths would be padded,
    and a body would see, save and edit the padded rows), the types of the other values. None
    where the inputs cannot be prepared (the request then runs alone and says why)."""
    try:
        args, kwargs, _ = model._batch_inputs([model._prepare_inputs(*inputs[0], **inputs[1])])
    except Exception:  # noqa: BLE001 - the request's own error, given when it runs alone
        return None
    key: list = []

    def walk(v, depth):
        if isinstance(v, torch.Tensor):
            key.append((v.dtype, tuple(v.shape[1:]), v.device))
        elif depth and isinstance(v, (list, tuple)):
            key.append((type(v), len(v)))
            for x in v:
                walk(x, depth - 1)
        elif depth and isinstance(v, Mapping):
            key.append((type(v), tuple(map(repr, v))))
            for x in v.values():
                walk(x, depth - 1)
        else:
            key.append(type(v))

    walk((args, kwargs), 4)
    return tuple(key)


class Batcher:
    """The replica's request queue (see the module docstring)."""

    def __init__(self, model, thread, options: dict):
        self.model = model
        self.thread = thread
        self.options = options
        self.window = options.get("batch_window")
        self.pending: list = []
        self.flusher = None
        self.runs = 0  # how many groups have run (a batched group is one forward)

    async def submit(self, payload: bytes) -> bytes:
        loop = asyncio.get_running_loop()
        if not self.window:
            self.runs += 1
            return await loop.run_in_executor(self.thread, handle, self.model, payload,
                                              self.options)
        future = loop.create_future()
        self.pending.append((payload, future))
        if self.flusher is None:
            self.flusher = asyncio.ensure_future(self._flush(loop))
        return await future

    async def _flush(self, loop):
        await asyncio.sleep(self.window)
        group, self.pending, self.flusher = self.pending, [], None
        self.runs += 1
        try:
            replies = await loop.run_in_executor(
                self.thread, handle_group, self.model, [p for p, _ in group], self.options)
        except BaseException as exc:  # noqa: BLE001 - every waiting request hears of it
            for _, future in group:
                future.set_exception(exc)
            return
        for (_, future), reply in zip(group, replies):
            future.set_result(reply)
