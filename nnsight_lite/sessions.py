"""``model.session()`` and ``model.edit()``: bodies that are not one forward.

    Session   ``with model.session():`` - traces in a row sharing their values
    Editor    ``with model.edit() as edited:`` - a body recorded and run before every trace's
              own bodies
    _add_edits(inter, model)  a model's recorded edits added to a trace's interleaver (first)
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from .capture import Scope, let_go_of_locals, names_read
from .context import RUNTIME, BodyContext, body_job
from .envoy import Envoy
from .errors import NNsightError
from .mediator import wait_for_name
from .waits import StopTrace

if TYPE_CHECKING:
    from .interleaver import Interleaver


class Session(BodyContext):
    """``with model.session():`` - several traces in a row that share their values.

    Example::

        with model.session():
            with model.trace(x1):
                h = model.layer1.output          # no .save() needed inside the session
            with model.trace(x2):
                model.layer1.output[:] = h
                out = model.output.save()        # only saved values leave the session

    Traces of other models may use the session's values too.
    """

    _what = "session"
    _single_use = False

    def __init__(self, model=None, backend=None):
        self._model = model
        self._backend = backend  # remote: the whole session runs on a served model

    def _on_exit(self, frame):
        if self._backend is not None:
            from .remote.client import run_remote

            return run_remote(self, frame, self._model)
        self._run_in_scope(frame, self._run)

    def _run(self, scope):
        try:
            exec(self._body.code, scope)
        except StopTrace:
            pass

    def _let_go(self) -> None:
        self._model = self._backend = None


class Editor(BodyContext):
    """``with model.edit() as edited:`` - record the body as an edit applied on every trace.

    Example::

        with model.edit() as edited:
            edited.layer1.output[:] = 0         # use `edited`, or `model` with inplace=True
        with edited.trace(x):
            out = edited.output.save()          # layer1 zeroed; model itself is unchanged

    nnsight 0.8's ``with model.edit() as (tracer, edited):`` works too. ``model.edit(inplace=True)`` edits ``model`` itself; ``model.clear_edits()`` removes all edits.
    Edits run before the trace's own bodies, on the whole batch.
    """

    _what = "edit"
    _made_by = "model.edit()"

    def __init__(self, target):
        self._target = target

    def _capture(self, frame) -> None:
        super()._capture(frame)
        # nnsight 0.8 binds `(tracer, edited)`: `as (tracer, edited)` unpacks the Envoy right
        # after __enter__ returns, and its __iter__ then gives (this editor, the Envoy) once
        self._target.__dict__["_unpacking"] = self
        self._binds = self._target  # `as edited` binds the model

    def __exit__(self, exc_type, exc, tb):
        self._target.__dict__.pop("_unpacking", None)
        return super().__exit__(exc_type, exc, tb)

    def _let_go(self) -> None:
        self._target = self._binds = None  # (0.8's `as (tracer, edited)` leaves this object bound)

    def _on_exit(self, frame):
        # The caller's variables the body reads, as the edit was written. Those that are the
        # edited model itself are kept as names only (bound at each trace): the model holding
        # its own edit would be a reference cycle, freed only by the garbage collector (so is
        # this editor, 0.8's `tracer`: dropped).
        target = self._target
        f_locals = frame.f_locals
        snapshot = {k: f_locals[k] for k in names_read(self._body.code) if k in f_locals}
        let_go_of_locals(frame)
        selves = tuple(k for k, v in snapshot.items() if v is target)
        for k in selves:
            del snapshot[k]
        for k in [k for k, v in snapshot.items() if v is self]:
            del snapshot[k]
        # a submodule's edit lives on a wrapper its Envoy holds: an Envoy that holds it (that
        # one, one above it) is held weakly, or the model would hold itself
        for k, v in snapshot.items():
            if isinstance(v, Envoy) and _holds(v, target):
                snapshot[k] = _Held(v)
        edit = _Edit((self._body, snapshot, frame.f_globals, selves))
        target.__dict__["_edits"] = target._edits + (edit,)


def _holds(envoy, target) -> bool:
    """Whether ``envoy`` holds the wrapper ``target`` (a submodule's own, made by its
    ``edit``): it is that submodule's Envoy, or one of a module above it."""
    if envoy.__dict__.get("_wrapped_alone") is target:
        return True
    module = target._module
    return envoy._module is not module and any(m is module for m in envoy._module.modules())


class _Edit(tuple):
    """One persistent edit: ``(body, names it reads, its globals, names meaning the model)``.
    Pickling or deep-copying it (with the model that holds it) says why it cannot be done,
    instead of pickle's "cannot pickle code objects"."""

    __slots__ = ()

    def __reduce_ex__(self, protocol):
        body = self[0]
        raise TypeError(
            f"a model with persistent edits cannot be pickled or deep-copied: the edit made by "
            f"`with ...edit(...)` at {body.filename}:{body.lineno} is a compiled body holding the "
            "names it was written with. Call model.clear_edits() first (and make the edits "
            "again on the copy), or copy the module itself and wrap it again.")


class _Held:
    """An Envoy a submodule's edit reads, held weakly (see Editor._on_exit)."""

    __slots__ = ("ref",)

    def __init__(self, envoy):
        self.ref = weakref.ref(envoy)

    def get(self, name: str, body):
        envoy = self.ref()
        if envoy is None:
            raise NNsightError(
                f"the edit made at {body.filename}:{body.lineno} reads `{name}`, a model that has "
                "since been dropped; keep the model while its submodule's edits are in use"
            )
        return envoy


def _add_edits(inter: Interleaver, model) -> list:
    """Add ``model``'s persistent edits to ``inter`` (they run first, on the whole batch);
    return the scopes made for them."""
    made = []
    edits = model._edits
    inter.edits = tuple(body for body, _, _, _ in edits)  # (messages name these bodies by it)
    for body, snapshot, f_globals, selves in edits:
        if selves:  # the names that meant the edited model mean the model traced now
            snapshot = {**snapshot, **dict.fromkeys(selves, model)}
        if any(type(v) is _Held for v in snapshot.values()):
            snapshot = {k: v.get(k, body) if type(v) is _Held else v for k, v in snapshot.items()}
        edit_scope = Scope(snapshot, f_globals, RUNTIME, wait_for_name)
        made.append(edit_scope)
        inter.add(body_job(body.code, edit_scope), None, edit_scope)
    return made
