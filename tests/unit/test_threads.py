"""Traces in several threads: independent models work; one model in two threads is refused."""

from __future__ import annotations

import threading

import pytest
import torch

from nnsight_lite import NNsight, NNsightError


def test_same_model_in_two_threads_is_refused(seq):
    model = NNsight(seq)
    x = torch.randn(2, 6)
    started, proceed = threading.Event(), threading.Event()
    result = {}

    def worker():
        with model.trace(x):
            h = model[0].output
            started.set()
            proceed.wait(10)
            out = model.output.save()
        result["out"] = out

    t = threading.Thread(target=worker)
    t.start()
    try:
        assert started.wait(10)
        with pytest.raises(NNsightError, match="being traced by another thread"):
            with model.trace(x):
                h = model.output.save()
    finally:
        proceed.set()
        t.join(10)
    torch.testing.assert_close(result["out"], seq(x))
    assert all("forward" not in m.__dict__ for m in seq.modules())
