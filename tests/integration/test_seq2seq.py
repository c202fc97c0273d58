"""An encoder-decoder model (a tiny BART from a config) as a LanguageModel with
``automodel=AutoModelForSeq2SeqLM``: traces given decoder inputs, generate with several invokes
and with beams, checked against plain transformers."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from tests.integration.conftest import make_tokenizer, save_tiny

from nnsight_lite import LanguageModel

PROMPTS = ["the eiffel tower is in", "mary and john went to"]


@pytest.fixture(scope="module")
def bart_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bart")
    tok = make_tokenizer()
    tok.pad_token = "<eos>"
    config = transformers.BartConfig(
        vocab_size=len(tok), d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=1, bos_token_id=1,
        eos_token_id=1, decoder_start_token_id=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(config)
    save_tiny(model, tok, d)
    return d


@pytest.fixture
def pair(bart_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        lm = LanguageModel(bart_dir, automodel=transformers.AutoModelForSeq2SeqLM, dispatch=True)
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(bart_dir)
    return lm, hf


def test_trace_with_decoder_inputs_reads_and_edits_the_encoder(pair):
    lm, hf = pair
    enc = lm.tokenizer(PROMPTS, return_tensors="pt")
    dec = torch.ones(2, 1, dtype=torch.long)
    with lm.trace(PROMPTS, decoder_input_ids=dec):
        lm.model.encoder.layers[0].output[:] = 0
        hidden = lm.model.encoder.layers[1].output.save()
        logits = lm.output.logits.save()
    seen = []
    hooks = [hf.model.encoder.layers[1].register_forward_hook(
                 lambda m, a, o: seen.append(o.clone())),
             hf.model.encoder.layers[0].register_forward_hook(lambda m, a, o: o.zero_())]
    try:
        plain = hf(**enc, decoder_input_ids=dec).logits
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(hidden, seen[0])
    assert torch.allclose(logits, plain)
    assert not torch.allclose(logits, hf(**enc, decoder_input_ids=dec).logits)  # (it edited)


@pytest.mark.parametrize("beams", [1, 2])
def test_generate_with_invokes_matches_the_batch(pair, beams):
    lm, hf = pair
    enc = lm.tokenizer(PROMPTS, return_tensors="pt")
    plain = hf.generate(**enc, max_new_tokens=3, do_sample=False, num_beams=beams)
    with lm.generate(max_new_tokens=3, do_sample=False, num_beams=beams) as tracer:
        with tracer.invoke(PROMPTS[0]):
            first = lm.generator.output.save()
        with tracer.invoke(PROMPTS[1]):
            encoded = lm.model.encoder.output.last_hidden_state.save()  # (once, before beams)
            second = lm.generator.output.save()
    assert torch.equal(first, plain[0:1]) and torch.equal(second, plain[1:2])
    assert torch.allclose(encoded, hf.model.encoder(**enc).last_hidden_state[1:2])
