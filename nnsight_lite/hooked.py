"""``envoy(x, hook=True)``: a module call made from a body that the trace sees.

    call_from_body(envoy, args, kwargs)   body side: hand the call to the forward's greenlet
    ModuleCall                            the request a body switches out with
    run_for_body(inter, med, req)         forward side: make the call, resume the body with it

A body calling a module is normally an ordinary call: the counting wrappers pass through any
call not made by the greenlet running the model's forward (``Interleaver.runner``), so the
call is neither counted nor served (the logit lens ``model.lm_head(h)`` must not take
``lm_head``'s place). With ``hook=True`` the body instead asks the forward's greenlet to make
the call, as the model's own code would: the module and its submodules count it as one of
their calls and serve it to the bodies waiting there. This is how an attached module (an SAE,
an adapter) applied in an edit or an invoke has observable internals::

    model.layer.sae = SAE(...)                   # attached: wrapped like any submodule
    with model.edit(inplace=True):
        model.layer.output = model.layer.sae(model.layer.output, hook=True)
    with model.trace(x):
        feats = model.layer.sae.encoder.output.save()   # served by the edit's call

The body making the call cannot read its own call's internals afterwards (they ran before it
asked: OutOfOrderError); another body (an invoke, or the trace's body under an edit) can.
"""

from __future__ import annotations

from .workers import _getcurrent

__all__ = ["ModuleCall", "call_from_body", "run_for_body"]


class ModuleCall:
    """A body's request that the forward's greenlet call ``module(*args, **kwargs)``."""

    __slots__ = ("module", "args", "kwargs")

    def __init__(self, module, args: tuple, kwargs: dict):
        self.module = module
        self.args = args
        self.kwargs = kwargs


def call_from_body(envoy, args: tuple, kwargs: dict):
    """``envoy(*args, hook=True, **kwargs)``: from a body, the result of the traced call;
    anywhere else (outside a trace, a backward block) an ordinary call, as in nnsight."""
    med = getattr(_getcurrent(), "mediator", None)
    if med is None or med.interleaver.finished or id(envoy._module) not in med.interleaver.slots:
        return envoy._module(*args, **kwargs)  # no body, the forward is over, or not traced
    return med.parent.switch(ModuleCall(envoy._module, args, kwargs))


def run_for_body(inter, med, req: ModuleCall):
    """On the forward's greenlet: make the call ``med``'s body asked for (the wrappers count
    and serve it), then resume the body with its result (or throw in what it raised);
    return the body's next request."""
    position, serving, calling = inter.position, inter.serving, inter.calling
    if serving is not None:  # still being served: bodies the call wakes may ask for it too
        inter.calling = calling + (serving,)
    try:
        out, exc = req.module(*req.args, **req.kwargs), None
    except Exception as err:  # the body gets the error at its call, as from a plain call
        out, exc = None, err
    finally:
        inter.position, inter.serving, inter.calling = position, serving, calling
        req.args = req.kwargs = None
    try:
        return med.resume(out, exc)
    finally:
        exc = None
