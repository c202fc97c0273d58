"""The errors of ``with loss.backward():`` bodies, built on the failure path only.

    BackwardErrors        the mixin Backward takes its error builders from:
      _freed_error          autograd's "backward through the graph a second time", said in
                            terms of the trace (an earlier invoke's or block's backward)
      _bad_request          a ``.grad`` read of a non-tensor, of a tensor that does not
                            require grad, or after the backward finished
    missed_error          a ``.grad`` read that backprop never answered, with the likely reason
    remote_leaf(t)        mark a tensor a remote trace sent back (a leaf: its graph stayed there)
    no_grad_trace         the sentence naming generate where a loss has no gradient there
    _describe             a value as a message names it: a tensor's shape and dtype
    grad_expr             what the user's line takes ``.grad`` of, for the example in advice
    _FREED                the words of autograd's message that ``_freed_error`` replaces

Apart from backward.py because none of it runs while gradients flow: it only words what went
wrong. It needs nothing of backward.py (a Backward's ``_runner`` and ``_args`` are read through
``self``), so backward.py, grads.py and nosource.py import from here and not the other way
round.
"""

from __future__ import annotations

import linecache
import re
import weakref

import torch

from .errors import GradientError
from .workers import _getcurrent, user_location

_FREED = "backward through the graph a second time"  # autograd's message, freed graph

# id -> tensor, for the tensors that requiring grad came back from a remote trace (weak: no
# tensor is kept; by id, as tensors compare elementwise)
_REMOTE_LEAVES: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def remote_leaf(t) -> None:
    """Remember that ``t`` came back from a remote trace: a leaf whose graph stayed there."""
    _REMOTE_LEAVES[id(t)] = t


def _from_remote(t) -> bool:
    return t is not None and _REMOTE_LEAVES.get(id(t)) is t


_GRAD_OF = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*|\[[^\[\]\n]*\])*)\.grad\b")


def grad_expr(where: str, default: str = "hs") -> str:
    """The expression whose ``.grad`` the line at ``where`` ("file:line") takes, as written
    (``model.layer1.output[0]``), or ``default`` where the line cannot be read."""
    filename, _, line = where.rpartition(":")
    if line.isdigit():
        found = _GRAD_OF.search(linecache.getline(filename, int(line)))
        if found:
            return found.group(1)
    return default


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"tensor of shape {tuple(t.shape)} ({t.dtype})"
    return type(t).__name__


class BackwardErrors:
    """The error builders of :class:`~nnsight_lite.backward.Backward` (see above)."""

    def _freed_error(self, exc: RuntimeError) -> GradientError:
        """Autograd's "backward through the graph a second time", said in terms of the trace."""
        med = getattr(self._runner, "mediator", None)
        many = med is not None and len(med.interleaver.mediators) > 1
        cause = (
            "all invokes of a trace run as one batched forward, so they share one autograd "
            "graph, and a backward in an earlier invoke freed it" if many else
            "an earlier backward through the same graph freed it"
        )
        fix = (
            "this backward passes retain_graph=True; it is the earlier one that did not: pass "
            "retain_graph=True to every backward but the last" if self._args[1] else
            "pass retain_graph=True to every backward but the last"
        )
        return GradientError(
            f"`with loss.backward():` at {user_location()}: the autograd graph was already "
            f"freed: {cause}; {fix} (torch: {str(exc).split('. ')[0]}.)"
        )

    def _bad_request(self, t) -> GradientError:
        where = user_location()
        if not isinstance(t, torch.Tensor):
            return GradientError(f".grad was read at {where} on a {type(t).__name__}, not a tensor")
        if not t.requires_grad:
            return GradientError(
                f"{_describe(t)} at {where} does not require grad, so it has no gradient in this "
                "backward. It was computed under torch.no_grad()/inference_mode or from tensors "
                "that do not require grad: call .requires_grad_(True) on it (or on the input) "
                "during the forward, before it is used."
            )
        return GradientError(
            f".grad of {_describe(t)} was read at {where} after the backward pass finished; "
            "read gradients inside the `with loss.backward():` body"
        )


