"""Older nnsight names still run: ``apply``, ``tracer.log``, ``CONFIG``, and the block form of
``tracer.iter`` gets an error that shows the loop form."""

from __future__ import annotations

import traceback

import pytest
import torch

import nnsight_lite
from nnsight_lite import NNsight
from nnsight_lite.errors import NNsightError


@pytest.fixture
def model():
    torch.manual_seed(0)
    return NNsight(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 2)))


def test_apply_is_a_plain_call(model):
    x = torch.randn(3, 4)
    with model.trace(x):
        top = nnsight_lite.apply(torch.topk, model.output, 1, dim=-1).indices.save()
    assert torch.equal(top, torch.topk(model._module(x), 1, dim=-1).indices)


def test_log_prints_from_the_body(model, capsys):
    x = torch.randn(2, 4)
    with model.trace(x) as tracer:
        tracer.log("shape", model[0].output.shape)
    assert capsys.readouterr().out == f"shape {torch.Size([2, 8])}\n"


def test_config_fields_read_and_set():
    cfg = nnsight_lite.CONFIG
    assert cfg.APP.DEBUG in (True, False)
    before = cfg.API.APIKEY
    cfg.set_default_api_key("abc")
    try:
        assert cfg.API.APIKEY == "abc"
        cfg.save()
    finally:
        cfg.API.APIKEY = before


def test_config_debug_keeps_the_runtime_frames(model):
    cfg = nnsight_lite.CONFIG
    old = cfg.APP.DEBUG
    files = {}
    for debug in (False, True):
        cfg.APP.DEBUG = debug
        try:
            with pytest.raises(ZeroDivisionError) as info:
                with model.trace(torch.randn(1, 4)):
                    model[0].output
                    1 / 0
        finally:
            cfg.APP.DEBUG = old
        files[debug] = [f.filename for f in traceback.extract_tb(info.value.__traceback__)]
    assert any("interleaver.py" in f for f in files[True])
    assert not any("nnsight_lite" in f for f in files[False])


@pytest.mark.parametrize("form", ["iter", "all"])
def test_block_form_of_iter_shows_the_loop_form(model, form):
    with pytest.raises(NNsightError, match=r"for step in tracer\.(iter\[\.\.\.\]|all\(\)):"):
        with model.trace(torch.randn(1, 4)) as tracer:
            with (tracer.iter[:] if form == "iter" else tracer.all()):
                model[0].output
