"""``NNsight``: wrap any ``torch.nn.Module`` so its insides can be read and edited in traces.

    NNsight(module)        the root Envoy, with .trace() .scan() and the module's own API
    _prepare_inputs        how one invoke's inputs become (args, kwargs, batch size)
    _batch_inputs          how several invokes' inputs become one batch (override per wrapper)
    _batch_size, _batch    nnsight's extension points for the same (used where overridden)
    _run_forward           how the batch is run through the module
"""

from __future__ import annotations

import os
import re

import torch

from .aliases import Tree
from .batching import batch_size_of, concat_inputs
from .envoy import Envoy
from .remote.hook import take_backend
from .sessions import Editor, Session
from .tracing import Tracer
from .workers import _note


#: what an Envoy keeps that leads back to it, so that an edited copy does not share it
_OWN_VIEWS = frozenset({"_source_view"})


class NNsight(Envoy):
    """Wrap ``module`` to read and edit its activations inside ``with model.trace(...)`` blocks.

    Example::

        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        model = NNsight(net)
        with model.trace(torch.randn(3, 4)):
            hidden = model[0].output.save()
            model[1].output[:] = 0
        print(hidden.shape)     # torch.Size([3, 8])

    - ``rename={"layers": "blocks", "transformer.h": "h"}``: aliases for module paths, usable
      everywhere a path is (bodies, ``tracer.cache``); see aliases.py for the key forms.
    - ``envoys={torch.nn.Linear: MyEnvoy, "mlp": MyEnvoy}``: the Envoy subclass to use for the
      modules of a class or at a path suffix (add your own properties there); ``envoys=MyEnvoy``
      for every module.

    ``model(x)`` outside a trace is the plain forward. Subclasses change how inputs are prepared
    and batched by overriding ``_prepare_inputs``, ``_batch_inputs`` and ``_run_forward``.
    """

    _edits: tuple = ()

    @property
    def _model(self) -> torch.nn.Module:
        """The wrapped module (nnsight's older name for ``_module``)."""
        return self._module

    def __init__(self, module: torch.nn.Module, *, rename: dict | None = None,
                 envoys: dict | None = None):
        if not isinstance(module, torch.nn.Module):
            hint = (f"; {module!r} looks like a Hugging Face hub id or directory: load it with "
                    f"LanguageModel({module!r})" if isinstance(module, (str, os.PathLike)) else "")
            raise TypeError(f"NNsight wraps a torch.nn.Module, got {type(module).__name__}{hint}")
        reserved = frozenset(n for n in dir(type(self)) if not n.startswith("_"))
        super().__init__(module, "model", Tree(module, rename, envoys, reserved))

    def trace(self, *inputs, trace: bool = True, **kwargs):
        """``with model.trace(*inputs, **kwargs) as tracer:`` - see :class:`Tracer`.

        With ``trace=False`` it runs the plain forward and returns its output.
        """
        if not trace:
            return self._module(*inputs, **kwargs)
        return Tracer(self, inputs, kwargs)

    def scan(self, *inputs, **kwargs):
        """Like ``trace`` but on fake tensors: shapes and dtypes, no real computation.

        Example::

            with model.scan(torch.randn(3, 4)):
                shape = model[0].output.shape
                nnsight_lite.save(shape)
        """
        return Tracer(self, inputs, kwargs, scan=True)

    def session(self, **kwargs):
        """``with model.session():`` - traces in a row sharing values; see :class:`Session`.
        ``remote=True`` / ``backend=...`` run the whole session on a served model."""
        return Session(self, take_backend(kwargs) if kwargs else None)

    def edit(self, *, inplace: bool = False):
        """``with model.edit() as edited:`` - a persistent edit; see :class:`Editor`."""
        return Editor(self if inplace else self._copy())

    def clear_edits(self) -> None:
        """Remove every edit recorded on this model with ``edit``."""
        self.__dict__["_edits"] = ()

    def _copy(self) -> "NNsight":
        """Another wrapper of the same module, with its own edits and its own child Envoys
        (made again as they are reached, so their ``.parent`` and ``.root`` lead to it)."""
        new = object.__new__(type(self))
        d = new.__dict__
        d.update((k, v) for k, v in self.__dict__.items()  # (not the Envoys a trace holds,
                 if (k.startswith("_") or not isinstance(v, Envoy))  # nor its .source view,
                 and k not in _OWN_VIEWS)  # which holds it: each wrapper makes its own)
        d["_subs"] = {}
        d["_items"] = {}
        return new

    # ---- overridable input handling

    def _prepare_inputs(self, *args, **kwargs):
        """One invoke's inputs as ``(args, kwargs, batch_size)``."""
        return args, kwargs, self._batch_size(*args, **kwargs)

    def _batch_inputs(self, prepared: list):
        """Several invokes' prepared inputs as one ``(args, kwargs, [sizes])``."""
        sizes = [n for _, _, n in prepared]
        if self._batch.__func__ is not NNsight._batch:  # (nnsight's extension point, overridden)
            args, kwargs = self._batch([(a, k) for a, k, _ in prepared], self._module)
            return args, kwargs, sizes
        if len(prepared) == 1:
            args, kwargs, _ = prepared[0]
            return args, kwargs, sizes
        return concat_inputs([(a, k) for a, k, _ in prepared], sizes)

    def _batch_size(self, *args, **kwargs) -> int:
        """nnsight's extension point: how many rows of the batch one invoke's inputs give
        (here: the first dimension of its tensors). Override it with ``_batch`` for inputs
        that are not tensors batched along dim 0."""
        return batch_size_of(args, kwargs)

    def _batch(self, invokes: list, fn) -> tuple:
        """nnsight's extension point: the invokes' ``(inputs, kwargs)`` pairs combined into the
        ``(args, kwargs)`` of one call of ``fn`` (here: tensors concatenated along dim 0).

        Example::

            class Padded(NNsight):          # invokes of different lengths, padded to one
                def _batch_size(self, x):
                    return x.shape[0]
                def _batch(self, invokes, fn):
                    n = max(x.shape[1] for (x,), _ in invokes)
                    return (torch.cat([F.pad(x, (0, n - x.shape[1])) for (x,), _ in invokes]),), {}
        """
        args, kwargs, _ = concat_inputs(list(invokes), [self._batch_size(*a, **k) for a, k in invokes])
        return args, kwargs

    def _run_forward(self, args: tuple, kwargs: dict):
        try:
            return self._module(*args, **kwargs)
        except TypeError as err:
            _note_raw_input(err, self._module, args)
            raise


def _note_raw_input(err: TypeError, module: torch.nn.Module, args: tuple) -> None:
    """Note on ``err``, a TypeError from the forward that names the type of an input that is
    text or a list of plain numbers ("must be Tensor, not str"): NNsight hands the trace's
    inputs to the module as they are."""
    raw = next((a for a in args if isinstance(a, str) or (
        isinstance(a, (list, tuple)) and a and all(
            isinstance(v, (int, float, str)) and not isinstance(v, bool) for v in a))), None)
    if raw is None or not re.search(rf"\b{type(raw).__name__}\b", str(err)):
        return  # (a TypeError of the forward's own, where a str is an option it takes)
    what = (f"a str ({raw[:40]!r})" if isinstance(raw, str) else
            f"a {type(raw).__name__} of {type(raw[0]).__name__}")
    _note(err, f"nnsight_lite: NNsight passes the inputs of model.trace(...) to "
          f"{type(module).__name__}.forward as they are, and it got {what}. Pass what the "
          "module takes (a tensor: torch.tensor(...)); for text, LanguageModel tokenizes it.")
