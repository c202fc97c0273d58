"""Shared fixtures: small models, and a guard that fails any test leaving state behind."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

import nnsight_lite  # noqa: F401  (patches Tensor.save / Tensor.backward once)
from nnsight_lite.calls import traced_slot
from nnsight_lite.capture.skip import _pending as _skips_pending
from nnsight_lite.install import _traced
from tests.helpers import suspended_bodies

settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=40, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=40)
settings.register_profile("thorough", deadline=None, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def _leftovers():
    """Traced forwards or hooks left on any model nnsight_lite has traced, and body greenlets
    still suspended in a body (idle pooled workers are fine)."""
    bad = []
    for root in list(_traced):
        for m in root.modules():
            d = m.__dict__
            for key in ("forward", "_compiled_call_impl"):
                fn = d.get(key)
                if fn is not None and traced_slot(fn) is not None:
                    bad.append(f"traced {key} left on {type(m).__name__}")
            if any(not _models_own(h) for key in ("_forward_hooks", "_forward_pre_hooks",
                                                  "_backward_hooks")
                   for h in (d.get(key) or {}).values()):
                bad.append(f"hook left on {type(m).__name__}")
    bad.extend(suspended_bodies())
    if _skips_pending:  # (Python 3.12+: a with-body's skip still armed on a code object)
        bad.append(f"body skips left armed on {[c.co_name for c, _ in _skips_pending.values()]}")
    return bad


def _models_own(hook) -> bool:
    """A hook the model put on itself: transformers 5 adds output-capturing forward hooks to
    some submodules at their first forward (LLaVA's CLIP layers) and keeps them."""
    return getattr(hook, "__module__", "").startswith("transformers.")


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """Fail a test that leaves a hook, a wrapper, a greenlet, a tracer or a torch mode behind."""
    before = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), sys.gettrace(),
              torch.Tensor.backward)
    yield
    after = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), sys.gettrace(),
             torch.Tensor.backward)
    assert after == before, f"global state changed: {before} -> {after}"
    bad = _leftovers()
    assert not bad, bad


class Tupled(torch.nn.Module):
    """Returns a tuple (h, h.sum(-1)) like older HF blocks."""

    def __init__(self, d=8):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        h = self.lin(x)
        return h, h.sum(-1)


class Net(torch.nn.Module):
    """A small model with a shared layer called twice, a tuple output and a dict output."""

    def __init__(self, d=8):
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.shared = torch.nn.Linear(d, d)
        self.block = Tupled(d)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(d, d) for _ in range(3)])
        self.act = torch.nn.ReLU()
        self.unused = torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, 2)

    def forward(self, x, scale=1.0):
        h = self.act(self.inp(x))
        h = self.shared(h)
        h, _ = self.block(h)
        for layer in self.layers:
            h = self.act(layer(h))
        h = self.shared(h) * scale
        return {"logits": self.head(h), "hidden": h}


@pytest.fixture
def seq():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(4)])


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Net()


@pytest.fixture
def x8():
    torch.manual_seed(1)
    return torch.randn(3, 8)
