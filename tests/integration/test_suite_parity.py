"""nnsight 0.5-0.8 forms met running nnsight's own test suite with the import changed, on tiny
GPT-2 and Llama, each checked against plain transformers."""

from __future__ import annotations

import torch

PROMPT = "the eiffel tower is in the city of"


def hf_step_logits(lm, hf, n):
    """The last position's logits of each of plain HF greedy generate's ``n`` steps."""
    steps = []
    handle = hf.lm_head.register_forward_hook(lambda m, i, o: steps.append(o[:, -1].clone()))
    try:
        enc = lm.tokenizer(PROMPT, return_tensors="pt")
        hf.generate(**enc, max_new_tokens=n, do_sample=False,
                    pad_token_id=lm.tokenizer.pad_token_id)
    finally:
        handle.remove()
    return steps


def test_model_iter_and_all_are_the_tracers(lm, hf):
    """`model.all()` and `model.iter[...]` (0.5-0.8's deprecated aliases on the Envoy) loop
    over generation steps like `tracer.all()` / `tracer.iter[...]`."""
    want = hf_step_logits(lm, hf, 3)
    with lm.generate(PROMPT, max_new_tokens=3, do_sample=False):
        every = list().save()
        for _ in lm.all():
            every.append(lm.lm_head.output[:, -1])
    with lm.generate(PROMPT, max_new_tokens=3, do_sample=False):
        some, idx = list().save(), list().save()
        for step in lm.iter[1:3]:
            some.append(lm.lm_head.output[:, -1])
            idx.append(step)
    assert len(every) == 3 and idx == [1, 2]
    for got, w in zip(every + some, want + want[1:3]):
        assert torch.allclose(got, w, atol=1e-5)
