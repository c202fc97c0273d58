"""Tiny Hugging Face causal LMs (GPT-2 and Llama built from configs) saved to a temp dir, with
a small word-level tokenizer built offline. No hub access."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nnsight_lite.remote.testing import save_tiny  # noqa: E402 (test_seq2seq imports it here)

WORDS = (
    "the eiffel tower is in city of paris colosseum rome when mary and john went to store "
    "gave a drink hello world hi big small red blue dog cat sat on mat"
).split()


def make_tokenizer():
    """A ``PreTrainedTokenizerFast`` over WORDS (lower-cased, split on whitespace), eos
    ``<eos>``, no pad token (like GPT-2's)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>"
    )


def _config(arch: str, vocab: int):
    if arch == "gpt2":
        return transformers.GPT2Config(
            vocab_size=vocab, n_positions=64, n_embd=32, n_layer=3, n_head=2,
            bos_token_id=1, eos_token_id=1,
        )
    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=1, tie_word_embeddings=False,
    )


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """``{"gpt2": dir, "llama": dir}``: config, random weights (seeded) and tokenizer."""
    transformers.utils.logging.disable_progress_bar()
    dirs = {}
    for arch in ("gpt2", "llama"):
        d = tmp_path_factory.mktemp(arch)
        tok = make_tokenizer()
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config(arch, len(tok)))
        save_tiny(model, tok, d)
        dirs[arch] = d
    return dirs


@pytest.fixture(params=["gpt2", "llama"])
def arch(request):
    return request.param


@pytest.fixture
def lm(model_dirs, arch):
    """A dispatched LanguageModel of the tiny ``arch`` model."""
    from nnsight_lite import LanguageModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no pad token: eos used (tested apart)
        return LanguageModel(model_dirs[arch], dispatch=True)


@pytest.fixture
def hf(model_dirs, arch):
    """The same model loaded by plain transformers: the ground truth."""
    return transformers.AutoModelForCausalLM.from_pretrained(model_dirs[arch])


def layers(lm_or_hf, arch):
    """The decoder blocks: ``transformer.h`` (GPT-2) or ``model.layers`` (Llama)."""
    return lm_or_hf.transformer.h if arch == "gpt2" else lm_or_hf.model.layers
