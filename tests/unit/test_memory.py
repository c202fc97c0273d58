"""Activations that were not saved are freed when the trace ends."""

from __future__ import annotations

import gc
import weakref

import torch

from nnsight_lite import NNsight


def test_unsaved_activations_are_freed(seq):
    model = NNsight(seq)
    x = torch.randn(2, 6)
    refs = []
    # no_grad: with grad on, autograd's own graph keeps each Linear's input alive for backward
    with torch.no_grad():
        with model.trace(x):
            for i in range(4):
                refs.append(weakref.ref(model[i].output))
            keep = model[3].output.save()
    alive = [r() is not None for r in refs]
    # only the saved tensor (layer 3's output) survives; no gc pass is needed for the rest
    assert alive == [False, False, False, True]
    del keep
    gc.collect()
    assert refs[3]() is None


def test_tracer_object_holds_no_activations(seq):
    model = NNsight(seq)
    refs = []
    with torch.no_grad():
        with model.trace(torch.randn(2, 6)) as tracer:
            refs.append(weakref.ref(model[1].output))
    assert refs[0]() is None
    assert tracer is not None


def test_error_path_frees_activations(seq):
    model = NNsight(seq)
    refs = []
    try:
        with model.trace(torch.randn(2, 6)):
            refs.append(weakref.ref(model[1].output))
            raise ValueError("x")
    except ValueError:
        pass
    gc.collect()
    assert refs and refs[0]() is None
