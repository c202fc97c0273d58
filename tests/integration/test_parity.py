"""nnsight code moved over by changing the import, on tiny GPT-2 and Llama: the model is freed,
``tracer.result`` in generate bodies, generate's default length, ``.to()``, ``rename=``."""

from __future__ import annotations

import gc
import pickle
import warnings
import weakref

import pytest
import torch
import transformers
from tests.integration.conftest import layers

from nnsight_lite import LanguageModel
from nnsight_lite.errors import BodySyntaxError, NNsightError

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


class TestDocExamples:
    """Examples from nnsight's usage pages, with only the import, the model and its module paths
    changed (docs/usage/cache.md, all-and-next.md)."""

    def test_one_line_invoke_bodies(self, lm, hf, arch):
        """`with tracer.invoke("the cat"): pass` (cache.md): an invoke inside a trace body may
        keep its body on the `with` line, trivial or not; the batch is what plain HF computes
        on the same left-padded batch."""
        short, long = "the cat", "the eiffel tower is in the city of paris"
        with lm.trace() as tracer:
            with tracer.invoke(short): pass  # noqa: E701
            with tracer.invoke(long): last = layers(lm, arch)[0].output[:, -1].save()  # noqa: E701
            with tracer.invoke():
                batch = tracer.cache(modules=[layers(lm, arch)[0]])
        with pytest.raises(BodySyntaxError, match="on its own indented lines"):
            with lm.trace(short): h = layers(lm, arch)[0].output.save()  # noqa: E701,F841
        with lm.trace(short): pass  # noqa: E701  (trivial: runs inline, harmless)
        enc = lm.tokenizer([short, long], return_tensors="pt", padding=True, padding_side="left")
        seen = {}
        handle = layers(hf, arch)[0].register_forward_hook(lambda m, i, o: seen.setdefault("h", o))
        try:
            position_ids = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
            hf(**enc, position_ids=position_ids)
        finally:
            handle.remove()
        key = "model.transformer.h.0" if arch == "gpt2" else "model.model.layers.0"
        got = batch[key].output
        mask = enc["attention_mask"].bool()
        assert got.shape == seen["h"].shape
        assert torch.allclose(got[mask], seen["h"][mask], atol=1e-5)
        assert torch.allclose(last, seen["h"][1:, -1], atol=1e-5)

    def test_tracer_next_addresses_the_next_step_of_every_module(self, lm, hf):
        """`tracer.next()` (all-and-next.md) moves every later read to the next generation step,
        as `module.next()` does for one module; the logits equal plain HF generate's per step."""
        steps = []
        handle = hf.lm_head.register_forward_hook(lambda m, i, o: steps.append(o[:, -1].clone()))
        try:
            enc = lm.tokenizer(PROMPT, return_tensors="pt")
            hf.generate(**enc, max_new_tokens=3, do_sample=False,
                        pad_token_id=lm.tokenizer.pad_token_id)
        finally:
            handle.remove()
        with lm.generate(PROMPT, max_new_tokens=3, do_sample=False) as tracer:
            s0 = lm.lm_head.output[:, -1].save()
            tracer.next()
            s1 = lm.lm_head.output[:, -1].save()
            lm.lm_head.next()                    # module.next() on top of tracer.next()
            s2 = lm.lm_head.output[:, -1].save()
        with lm.generate(PROMPT, max_new_tokens=3, do_sample=False) as tracer:
            tracer.next(2)
            t2 = lm.lm_head.output[:, -1].save()
        for got, want in zip((s0, s1, s2, t2), steps[:3] + steps[2:3]):
            assert torch.allclose(got, want, atol=1e-5)
        assert not torch.allclose(s0, s1)

    def test_a_loaded_cache_navigates_once_its_model_is_back(self, lm, arch):
        """cache.md: a pickled view answers by path; with its model re-attached as nnsight
        writes it (`view._cache.model = model`, or `view._root = model`) it navigates."""
        with lm.trace(PROMPT) as tracer:
            cache = tracer.cache(modules=[layers(lm, arch)[1]])
        back = pickle.loads(pickle.dumps(cache))
        back._cache.model = lm
        assert back._root is lm
        want = cache["model.transformer.h.1" if arch == "gpt2" else "model.model.layers.1"].output
        assert torch.equal(layers(back, arch)[1].output, want)
        assert torch.equal(back[next(iter(back.keys()))].output, want)
