"""nnsight code moved over by changing the import, on tiny GPT-2 and Llama: the model is freed,
``tracer.result`` in generate bodies, generate's default length, ``.to()``, ``rename=``."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
import transformers
from tests.integration.conftest import layers

from nnsight_lite import LanguageModel
from nnsight_lite.errors import NNsightError

PROMPT = "the eiffel tower is in the city of"


def load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no pad token: eos is used
        return LanguageModel(path, **kw)


def test_language_models_are_freed_over_many_recreations(model_dirs, arch):
    """A notebook re-running `model = LanguageModel(...)` and a trace and a generate: every
    earlier model, its modules and weights go (by reference counting alone)."""
    refs = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(4):
            lm = load(model_dirs[arch], dispatch=True)
            hf = lm._module
            refs += [weakref.ref(lm), weakref.ref(hf), weakref.ref(layers(hf, arch)[0]),
                     weakref.ref(next(hf.parameters()))]
            with lm.trace(PROMPT):
                h = layers(lm, arch)[0].output.save()
            with lm.generate(PROMPT, max_new_tokens=2) as tracer:
                ids = tracer.result.save()
            del lm, hf, h, ids, tracer
        alive = sum(r() is not None for r in refs)
    finally:
        gc.enable()
    assert alive == 0


class TestResult:
    def test_in_a_generate_body_it_is_the_generated_ids(self, lm, hf):
        """`tracer.result` in the body waits for generation to end (it was a silent None)."""
        with lm.generate(PROMPT, max_new_tokens=4, do_sample=False) as tracer:
            for step in tracer.all():
                lm.lm_head.output
            ids = tracer.result.save()
            gen = lm.generator.output.save()
        enc = lm.tokenizer(PROMPT, return_tensors="pt")
        plain = hf.generate(**enc, max_new_tokens=4, do_sample=False,
                            pad_token_id=lm.tokenizer.pad_token_id)
        assert torch.equal(ids, plain) and torch.equal(gen, plain)
        assert torch.equal(tracer.result, plain)  # and after the block

    def test_in_a_trace_body_it_is_the_model_output(self, lm, hf):
        enc = lm.tokenizer(PROMPT, return_tensors="pt")
        with lm.trace(PROMPT) as tracer:
            out = tracer.result.save()
        assert torch.allclose(out.logits, hf(**enc).logits, atol=1e-5)
        with pytest.raises(NNsightError, match=r"tracer.result.save\(\)"):
            tracer.result


def test_generate_without_max_new_tokens_uses_the_generation_config(lm, hf):
    """As HF generate does: the model's generation config sets the length."""
    enc = lm.tokenizer(PROMPT, return_tensors="pt")
    plain = hf.generate(**enc, do_sample=False, pad_token_id=lm.tokenizer.pad_token_id)
    with lm.generate(PROMPT, do_sample=False) as tracer:
        ids = tracer.result.save()
    assert torch.equal(ids, plain)
    assert ids.shape[1] > enc["input_ids"].shape[1]


def test_to_on_a_model_still_on_meta_loads_it_and_keeps_the_wrapper(model_dirs, hf, arch):
    lm = load(model_dirs[arch])
    assert not lm.dispatched
    same = lm.to(torch.float64)
    assert same is lm and lm.dispatched
    enc = lm.tokenizer(PROMPT, return_tensors="pt")
    with lm.trace(PROMPT):
        logits = lm.lm_head.output.save()
    assert logits.dtype == torch.float64
    assert torch.allclose(logits.float(), hf(**enc).logits, atol=1e-4)
    assert lm.eval() is lm and lm.cpu() is lm


def test_rename_on_gpt2_equals_plain_hooks(model_dirs):
    """`rename={"transformer.h": "layers", "mlp": "ffn"}` as in nnsight's docs, on a model loaded
    on meta first (aliases are resolved by path, so they survive the weights loading)."""
    lm = load(model_dirs["gpt2"], rename={"transformer.h": "layers", "mlp": "ffn",
                                          "transformer": ["backbone"]})
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dirs["gpt2"])
    enc = lm.tokenizer(PROMPT, return_tensors="pt")
    with lm.trace(PROMPT):
        a = lm.layers[1].ffn.output.clone().save()
        lm.layers[1].ffn.output[:] = 0
        b = lm.backbone.h[2].output.save()
    seen = {}
    h1 = hf.transformer.h[1].mlp.register_forward_hook(
        lambda m, i, o: seen.setdefault("mlp", o.clone()) * 0)
    h2 = hf.transformer.h[2].register_forward_hook(lambda m, i, o: seen.setdefault("h2", o))
    try:
        hf(**enc)
    finally:
        h1.remove()
        h2.remove()
    assert torch.allclose(a, seen["mlp"], atol=1e-5) and torch.allclose(b, seen["h2"], atol=1e-5)
    assert lm.layers is lm.transformer.h and "(backbone/transformer)" in repr(lm)


def test_generate_called_without_with_returns_the_ids(lm, hf):
    """`ids = model.generate(prompt, ...)` as in HF and nnsight: the ids, no tracer."""
    enc = lm.tokenizer(PROMPT, return_tensors="pt")
    ids = lm.generate(PROMPT, max_new_tokens=3, do_sample=False)
    plain = hf.generate(**enc, max_new_tokens=3, do_sample=False,
                        pad_token_id=lm.tokenizer.pad_token_id)
    assert torch.equal(ids, plain)
