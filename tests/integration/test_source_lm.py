"""``.source`` on tiny GPT-2 and Llama: operations inside attention read and edited, checked
against plain transformers with the same edit made by a hook or a monkeypatch; per-step
reads during generate; nested ``.source`` into the attention function."""

from __future__ import annotations

import pytest
import torch
from tests.integration.conftest import layers

import nnsight_lite

PROMPT = "the eiffel tower is in the city of"


def attn_of(block, arch):
    return block.attn if arch == "gpt2" else block.self_attn


def proj_name(arch):
    """The op of attention's output projection, as nnsight names it."""
    return "self_c_proj_0" if arch == "gpt2" else "self_o_proj_0"


def proj_of(attn, arch):
    return attn.c_proj if arch == "gpt2" else attn.o_proj


def test_attention_interface_output_equals_projection_input(lm, hf, arch):
    """attention_interface_0's output (per-head attention output) is what the projection
    receives, reshaped; the projection op's output equals the projection module's output."""
    enc = lm.tokenizer(PROMPT, return_tensors="pt")
    with lm.trace(PROMPT):
        src = attn_of(layers(lm, arch)[1], arch).source
        heads = src.attention_interface_0.output[0].save()
        proj = getattr(src, proj_name(arch)).output.save()
    seen = {}
    mod = proj_of(attn_of(layers(hf, arch)[1], arch), arch)
    h1 = mod.register_forward_pre_hook(lambda m, a: seen.__setitem__("in", a[0].clone()))
    h2 = mod.register_forward_hook(lambda m, a, o: seen.__setitem__("out", o.clone()))
    try:
        with torch.no_grad():
            hf(**enc)
    finally:
        h1.remove()
        h2.remove()
    torch.testing.assert_close(heads.reshape(*heads.shape[:2], -1), seen["in"])
    torch.testing.assert_close(proj, seen["out"])


def test_editing_one_head_equals_plain_model_with_a_hook(lm, hf, arch):
    """Zeroing head 0 in attention_interface_0's output changes the logits exactly as a
    plain pre-hook zeroing the same columns of the projection's input does."""
    enc = lm.tokenizer(PROMPT, return_tensors="pt")
    with lm.trace(PROMPT):
        attn_of(layers(lm, arch)[0], arch).source.attention_interface_0.output[0][:, :, 0] = 0
        logits = lm.lm_head.output.save()
    hd = hf.config.hidden_size // hf.config.num_attention_heads

    def zero_head(m, args):
        x = args[0].clone()
        x[..., :hd] = 0
        return (x,)

    handle = proj_of(attn_of(layers(hf, arch)[0], arch), arch).register_forward_pre_hook(zero_head)
    try:
        with torch.no_grad():
            ref = hf(**enc).logits
    finally:
        handle.remove()
    torch.testing.assert_close(logits, ref)
    with torch.no_grad():
        assert not torch.allclose(ref, hf(**enc).logits)


def test_nested_source_reads_the_attention_kernel(lm, hf, arch, monkeypatch):
    """attention_interface_0.source.<sdpa op> is the scaled_dot_product_attention result of
    that layer: the same tensor a monkeypatched plain run records."""
    if hf.config._attn_implementation != "sdpa":
        pytest.skip("the tiny model does not use sdpa here")
    enc = lm.tokenizer(PROMPT, return_tensors="pt")
    with lm.trace(PROMPT):
        inner = attn_of(layers(lm, arch)[1], arch).source.attention_interface_0.source
        sdpa = inner.torch_nn_functional_scaled_dot_product_attention_0.output.save()
    records = []
    real = torch.nn.functional.scaled_dot_product_attention

    def recording(*a, **k):
        out = real(*a, **k)
        records.append(out.clone())
        return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    with torch.no_grad():
        hf(**enc)
    monkeypatch.undo()
    assert len(records) == len(layers(hf, arch))
    torch.testing.assert_close(sdpa, records[1])


def test_generate_reads_an_op_at_every_step(lm, hf, arch):
    """In generate, tracer.all() and .next() give the projection op's output at each step,
    equal to a plain forward hook on the projection module during HF generate."""
    from test_language import plain_generate

    k = 3
    enc = lm.tokenizer(PROMPT, return_tensors="pt")
    with lm.generate(PROMPT, max_new_tokens=k, do_sample=False) as tracer:
        by_all = nnsight_lite.save([])
        for _ in tracer.all():
            op = getattr(attn_of(layers(lm, arch)[0], arch).source, proj_name(arch))
            by_all.append(op.output[:, -1].clone())
    with lm.generate(PROMPT, max_new_tokens=k, do_sample=False) as tracer:
        op = getattr(attn_of(layers(lm, arch)[0], arch).source, proj_name(arch))
        first = op.output[:, -1].save()
        second = op.next().output[:, -1].save()
    ref = []
    hook = (proj_of(attn_of(layers(hf, arch)[0], arch), arch),
            lambda step, out: ref.append(out[:, -1].clone()))
    plain_generate(hf, enc, k, hooks=[hook])
    assert len(by_all) == k == len(ref)
    for got, want in zip(by_all, ref):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(first, ref[0])
    torch.testing.assert_close(second, ref[1])


