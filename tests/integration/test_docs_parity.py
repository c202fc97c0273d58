"""Forms from nnsight's own documentation (its docs/gotchas, docs/errors and docs/models pages)
met running their examples with the import changed, on tiny GPT-2 and Llama, each checked
against plain transformers."""

from __future__ import annotations

import warnings

import pytest
import torch

from nnsight_lite import InputError, LanguageModel

# a template over the tiny tokenizer's words: "<role> content" turns, then the assistant's
# turn opened when asked for (the shape of real chat templates, ids the model knows)
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
            "{% if add_generation_prompt %}assistant {% endif %}")
CHAT = [{"role": "user", "content": "the eiffel tower is in"}]


def load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no pad token: eos is used
        return LanguageModel(path, **kw)


def test_language_model_attributes_of_nnsight_08(model_dirs, arch):
    """docs/models/transformers-model.md: ``model.repo_id``, ``model.revision``,
    ``model.config`` and ``model.dispatched`` are there, and the preprocessors a causal LM has
    none of (``processor``, ``image_processor``, ``feature_extractor``) are None, as in nnsight
    0.8.1. Found by the docs hunt: all but config/dispatched raised ModulePathError."""
    import transformers

    model = load(model_dirs[arch], revision="main")
    assert model.repo_id == str(model_dirs[arch]) and model.revision == "main"
    assert (model.processor, model.image_processor, model.feature_extractor) == (None,) * 3
    assert model.dispatched is False
    built = transformers.AutoModelForCausalLM.from_pretrained(model_dirs[arch])
    wrapped = load(built, tokenizer=model.tokenizer)
    assert wrapped.repo_id == built.name_or_path and wrapped.revision is None


def _chat_ids(tok, messages, **kw):
    return tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"]


def test_chat_messages_are_templated_prompts(model_dirs, hf, arch):
    """docs/models/transformers-model.md: a list of chat messages is a prompt, templated by the
    tokenizer's chat template with the assistant's turn opened (one ending in an assistant
    message is continued), a list of conversations a batch, in trace, invoke and generate, as
    in nnsight 0.8.1 (the same ids). Found by the docs hunt: it raised InputError ("cannot use a
    list of dict as a prompt")."""
    model = load(model_dirs[arch], dispatch=True)
    tok = model.tokenizer
    tok.chat_template = TEMPLATE
    want = torch.tensor([_chat_ids(tok, CHAT, add_generation_prompt=True)])
    assert want.shape[1] == 8  # user, the 5 words, <eos>, assistant
    with model.trace(CHAT):
        logits = model.output.logits.save()
    torch.testing.assert_close(logits, hf(want).logits)

    other = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the"}]
    cont = torch.tensor([_chat_ids(tok, other, continue_final_message=True)])
    with model.trace() as tracer:
        with tracer.invoke(CHAT):
            a = model.output.logits[:, -1].save()
        with tracer.invoke([other, CHAT]):
            b = model.output.logits[:, -1].save()
    torch.testing.assert_close(a, hf(want).logits[:, -1])
    torch.testing.assert_close(b[0], hf(cont).logits[0, -1], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(b[1], a[0], atol=1e-5, rtol=1e-4)

    with model.generate(CHAT, max_new_tokens=2, do_sample=False) as tracer:
        out = tracer.result.save()
    plain = hf.generate(want, attention_mask=torch.ones_like(want), max_new_tokens=2,
                        do_sample=False, pad_token_id=tok.pad_token_id)
    assert torch.equal(out, plain)


def test_chat_messages_without_a_template_say_so(model_dirs, arch):
    """A chat prompt to a tokenizer with no chat template raises InputError naming it."""
    model = load(model_dirs[arch], dispatch=True)
    model.tokenizer.chat_template = None
    with pytest.raises(InputError, match="has none: pass the conversation as text"):
        with model.trace(CHAT):
            model.output.save()


def test_a_generate_option_given_to_trace_warns(model_dirs, hf, arch):
    """docs/errors/symptom-index.md ("only one forward ran"): ``model.trace(prompt,
    max_new_tokens=5)`` runs one forward, which ignores the option; nnsight 0.8.1 says nothing,
    here a UserWarning names the option, the line and ``model.generate``. The forward is the
    plain one, and a generate given the same option does not warn."""
    model = load(model_dirs[arch], dispatch=True)
    enc = model.tokenizer("the eiffel tower is in", return_tensors="pt")
    with pytest.warns(UserWarning, match=r"model\.trace\(\.\.\., max_new_tokens=\.\.\.\) at .*"
                      r"test_docs_parity\.py:\d+ runs one forward, which ignores "
                      r"max_new_tokens, do_sample.*model\.generate\(prompt, max_new_tokens"):
        with model.trace("the eiffel tower is in", max_new_tokens=5, do_sample=False):
            logits = model.output.logits.save()
    torch.testing.assert_close(logits, hf(**enc).logits)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with model.generate("the eiffel tower is in", max_new_tokens=2, do_sample=False):
            pass
