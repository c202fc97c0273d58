"""Batch slicing: give each invoke its rows of a value, and put its edits back.

    narrow(value, start, size, total)         each invoke's view of a (nested) value
    merge(full, part, start, size, total)     the full value with one invoke's rows replaced
    entries / merge_replaced                  members a body set in a narrowed dict or list
    concat_inputs(invoke_inputs)              one batch from several invokes' (args, kwargs)

A tensor is "batch-shaped" when its first dimension equals the trace's total batch size; only
those are sliced (and, in a ``generate`` with beams or several returned sequences, those whose
rows are the batch's expanded by that factor: each invoke's rows' beams). Views from ``narrow``
share storage with the full tensor, so in-place edits made by a body land in the batch without
copying; rows laid out in blocks (``Tiles``: a diffusion pipeline's guidance batch) are served
as a copy, and ``write_back`` puts a body's in-place edits of it back (tiles.py).
"""

from __future__ import annotations

import dataclasses
from itertools import chain, repeat
from typing import Any

import torch

from .errors import BatchingError
from .tiles import Tiles, _rows_of_spans


def _is_batch_tensor(x, total: int) -> bool:
    """Whether ``x`` is a tensor whose first dimension is the batch's ``total`` rows."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return False
    try:
        return x.shape[0] == total
    except RuntimeError:  # a nested tensor (TransformerEncoder's fast path) has no sizes: it
        return False  # reaches every invoke whole, as any value not shaped by the batch


def _expanded_rows(x, start: int, size: int, total: int, factors) -> "tuple | list | None":
    """Where ``x``'s first dimension is ``total * f`` for a factor ``f`` of ``factors`` (HF
    ``generate`` expands each row into ``f`` adjacent rows for beams or returned sequences,
    ``repeat_interleave``), the rows ``start:start+size`` cover there: ``(start*f, size*f)``;
    for a ``Tiles`` factor, a list of such ``(start, size)`` spans, one in each block; else
    None."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return None
    try:
        n = x.shape[0]
    except RuntimeError:  # (a nested tensor)
        return None
    for f in factors:
        if f.__class__ is Tiles:
            block = total * f.factor
            if n == block * f.count:
                return [(b * block + start * f.factor, size * f.factor) for b in range(f.count)]
        elif n == total * f:
            return start * f, size * f
    return None


def narrow(value: Any, start: int, size: int, total: int, factors=()) -> Any:
    """The rows ``start:start+size`` of every batch-shaped tensor inside ``value``, and of
    every tensor whose rows are the batch's expanded by one of ``factors`` (see
    _expanded_rows): ``generate`` with beams gives each invoke its rows' beams.

    Each view remembers where it came from (``view._nnsight_rows = (base, start, size)``) so
    that ``view.grad`` in a backward body can answer with its rows of the base's gradient.
    """
    if isinstance(value, torch.Tensor):
        if not _is_batch_tensor(value, total):
            rows = _expanded_rows(value, start, size, total, factors) if factors else None
            if rows is None:
                return value
            if rows.__class__ is list:  # (spans in several blocks: Tiles)
                return _rows_of_spans(value, rows)
            start, size = rows
        view = value[start:start + size]  # a view, like narrow(), and cheaper to make
        view._nnsight_rows = (value, start, size)
        return view
    return _map(value, lambda t: narrow(t, start, size, total, factors))


def merge(full: Any, part: Any, start: int, size: int, total: int, factors=()) -> Any:
    """``full`` with rows ``start:start+size`` of its batch-shaped tensors taken from ``part``
    (of its expanded ones, the rows those cover: see narrow).

    Built with ``torch.cat`` so autograd flows through both the kept and the replaced rows.
    """
    if isinstance(full, torch.Tensor):
        spans = None
        if not _is_batch_tensor(full, total):
            rows = _expanded_rows(full, start, size, total, factors) if factors else None
            if rows is None:
                return part
            if rows.__class__ is list:  # (spans in several blocks: Tiles)
                spans = rows
                start, size = 0, sum(n for _, n in spans)
            else:
                start, size = rows
        if not isinstance(part, torch.Tensor):
            part = torch.as_tensor(part, dtype=torch.float32 if full.is_quantized else full.dtype,
                                   device=full.device)
        if full.is_quantized:  # (torch.cat requantizes every piece to the first one's scale)
            part = _requantized(part.to(device=full.device), full)
        else:
            part = part.to(dtype=full.dtype, device=full.device)
        part = part.expand(size, *full.shape[1:])
        if spans is not None:
            pieces, at, end = [], 0, 0
            for s, n in spans:
                pieces += [full[end:s], part[at:at + n]]
                at, end = at + n, s + n
            pieces.append(full[end:])
        else:
            pieces = [full[:start], part, full[start + size:]]
        return torch.cat([p for p in pieces if p.shape[0] > 0], 0)
    if isinstance(full, (tuple, list)) and isinstance(part, (tuple, list)) and len(full) == len(part):
        merged = [merge(f, p, start, size, total, factors) for f, p in zip(full, part)]
        return _rebuild_sequence(full, merged)
    if isinstance(full, dict) and isinstance(part, dict):
        out = _copy_mapping(full)
        for k, p in part.items():
            out[k] = merge(full[k], p, start, size, total, factors) if k in full else p
        return out
    if type(part) is type(full) and _is_dataclass_object(full):  # field by field
        return dataclasses.replace(full, **{
            f.name: merge(getattr(full, f.name), getattr(part, f.name), start, size, total,
                          factors)
            for f in dataclasses.fields(full) if f.init})
    return part


