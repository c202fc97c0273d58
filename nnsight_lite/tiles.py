"""Rows laid out in blocks: ``Tiles``, and the copies of them served to invokes.

    Tiles(count, factor)    a row factor (batching.narrow): ``count`` blocks, each the batch's
                            rows expanded by ``factor`` (classifier-free guidance's batch)
    gather(x, spans)        the rows of ``x`` in spans, as one tensor (cache.py keeps them)
    _rows_of_spans(x, ...)  an invoke's spans of such a tensor, as one copy (remembered)
    write_back(mark)        the copies' in-place edits put back into their blocks' rows
    _TILED                  the copies served on this thread and not yet written back

An invoke's rows of a tiled value are one span in each block, no one slice of it, so the body
gets a copy; Mediator.serve marks ``len(_TILED)`` before serving and calls ``write_back`` after
the body's turn, before any replacement is merged.
"""

from __future__ import annotations

import threading

import torch


class Tiles:
    """A factor (in ``row_factors``) for values whose rows are ``count`` blocks one after
    another, each the batch's rows expanded by ``factor``: classifier-free guidance's batch,
    every prompt's unconditional rows and then every prompt's conditional ones. An invoke's
    rows there are one span in each block, so it is served a copy of them, and what it edits
    in place is written back into the blocks after its turn (write_back)."""

    __slots__ = ("count", "factor")

    def __init__(self, count: int, factor: int = 1):
        self.count = count
        self.factor = factor


class _Served(threading.local):
    """The tiled copies served on this thread and not yet written back, newest last, as
    ``(base, spans, copy, its version)``: per thread, as traces on two threads interleave."""

    def __init__(self):
        self.copies = []

    def __len__(self):
        return len(self.copies)


_TILED = _Served()


def gather(x: torch.Tensor, spans: list) -> torch.Tensor:
    """The rows of ``x`` in ``spans`` (``(start, size)`` pairs), as one tensor (a copy)."""
    return torch.cat([x[s:s + n] for s, n in spans], 0)


def _rows_of_spans(x: torch.Tensor, spans: list) -> torch.Tensor:
    """The rows of ``x`` in ``spans``, as one tensor (a copy: kept in _TILED for write_back)."""
    copy = gather(x, spans)
    _TILED.copies.append((x, spans, copy, copy._version))
    return copy


def write_back(mark: int) -> None:
    """Copy what bodies edited in place in the tiled copies served since ``len(_TILED)`` was
    ``mark`` back into their blocks' rows, and forget them."""
    served = _TILED.copies
    for base, spans, copy, version in served[mark:]:
        if copy._version != version:
            at = 0
            for s, n in spans:
                base[s:s + n].copy_(copy[at:at + n])
                at += n
    del served[mark:]
