"""How a trace's invokes become bodies of one interleaved forward: their rows of the batch and
the scopes they run in.

    add_invokes(inter, invokes, sizes, scope, made)   a Mediator per invoke, in invoke order

Each invoke has its own scope: the trace body's names as of the invoke (its snapshot), then
what it binds itself; what other invokes bind reaches it through the trace's shared scope, and
a later invoke waits for a name an earlier one binds (``Scope._awaited``). Invokes opened in a
helper function share names with that call's invokes only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .context import body_job

if TYPE_CHECKING:
    from .interleaver import Interleaver


def add_invokes(inter: "Interleaver", invokes: list, sizes: list, scope, made: list) -> None:
    """Add a body for each of ``invokes`` (the ones with inputs have ``sizes`` rows each, in
    order) to ``inter``, each in a child of the trace's ``scope``; the scopes made go into
    ``made``, which the trace clears at its end."""
    start = 0
    sized = iter(sizes)
    many = len(invokes) > 1
    add = inter.add
    homes: dict = {}  # id(frame) -> the shared scope of the invokes written in a helper
    bound: dict = {}  # id(shared scope) -> the names its invokes so far bind
    for inv in invokes:
        if inv._args or inv._kwargs:
            size = next(sized)
            batch = (start, size) if many else None
            start += size
        else:
            batch = None
        # Each invoke has its own scope: the trace body's names as of the invoke, then what
        # it binds itself; what other invokes bind reaches it through the shared `scope`.
        # Invokes opened in a helper function share names with that call's invokes only.
        shared = scope
        home = inv._home
        if home is not None:
            shared = homes.get(id(home))
            if shared is None:
                shared = homes[id(home)] = scope.child({})
                made.append(shared)
        snapshot = inv._snapshot
        own = shared.child(snapshot)
        made.append(own)
        body = inv._body
        own._awaited = bound.get(id(shared))
        if body.binds:
            bound[id(shared)] = body.binds | bound.get(id(shared), frozenset())
        med = add(body_job(body.code, own), batch, own)
        if body.assigned:  # (names it binds are published for later invokes: see publish)
            med.shared, med.snapshot, med.assigned = shared, snapshot, body.assigned