def missed_error(t, where: str, inputs, last, loss=None) -> GradientError:
    """The error for a ``.grad`` read that backprop never answered, with the likely reason:
    ``inputs=`` leaving ``t`` out, ``t`` a view made after its base was used (``h[:, 0].grad``),
    or a leaf (a parameter, an input) read out of turn; ``last`` is the tensor read before,
    ``loss`` the tensor the backward runs from."""
    base = t._base if t._base is not None and t._base.requires_grad else None
    # (whether the loss's graph holds t and its base: None where there is no graph to walk)
    on, on_base = _graph_holds(loss, (t, t if base is None else base))
    if on is not True and (_from_remote(t) or _from_remote(loss)):
        why = ("it came back from a remote trace, as a leaf: the graph that linked it to "
               "the loss stayed on the server. Run the backward in the remote trace's body "
               "(`with loss.backward():` there) and save the gradients you need")
    elif inputs is not None and not any(t is i for i in _as_tuple(inputs)):
        why = ("this backward was given inputs=, and backprop runs only as far as those "
               "tensors need: add it to inputs= (or leave inputs= out)")
    elif base is not None and on is not True and on_base is not False:
        why = ("it is a view (a slice, an index, a reshape) of another tensor; one made "
               "after that tensor was used (`h[:, 0]` in the body) is not part of the loss's "
               "graph: read the gradient of the tensor itself and index that "
               "(`h.grad[:, 0]`, not `h[:, 0].grad`)")
    elif (t.is_leaf or (last is not None and last.is_leaf)) and on is not False:
        who = "it is" if t.is_leaf else f"the {_describe(last)} read before it is"
        why = (f"{who} a leaf (a parameter or an input), whose gradient arrives as backprop "
               "passes the operation that uses it, not in the order the tensors were made: "
               "read a leaf's .grad right after that of the operation's output, or read "
               "`param.grad` after the block")
    elif on is False and (cut := _grad_cut()):
        why = (f"{cut}, which cuts the loss's graph there. "
               "Edit the value in place (`[:] = ...`) or build the replacement from it "
               "(`output * 0`, `output + v`) so that gradients flow through it")
    else:
        why = ("the tensor is not part of this loss's graph, or its gradient was computed "
               "before it was asked for, with no later tensor read in between: check that the "
               "loss is computed from it, and read gradients in reverse execution order")
    return GradientError(f".grad of {_describe(t)} was read at {where}, but backprop never "
                         f"reached it: {why}.")


def _grad_cut() -> str:
    """What a body of the running trace replaced with a tensor that does not require grad
    (Mediator.set records the first); "" where nothing was, or outside a trace."""
    med = getattr(_getcurrent(), "mediator", None)
    return getattr(med.interleaver, "grad_cut", "") if med is not None else ""


def no_grad_trace() -> str:
    """A sentence naming the trace that runs the model without gradients, where the body
    running now is in one (a generate); else ""."""
    med = getattr(_getcurrent(), "mediator", None)
    by = getattr(med.interleaver, "no_grad_by", None) if med is not None else None
    return (f" This body runs in {by}, so nothing it reads has a gradient: compute gradients "
            "in a `with model.trace(...):` instead") if by else ""


def _graph_holds(loss, tensors) -> list:
    """For each of ``tensors``, whether ``loss``'s autograd graph holds it (its ``grad_fn``, or
    a leaf's AccumulateGrad); all None without a loss tensor. Walked on the failure path only:
    a view the model made (a forward's ``x.view(...)``) or a tensor the loss does not use at
    all is off the graph, and the reasons that assume it is on it (a view made in the body
    after its base was used, a leaf read out of turn) do not apply."""
    if not isinstance(loss, torch.Tensor):
        return [None] * len(tensors)
    fns = [x.grad_fn for x in tensors]
    found = [False] * len(tensors)
    seen = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # (an AccumulateGrad: a leaf's node)
        for i, x in enumerate(tensors):
            if fn is fns[i] or (fns[i] is None and variable is x):
                found[i] = True
        stack.extend(f for f, _ in fn.next_functions)
    return found


def _as_tuple(inputs) -> tuple:
    return (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)


__all__ = ["BackwardErrors", "missed_error"]