def _requantized(part: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``part`` quantized as ``full`` is (its scale and zero point), so the other invokes' rows of
    the merged tensor keep theirs exactly; a quantization other than per tensor is left as it is."""
    if full.qscheme() not in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return part  # (torch.cat says what it cannot join)
    if part.is_quantized and part.dtype is full.dtype and part.qscheme() == full.qscheme() \
            and part.q_scale() == full.q_scale() and part.q_zero_point() == full.q_zero_point():
        return part
    value = part.dequantize() if part.is_quantized else part.float()
    return torch.quantize_per_tensor(value, full.q_scale(), full.q_zero_point(), full.dtype)


def entries(view: Any, depth: int = 3):
    """What a body could replace in its narrowed ``view`` without replacing the view itself:
    the members of a dict (a model-output object included), list, tuple or dataclass, and
    those of the containers among them (``depth`` levels), each as ``(member, its entries)``;
    None where ``view`` is no container."""
    if isinstance(view, dict):
        items = view.items()
    elif isinstance(view, (list, tuple)):
        items = enumerate(view)
    elif _is_dataclass_object(view):
        items = [(f.name, getattr(view, f.name)) for f in dataclasses.fields(view) if f.init]
    else:
        return None
    if depth <= 1:
        return {k: (v, None) for k, v in items}
    return {k: (v, None if v.__class__ is torch.Tensor else entries(v, depth - 1))
            for k, v in items}


def merge_replaced(full: Any, view: Any, before, start: int, size: int, total: int,
                   factors=()) -> Any:
    """``full`` with the members the body replaced in its narrowed container ``view`` since
    ``before`` (``entries(view)``: ``view["h"] = x``, ``out.logits = x``, ``view[0] = x``,
    ``inputs[1]["mask"] = x``, at any level ``before`` covers) merged back into its rows."""
    if isinstance(view, (list, tuple)) and (len(view) != len(before) or len(view) != len(full)):
        return full
    updates = {}
    for k, (old, inner) in before.items():
        now = _member(view, k)
        if now is not old:
            updates[k] = merge(_member(full, k), now, start, size, total, factors)
        elif inner is not None:
            sub = _member(full, k)
            new = merge_replaced(sub, now, inner, start, size, total, factors)
            if new is not sub:
                updates[k] = new
    if isinstance(view, dict):
        for k, v in view.items():
            if k not in before:  # a key the body added
                updates[k] = merge(full[k], v, start, size, total, factors) if k in full else v
    return _with_members(full, updates) if updates else full


def _member(value, key):
    return getattr(value, key) if _is_dataclass_object(value) and not isinstance(value, dict) \
        else value[key]


def _with_members(full, updates: dict):
    """A copy of container ``full`` with the members in ``updates`` replaced."""
    if isinstance(full, dict):
        out = _copy_mapping(full)
        for k, v in updates.items():
            out[k] = v
        return out
    if isinstance(full, (list, tuple)):
        items = list(full)
        for k, v in updates.items():
            items[k] = v
        return _rebuild_sequence(full, items)
    return dataclasses.replace(full, **updates)


def _is_dataclass_object(value) -> bool:
    return hasattr(type(value), "__dataclass_fields__") and not isinstance(value, type)


_ABSENT = object()


def _rebuild_sequence(like, items):
    if isinstance(like, list):
        return items
    if hasattr(like, "_fields"):  # namedtuple
        return type(like)(*items)
    try:
        return type(like)(items)
    except TypeError:
        return tuple(items)


def _copy_mapping(d):
    """A shallow copy of the mapping ``d`` of the same type where it can be made: a model-output
    dataclass with required fields (HF ``GenerateDecoderOnlyOutput``'s ``sequences``) is built
    from its fields, so a body's rows of it keep its attributes (``out.sequences``)."""
    try:
        out = d.__class__()
    except TypeError:
        if not dataclasses.is_dataclass(d):
            return dict(d)
        try:
            out = d.__class__(**{f.name: getattr(d, f.name, None)
                                 for f in dataclasses.fields(d) if f.init})
        except (TypeError, ValueError):
            return dict(d)
    for k, v in d.items():
        out[k] = v
    return out


def _map(value: Any, fn):
    """Apply ``fn`` to the members of a container value, keeping its type."""
    if isinstance(value, (tuple, list)):
        return _rebuild_sequence(value, [fn(v) for v in value])
    if isinstance(value, dict):
        out = _copy_mapping(value)
        for k in list(out.keys()):
            out[k] = fn(value[k])
        return out
    if _is_dataclass_object(value):
        return dataclasses.replace(
            value, **{f.name: fn(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        )
    return value


def batch_size_of(args: tuple, kwargs: dict) -> int:
    """The batch size of one invoke's inputs: the first dimension of its first tensor (looked
    for in dicts, lists and tuples among them too: ``model.trace({"x": x})``)."""
    rows = _first_rows(chain(args, kwargs.values()) if kwargs else args, 4)
    return 1 if rows is None else rows


def _first_rows(values, depth: int):
    """The first dimension of the first tensor (dim > 0) among ``values`` and the dicts, lists
    and tuples among them (``depth`` levels in all), or None."""
    for x in values:
        if isinstance(x, torch.Tensor):
            if x.dim() > 0:
                return x.shape[0]
        elif depth > 1 and isinstance(x, (dict, list, tuple)):
            inner = _first_rows(x.values() if isinstance(x, dict) else x, depth - 1)
            if inner is not None:
                return inner
    return None


def concat_inputs(inputs: list[tuple[tuple, dict]], sizes: list[int] | None = None
                  ) -> tuple[tuple, dict, list[int]]:
    """Concatenate several invokes' ``(args, kwargs)`` along dim 0.

    Tensors are concatenated; any other value must be equal in every invoke. Returns the batched
    args, kwargs, and each invoke's batch size. Raises ``BatchingError`` naming the invokes
    and shapes when they cannot be combined.
    """
    if sizes is None:
        sizes = [batch_size_of(a, k) for a, k in inputs]
    if len(inputs) == 1:
        return inputs[0][0], inputs[0][1], sizes
    n_args = {len(a) for a, _ in inputs}
    if len(n_args) != 1:
        raise BatchingError(
            "invokes pass different numbers of positional inputs: "
            + ", ".join(f"invoke {i}: {len(a)}" for i, (a, _) in enumerate(inputs))
            + "; give every invoke the same kind of input"
        )
    keys = [tuple(sorted(k)) if k else () for _, k in inputs]
    if len(set(keys)) != 1:
        raise BatchingError(
            "invokes pass different keyword inputs: "
            + ", ".join(f"invoke {i}: {list(k)}" for i, k in enumerate(keys))
            + "; they run as one batch, so give every invoke the same ones (an image-text "
            "model: images= in every invoke or in none), or run those that differ in a trace "
            "of their own"
        )
    args = tuple(
        _concat_one([a[j] for a, _ in inputs], f"positional input {j}") for j in range(n_args.pop())
    )
    kwargs = {k: _concat_one([kw[k] for _, kw in inputs], f"keyword input {k!r}") for k in keys[0]}
    return args, kwargs, sizes


def _concat_one(values: list, what: str):
    if all(map(isinstance, values, repeat(torch.Tensor))):
        dtype, dims = values[0].dtype, values[0].dim()
        # torch.cat would promote mixed dtypes and skip empty 1-D tensors: only when neither
        # can happen does it decide alone; where it refuses, the checks below say why
        if all(v.dtype == dtype and v.dim() == dims for v in values):
            try:
                return torch.cat(values, 0)
            except RuntimeError:
                pass
        shapes = [tuple(v.shape) for v in values]
        dtypes = [v.dtype for v in values]
        if any(v.dim() == 0 for v in values) or len({s[1:] for s in shapes}) != 1:
            raise BatchingError(
                f"cannot batch {what} of the invokes along dim 0: shapes "
                + ", ".join(f"invoke {i}: {s}" for i, s in enumerate(shapes))
                + " must agree in every dimension but the first"
            )
        if len(set(dtypes)) != 1:
            raise BatchingError(
                f"cannot batch {what} of the invokes: dtypes "
                + ", ".join(f"invoke {i}: {d}" for i, d in enumerate(dtypes))
                + " differ; convert them to one dtype"
            )
        return torch.cat(values, 0)
    first = values[0]
    if isinstance(first, dict) and first and all(
            isinstance(v, dict) and v.keys() == first.keys() for v in values):
        out = _copy_mapping(first)  # (a dict of inputs: each member batched on its own)
        for k in first:
            out[k] = _concat_one([v[k] for v in values], f"{what}[{k!r}]")
        return out
    if isinstance(first, (list, tuple)) and first and all(
            type(v) is type(first) and len(v) == len(first) for v in values):
        return _rebuild_sequence(first, [_concat_one([v[j] for v in values], f"{what}[{j}]")
                                         for j in range(len(first))])
    for i, v in enumerate(values[1:], 1):
        same = v is first
        if not same:
            try:
                same = bool(v == first)
            except Exception:
                same = False
        if not same:
            raise BatchingError(
                f"{what} is not a tensor and differs between invoke 0 ({_brief(first)}) and "
                f"invoke {i} ({_brief(v)}); a non-batched input must be the same in every "
                "invoke (tensors are batched along dim 0, also inside dicts, lists and tuples "
                "of the same keys or length)"
            )
    return first


def _brief(value) -> str:
    """A short description of an input for messages (no tensor's values)."""
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    if isinstance(value, dict):
        return f"{type(value).__name__} with keys {list(value)[:8]}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
