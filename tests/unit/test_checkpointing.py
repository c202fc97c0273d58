"""Edits inside activation checkpointing (torch.utils.checkpoint): the backward recomputes the
region without the bodies, so an edit there is lost to the gradients. A trace that makes one,
with gradients on, warns; reads, edits outside the region and traces without gradients do not.
Ground truth: the same edit made by a forward hook, which the recompute runs again."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from nnsight_lite import NNsight

WARNING = "activation checkpointing"


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Net(torch.nn.Module):
    """``blk`` runs inside a checkpoint, ``pre`` and ``head`` outside it."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.pre = torch.nn.Linear(8, 8)
        self.blk = Block()
        self.head = torch.nn.Linear(8, 1)
        self.reentrant = reentrant

    def forward(self, x):
        h = checkpoint(self.blk, self.pre(x), use_reentrant=self.reentrant)
        return self.head(h)


class NoGradInside(torch.nn.Module):
    """A model that turns gradients off around a module itself (no checkpoint)."""

    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        with torch.no_grad():
            h = self.frozen(x)
        return self.head(h)


def hooked_grad(net, module, x, edit):
    """Plain PyTorch: the gradient of x with ``edit`` applied to ``module``'s output by a hook."""
    handle = module.register_forward_hook(lambda m, i, o: edit(o))
    try:
        x = x.detach().requires_grad_(True)
        net(x).sum().backward()
        return x.grad
    finally:
        handle.remove()


