"""Sessions share values between traces; edits persist across traces."""

from __future__ import annotations

import copy
import gc
import inspect
import pickle
import re
import weakref

import pytest
import torch

from nnsight_lite import NNsight


class TestSession:
    def test_values_flow_between_traces_only_saved_leave(self, seq):
        model = NNsight(seq)
        x1, x2 = torch.randn(1, 6), torch.randn(1, 6)
        with model.session():
            with model.trace(x1):
                h = model[1].output               # no save: usable later in the session
            with model.trace(x2):
                model[1].output[:] = h
                out = model.output.save()
        torch.testing.assert_close(out, seq(x1))
        with pytest.raises(NameError):
            h  # noqa: B018

    def test_two_models_in_one_session(self, seq):
        torch.manual_seed(3)
        other = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 6))
        a, b = NNsight(seq), NNsight(other)
        x = torch.randn(2, 6)
        with a.session():
            with a.trace(x):
                h = a[0].output
            with b.trace(x):
                b[0].output = h
                out = b.output.save()
        torch.testing.assert_close(out, other[1](seq[0](x)))


class TestEdit:
    def test_edit_applies_on_edited_not_on_model(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with model.edit() as edited:
            edited[1].output[:] = 0
        with edited.trace(x):
            out = edited.output.save()
        with model.trace(x):
            plain = model.output.save()
        torch.testing.assert_close(out, seq[3](seq[2](torch.zeros(2, 6))))
        torch.testing.assert_close(plain, seq(x))

    def test_edit_composes_with_trace_body(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        scale = 2.0
        with model.edit() as edited:
            edited[1].output[:] = edited[1].output * scale
        with edited.trace(x):
            seen = edited[1].output.clone().save()   # the trace sees the edited value
            edited[2].output[:] = 1
            out = edited.output.save()
        torch.testing.assert_close(seen, seq[1](seq[0](x)) * 2)
        torch.testing.assert_close(out, seq[3](torch.ones(2, 6)))

    def test_edited_copy_has_its_own_envoy_tree(self, seq):
        """The edited copy's children lead back to the copy (``.parent``, ``.root``), also
        where the original's children were reached first, and a trace of that root runs the
        edit; its ``.source`` view is its own; the original wrapper is freed when dropped, and
        the copy's links still hold."""
        model = NNsight(seq)
        model[1]  # (the original's child Envoy and .source view exist before the copy)
        assert model.source._envoy is model
        with model.edit() as edited:
            edited[1].output[:] = 0
        assert edited[1].parent is edited and edited[2].root is edited
        assert model[1].parent is model and edited[1] is not model[1]
        x = torch.randn(2, 6)
        with edited[3].root.trace(x):
            out = edited.output.save()
        torch.testing.assert_close(out, seq[3](seq[2](torch.zeros(2, 6))))
        assert edited.source._envoy is edited
        original = weakref.ref(model)
        del model
        gc.collect()
        assert original() is None  # (the copy holds nothing of the original wrapper)
        assert edited[1].parent is edited and edited[1].root is edited

    def test_inplace_and_clear(self, seq):
        model = NNsight(seq)
        x = torch.randn(2, 6)
        with model.edit(inplace=True):
            model[3].output = model[3].output * 0
        with model.trace(x):
            zeroed = model.output.save()
        assert torch.all(zeroed == 0)
        model.clear_edits()
        with model.trace(x):
            out = model.output.save()
        torch.testing.assert_close(out, seq(x))


    def test_pickling_or_deep_copying_an_edited_model_names_the_edit(self, seq):
        """pickle / deepcopy of a model with persistent edits raises TypeError naming the edit's
        line and model.clear_edits() (it said "cannot pickle code objects" / "'module' object");
        a shallow copy keeps working, and after clear_edits() both work."""
        model = NNsight(seq)
        with model.edit(inplace=True):
            model[1].output[:] = 0
        line = inspect.currentframe().f_lineno - 2
        for make in (pickle.dumps, copy.deepcopy):
            with pytest.raises(TypeError, match=rf"persistent edits cannot be pickled or deep-"
                               rf"copied: the edit made by `with \.\.\.edit\(\.\.\.\)` at "
                               rf"{re.escape(__file__)}:{line} .*model\.clear_edits\(\)"):
                make(model)
        assert copy.copy(model)._edits == model._edits
        model.clear_edits()
        x = torch.randn(2, 6)
        torch.testing.assert_close(pickle.loads(pickle.dumps(model))(x), seq(x))
        torch.testing.assert_close(copy.deepcopy(model)(x), seq(x))


class TestTraining:
    def test_lora_adapter_trains_through_interventions(self, seq):
        torch.manual_seed(0)
        model = NNsight(seq)
        for p in seq.parameters():
            p.requires_grad_(False)
        down = torch.nn.Parameter(torch.randn(6, 2) * 0.1)
        up = torch.nn.Parameter(torch.zeros(2, 6))
        opt = torch.optim.Adam([down, up], lr=0.05)
        x, target = torch.randn(16, 6), torch.randn(16, 6)
        losses = []
        for _ in range(30):
            with model.trace(x):
                h = model[1].output
                model[1].output = h + h @ down @ up
                loss = ((model.output - target) ** 2).mean()
                with loss.backward():
                    pass
                loss = loss.save()
            losses.append(loss.item())
            assert up.grad is not None and down.grad is not None
            opt.step()
            opt.zero_grad()
        assert losses[-1] < losses[0] * 0.9
        assert all(p.grad is None for p in seq.parameters())


def test_readme_tour_blocks_run_in_order_as_written(tmp_path):
    """The README's blocks on the tour's model (the tour, several invokes, caching, sessions
    and edits, gradients) run one after another in one script, as a reader pastes them, and
    give what plain torch gives. Before, the batching block used `clean`/`corrupt` defined
    nowhere, the standalone backward `out`/`h0`, and the session block left its in-place edit
    of model[1] on `model`, so the gradients block failed in torch's backward."""
    import runpy
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()

    def block(heading):
        return re.search(r"```python\n(.*?)```", readme.split(heading, 1)[1], re.S).group(1)

    headings = ["## A tour", "### Several inputs in one batched forward",
                "### Caching many modules at once", "### Sessions and persistent edits",
                "### Gradients"]
    script = tmp_path / "readme_tour.py"
    script.write_text("\n".join(block(h) for h in headings))
    ns = runpy.run_path(str(script))
    net, x, clean = ns["model"]._module, ns["x"], ns["clean"]
    h = net[1](net[0](clean))
    torch.testing.assert_close(ns["patched"], net[2](h))  # the session's patch: clean's layer 1
    h0 = net[0](x)
    h0.retain_grad()
    net[2](net[1](h0)).sum().backward()
    torch.testing.assert_close(ns["g0"], h0.grad)
    assert not ns["g"].any()  # edited in place by `h.grad[:] = 0` after it was saved