def test_several_invokes_edit_their_own_rows(lm, hf, arch):
    """Two invokes: the second zeroes the projection op's output for its own prompt only; the
    first prompt's logits are those of the clean model, the second's those of a plain model
    with the projection's output zeroed by a hook."""
    prompts = ["hello world", "the cat sat on the mat"]
    with lm.trace() as tracer:
        with tracer.invoke(prompts[0]):
            a = lm.lm_head.output[:, -1].save()
        with tracer.invoke(prompts[1]):
            op = getattr(attn_of(layers(lm, arch)[0], arch).source, proj_name(arch))
            op.output[:] = 0
            b = lm.lm_head.output[:, -1].save()
    with torch.no_grad():
        clean = hf(**lm.tokenizer(prompts[0], return_tensors="pt")).logits[:, -1]
        mod = proj_of(attn_of(layers(hf, arch)[0], arch), arch)
        handle = mod.register_forward_hook(lambda m, i, o: torch.zeros_like(o))
        try:
            zeroed = hf(**lm.tokenizer(prompts[1], return_tensors="pt")).logits[:, -1]
        finally:
            handle.remove()
    torch.testing.assert_close(a, clean)
    torch.testing.assert_close(b, zeroed)


def test_print_lists_the_attention_ops(lm, arch):
    """print(attn.source) names attention_interface_0 on the line that calls it."""
    text = str(attn_of(layers(lm, arch)[0], arch).source)
    line = next(ln for ln in text.splitlines() if "attention_interface_0 " in ln)
    assert "attention_interface(" in line


def test_readme_source_example_runs(model_dirs, tmp_path):
    """The README's `.source` example runs as written on the tiny GPT-2, and what it saves is
    consistent: the sdpa result with head 0 zeroed afterwards is the saved per-head output."""
    import re
    import runpy
    import warnings
    from pathlib import Path

    from nnsight_lite import LanguageModel

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("### Operations inside a forward", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "readme_source.py"
    script.write_text(code)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = LanguageModel(model_dirs["gpt2"], dispatch=True)
    ns = runpy.run_path(str(script), init_globals={"model": model})
    heads, sdpa = ns["heads"], ns["sdpa"]
    assert not heads[:, :, 0].any()
    torch.testing.assert_close(heads[:, :, 1:], sdpa.transpose(1, 2)[:, :, 1:])


def test_the_root_of_a_language_model_has_source(lm, hf, arch, model_dirs):
    """``lm.source`` on the root of a LanguageModel loaded from a path lists the top forward's
    operations, and its call of the base model reads what a hook on that module sees; the
    path the model was loaded from is still what it reloads from."""
    name, base = (("self_transformer_0", hf.transformer) if arch == "gpt2"
                  else ("self_model_0", hf.model))
    assert name in str(lm.source)
    with lm.trace(PROMPT):
        h = getattr(lm.source, name).output[0].save()
    seen = []
    hook = base.register_forward_hook(lambda m, a, o: seen.append(o[0].clone()))
    try:
        with torch.no_grad():
            hf(**lm.tokenizer(PROMPT, return_tensors="pt"))
    finally:
        hook.remove()
    torch.testing.assert_close(h, seen[0])
    assert str(lm._source) == str(model_dirs[arch])


def test_attention_pattern_after_a_warm_up_trace(model_dirs, hf, arch):
    """nnsight's TransformerLens migration tutorial: one trace touches the attention
    function's ``.source``; the next reads the query projection (computed inside attention's
    own call) and then the attention weights from that op, and a read of the softmax inside
    the attention function follows. Each equals plain transformers (``output_attentions``,
    eager attention). Found by a docs hunt: the second trace raised OutOfOrderError, where
    nnsight 0.8.1 runs it."""
    import warnings

    from nnsight_lite import LanguageModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        lm = LanguageModel(model_dirs[arch], dispatch=True, attn_implementation="eager")
    enc = lm.tokenizer(PROMPT, return_tensors="pt")
    attn = attn_of(layers(lm, arch)[1], arch)
    first = attn.c_attn if arch == "gpt2" else attn.q_proj
    with lm.trace(PROMPT):  # the warm-up: touches the op alone
        attn.source.attention_interface_0.output[1].save()
    with lm.trace(PROMPT):
        q = first.output.save()
        pattern = attn.source.attention_interface_0.output[1].save()
    with lm.trace(PROMPT):
        q2 = first.output.save()
        probs = attn.source.attention_interface_0.source.nn_functional_softmax_0.output.clone().save()
        attn.source.attention_interface_0.source.nn_functional_softmax_0.output[:] = 0
        logits = lm.lm_head.output.save()
    plain = _eager_hf(model_dirs[arch])
    with torch.no_grad():
        ref = plain(**enc, output_attentions=True)
    torch.testing.assert_close(pattern, ref.attentions[1])
    torch.testing.assert_close(probs.to(pattern.dtype), pattern)
    torch.testing.assert_close(q, q2)
    mod = proj_of(attn_of(layers(plain, arch)[1], arch), arch)
    handle = mod.register_forward_pre_hook(lambda m, a: (torch.zeros_like(a[0]),))
    try:
        with torch.no_grad():
            zeroed = plain(**enc).logits
    finally:
        handle.remove()
    torch.testing.assert_close(logits, zeroed)


def _eager_hf(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