def traced_grad(net, path, x, edit):
    """The same edit made by a trace body, backward after the trace; (x.grad, warnings)."""
    model = NNsight(net)
    x = x.detach().requires_grad_(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with model.trace(x):
            env = eval(f"model.{path}")
            env.output = edit(env.output)
            out = model.output.save()
        out.sum().backward()
    return x.grad, [w for w in caught if WARNING in str(w.message)]


@pytest.fixture(params=[True, False], ids=["reentrant", "non-reentrant"])
def reentrant(request):
    return request.param


def test_an_edit_inside_the_region_warns_naming_module_invoke_and_mode(reentrant):
    torch.manual_seed(0)
    net = Net(reentrant)
    x = torch.randn(4, 8)
    want = hooked_grad(net, net.blk.a, x, lambda o: o * 3 + 1)
    got, caught = traced_grad(net, "blk.a", x, lambda o: o * 3 + 1)
    # what the warning is about: the trace's gradient is not the edited model's
    assert got is None or not torch.allclose(got, want)
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "invoke 0 changed model.blk.a.output" in text
    assert f"use_reentrant={reentrant}" in text
    assert "activation_checkpointing_disable()" in text
    assert caught[0].filename == __file__  # shown at the body's lines, not in nnsight_lite
    assert f"its body is now at {__file__}:" in text  # (at its next read)


def test_an_edit_of_an_operation_inside_the_region_warns_with_the_next_read(reentrant):
    torch.manual_seed(0)
    model = NNsight(Net(reentrant))
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.warns(UserWarning, match=r"changed model\.blk\.source\.torch_tanh_0\.output") as rec:
        with model.trace(x):
            op = model.blk.source.torch_tanh_0
            op.output = op.output * 2
            out = model.head.output.save()
    text = str(rec[0].message)
    with open(__file__) as f:
        line = next(i for i, t in enumerate(f, 1) if "out = model.head.output.save()" in t)
    assert f"its body is now at {__file__}:{line}, the read after the edit" in text
    assert out.shape == (4, 1)


def test_a_body_that_ended_is_named_by_its_lines():
    torch.manual_seed(0)
    model = NNsight(Net(True))
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.warns(UserWarning, match="changed model.blk.b.output") as rec:
        with model.trace(x):
            model.blk.b.output = model.blk.b.output + 1
    with open(__file__) as f:
        line = next(i for i, t in enumerate(f, 1) if "model.blk.b.output + 1" in t)
    assert f"its body at {__file__}:{line}-{line}" in str(rec[0].message)


def test_an_edit_outside_the_region_does_not_warn_and_is_exact(reentrant):
    torch.manual_seed(0)
    net = Net(reentrant)
    x = torch.randn(4, 8)
    for module, path in ((net.pre, "pre"), (net.head, "head")):
        want = hooked_grad(net, module, x, lambda o: o * 3 + 1)
        got, caught = traced_grad(net, path, x, lambda o: o * 3 + 1)
        torch.testing.assert_close(got, want)
        assert caught == []


def test_an_in_place_edit_inside_the_region_warns(reentrant):
    torch.manual_seed(0)
    net = Net(reentrant)
    model = NNsight(net)
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.warns(UserWarning, match="invoke 0 changed model.blk.b.output"):
        with model.trace(x):
            model.blk.b.output[:, 0] = 0
            out = model.output.save()
    plain = net.head(torch.tanh(net.blk.a(net.pre(x))) @ net.blk.b.weight.T + net.blk.b.bias)
    assert not torch.allclose(out, plain)  # the forward's value is edited as asked


def test_input_edits_and_skips_inside_the_region_warn(reentrant):
    torch.manual_seed(0)
    model = NNsight(Net(reentrant))
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.warns(UserWarning, match=r"changed model\.blk\.b\.input"):
        with model.trace(x):
            model.blk.b.input = model.blk.b.input * 2
    with pytest.warns(UserWarning, match=r"changed model\.blk\.a\.input"):
        with model.trace(x):
            model.blk.a.skip(model.blk.a.input)


def test_reads_inside_the_region_do_not_warn(reentrant):
    torch.manual_seed(0)
    net = Net(reentrant)
    model = NNsight(net)
    x = torch.randn(4, 8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        with model.trace(x):
            a = model.blk.a.output.save()
            b = model.blk.b.output.sum().save()
    torch.testing.assert_close(a, net.blk.a(net.pre(x)))
    torch.testing.assert_close(b, net.blk(net.pre(x)).sum())


def test_no_warning_without_gradients(reentrant):
    torch.manual_seed(0)
    model = NNsight(Net(reentrant))
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*" + WARNING)
        warnings.filterwarnings("ignore", module="torch")  # torch's own warnings about no grad
        with torch.no_grad(), model.trace(x):
            model.blk.a.output = model.blk.a.output * 3


def test_a_no_grad_block_of_the_models_own_is_not_taken_for_a_checkpoint():
    torch.manual_seed(0)
    net = NoGradInside()
    model = NNsight(net)
    x = torch.randn(4, 8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with model.trace(x):
            model.frozen.output = model.frozen.output * 3
            out = model.output.save()
    torch.testing.assert_close(out, net.head(net.frozen(x) * 3))


def test_the_invoke_that_edited_is_named(reentrant):
    torch.manual_seed(0)
    model = NNsight(Net(reentrant))
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.warns(UserWarning, match="invoke 1 changed model.blk.a.output") as rec:
        with model.trace() as tracer:
            with tracer.invoke(x):
                model.blk.a.output.save()
            with tracer.invoke(x):
                model.blk.a.output[:] = 0
    assert not any("invoke 0 changed" in str(w.message) for w in rec)


def test_an_hf_model_with_activation_checkpointing_in_train_mode_warns():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32,
                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=50)
    hf = transformers.LlamaForCausalLM(cfg)
    on = getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable
    off = getattr(hf, "activation_checkpointing_disable", None) or hf.gradient_checkpointing_disable
    ids = torch.randint(0, 50, (1, 5))
    steer = torch.randn(16, requires_grad=True)
    attn = hf.model.layers[0].self_attn
    model = NNsight(hf)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="transformers")
        on()  # (it hooks the input embeddings: taken off again below)
        hf.train()
        try:
            handle = attn.register_forward_hook(lambda m, i, o: (o[0] + steer, *o[1:]))
            hf(ids).logits.sum().backward()  # the recompute runs the hook again: exact
            handle.remove()
            want, steer.grad = steer.grad, None
            with pytest.warns(UserWarning, match=r"invoke 0 changed "
                              r"model\.model\.layers\[0\]\.self_attn\.output"):
                with model.trace(ids):
                    o = model.model.layers[0].self_attn.output
                    model.model.layers[0].self_attn.output = (o[0] + steer, *o[1:])
                    loss = model.lm_head.output.sum().save()
            loss.backward()
        finally:
            off()
    assert steer.grad is None or not torch.allclose(steer.grad, want)
