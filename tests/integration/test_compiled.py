"""Models holding torch.compile'd modules: traces read and edit them as eager hooks see them,
and leave their compiled code alone (compiled.py).

Ground truth is the eager module with forward hooks. Dynamo's own counters tell whether a
trace compiled anything: ``frames.total`` counts the frames dynamo has tried to compile.
``backend="eager"`` keeps dynamo (frames, guards, graph breaks) and skips inductor's C++.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from nnsight_lite import NNsight


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.act = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(16, 8)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(), Block(), torch.nn.Linear(8, 4))


def _hooked(net, x, module, edit=None):
    """The eager forward with a hook keeping ``module``'s output (and applying ``edit`` to it)."""
    kept = {}

    def hook(mod, args, out):
        if edit is not None:
            out = edit(out)
        kept["out"] = out.detach().clone()
        return out

    handle = module.register_forward_hook(hook)
    try:
        return kept, net(x)
    finally:
        handle.remove()


def _frames():
    return counters["frames"]["total"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_model_compiled_whole():
    """``NNsight(torch.compile(net))``: dynamo tried to compile the bodies' code and failed."""
    net = _net()
    compiled = torch.compile(net, backend="eager")
    x = torch.randn(3, 8)
    compiled(x)  # compiled once, before any trace
    frames = _frames()
    model = NNsight(compiled)
    ref_mid, _ = _hooked(net, x, net[0].fc1)
    ref_edit, ref_out = _hooked(net, x, net[1], edit=lambda o: o * 0)
    for _ in range(3):
        with model.trace(x):
            mid = model[0].fc1.output.save()  # (indexes the compiled module's _orig_mod)
            model._orig_mod[1].output[:] = 0
            out = model.output.save()
        assert torch.equal(mid, ref_mid["out"]) and torch.equal(out, ref_out)
        assert torch.equal(compiled(x), net(x))  # the compiled call outside traces
    assert _frames() == frames  # no trace compiled anything, nor made the compiled call recompile


def test_compiled_submodules():
    """``block.compile()`` and ``net[i] = torch.compile(net[i])`` inside the model: modules
    inside them are read and edited too, and their compiled calls stay as they were."""
    eager = _net()  # the same weights, nothing compiled: the ground truth
    net = _net()
    net[0].compile(backend="eager")
    net[1] = torch.compile(net[1], backend="eager")
    x = torch.randn(3, 8)
    net(x)
    frames = _frames()
    model = NNsight(net)
    ref_act, _ = _hooked(eager, x, eager[0].act, edit=lambda o: o + 1)
    ref_fc2, ref_out = {}, None
    handle = eager[1].fc2.register_forward_hook(lambda m, a, o: ref_fc2.setdefault("out", o))
    try:
        _, ref_out = _hooked(eager, x, eager[0].act, edit=lambda o: o + 1)
    finally:
        handle.remove()
    for _ in range(2):
        with model.trace(x):
            model[0].act.output[:] += 1
            act = model[0].act.output.save()
            fc2 = model[1]._orig_mod.fc2.output.save()
            out = model.output.save()
        assert torch.equal(act, ref_act["out"])
        assert torch.equal(fc2, ref_fc2["out"]) and torch.equal(out, ref_out)
    assert _frames() == frames
    assert "_compiled_call_impl" in net[0].__dict__  # the block's compiled call is still there
    assert torch.equal(net(x), eager(x))


def test_a_forward_compiled_in_place():
    """``module.forward = torch.compile(module.forward)`` (a compiled forward as the module's
    instance attribute, not ``module.compile()``): the trace ran it compiled, and dynamo
    compiled through the call entries into the bodies (21 frames for this trace)."""
    eager = _net()
    net = _net()
    net[0].forward = torch.compile(net[0].forward, backend="eager")
    x = torch.randn(3, 8)
    net(x)
    frames = _frames()
    model = NNsight(net)
    ref_mid, ref_out = _hooked(eager, x, eager[0].fc1, edit=lambda o: o * 2)
    for _ in range(2):
        with model.trace(x):
            model[0].fc1.output[:] *= 2
            mid = model[0].fc1.output.save()
            out = model.output.save()
        assert torch.equal(mid, ref_mid["out"]) and torch.equal(out, ref_out)
    assert _frames() == frames
    assert torch.equal(net(x), eager(x))  # (the compiled forward, outside traces)


def test_traces_on_two_threads_leave_the_stance_as_they_found_it():
    """Traces of two compiled models on two threads, overlapping (the README: separate model
    objects work): each took torch.compiler.set_stance("force_eager") as a context manager of
    its own, so B, entered while A's stance was on, put force_eager back when it ended after A,
    and every compiled call of the process ran eagerly from then on: a new input shape no longer
    compiled anything."""
    import threading

    def compiled():
        torch.manual_seed(0)
        return torch.compile(_net(), backend="eager")

    a, b = compiled(), compiled()
    x = torch.randn(3, 8)
    ref = _net()(x)
    a(x)
    b(x)
    model_a, model_b = NNsight(a), NNsight(b)
    a_in, b_in, a_done, got = threading.Event(), threading.Event(), threading.Event(), {}

    def other():
        a_in.wait(60)
        try:
            with model_b.trace(x):
                first = model_b[0].output.save()
                b_in.set()  # B's forward is running now; A's trace ends meanwhile
                a_done.wait(60)
                out = model_b.output.save()
            got["b"] = first, out
        except Exception as exc:  # (reported in the main thread)
            got["b"] = exc
        finally:
            b_in.set()

    thread = threading.Thread(target=other)
    thread.start()
    try:
        with model_a.trace(x):
            out_a = model_a.output.save()
            a_in.set()
            b_in.wait(60)
    finally:
        a_done.set()
        a_in.set()
        thread.join(60)
    assert isinstance(got["b"], tuple), got["b"]
    assert torch.equal(out_a, ref) and torch.equal(got["b"][1], ref)
    frames = _frames()
    y = torch.randn(5, 2, 8)  # a new shape: the compiled call compiles it, as before the traces
    assert torch.equal(a(y), _net()(y))
    assert _frames() > frames


def test_generate_with_a_cache_hf_compiles_for():
    """HF generate compiles the model's forward itself where the cache is compileable (static,
    hybrid) on an accelerator; a traced generate then had dynamo compile through the trace (43
    frames here). ``_compile_all_devices`` makes HF do on the CPU what it does on a GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import CompileConfig

    from nnsight_lite import LanguageModel

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)).eval()
    ids = torch.randint(0, 64, (1, 5))
    compile_config = CompileConfig(fullgraph=False, backend="eager")
    compile_config._compile_all_devices = True
    kw = dict(max_new_tokens=4, do_sample=False, cache_implementation="static", pad_token_id=0)
    kept = []
    handle = hf.model.layers[0].register_forward_hook(lambda m, a, o: kept.append(o.clone()))
    try:  # the ground truth: the same generate, eager, with a hook
        ref = hf.generate(ids, disable_compile=True, **kw)
    finally:
        handle.remove()
    model = LanguageModel(hf)
    frames = _frames()
    with model.generate(ids, compile_config=compile_config, **kw) as tracer:
        first = model.model.layers[0].output.save()
        out = tracer.result.save()
    assert _frames() == frames
    assert torch.equal(out, ref) and torch.equal(first, kept[0])
