"""Several invokes in a ``generate`` with beam search or several returned sequences: HF
expands each prompt's row into adjacent rows (``repeat_interleave``), and each invoke reads and
edits the rows of its own prompts, checked against plain HF ``generate`` with forward hooks."""

from __future__ import annotations

import pytest
import torch
from tests.integration.conftest import layers

import nnsight_lite

# two prompts of the same length (no padding, so the plain batch is the traced one)
PROMPTS = ["the eiffel tower is in", "mary and john went to"]


def plain_generate(lm, hf, arch, hook=None, **kw):
    """HF generate on both prompts batched, with ``hook`` on block 1 (its outputs, in order)."""
    enc = lm.tokenizer(PROMPTS, return_tensors="pt")
    assert enc["input_ids"].shape == (2, 5)
    seen = []

    def record(module, args, out):
        if hook is not None:
            hook(out)
        seen.append(out.clone())

    handle = layers(hf, arch)[1].register_forward_hook(record)
    try:
        ids = hf.generate(**enc, pad_token_id=1, do_sample=False, **kw)
    finally:
        handle.remove()
    return ids, seen


def test_each_invoke_reads_its_prompts_beams(lm, hf, arch):
    with lm.generate(max_new_tokens=3, num_beams=2, do_sample=False) as tracer:
        got = nnsight_lite.save([])
        for i, prompt in enumerate(PROMPTS):
            with tracer.invoke(prompt):
                steps = []
                for step in tracer.all():
                    steps.append(layers(lm, arch)[1].output.clone())
                got.append((steps, lm.generator.output))
    ids, seen = plain_generate(lm, hf, arch, max_new_tokens=3, num_beams=2)
    assert len(seen) == 3
    for i, (steps, out) in enumerate(got):
        assert len(steps) == 3
        for s, h in enumerate(steps):
            assert h.shape[0] == 2  # its prompt's two beams, not all four rows
            assert torch.equal(h, seen[s][2 * i:2 * i + 2]), (i, s)
        assert torch.equal(out, ids[i:i + 1])
    assert torch.equal(tracer.result, ids)


def test_an_invokes_edit_reaches_its_own_beams_only(lm, hf, arch):
    with lm.generate(max_new_tokens=3, num_beams=2, do_sample=False) as tracer:
        with tracer.invoke(PROMPTS[0]):
            first = lm.generator.output.save()
        with tracer.invoke(PROMPTS[1]):
            for step in tracer.all():
                layers(lm, arch)[1].output[:] = 0
            second = lm.generator.output.save()

    def zero_second(out):
        out[2:4] = 0

    ids, _ = plain_generate(lm, hf, arch, hook=zero_second, max_new_tokens=3, num_beams=2)
    plain, _ = plain_generate(lm, hf, arch, max_new_tokens=3, num_beams=2)
    assert not torch.equal(ids[1], plain[1])  # (the edit changes what prompt 1 generates)
    assert torch.equal(first, ids[0:1]) and torch.equal(first, plain[0:1])
    assert torch.equal(second, ids[1:2])


@pytest.mark.parametrize("sample", [False, True])
def test_returned_sequences_are_split_by_invoke(lm, hf, arch, sample):
    """num_return_sequences=2, with beam search or sampling (the same seed for both runs):
    each invoke gets its prompt's sequences, its block rows and its cache rows."""
    kw = dict(max_new_tokens=2, num_return_sequences=2, do_sample=sample,
              num_beams=1 if sample else 2)
    torch.manual_seed(0)
    with lm.generate(**kw) as tracer:
        with tracer.invoke(PROMPTS[0]):
            h0 = layers(lm, arch)[1].output.save()
            first = lm.generator.output.save()
        with tracer.invoke(PROMPTS[1]):
            cache = tracer.cache(modules=[layers(lm, arch)[1]])
            second = lm.generator.output.save()
    torch.manual_seed(0)
    kw.pop("do_sample")
    enc = lm.tokenizer(PROMPTS, return_tensors="pt")
    seen = []
    handle = layers(hf, arch)[1].register_forward_hook(lambda m, a, o: seen.append(o.clone()))
    try:
        ids = hf.generate(**enc, pad_token_id=1, do_sample=sample, **kw)
    finally:
        handle.remove()
    assert ids.shape[0] == 4 and seen[0].shape[0] == 4
    assert torch.equal(first, ids[0:2]) and torch.equal(second, ids[2:4])
    assert torch.equal(h0, seen[0][0:2])
    outputs = cache[list(cache.keys())[0]].output  # (one a step)
    assert len(outputs) == len(seen) == 2
    assert all(torch.equal(o, h[2:4]) for o, h in zip(outputs, seen))


def test_beams_given_to_the_invokes_split_the_rows_too(lm, hf, arch):
    """num_beams given to tracer.invoke(...) reaches HF generate with the batch's keywords,
    so the rows are expanded just the same: each invoke still gets its own prompt's beams."""
    with lm.generate(max_new_tokens=2, do_sample=False) as tracer:
        got = nnsight_lite.save([])
        for prompt in PROMPTS:
            with tracer.invoke(prompt, num_beams=2):
                got.append((layers(lm, arch)[1].output.clone(), lm.generator.output))
    ids, seen = plain_generate(lm, hf, arch, max_new_tokens=2, num_beams=2)
    assert torch.equal(tracer.result, ids)
    for i, (h, out) in enumerate(got):
        assert torch.equal(h, seen[0][2 * i:2 * i + 2]), i
        assert torch.equal(out, ids[i:i + 1]), i
