"""Tiny random models of many transformers architectures (built from configs, seeded, no hub),
traced by NNsight and checked against plain torch hooks: a smoke sweep saving every module's
output in one trace, and what an architecture sweep found (the ``.source`` of transformers'
MoE experts, whose forward a decorator dispatches)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nnsight_lite import MissedModuleError, NNsight  # noqa: E402

_DEC = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            bos_token_id=1, eos_token_id=1, tie_word_embeddings=False)
_ENC = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64)
_S2S = dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, pad_token_id=0, bos_token_id=1, eos_token_id=1,
            decoder_start_token_id=1)
_VIS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            image_size=32, patch_size=8)

# name: (model type, model class in transformers, inputs, config keywords)
ARCHS = {
    "mistral": ("mistral", "AutoModelForCausalLM", "ids", dict(_DEC, head_dim=8)),
    "qwen2": ("qwen2", "AutoModelForCausalLM", "ids", _DEC),
    "qwen3": ("qwen3", "AutoModelForCausalLM", "ids", dict(_DEC, head_dim=8)),
    "gemma": ("gemma", "AutoModelForCausalLM", "ids", dict(_DEC, head_dim=8)),
    "gemma2": ("gemma2", "AutoModelForCausalLM", "ids", dict(_DEC, head_dim=8, sliding_window=4)),
    "phi": ("phi", "AutoModelForCausalLM", "ids", dict(_DEC, num_key_value_heads=4)),
    "phi3": ("phi3", "AutoModelForCausalLM", "ids", dict(_DEC, pad_token_id=0)),
    "gpt_neox": ("gpt_neox", "AutoModelForCausalLM", "ids", dict(_DEC, num_key_value_heads=None)),
    "gptj": ("gptj", "AutoModelForCausalLM", "ids",
             dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64)),
    "opt": ("opt", "AutoModelForCausalLM", "ids",
            dict(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                 num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64)),
    "bloom": ("bloom", "AutoModelForCausalLM", "ids",
              dict(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)),
    "falcon": ("falcon", "AutoModelForCausalLM", "ids",
               dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)),
    "stablelm": ("stablelm", "AutoModelForCausalLM", "ids", _DEC),
    "olmo": ("olmo", "AutoModelForCausalLM", "ids", dict(_DEC, pad_token_id=0)),
    "mixtral": ("mixtral", "AutoModelForCausalLM", "ids",
                dict(_DEC, head_dim=8, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2_moe", "AutoModelForCausalLM", "ids",
                  dict(_DEC, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=32)),
    "mamba": ("mamba", "AutoModelForCausalLM", "ids",
              dict(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2,
                   expand=2, conv_kernel=4)),
    "mamba2": ("mamba2", "AutoModelForCausalLM", "ids",
               dict(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                    conv_kernel=4, num_heads=8, head_dim=8, n_groups=1, chunk_size=8)),
    "t5": ("t5", "AutoModelForSeq2SeqLM", "s2s",
           dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                decoder_start_token_id=0, pad_token_id=0)),
    "bert": ("bert", "AutoModelForMaskedLM", "ids", _ENC),
    "roberta": ("roberta", "AutoModelForMaskedLM", "ids",
                dict(_ENC, max_position_embeddings=70, pad_token_id=0)),
    "distilbert": ("distilbert", "AutoModelForMaskedLM", "ids",
                   dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64)),
    "vit": ("vit", "ViTForImageClassification", "pixels", _VIS),
    "whisper": ("whisper", "WhisperForConditionalGeneration", "audio",
                dict(_S2S, num_mel_bins=16, max_source_positions=16, max_target_positions=32)),
    "clip": ("clip", "CLIPModel", "clip",
             dict(text_config=dict(_ENC, eos_token_id=1, bos_token_id=1, pad_token_id=0),
                  vision_config=_VIS, projection_dim=16)),
}


def build(name: str):
    """The tiny ``name`` model (eval mode, seeded) and one input for it, as keywords."""
    kind, cls, inputs, kw = ARCHS[name]
    try:
        config = transformers.AutoConfig.for_model(kind, **kw)
    except ValueError:
        pytest.skip(f"transformers {transformers.__version__} has no {kind}")
    auto = getattr(transformers, cls)
    torch.manual_seed(0)
    model = (auto.from_config(config) if cls.startswith("Auto") else auto(config)).eval()
    ids = torch.tensor([[2, 5, 9, 4, 7, 3, 8, 6]])
    dec = torch.tensor([[1, 5, 7, 9]])
    return model, {
        "ids": dict(input_ids=ids, attention_mask=torch.ones_like(ids)),
        "s2s": dict(input_ids=ids, decoder_input_ids=dec),
        "pixels": dict(pixel_values=torch.randn(1, 3, 32, 32)),
        "audio": dict(input_features=torch.randn(1, 16, 32), decoder_input_ids=dec),
        "clip": dict(input_ids=ids, pixel_values=torch.randn(1, 3, 32, 32)),
    }[inputs]


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return [_clone(v) for v in x]
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if hasattr(x, "to_tuple"):  # a ModelOutput
        return [_clone(v) for v in x.to_tuple()]
    return x


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, list):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_every_modules_output_saved_in_one_trace_equals_hooks(name):
    """Smoke sweep: each module's output (every call: ``.next()`` for a module called more
    than once per forward, such as Phi's ``resid_dropout``) read in the order the model runs
    them, cloned where read, equals a forward hook's clone, bit for bit; nothing stays on the
    model (the autouse fixture checks)."""
    model, inputs = build(name)
    modules = dict(model.named_modules())
    order, want, handles = [], {}, []

    def recorder(path):
        def hook(module, args, output):
            call = sum(p == path for p, _ in order)
            order.append((path, call))
            want[path, call] = _clone(output)
        return hook

    for path, module in modules.items():
        handles.append(module.register_forward_hook(recorder(path)))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    traced = NNsight(model)
    with torch.no_grad():
        with traced.trace(**inputs):
            got = []
            for path, call in order:
                envoy = traced.get(path) if path else traced
                if call:
                    envoy.next(call)
                got.append(_clone(envoy.output))
                if call:
                    envoy.next(-call)
            got = got.save()
    assert len(got) == len(order)
    for (path, call), value in zip(order, got):
        mine, theirs = _tensors(value), _tensors(want[path, call])
        assert len(mine) == len(theirs), (path, call)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs)), (path, call)


class TestMoEExpertsSource:
    """transformers 5's MoE experts (Mixtral, Qwen2-MoE, Qwen3-MoE, ...) have a ``forward``
    that a decorator wraps: it dispatches to ``config._experts_implementation`` (``grouped_mm``
    by default) and calls the eager function that ``.source`` lists only for ``"eager"``."""

    def test_a_wrapper_that_ran_other_code_is_named_in_the_error(self):
        """Found by the sweep: reading an operation of ``experts.source`` raised the generic
        "the line it is on did not run (a branch the forward did not take ...)", though no
        line of the function ran at all; the error now names the wrapper and the setting."""
        model, inputs = build("mixtral")
        traced = NNsight(model)
        experts = traced.model.layers[0].mlp.experts
        with pytest.raises(MissedModuleError, match=r"wrapped by a decorator \(use_experts_imp"
                           r"lementation[\s\S]*set_experts_implementation\(\"eager\"\)"):
            with traced.trace(**inputs):
                experts.source.self_act_fn_0.output.save()

    def test_with_eager_experts_the_listed_operations_run(self):
        """``set_experts_implementation("eager")`` runs the listed code: an operation read in
        the body equals a hook on the module it calls, the logits the plain eager model's."""
        model, inputs = build("mixtral")
        model.set_experts_implementation("eager")
        seen = []
        act = model.model.layers[0].mlp.experts.act_fn
        handle = act.register_forward_hook(lambda m, a, o: seen.append(o.clone()))
        try:
            with torch.no_grad():
                plain = model(**inputs).logits
        finally:
            handle.remove()
        traced = NNsight(model)
        with torch.no_grad():
            with traced.trace(**inputs):
                first = traced.model.layers[0].mlp.experts.source.self_act_fn_0.output.save()
                logits = traced.output.logits.save()
        assert torch.equal(first, seen[0])
        assert torch.equal(logits, plain)
