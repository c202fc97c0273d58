"""LanguageModel on tiny GPT-2 and Llama models built from configs (see conftest.py), checked
against plain transformers: loading, tokenizing and padding, traces, generation, errors."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
import transformers
from tests.integration.conftest import layers, make_tokenizer

from tests.helpers import cycles_left_by

import nnsight_lite
from nnsight_lite import InputError, LanguageModel, ModulePathError

PROMPTS = [
    "the eiffel tower is in the city of",
    "hello world",
    "when mary and john went to the store",
]


def tokenize(lm, prompts):
    """What a user would pass to the plain model: left-padded, with mask."""
    return lm.tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")


def position_ids(mask):
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def soft_prompt(hf, prompt_ids, seed=0):
    """Embeddings of ``prompt_ids`` plus noise, as a soft prompt would be: (1, len, hidden)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        emb = hf.get_input_embeddings()(torch.tensor([prompt_ids]))
    return emb + 0.1 * torch.randn_like(emb)


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return fn(*args, **kwargs)


# --------------------------------------------------------------------------- loading


class TestLoading:
    def test_without_dispatch_the_model_lives_on_meta(self, model_dirs, arch):
        """LanguageModel(path) builds the module tree on the meta device: no weights yet."""
        lm = quiet(LanguageModel, model_dirs[arch])
        assert not lm.dispatched
        assert all(p.is_meta for p in lm._module.parameters())
        assert "lm_head" in repr(lm)

    def test_meta_construction_reads_no_weights(self, model_dirs, tmp_path, arch):
        """A directory holding only config and tokenizer is enough to construct, print and
        scan; the weights file is only needed at the first real trace."""
        cfg = transformers.AutoConfig.from_pretrained(model_dirs[arch])
        cfg.save_pretrained(tmp_path)
        make_tokenizer().save_pretrained(tmp_path)
        lm = quiet(LanguageModel, tmp_path)
        with lm.scan("hello world"):
            shape = nnsight_lite.save(tuple(layers(lm, arch)[0].output.shape))
        assert shape == (1, 2, 32)
        assert not lm.dispatched
        with pytest.raises(OSError):
            with lm.trace("hello world"):
                pass

    @pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
    def test_meta_construction_allocates_no_weight_memory(self, tmp_path):
        """A model with ~400 MB of float32 weights costs far less than that to construct."""
        cfg = transformers.LlamaConfig(
            vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=6,
            num_attention_heads=8, num_key_value_heads=8,
        )
        cfg.save_pretrained(tmp_path)
        make_tokenizer().save_pretrained(tmp_path)
        weight_bytes = 4 * (2 * 32000 * 1024 + 6 * (4 * 1024 * 1024 + 3 * 1024 * 4096))
        assert weight_bytes > 390e6

        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

        before = rss()
        lm = quiet(LanguageModel, tmp_path)
        grown = rss() - before
        assert all(p.is_meta for p in lm._module.parameters())
        assert grown < weight_bytes / 8, f"constructing grew RSS by {grown / 1e6:.0f} MB"

    def test_first_trace_loads_weights_and_keeps_envoys(self, model_dirs, hf, arch):
        """Envoys taken before dispatch point at the loaded modules afterwards."""
        lm = quiet(LanguageModel, model_dirs[arch])
        block = layers(lm, arch)[1]
        head = lm.lm_head
        with lm.trace("hello world"):
            h = block.output.save()
            logits = head.output.save()
        assert lm.dispatched
        assert block._module is layers(lm._module, arch)[1]
        assert not any(p.is_meta for p in lm._module.parameters())
        with torch.no_grad():
            plain = hf(**lm.tokenizer("hello world", return_tensors="pt")).logits
        torch.testing.assert_close(logits, plain)
        assert h.shape == (1, 2, 32)

    def test_a_module_traced_on_its_own_loads_the_weights_first(self, model_dirs, hf, arch):
        """``with model.<block>.mlp.trace(h):`` (and ``scan``, and an ``edit`` of it recorded
        while the model is still on meta) on a model never traced: the weights load first, so
        it runs the real MLP (it ran the meta placeholder, and failed on the input's device)."""
        torch.manual_seed(0)
        h = torch.randn(1, 3, 32)
        plain_mlp = layers(hf, arch)[1].mlp
        with torch.no_grad():
            plain = plain_mlp(h)
        lm = quiet(LanguageModel, model_dirs[arch])
        mlp = layers(lm, arch)[1].mlp
        with mlp.trace(h):
            out = mlp.output.save()
        assert lm.dispatched
        torch.testing.assert_close(out, plain)

        lm = quiet(LanguageModel, model_dirs[arch])
        mlp = layers(lm, arch)[1].mlp
        with mlp.scan(h):
            shape = nnsight_lite.save(tuple(mlp.output.shape))
        assert shape == tuple(plain.shape)

        lm = quiet(LanguageModel, model_dirs[arch])
        mlp = layers(lm, arch)[1].mlp
        with mlp.edit(inplace=True):
            mlp.output[:] *= 2
        with mlp.trace(h):
            doubled = mlp.output.save()
        torch.testing.assert_close(doubled, 2 * plain)

    def test_edit_on_meta_loads_nothing_and_then_shares_one_set_of_weights(self, model_dirs, hf,
                                                                            arch):
        """``model.edit()`` on a model still on meta loads nothing; the first local trace of
        the edited copy loads the weights once, for both: the original then uses the very same
        parameters, and each gives its own result (edit applied or not) against plain HF."""
        lm = quiet(LanguageModel, model_dirs[arch])
        with lm.edit() as edited:
            edited.lm_head.output[:] = 0
        assert not lm.dispatched and not edited.dispatched
        with edited.trace("hello world"):
            zeroed = edited.lm_head.output.save()
        assert lm.dispatched and edited._module is lm._module
        with lm.trace("hello world"):
            logits = lm.lm_head.output.save()
        with torch.no_grad():
            plain = hf(**lm.tokenizer("hello world", return_tensors="pt")).logits
        torch.testing.assert_close(logits, plain)
        assert torch.count_nonzero(zeroed) == 0

    def test_envoys_of_an_edited_copy_taken_after_the_original_loaded_still_load(
            self, model_dirs, hf, arch):
        """The original traced first (it loads, the edited copy still on meta), then an Envoy
        taken from the copy and one from the original by the same path: the copy's Envoy,
        used in the copy's first trace, reads the loaded module (the edit applied), and the
        original's reads the plain model's logits."""
        lm = quiet(LanguageModel, model_dirs[arch])
        with lm.edit() as edited:
            edited.lm_head.output[:] = 0
        with lm.trace("hello world"):
            pass
        head_edited, head_lm = edited.lm_head, lm.lm_head
        with edited.trace("hello world"):
            zeroed = head_edited.output.save()
        with lm.trace("hello world"):
            logits = head_lm.output.save()
        with torch.no_grad():
            plain = hf(**lm.tokenizer("hello world", return_tensors="pt")).logits
        assert torch.count_nonzero(zeroed) == 0
        torch.testing.assert_close(logits, plain)

    def test_changes_to_a_model_still_on_meta_survive_loading(self, model_dirs, hf, arch):
        """Loading replaces the placeholder module tree, so a change made to it before the
        first trace was dropped silently (nnsight 0.8.1 drops it too): a fine-tuned
        ``load_state_dict``, ``requires_grad_(False)``, ``train()``, a forward hook, a replaced
        submodule. Each of these now loads the weights first, and the trace matches plain HF
        given the same changes. Reading does not load (``parameters()``, ``state_dict()``,
        ``eval()``: a client of remote traces never needs the weights); after ``dispatch()``
        the parameters are the loaded model's."""
        lm = quiet(LanguageModel, model_dirs[arch])
        tuned = {k: v + 0.01 for k, v in hf.state_dict().items()}
        lm.load_state_dict(tuned)
        assert lm.dispatched
        hf.load_state_dict(tuned)
        ids = lm.tokenizer("hello world", return_tensors="pt")
        with torch.no_grad():
            plain = hf(**ids).logits
        with lm.trace("hello world"):
            logits = lm.lm_head.output.save()
        torch.testing.assert_close(logits, plain)

        seen = []
        for change in ("requires_grad_", "train", "hook", "submodule", "optimizer"):
            lm = quiet(LanguageModel, model_dirs[arch])
            block = layers(lm, arch)[0]  # an Envoy taken before loading
            if change == "requires_grad_":
                lm.requires_grad_(False)
            elif change == "train":
                lm.train()
            elif change == "hook":
                block.register_forward_hook(lambda m, a, out: seen.append(out.shape))
            elif change == "submodule":
                lm.lm_head = torch.nn.Identity()
            else:
                assert all(p.is_meta for p in lm.parameters())
                lm.state_dict()
                lm.eval()
                assert not lm.dispatched  # (reading does not load)
                params = list(lm.dispatch().parameters())
            assert lm.dispatched, change
            with lm.trace("hello world"):
                out = lm.output.save()
            if change == "requires_grad_":
                assert not any(p.requires_grad for p in lm._module.parameters())
                assert not out.logits.requires_grad
            elif change == "train":
                assert all(m.training for m in lm._module.modules())
            elif change == "hook":
                assert seen == [(1, 2, 32)]
            elif change == "submodule":
                fresh = transformers.AutoModelForCausalLM.from_pretrained(model_dirs[arch])
                with torch.no_grad():  # the hidden states, as plain HF's last layer gives them
                    hidden = fresh(**ids, output_hidden_states=True).hidden_states[-1]
                torch.testing.assert_close(out.logits, hidden)
            else:
                assert all(p is q for p, q in zip(params, lm._module.parameters()))
                assert not any(p.is_meta for p in params)

    def test_config_changes_before_loading_survive_it(self, model_dirs, arch):
        """``model.config.x = ...`` or ``set_attn_implementation(...)`` on a model still on meta
        changed the placeholder's config only, and loading dropped it (nnsight 0.8.1 too): the
        changes are carried over to the loaded model's config, which the trace then follows as
        plain HF given the same config does."""
        lm = quiet(LanguageModel, model_dirs[arch])
        lm.config.output_hidden_states = True
        lm.config.use_cache = False
        lm.set_attn_implementation("eager")
        assert not lm.dispatched  # (none of these loads the weights)
        with lm.trace("hello world"):
            out = lm.output.save()
        config = lm._module.config
        assert config.output_hidden_states and not config.use_cache
        assert config._attn_implementation == "eager"
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            model_dirs[arch], attn_implementation="eager")
        ids = lm.tokenizer("hello world", return_tensors="pt")
        with torch.no_grad():
            plain = hf(**ids, output_hidden_states=True, use_cache=False)
        assert out.past_key_values is None and len(out.hidden_states) == len(plain.hidden_states)
        for mine, theirs in zip(out.hidden_states, plain.hidden_states):
            torch.testing.assert_close(mine, theirs)
        untouched = quiet(LanguageModel, model_dirs[arch]).dispatch()  # nothing changed: as saved
        assert not untouched._module.config.output_hidden_states

    def test_a_config_given_at_construction_shapes_the_tree_before_loading(self, model_dirs,
                                                                           arch):
        """``LanguageModel(path, config=cfg)`` or a config keyword (``n_layer=1``), as
        from_pretrained takes them: the tree on meta was built from the saved config instead
        (3 blocks listed and indexable before loading, 1 after). Plain HF given the same is
        the ground truth."""
        cfg = transformers.AutoConfig.from_pretrained(model_dirs[arch])
        name = "n_layer" if arch == "gpt2" else "num_hidden_layers"
        setattr(cfg, name, 1)
        ids = make_tokenizer()("hello world", return_tensors="pt")
        hf = quiet(transformers.AutoModelForCausalLM.from_pretrained, model_dirs[arch], config=cfg)
        with torch.no_grad():
            want = hf(**ids).logits
        for kw in ({"config": cfg}, {name: 1}):
            lm = quiet(LanguageModel, model_dirs[arch], **kw)
            assert len(layers(lm, arch)) == 1 and not lm.dispatched
            with lm.trace("hello world"):
                out = lm.output.logits.save()
            assert len(layers(lm._module, arch)) == 1
            torch.testing.assert_close(out, want)
        assert getattr(cfg, name) == 1  # (the given config is not changed)

    def test_generation_config_changes_before_loading_survive_it(self, model_dirs, arch):
        """``model.generation_config.max_new_tokens = 3`` on a model still on meta changed the
        placeholder's generation config only, and loading dropped it: generate ran to HF's
        default length (20) instead of 3 new tokens. Changed attributes are carried over as
        the config's are; plain HF with the same change is the ground truth."""
        lm = quiet(LanguageModel, model_dirs[arch])
        lm.generation_config.max_new_tokens = 3
        lm.generation_config.do_sample = False
        assert not lm.dispatched
        with lm.generate("hello world") as tracer:
            out = tracer.result.save()
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dirs[arch])
        hf.generation_config.max_new_tokens = 3
        hf.generation_config.do_sample = False
        ids = lm.tokenizer("hello world", return_tensors="pt")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = hf.generate(**ids, pad_token_id=lm.tokenizer.eos_token_id)
        assert ref.shape[1] == ids["input_ids"].shape[1] + 3
        assert torch.equal(out, ref)
        untouched = quiet(LanguageModel, model_dirs[arch]).dispatch()  # nothing changed
        assert untouched._module.generation_config.max_new_tokens is None

    def test_dispatch_true_loads_now(self, model_dirs, arch):
        lm = quiet(LanguageModel, model_dirs[arch], dispatch=True)
        assert lm.dispatched
        assert lm.dispatch() is lm

    @pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
    def test_dtype(self, model_dirs, arch, key):
        """dtype (and the older torch_dtype) apply to the meta build and the loaded weights."""
        lm = quiet(LanguageModel, model_dirs[arch], **{key: torch.bfloat16})
        assert lm._module.lm_head.weight.dtype == torch.bfloat16
        with lm.trace("hello world"):
            logits = lm.lm_head.output.save()
        assert logits.dtype == torch.bfloat16
        assert lm._module.lm_head.weight.dtype == torch.bfloat16

    @pytest.mark.parametrize("device_map", ["cpu", "auto"])
    def test_device_map(self, model_dirs, hf, arch, device_map):
        """device_map goes to from_pretrained ("auto" through accelerate)."""
        pytest.importorskip("accelerate")
        lm = quiet(LanguageModel, model_dirs[arch], device_map=device_map)
        with lm.trace("hello world"):
            logits = lm.lm_head.output.save()
        with torch.no_grad():
            plain = hf(**lm.tokenizer("hello world", return_tensors="pt")).logits
        torch.testing.assert_close(logits, plain)

    def test_prebuilt_model_and_tokenizer(self, hf):
        lm = quiet(LanguageModel, hf, tokenizer=make_tokenizer())
        assert lm._module is hf and lm.dispatched
        with lm.trace("hello world"):
            logits = lm.lm_head.output.save()
        with torch.no_grad():
            plain = hf(**lm.tokenizer("hello world", return_tensors="pt")).logits
        torch.testing.assert_close(logits, plain)

    def test_prebuilt_model_without_a_tokenizer_takes_token_ids(self, hf):
        """As in nnsight, a built model needs no tokenizer until a text prompt comes: token
        ids (one invoke, and two of different lengths, padded) trace and generate as the
        plain model does; a text prompt raises InputError saying to give one."""
        lm = LanguageModel(hf)
        assert lm.tokenizer is None
        ids = torch.tensor([[5, 6, 7, 8]])
        with lm.trace(ids):
            logits = lm.lm_head.output.save()
        with torch.no_grad():
            torch.testing.assert_close(logits, hf(ids).logits)
        with lm.trace() as tracer:
            with tracer.invoke([[5, 6]]):
                short = lm.lm_head.output[:, -1].save()
            with tracer.invoke(ids):
                long = lm.lm_head.output[:, -1].save()
        with torch.no_grad():
            torch.testing.assert_close(short[0], hf(torch.tensor([[5, 6]])).logits[0, -1],
                                       atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(long, hf(ids).logits[:, -1], atol=1e-4, rtol=1e-4)
        with lm.generate(ids, max_new_tokens=3, do_sample=False) as tracer:
            out = tracer.result.save()
        assert torch.equal(out, hf.generate(ids, max_new_tokens=3, do_sample=False,
                                            attention_mask=torch.ones_like(ids),
                                            pad_token_id=0))
        with pytest.raises(InputError, match="needs a tokenizer"):
            with lm.trace("hello world"):
                lm.output.save()

    def test_missing_pad_token_uses_eos_with_a_warning(self, model_dirs, arch):
        with pytest.warns(UserWarning, match="no pad token; using its eos token '<eos>'"):
            lm = LanguageModel(model_dirs[arch])
        assert lm.tokenizer.pad_token == "<eos>"

    def test_tokenizer_without_pad_or_eos_is_an_error(self, hf):
        tok = make_tokenizer()
        tok.eos_token = None
        with pytest.raises(InputError, match="neither a pad token nor an eos token"):
            LanguageModel(hf, tokenizer=tok)


# --------------------------------------------------------------------------- inputs


def model_inputs(lm, *prompt, **kwargs):
    """The (input_ids, attention_mask) the model's forward receives for one invoke."""
    with lm.trace(*prompt, **kwargs):
        _, kw = lm.inputs
        got = nnsight_lite.save((kw["input_ids"].clone(), kw["attention_mask"].clone()))
    return got


class TestInputs:
    @pytest.fixture
    def arch(self):
        """Tokenizing does not depend on the architecture: GPT-2 only (saves CI time)."""
        return "gpt2"

    def test_string(self, lm):
        ids, mask = model_inputs(lm, "hello world")
        assert ids.tolist() == [lm.tokenizer("hello world")["input_ids"]]
        assert mask.tolist() == [[1, 1]]

    def test_list_of_strings_is_left_padded(self, lm):
        ids, mask = model_inputs(lm, ["hello world", "the big red dog"])
        pad = lm.tokenizer.pad_token_id
        hello = lm.tokenizer("hello world")["input_ids"]
        assert ids[0].tolist() == [pad, pad] + hello
        assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]

    @pytest.mark.parametrize("form", ["list", "lists", "tensor1d", "tensor2d", "dict", "encoding"])
    def test_token_id_forms(self, lm, form):
        ids = [4, 5, 6]
        prompt = {
            "list": ids,
            "lists": [ids],
            "tensor1d": torch.tensor(ids),
            "tensor2d": torch.tensor([ids]),
            "dict": {"input_ids": [ids], "attention_mask": [[1, 1, 1]]},
            "encoding": lm.tokenizer("the eiffel tower", return_tensors="pt"),
        }[form]
        got, mask = model_inputs(lm, prompt)
        expect = lm.tokenizer("the eiffel tower")["input_ids"] if form == "encoding" else ids
        assert got.tolist() == [expect] and mask.tolist() == [[1] * len(expect)]

    def test_ragged_token_id_lists_are_left_padded(self, lm):
        got, mask = model_inputs(lm, [[4, 5, 6], [7]])
        pad = lm.tokenizer.pad_token_id
        assert got.tolist() == [[4, 5, 6], [pad, pad, 7]]
        assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]

    def test_input_ids_keyword(self, lm):
        got, mask = model_inputs(lm, input_ids=torch.tensor([[4, 5]]),
                                 attention_mask=torch.tensor([[1, 1]]))
        assert got.tolist() == [[4, 5]] and mask.tolist() == [[1, 1]]

    def test_invokes_are_padded_into_one_batch(self, lm):
        """Each invoke's rows hold exactly its own tokens, left-padded to the longest."""
        tok = lm.tokenizer
        with lm.trace() as tracer:
            with tracer.invoke("hello world"):
                a = nnsight_lite.save(lm.inputs[1]["input_ids"].clone())
            with tracer.invoke(["the big red dog sat", "hi"]):
                b = nnsight_lite.save(lm.inputs[1]["input_ids"].clone())
            with tracer.invoke():
                full = nnsight_lite.save({k: lm.inputs[1][k].clone()
                                          for k in ("input_ids", "attention_mask")})
        pad = tok.pad_token_id
        assert a.tolist() == [[pad] * 3 + tok("hello world")["input_ids"]]
        assert b.tolist() == [tok("the big red dog sat")["input_ids"],
                              [pad] * 4 + tok("hi")["input_ids"]]
        assert full["input_ids"].shape == (3, 5)
        assert full["attention_mask"].tolist() == [[0, 0, 0, 1, 1], [1] * 5, [0, 0, 0, 0, 1]]

    def test_token_id_tensor_invokes(self, lm, hf):
        """Invokes given token-id tensors (the loop over prompts): equal lengths batch with an
        all-ones mask and no position ids, equal to the plain model on the stacked ids; mixed
        with a text prompt of another length, each is left-padded as if tokenized alone."""
        ids = torch.tensor([[4, 5, 6], [7, 8, 9]])
        with lm.trace() as tracer:
            outs = nnsight_lite.save([])
            for row in (ids[:1], ids[1]):  # a 2-D and a 1-D tensor
                with tracer.invoke(row):
                    outs.append(lm.lm_head.output)
            with tracer.invoke():
                seen = nnsight_lite.save({k: v.clone() for k, v in lm.inputs[1].items()})
        assert sorted(seen) == ["attention_mask", "input_ids"]
        assert seen["input_ids"].tolist() == ids.tolist()
        assert seen["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 1]]
        with torch.no_grad():
            plain = hf(ids).logits
        assert torch.equal(torch.cat(outs), plain)

        tok = lm.tokenizer
        with lm.trace() as tracer:
            with tracer.invoke(torch.tensor([4, 5])):
                a = nnsight_lite.save(lm.inputs[1]["input_ids"].clone())
            with tracer.invoke("the big red dog"):
                pass
            with tracer.invoke():
                full = nnsight_lite.save({k: lm.inputs[1][k].clone()
                                          for k in ("attention_mask", "position_ids")})
        pad = tok.pad_token_id
        n = len(tok("the big red dog")["input_ids"])
        assert a.tolist() == [[pad] * (n - 2) + [4, 5]]
        assert full["attention_mask"].tolist() == [[0] * (n - 2) + [1, 1], [1] * n]
        assert full["position_ids"].tolist() == [[0] * (n - 2) + [0, 1], list(range(n))]

    def test_text_invokes_tokenized_as_if_alone(self, lm, hf):
        """A loop of text invokes (tokenized together, in one tokenizer call) gives every
        invoke the rows it would get tokenized on its own, left-padded to the batch, and
        the logits of the plain model on those rows."""
        tok = lm.tokenizer
        texts = ["hello world", "the big red dog sat", "hi", "the cat"]
        with lm.trace() as tracer:
            for t in texts:
                with tracer.invoke(t):
                    pass
            with tracer.invoke():
                seen = nnsight_lite.save({k: lm.inputs[1][k].clone()
                                          for k in ("input_ids", "attention_mask")})
                logits = lm.lm_head.output.save()
        width = max(len(tok(t)["input_ids"]) for t in texts)
        pad = tok.pad_token_id
        alone = [tok(t)["input_ids"] for t in texts]
        assert seen["input_ids"].tolist() == [[pad] * (width - len(a)) + a for a in alone]
        assert seen["attention_mask"].tolist() == [[0] * (width - len(a)) + [1] * len(a)
                                                   for a in alone]
        mask = seen["attention_mask"]
        with torch.no_grad():
            plain = hf(input_ids=seen["input_ids"], attention_mask=mask,
                       position_ids=position_ids(mask)).logits
        assert torch.equal(logits, plain)

    def test_text_with_token_type_ids_is_tokenized_per_invoke(self, lm):
        """A tokenizer that also returns token_type_ids: each invoke's text is tokenized on
        its own (as before) and the forward gets the token type ids of every invoke."""
        tok = lm.tokenizer
        old = tok.model_input_names
        tok.model_input_names = ["input_ids", "token_type_ids", "attention_mask"]
        try:
            with lm.trace() as tracer:
                with tracer.invoke("hello world"):
                    pass
                with tracer.invoke("the cat"):
                    pass
                with tracer.invoke():
                    seen = nnsight_lite.save({k: v.clone() for k, v in lm.inputs[1].items()})
        finally:
            tok.model_input_names = old
        assert seen["input_ids"].tolist() == [tok("hello world")["input_ids"],
                                              tok("the cat")["input_ids"]]
        assert seen["token_type_ids"].tolist() == [[0, 0], [0, 0]]

    @pytest.mark.parametrize("bad", [10_000, -1])
    def test_token_ids_out_of_vocabulary_in_any_invoke(self, lm, bad):
        """An id outside the vocabulary in a later invoke's tensor is refused before the model
        runs, with the same message as a single prompt's."""
        vocab = lm._module.get_input_embeddings().num_embeddings
        with pytest.raises(InputError, match=rf"token id {bad} is outside this model's "
                                             rf"vocabulary \(valid ids: 0..{vocab - 1}\)"):
            with lm.trace() as tracer:
                with tracer.invoke(torch.tensor([[4, 5]])):
                    pass
                with tracer.invoke(torch.tensor([[bad, 5]])):
                    pass

    def test_an_invokes_input_error_names_the_invoke(self, lm, hf):
        """Where a trace has several invokes, an input one of them cannot use names that invoke
        and its line in a note (the error is raised when the trace's block ends, at its `with`
        line; it said neither which invoke nor where)."""
        with pytest.raises(InputError, match=r"token id 10000 is outside") as info:
            with lm.trace() as tracer:
                with tracer.invoke(torch.tensor([[4, 5]])):
                    pass
                with tracer.invoke(torch.tensor([[10_000, 5]])):  # invoke 1: bad id
                    pass
        line = next(i for i, text in enumerate(open(__file__), 1)
                    if text.rstrip().endswith("# invoke 1: bad id"))
        assert (f"nnsight_lite: raised on the inputs of invoke 1 (tracer.invoke(...) at "
                f"{__file__}:{line})") in getattr(info.value, "__notes__", [])
        with pytest.raises(InputError, match=r"attention_mask=\.\.\. was given with a text "
                           r"prompt") as info:
            with lm.trace() as tracer:
                with tracer.invoke("the cat"):
                    pass
                with tracer.invoke("the dog", attention_mask=torch.ones(1, 2)):  # invoke 1: mask
                    pass
        line = next(i for i, text in enumerate(open(__file__), 1)
                    if text.rstrip().endswith("# invoke 1: mask"))
        assert (f"nnsight_lite: raised on the inputs of invoke 1 (tracer.invoke(...) at "
                f"{__file__}:{line})") in getattr(info.value, "__notes__", [])
        ids = torch.tensor([[4, 5]])
        with lm.trace(ids):
            out = lm.output.save()
        torch.testing.assert_close(out.logits, hf(ids).logits)

    @pytest.mark.parametrize("how", ["set_input_embeddings", "replace_base_model"])
    def test_vocabulary_follows_a_new_input_embedding(self, lm, how):
        """The vocabulary check uses the model's input embedding as it is at each trace: after
        ``set_input_embeddings`` (or a replaced module on the way to it) an id valid only for
        the new embedding runs, matching the plain forward, and one past it is refused."""
        hf = lm._module
        old_vocab = hf.get_input_embeddings().num_embeddings
        with lm.trace(torch.tensor([[4, 5]])):
            pass
        vocab = old_vocab + 8
        if how == "set_input_embeddings":
            hf.set_input_embeddings(torch.nn.Embedding(vocab, hf.config.n_embd))
        else:
            config = type(hf.config).from_dict({**hf.config.to_dict(), "vocab_size": vocab})
            setattr(hf, hf.base_model_prefix, type(hf.base_model)(config).eval())
        ids = torch.tensor([[4, old_vocab + 3]])
        with lm.trace(ids):
            hidden = layers(lm, "gpt2")[-1].output.save()
        with torch.no_grad():
            plain = hf.base_model(ids).last_hidden_state
        assert torch.equal(hf.base_model.ln_f(hidden), plain)
        with pytest.raises(InputError, match=rf"token id {vocab} is outside this model's "
                                             rf"vocabulary \(valid ids: 0..{vocab - 1}\)"):
            with lm.trace(torch.tensor([[4, vocab]])):
                pass

    def test_tokenizer_kwargs_apply_per_invoke(self, lm):
        with lm.trace() as tracer:
            with tracer.invoke("the big red dog sat on the mat", max_length=3, truncation=True):
                a = nnsight_lite.save(lm.inputs[1]["attention_mask"].sum().item())
            with tracer.invoke("the big red dog sat on the mat"):
                b = nnsight_lite.save(lm.inputs[1]["attention_mask"].sum().item())
        assert (a, b) == (3, 8)

    def test_other_kwargs_go_to_the_forward(self, lm):
        # (not output_hidden_states: transformers 5 installs permanent hooks for it)
        with lm.trace("hello world", use_cache=False):
            cache = nnsight_lite.save([lm.output.past_key_values])
        with lm.trace("hello world", use_cache=True):
            cache.append(lm.output.past_key_values)
        assert cache[0] is None and cache[1] is not None

    def test_tokenizer_property_and_trace_false(self, lm, hf):
        assert isinstance(lm.tokenizer, transformers.PreTrainedTokenizerBase)
        out = lm.trace("hello world", trace=False)
        with torch.no_grad():
            plain = hf(**lm.tokenizer("hello world", return_tensors="pt")).logits
        torch.testing.assert_close(out.logits, plain)


# --------------------------------------------------------------------------- traces vs plain HF


class TestAgainstTransformers:
    def test_single_prompt_logits_equal_plain_forward(self, lm, hf):
        with lm.trace(PROMPTS[0]):
            logits = lm.lm_head.output.save()
        with torch.no_grad():
            plain = hf(**lm.tokenizer(PROMPTS[0], return_tensors="pt")).logits
        torch.testing.assert_close(logits, plain)

    def test_batched_prompts_of_different_lengths(self, lm, hf):
        """One invoke per prompt: the batch equals the plain model on the same left-padded
        batch (with position ids from the mask, as HF generate makes them), and every prompt's
        predictions equal that prompt run alone."""
        with lm.trace() as tracer:
            outs = nnsight_lite.save([])
            for p in PROMPTS:
                with tracer.invoke(p):
                    outs.append(lm.lm_head.output)
        logits = torch.cat(outs)
        enc = tokenize(lm, PROMPTS)
        with torch.no_grad():
            plain = hf(**enc, position_ids=position_ids(enc["attention_mask"])).logits
        torch.testing.assert_close(logits, plain)
        for i, p in enumerate(PROMPTS):
            with torch.no_grad():
                alone = hf(**lm.tokenizer(p, return_tensors="pt")).logits[0]
            n = alone.shape[0]
            torch.testing.assert_close(logits[i, -n:], alone, atol=1e-4, rtol=1e-4)

    def test_block_outputs_equal_plain_hooks(self, lm, hf, arch):
        """Saved block outputs (a tensor in transformers 5) equal forward hooks' on plain HF."""
        enc = lm.tokenizer(PROMPTS[2], return_tensors="pt")
        seen = []
        handles = [b.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
                   for b in layers(hf, arch)]
        try:
            with torch.no_grad():
                hf(**enc)
        finally:
            for h in handles:
                h.remove()
        with lm.trace(PROMPTS[2]):
            hs = nnsight_lite.save([b.output.clone() for b in layers(lm, arch)])
        assert isinstance(hs[0], torch.Tensor)
        for got, want in zip(hs, seen):
            torch.testing.assert_close(got, want)

    def test_mlp_edit_in_one_invoke_equals_plain_hook(self, lm, hf, arch):
        """Zeroing invoke 1's MLP output of block 1 changes only invoke 1, exactly as a plain
        hook zeroing that row does."""
        with lm.trace() as tracer:
            with tracer.invoke(PROMPTS[0]):
                a = lm.lm_head.output.save()
            with tracer.invoke(PROMPTS[1]):
                layers(lm, arch)[1].mlp.output[:] = 0
                b = lm.lm_head.output.save()
        enc = tokenize(lm, PROMPTS[:2])

        def zero_row1(m, i, o):
            o = o.clone()
            o[1] = 0
            return o

        handle = layers(hf, arch)[1].mlp.register_forward_hook(zero_row1)
        try:
            with torch.no_grad():
                plain = hf(**enc, position_ids=position_ids(enc["attention_mask"])).logits
        finally:
            handle.remove()
        torch.testing.assert_close(torch.cat([a, b]), plain)

    def test_cross_invoke_patching_equals_plain_hooks(self, lm, hf, arch):
        """Invoke 1 takes invoke 0's last-token block output: same as doing it with hooks."""
        with lm.trace() as tracer:
            with tracer.invoke(PROMPTS[0]):
                src = layers(lm, arch)[1].output[:, -1]
            with tracer.invoke(PROMPTS[2]):
                layers(lm, arch)[1].output[:, -1] = src
                patched = lm.lm_head.output.save()
        enc = tokenize(lm, [PROMPTS[0], PROMPTS[2]])

        def patch(m, i, o):
            o = o.clone()
            o[1, -1] = o[0, -1]
            return o

        handle = layers(hf, arch)[1].register_forward_hook(patch)
        try:
            with torch.no_grad():
                plain = hf(**enc, position_ids=position_ids(enc["attention_mask"])).logits
        finally:
            handle.remove()
        torch.testing.assert_close(patched, plain[1:])

    def test_trace_keywords_without_inputs_go_to_the_batched_forward(self, lm, hf):
        """``model.trace(use_cache=False)`` with the prompts in invokes: the keyword reaches the
        forward of the invokes' batch, as nnsight passes it; logits equal plain HF's."""
        with lm.trace(use_cache=False) as tracer:
            with tracer.invoke(PROMPTS[1]):
                a = lm.lm_head.output.save()
            with tracer.invoke(PROMPTS[2]):
                out = lm.output.save()
        enc = tokenize(lm, PROMPTS[1:])
        with torch.no_grad():
            plain = hf(**enc, position_ids=position_ids(enc["attention_mask"]), use_cache=False)
        assert out.past_key_values is None and plain.past_key_values is None
        torch.testing.assert_close(torch.cat([a, out.logits]), plain.logits)
        with lm.trace() as tracer:  # (the model's default: a cache)
            with tracer.invoke(PROMPTS[1]):
                out = lm.output.save()
        assert out.past_key_values is not None

    def test_an_attention_mask_without_a_prompt_is_the_batch_mask(self, lm, hf):
        """``model.trace(attention_mask=m)`` / ``model.generate(attention_mask=m, ...)`` with
        the prompts in invokes: ``m`` is the mask of the batch's forward (generate), as in
        nnsight; outputs equal plain HF's given the same ids and mask."""
        ids = tokenize(lm, PROMPTS[1:2])["input_ids"]
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        with lm.trace(attention_mask=mask) as tracer:
            with tracer.invoke(ids):
                logits = lm.lm_head.output.save()
        with torch.no_grad():
            plain = hf(ids, attention_mask=mask).logits
            unmasked = hf(ids).logits
        torch.testing.assert_close(logits, plain)
        assert not torch.allclose(logits, unmasked)
        with lm.generate(attention_mask=mask, max_new_tokens=3, do_sample=False) as tracer:
            with tracer.invoke(ids):
                out = lm.generator.output.save()
        expected = hf.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                               pad_token_id=1)
        assert torch.equal(out, expected)

    def test_a_one_dimensional_mask_beside_one_dimensional_ids(self, lm, hf):
        """One prompt's ids and mask both 1-D (as a tokenizer gives them without
        return_tensors): taken as one row, as the ids are (the mask was refused for its
        shape); logits equal plain HF's with that mask (and the positions it implies)."""
        ids = tokenize(lm, PROMPTS[:1])["input_ids"][0]
        mask = torch.ones_like(ids)
        mask[:2] = 0
        with lm.trace(ids, attention_mask=mask):
            logits = lm.lm_head.output.save()
        with lm.trace(input_ids=ids.tolist(), attention_mask=mask.tolist()):
            again = lm.lm_head.output.save()
        with torch.no_grad():
            plain = hf(ids[None], attention_mask=mask[None],
                       position_ids=position_ids(mask[None])).logits
        torch.testing.assert_close(logits, plain)
        torch.testing.assert_close(again, plain)

    def test_a_mask_with_a_hole_keeps_the_plain_forwards_positions(self, lm, hf, arch):
        """A prompt's own mask with a masked token inside it (a token knocked out), in a trace
        of its own and as the shorter (left-padded) invoke beside a longer prompt: the tokens
        after the hole keep their positions, so logits and block outputs equal the plain HF
        forward given that mask (positions counted over the mask moved them: ~2.6 off on
        Llama). The other invoke is unchanged."""
        enc = tokenize(lm, PROMPTS[:1])
        ids, mask = enc["input_ids"], enc["attention_mask"].clone()
        mask[0, 2] = 0
        other = "the big red dog sat on the mat and the small cat sat"
        seen = {}
        hook = layers(hf, arch)[1].register_forward_hook(lambda m, a, o: seen.setdefault(0, o))
        try:
            with torch.no_grad():
                plain = hf(input_ids=ids, attention_mask=mask).logits
        finally:
            hook.remove()
        with torch.no_grad():
            plain_other = hf(**tokenize(lm, [other])).logits
        with lm.trace({"input_ids": ids, "attention_mask": mask}):
            alone = lm.lm_head.output.save()
        with lm.trace() as tracer:
            with tracer.invoke({"input_ids": ids, "attention_mask": mask}):
                h = layers(lm, arch)[1].output.save()
                holed = lm.lm_head.output.save()
            with tracer.invoke(other):
                longer = lm.lm_head.output.save()
        n = ids.shape[1]
        assert holed.shape[1] > n  # padded on the left beside the longer prompt
        torch.testing.assert_close(alone, plain)
        torch.testing.assert_close(holed[:, -n:], plain, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(h[:, -n:], seen[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(longer, plain_other, atol=1e-4, rtol=1e-4)

    def test_attribution_grads_of_two_invokes(self, lm, hf, arch):
        """Attribution patching over clean and corrupted invokes: each module's .grad read in
        both invokes (from the last module back) equals plain retain_grad on each prompt
        alone. Reading one invoke's grads of all modules first, then the other's, raises
        OutOfOrderError describing the invoke's own tensor (not the batch's) and saying that
        the invokes' rows share one gradient (it described only the batch's tensor, of the
        same shape at every layer)."""
        from nnsight_lite.errors import OutOfOrderError

        clean, corrupt = PROMPTS[0], PROMPTS[2]
        with lm.trace() as tracer:
            with tracer.invoke(clean):
                hc = [layers(lm, arch)[i].output for i in (0, 2)]
                lc = lm.lm_head.output[0, -1]
            with tracer.invoke(corrupt):
                hx = [layers(lm, arch)[i].output for i in (0, 2)]
                lx = lm.lm_head.output[0, -1]
            with tracer.invoke():
                with (lc[3] - lc[4] + lx[3] - lx[4]).backward():
                    gx2, gc2 = hx[1].grad.save(), hc[1].grad.save()
                    gx0, gc0 = hx[0].grad.save(), hc[0].grad.save()

        def plain(prompt):
            kept = {}
            hooks = [layers(hf, arch)[i].register_forward_hook(
                lambda m, a, o, i=i: (o.retain_grad(), kept.__setitem__(i, o)) and None)
                for i in (0, 2)]
            try:
                out = hf(**lm.tokenizer(prompt, return_tensors="pt")).logits[0, -1]
            finally:
                for h in hooks:
                    h.remove()
            (out[3] - out[4]).backward()
            hf.zero_grad()
            return kept[0].grad, kept[2].grad

        for (g0, g2), want in (((gc0, gc2), plain(clean)), ((gx0, gx2), plain(corrupt))):
            n = want[0].shape[1]
            torch.testing.assert_close(g0[:, -n:], want[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(g2[:, -n:], want[1], atol=1e-5, rtol=1e-4)
        with pytest.raises(OutOfOrderError, match=r"(?s)tensor of shape \(1, 8, 32\).*"
                           r"an invoke's rows of a batched activation of shape \(2, 8, 32\)"):
            with lm.trace() as tracer:
                with tracer.invoke(clean):
                    hc = [layers(lm, arch)[i].output for i in (0, 2)]
                with tracer.invoke(corrupt):
                    hx = [layers(lm, arch)[i].output for i in (0, 2)]
                    loss = lm.lm_head.output.sum()
                    with loss.backward():
                        g = [hx[1].grad, hx[0].grad, hc[1].grad]

    def test_retain_grad_attribution_over_two_invokes(self, lm, hf, arch):
        """The retain_grad form of attribution patching: ``h.retain_grad()`` on each invoke's
        layer output, a plain ``backward()`` of both invokes' logit differences after the trace:
        each ``h.grad`` equals plain retain_grad on its prompt alone (its .grad was None with
        two invokes)."""
        clean, corrupt = PROMPTS[0], PROMPTS[2]
        with lm.trace() as tracer:
            with tracer.invoke(clean):
                hc = layers(lm, arch)[1].output.save()
                hc.retain_grad()
                lc = lm.lm_head.output[0, -1].save()
            with tracer.invoke(corrupt):
                hx = layers(lm, arch)[1].output.save()
                hx.retain_grad()
                lx = lm.lm_head.output[0, -1].save()
        (lc[3] - lc[4] + lx[3] - lx[4]).backward()
        lm.zero_grad()

        def plain(prompt):
            kept = []
            hook = layers(hf, arch)[1].register_forward_hook(
                lambda m, a, o: (o.retain_grad(), kept.append(o)) and None)
            try:
                out = hf(**lm.tokenizer(prompt, return_tensors="pt")).logits[0, -1]
            finally:
                hook.remove()
            (out[3] - out[4]).backward()
            hf.zero_grad()
            return kept[0].grad

        for got, prompt in ((hc.grad, clean), (hx.grad, corrupt)):
            want = plain(prompt)
            n = want.shape[1]
            torch.testing.assert_close(got[:, -n:], want, atol=1e-5, rtol=1e-4)

    def test_attention_mask_none_is_no_mask(self, lm, hf):
        """``attention_mask=None`` (HF's default, passed on by code with an optional mask) is
        no mask: with a text prompt it was refused ("the tokenizer makes the mask"), and given
        to a trace whose prompts are in invokes it would have replaced the padded batch's
        mask. Logits and ids equal plain HF's with the tokenizer's padded mask."""
        enc = tokenize(lm, PROMPTS[:2])
        with torch.no_grad():
            plain = hf(**enc, position_ids=position_ids(enc["attention_mask"])).logits
        with lm.trace(PROMPTS[:2], attention_mask=None):
            a = lm.lm_head.output.save()
        with lm.trace(attention_mask=None) as tracer:
            with tracer.invoke(PROMPTS[0], attention_mask=None):
                b = lm.lm_head.output.save()
            with tracer.invoke(PROMPTS[1]):
                c = lm.lm_head.output.save()
        torch.testing.assert_close(a, plain)
        torch.testing.assert_close(torch.cat([b, c]), plain)
        with lm.generate(PROMPTS[:2], attention_mask=None, max_new_tokens=2,
                         do_sample=False) as tracer:
            pass
        assert torch.equal(tracer.result, plain_generate(hf, enc, 2))

    def test_a_keyword_on_the_trace_and_an_invoke(self, lm):
        """An invoke's keyword yields to the trace's (it applies to the whole batch), with a
        warning at the invoke where the values differ (nnsight takes the invoke's, silently)."""
        with pytest.warns(UserWarning, match=r"tracer.invoke\(\.\.\., use_cache=True\) is "
                                             r"overridden by model.trace\(\.\.\., use_cache="
                                             r"False\): model.trace\(\)'s keywords apply to "
                                             r"the whole batch; give use_cache in one place"):
            with lm.trace(use_cache=False) as tracer:
                with tracer.invoke(PROMPTS[1], use_cache=True):
                    out = lm.output.save()
        assert out.past_key_values is None

    def test_scan_keywords_and_tokenizer_options_without_a_prompt(self, lm):
        """``model.scan(use_cache=False)`` with the prompts in invokes passes the keyword to
        the batch's forward as ``trace`` does; tokenizer options given to a trace, scan or
        generate that has no prompt raise an InputError saying where they go."""
        with lm.scan(use_cache=False) as tracer:
            with tracer.invoke(PROMPTS[1]):
                logits = lm.lm_head.output.save()
        n = tokenize(lm, PROMPTS[1:2])["input_ids"].shape[1]
        assert tuple(logits.shape) == (1, n, lm.lm_head._module.out_features)
        for call in ("trace", "scan", "generate"):
            with pytest.raises(InputError, match=rf"model\.{call}\(\) was given tokenizer "
                                                 r"options \['add_special_tokens'\] but no "
                                                 r"prompt.*each tracer\.invoke"):
                with getattr(lm, call)(add_special_tokens=False) as tracer:
                    with tracer.invoke(PROMPTS[1]):
                        pass

    def test_the_override_warning_is_once_per_line_and_not_for_equal_tensors(self, lm):
        """The warning for an invoke's keyword that yields shows once per line across repeated
        traces (as warnings.warn does under the default filter), and not for an equal tensor."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            for _ in range(3):
                with lm.trace(use_cache=False) as tracer:
                    with tracer.invoke(PROMPTS[1], use_cache=True):
                        pass
            for _ in range(2):
                with lm.generate(max_new_tokens=1, eos_token_id=torch.tensor([0, 1])) as tracer:
                    with tracer.invoke(PROMPTS[1], eos_token_id=torch.tensor([0, 1])):
                        pass
        overridden = [w for w in caught if "overridden" in str(w.message)]
        assert len(overridden) == 1 and "use_cache" in str(overridden[0].message)

    def test_inputs_embeds_equal_plain_forward(self, lm, hf, arch):
        """``trace(inputs_embeds=...)`` (with or without a mask) and ``tracer.invoke(
        inputs_embeds=...)`` run the model on the embeddings: block outputs and logits equal
        plain HF's on the same embeddings; the embedding module does not run."""
        emb = soft_prompt(hf, [4, 5, 6, 7])
        mask = torch.tensor([[0, 1, 1, 1]])
        with torch.no_grad():
            plain = hf(inputs_embeds=emb).logits
            masked = hf(inputs_embeds=emb, attention_mask=mask,
                        position_ids=position_ids(mask)).logits
        with lm.trace(inputs_embeds=emb):
            h = layers(lm, arch)[0].output.save()
            logits = lm.lm_head.output.save()
        torch.testing.assert_close(logits, plain)
        assert h.shape == emb.shape
        with lm.trace() as tracer:
            with tracer.invoke(inputs_embeds=emb, attention_mask=mask):
                logits = lm.lm_head.output.save()
        torch.testing.assert_close(logits, masked)

    def test_a_float_mask_of_zeros_and_ones_is_taken(self, lm, hf):
        """A float attention mask of 0s and 1s (a soft-prompt idiom HF takes) works with
        embeddings and ids; the result equals the integer mask's."""
        emb = soft_prompt(hf, [4, 5, 6, 7])
        mask = torch.tensor([[0, 1, 1, 1]])
        with lm.trace(inputs_embeds=emb, attention_mask=mask):
            want = lm.lm_head.output.save()
        with lm.trace(inputs_embeds=emb, attention_mask=mask.float()):
            got = lm.lm_head.output.save()
        torch.testing.assert_close(got, want)
        with pytest.raises(InputError, match="attention_mask must hold integers"):
            with lm.trace(inputs_embeds=emb, attention_mask=mask.float() * 0.5):
                pass

    def test_inputs_embeds_invokes_are_left_padded_into_one_batch(self, lm, hf):
        """Invokes given embeddings of different lengths are left-padded (zero vectors, masked
        out) into one batch, like token prompts: each invoke's logits equal plain HF on its
        embeddings alone, and the batch equals HF on the padded batch."""
        short, long = soft_prompt(hf, [4, 5], seed=1), soft_prompt(hf, [6, 7, 8, 9], seed=2)
        with lm.trace() as tracer:
            with tracer.invoke(inputs_embeds=short):
                a = lm.lm_head.output.save()
            with tracer.invoke(inputs_embeds=long):
                b = lm.lm_head.output.save()
        with torch.no_grad():
            alone = [hf(inputs_embeds=e).logits for e in (short, long)]
        torch.testing.assert_close(a[:, -2:], alone[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b, alone[1])
        padded = torch.cat([torch.cat([torch.zeros_like(short), short], 1), long])
        mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
        with torch.no_grad():
            plain = hf(inputs_embeds=padded, attention_mask=mask,
                       position_ids=position_ids(mask)).logits
        torch.testing.assert_close(torch.cat([a, b]), plain)

    def test_scan_gives_shapes_without_compute(self, lm, arch):
        with lm.scan(["hello world", "the big red dog sat"]):
            shape = nnsight_lite.save(tuple(layers(lm, arch)[0].output.shape))
        assert shape == (2, 5, 32)

    def test_session_and_edit(self, lm, hf, arch):
        """Sessions and persistent edits work on a LanguageModel like on any NNsight."""
        with lm.session():
            with lm.trace(PROMPTS[0]):
                h = layers(lm, arch)[1].output[:, -1]
            with lm.trace(PROMPTS[2]):
                layers(lm, arch)[1].output[:, -1] = h
                patched = lm.lm_head.output.save()
        with lm.edit() as edited:
            layers(edited, arch)[1].mlp.output[:] = 0
        with edited.trace(PROMPTS[1]):
            zeroed = edited.lm_head.output.save()
        with lm.trace(PROMPTS[1]):
            clean = lm.lm_head.output.save()
        handle = layers(hf, arch)[1].mlp.register_forward_hook(lambda m, i, o: o * 0)
        try:
            with torch.no_grad():
                plain = hf(**lm.tokenizer(PROMPTS[1], return_tensors="pt")).logits
        finally:
            handle.remove()
        torch.testing.assert_close(zeroed, plain)
        assert not torch.allclose(clean, zeroed)
        assert patched.shape[0] == 1


# --------------------------------------------------------------------------- generation


def plain_generate(hf, enc, k, hooks=(), **kw):
    """HF generate with plain forward hooks ``[(module, fn(step, output) -> output)]``."""
    handles = []
    for module, fn in hooks:
        step = [0]

        def hook(m, i, o, fn=fn, step=step):
            out = fn(step[0], o)
            step[0] += 1
            return out

        handles.append(module.register_forward_hook(hook))
    try:
        return hf.generate(**enc, max_new_tokens=k, do_sample=False,
                           pad_token_id=1, **kw)
    finally:
        for h in handles:
            h.remove()


class TestGenerate:
    def test_a_backward_block_in_a_generate_names_generate(self, lm, arch):
        """HF generate runs the model without gradients, so a loss read in a generate body has
        none: the error names generate and says to take gradients in a trace."""
        from nnsight_lite import GradientError

        with pytest.raises(GradientError, match=r"runs in model\.generate .*with model\.trace"):
            with lm.generate(PROMPTS[0], max_new_tokens=2, do_sample=False):
                h = layers(lm, arch)[1].output
                loss = lm.lm_head.output.sum()
                with loss.backward():
                    g = h.grad.save()
        with lm.trace(PROMPTS[0]):  # (and in a trace, the same body works)
            h = layers(lm, arch)[1].output
            loss = lm.lm_head.output.sum()
            with loss.backward():
                g = h.grad.save()
        assert g.abs().sum() > 0

    def test_an_edit_acts_at_every_step_when_its_body_loops(self, lm, hf, arch):
        """A persistent edit's body is a body like an invoke's: in a generate it acts at the
        first step unless it loops over the steps (``for step in edited.all():``), then at
        every step, as a hook does; the ids equal plain HF generate with such a hook."""
        enc = lm.tokenizer(PROMPTS[0], return_tensors="pt")
        block = layers(hf, arch)[1]
        every = plain_generate(hf, enc, 3, hooks=[(block, lambda step, out: -out)])
        first = plain_generate(hf, enc, 3, hooks=[(block, lambda step, out: -out if step == 0
                                                   else out)])
        assert not torch.equal(every, first)  # (the later steps' edit changes the tokens)
        with lm.edit() as looped:
            for step in looped.all():
                layers(looped, arch)[1].output = -layers(looped, arch)[1].output
        with lm.edit() as once:
            layers(once, arch)[1].output = -layers(once, arch)[1].output
        with looped.generate(PROMPTS[0], max_new_tokens=3, do_sample=False) as tracer:
            pass
        assert torch.equal(tracer.result, every)
        with once.generate(PROMPTS[0], max_new_tokens=3, do_sample=False) as tracer:
            pass
        assert torch.equal(tracer.result, first)

    def test_tokens_equal_plain_generate(self, lm, hf):
        with lm.generate(PROMPTS[0], max_new_tokens=5, do_sample=False) as tracer:
            ids = lm.generator.output.save()
        plain = plain_generate(hf, lm.tokenizer(PROMPTS[0], return_tensors="pt"), 5)
        assert torch.equal(ids, plain)
        assert torch.equal(tracer.result, plain)

    def test_batched_invokes_equal_plain_batched_generate(self, lm, hf):
        """Two invokes with prompts of different lengths: each sees its own rows of the ids."""
        with lm.generate(max_new_tokens=4, do_sample=False) as tracer:
            with tracer.invoke(PROMPTS[1]):
                a = lm.generator.output.save()
            with tracer.invoke(PROMPTS[2]):
                b = lm.generator.output.save()
        plain = plain_generate(hf, tokenize(lm, PROMPTS[1:]), 4)
        assert torch.equal(torch.cat([a, b]), plain)
        assert torch.equal(tracer.result, plain)

    def test_steering_with_a_vector_that_requires_grad(self, lm, hf, arch):
        """The usual steering recipe: a vector read in an earlier trace (grad on, so it requires
        grad) added in place at every step of a generate with two invokes, where each body's
        value is a view of the batch. HF generate runs the model without grad; the bodies do
        too (they raised "a view was created in no_grad mode and is being modified inplace"),
        and the ids equal plain HF generate with a hook adding the vector to the first
        prompt's rows."""
        with lm.trace(PROMPTS[0]):
            vec = layers(lm, arch)[1].output[0, -1].save()
        assert vec.requires_grad
        enc = tokenize(lm, PROMPTS[1:])

        def steer(step, out):
            out = out.clone()
            out[0, -1] += 4 * vec.detach()
            return out

        plain = plain_generate(hf, enc, 3, hooks=[(layers(hf, arch)[1], steer)])
        with lm.generate(max_new_tokens=3, do_sample=False) as tracer:
            with tracer.invoke(PROMPTS[1]):
                for step in tracer.iter[:3]:
                    layers(lm, arch)[1].output[:, -1] += 4 * vec
                grad_on = nnsight_lite.save(torch.is_grad_enabled())
                a = tracer.result.save()
            with tracer.invoke(PROMPTS[2]):
                b = tracer.result.save()
        assert torch.equal(torch.cat([a, b]), plain)
        assert not torch.equal(plain, plain_generate(hf, enc, 3))  # (the vector steers)
        assert not grad_on  # (the body's own mode: HF generate's)
        assert torch.is_grad_enabled()  # (and the caller's is as it was)

    def test_invokes_read_a_dict_generate_output_as_its_own_type(self, lm, hf):
        """``return_dict_in_generate=True``: each invoke's ``model.generator.output`` is a
        ``GenerateDecoderOnlyOutput`` of its rows (``.sequences``, ``.scores``), as HF's is."""
        kw = dict(output_scores=True, return_dict_in_generate=True)
        with lm.generate(max_new_tokens=3, do_sample=False, **kw) as tracer:
            with tracer.invoke(PROMPTS[1]):
                a = lm.generator.output.save()
            with tracer.invoke(PROMPTS[2]):
                b = lm.generator.output.save()
        plain = plain_generate(hf, tokenize(lm, PROMPTS[1:]), 3, **kw)
        assert type(a) is type(plain) and type(b) is type(plain)
        assert torch.equal(torch.cat([a.sequences, b.sequences]), plain.sequences)
        for i, scores in enumerate(plain.scores):
            torch.testing.assert_close(torch.cat([a.scores[i], b.scores[i]]), scores)

    def test_result_after_a_stop_names_the_stop(self, lm, hf, arch):
        """``tracer.stop()`` at step 1 of a generate: the values read by then are those of
        plain generate's first two steps, and ``tracer.result`` (generation never returned)
        raises an error naming the stop's line."""
        seen = []
        plain_generate(hf, lm.tokenizer(PROMPTS[0], return_tensors="pt"), 4,
                       hooks=[(layers(hf, arch)[0], lambda step, o: seen.append(o))])
        with lm.generate(PROMPTS[0], max_new_tokens=4) as tracer:
            got = nnsight_lite.save([])
            for step in tracer.iter[:]:
                got.append(layers(lm, arch)[0].output)
                if step == 1:
                    tracer.stop()
        stop_line = f"{__file__}:{sys._getframe().f_lineno - 1}"
        assert len(got) == 2
        for a, b in zip(got, seen):
            torch.testing.assert_close(a, b)
        with pytest.raises(nnsight_lite.NNsightError, match="tracer.stop") as info:
            tracer.result
        assert stop_line in str(info.value)

    def test_keyword_inputs_are_the_prompt(self, lm, hf):
        """``generate(**tokenizer(...))`` and ``generate(input_ids=..., attention_mask=...)``:
        the keywords are the batch, as a positional prompt is; the body reads modules and
        ``tracer.result``, and the ids equal plain HF generate's."""
        enc = lm.tokenizer(PROMPTS[0], return_tensors="pt")
        plain = plain_generate(hf, enc, 3)
        with torch.no_grad():
            first = hf(**enc).logits[:, -1:]
        with lm.generate(**enc, max_new_tokens=3, do_sample=False) as tracer:
            logits = lm.lm_head.output.save()
            ids = tracer.result.save()
        torch.testing.assert_close(logits, first)
        assert torch.equal(ids, plain)
        with lm.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                         max_new_tokens=3, do_sample=False) as tracer:
            pass
        assert torch.equal(tracer.result, plain)
        ids = lm.generate(input_ids=enc["input_ids"], max_new_tokens=3, do_sample=False)
        assert torch.equal(ids, plain)

    def test_the_model_runs_with_no_exception_being_handled(self, lm, hf):
        """As under plain HF generate, the model's code sees no exception being handled
        (``sys.exc_info()``) while a generate block runs it, so the errors HF raises and
        catches inside are not chained to the with-statement's own."""
        import sys

        seen = []
        record = (lambda step, out: seen.append(sys.exc_info()[0]))
        plain_generate(hf, tokenize(lm, PROMPTS[:1]), 3, hooks=[(hf.lm_head, record)])
        plain = list(seen)
        seen.clear()
        handle = lm._module.lm_head.register_forward_hook(lambda m, i, o: record(0, o))
        try:
            with lm.generate(PROMPTS[0], max_new_tokens=3, do_sample=False):
                ids = lm.generator.output.save()
        finally:
            handle.remove()
        assert ids.shape[1] == tokenize(lm, PROMPTS[:1])["input_ids"].shape[1] + 3
        assert plain == seen == [None] * 3

    def test_module_next_moves_the_whole_body_to_the_next_step(self, lm, hf):
        """nnsight 0.5+'s form: after ``h[-1].next().output`` the lm_head read is step 1's,
        HF generate's logits at step 1, not step 0's (which has already run)."""
        enc = lm.tokenizer(PROMPTS[0], return_tensors="pt")
        ref = plain_generate(hf, enc, 3, return_dict_in_generate=True, output_logits=True).logits
        layers = lm.transformer.h if hasattr(lm, "transformer") else lm.model.layers
        with lm.generate(PROMPTS[0], max_new_tokens=3, do_sample=False):
            first = lm.lm_head.output[:, -1].save()
            layers[-1].next().output
            second = lm.lm_head.output[:, -1].save()
        torch.testing.assert_close(first, ref[0])
        torch.testing.assert_close(second, ref[1])

    def test_steps_are_calls(self, lm, hf):
        """Step i's lm_head output is HF generate's logits at step i, read with .next(),
        tracer.iter[i], tracer.iter[a:b] and tracer.all()."""
        k = 4
        enc = lm.tokenizer(PROMPTS[0], return_tensors="pt")
        ref = plain_generate(hf, enc, k, return_dict_in_generate=True, output_logits=True).logits
        with lm.generate(PROMPTS[0], max_new_tokens=k, do_sample=False) as tracer:
            by_next = nnsight_lite.save([lm.lm_head.output[:, -1].clone()])
            for _ in range(k - 1):
                by_next.append(lm.lm_head.next().output[:, -1].clone())
        with lm.generate(PROMPTS[0], max_new_tokens=k, do_sample=False) as tracer:
            for step in tracer.iter[2]:
                two = lm.lm_head.output[:, -1].save()
        with lm.generate(PROMPTS[0], max_new_tokens=k, do_sample=False) as tracer:
            by_slice = nnsight_lite.save([])
            for step in tracer.iter[1:3]:
                by_slice.append(lm.lm_head.output[:, -1].clone())
        with lm.generate(PROMPTS[0], max_new_tokens=k, do_sample=False) as tracer:
            by_all = nnsight_lite.save([])
            for step in tracer.all():
                by_all.append(lm.lm_head.output[:, -1].clone())
            after = nnsight_lite.save(["ran"])
        for i in range(k):
            torch.testing.assert_close(by_next[i], ref[i])
            torch.testing.assert_close(by_all[i], ref[i])
        torch.testing.assert_close(two, ref[2])
        assert len(by_slice) == 2
        torch.testing.assert_close(by_slice[0], ref[1])
        assert len(by_all) == k and after == ["ran"]

    def test_edit_at_chosen_steps_equals_plain_hooks(self, lm, hf, arch):
        """Edits at steps 1 and 2 (block 1's output scaled, and token 7 forced through the
        logits) give exactly the tokens of plain hooks doing the same at those calls."""
        k, prompt = 5, PROMPTS[2]
        with lm.generate(prompt, max_new_tokens=k, min_new_tokens=k, do_sample=False) as tracer:
            for step in tracer.iter[1:3]:
                layers(lm, arch)[1].output[:] *= -2
                lm.lm_head.output[:, -1, 7] = 1e4
            ids = lm.generator.output.save()

        def scale(step, out):
            return out * -2 if step in (1, 2) else out

        def force(step, out):
            if step in (1, 2):
                out = out.clone()
                out[:, -1, 7] = 1e4
            return out

        enc = lm.tokenizer(PROMPTS[2], return_tensors="pt")
        hooks = [(layers(hf, arch)[1], scale), (hf.lm_head, force)]
        plain = plain_generate(hf, enc, k, hooks=hooks, min_new_tokens=k)
        assert torch.equal(ids, plain)
        n = enc["input_ids"].shape[1]
        assert ids[0, n + 1:n + 3].tolist() == [7, 7]
        assert not torch.equal(ids, plain_generate(hf, enc, k, min_new_tokens=k))

    def test_an_open_loop_whose_steps_read_nothing_ends_after_the_last_token(self, lm, hf, arch):
        """``for step in tracer.all():`` with an edit at one step only: the steps after it
        read nothing, and the loop ends after max_new_tokens steps, as in nnsight (it spun
        for ever: the model never got to run again). The tokens equal plain hooks making the
        same edit."""
        k, prompt = 4, PROMPTS[2]
        with lm.generate(prompt, max_new_tokens=k, min_new_tokens=k, do_sample=False) as tracer:
            seen = nnsight_lite.save([])
            for step in tracer.all():
                seen.append(step)
                if step == 1:
                    layers(lm, arch)[0].output[:] = 0
            ids = tracer.result.save()

        def zero(step, out):
            return out * 0 if step == 1 else out

        enc = lm.tokenizer(prompt, return_tensors="pt")
        plain = plain_generate(hf, enc, k, hooks=[(layers(hf, arch)[0], zero)], min_new_tokens=k)
        assert seen == list(range(k))
        assert torch.equal(ids, plain)

    def test_a_loop_past_the_last_token_warns(self, lm):
        """A step loop starting past the generation's last step (``tracer.iter[5:]`` or
        ``tracer.iter[7]`` with max_new_tokens=3) runs none of its steps: it warns, as nnsight
        0.8 does (it said nothing); one that runs some steps and outlasts the generation ends
        quietly."""
        import warnings

        prompt = PROMPTS[2]
        with pytest.warns(UserWarning, match=r"tracer\.iter\[\.\.\.\] at .*test_language\.py:"
                          r"\d+ starts at step 5, but this run makes only 3 step\(s\)"):
            with lm.generate(prompt, max_new_tokens=3, min_new_tokens=3) as tracer:
                got = nnsight_lite.save([])
                for step in tracer.iter[5:]:
                    got.append(lm.lm_head.output)
        assert got == []
        with pytest.warns(UserWarning, match=r"its first step, call 7 of model\.lm_head, never "
                          r"happened \(model\.lm_head was called 3 time\(s\)"):
            with lm.generate(prompt, max_new_tokens=3, min_new_tokens=3) as tracer:
                got = nnsight_lite.save([])
                for step in tracer.iter[7]:
                    got.append(lm.lm_head.output)
        assert got == []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with lm.generate(prompt, max_new_tokens=3, min_new_tokens=3) as tracer:
                got = nnsight_lite.save([])
                for step in tracer.iter[1:9]:
                    lm.lm_head.output
                    got.append(step)
        assert got == [1, 2]

    def test_an_open_loop_follows_the_generation_config_given_to_generate(self, lm, hf):
        """A ``generation_config=`` given to generate sets the steps of an open loop before
        the model's own config (whose max_new_tokens would cut the loop short)."""
        enc = lm.tokenizer(PROMPTS[0], return_tensors="pt")
        hf.generation_config.max_new_tokens = 2
        lm._module.generation_config.max_new_tokens = 2
        config = transformers.GenerationConfig(max_new_tokens=5, min_new_tokens=5,
                                               do_sample=False, pad_token_id=1)
        with lm.generate(PROMPTS[0], generation_config=config) as tracer:
            seen = nnsight_lite.save([])
            for step in tracer.all():
                seen.append(lm.lm_head.output.shape[1])
            ids = tracer.result.save()
        assert len(seen) == 5
        assert torch.equal(ids, hf.generate(**enc, generation_config=config))

    def test_a_generation_config_without_pad_token_gets_no_hf_deprecation_warning(self, lm, hf):
        """``generate(prompt, generation_config=cfg)`` (nnsight's generate page) where neither
        ``cfg`` nor the model sets a pad token: the pad id went to HF generate as a keyword
        beside the config, and HF warned "Passing `generation_config` together with
        generation-related arguments=({'pad_token_id'}) is deprecated". It goes into a copy of
        the config now: no warning, the user's config untouched, the ids HF gives."""
        import logging

        enc = lm.tokenizer(PROMPTS[0], return_tensors="pt")
        assert lm._module.generation_config.pad_token_id is None  # (the case at hand)
        config = transformers.GenerationConfig(max_new_tokens=3, do_sample=False)
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        hf_logger = logging.getLogger("transformers.generation.utils")
        logging.Logger.warning_once.cache_clear()  # (HF says it once a process)
        hf_logger.addHandler(handler)
        try:
            with lm.generate(PROMPTS[0], generation_config=config) as tracer:
                ids = tracer.result.save()
        finally:
            hf_logger.removeHandler(handler)
        assert not [r for r in records if "generation_config" in r.getMessage()]
        assert config.pad_token_id is None
        want = transformers.GenerationConfig(max_new_tokens=3, do_sample=False,
                                             pad_token_id=lm.tokenizer.pad_token_id)
        assert torch.equal(ids, hf.generate(**enc, generation_config=want))

    def test_eos_ends_open_loops_and_code_after_runs(self, lm, hf):
        """Generation stopped early by EOS ends tracer.all() / iter[:] loops; the code after
        the loop runs and reads model.generator.output."""
        enc = lm.tokenizer(PROMPTS[0], return_tensors="pt")
        full = plain_generate(hf, enc, 6)
        eos = int(full[0, enc["input_ids"].shape[1] + 2])  # the third new token
        first = (full[0, enc["input_ids"].shape[1]:] == eos).nonzero()[0].item()
        stopped = plain_generate(hf, enc, 6, eos_token_id=eos)
        assert stopped.shape[1] < full.shape[1]
        with lm.generate(PROMPTS[0], max_new_tokens=6, do_sample=False, eos_token_id=eos) as tracer:
            by_all = nnsight_lite.save([])
            for step in tracer.all():
                by_all.append(lm.lm_head.output.shape)
            ids = lm.generator.output.save()
        with lm.generate(PROMPTS[0], max_new_tokens=6, do_sample=False, eos_token_id=eos) as t2:
            by_iter = nnsight_lite.save([])
            for step in t2.iter[0:]:
                by_iter.append(lm.lm_head.output.shape)
            ids2 = lm.generator.output.save()
        assert len(by_all) == len(by_iter) == first + 1
        assert torch.equal(ids, stopped) and torch.equal(tracer.result, stopped)
        assert torch.equal(ids2, stopped) and torch.equal(t2.result, stopped)

    def test_generate_trace_false(self, lm, hf):
        ids = lm.generate(PROMPTS[1], max_new_tokens=3, do_sample=False, trace=False)
        enc = lm.tokenizer(PROMPTS[1], return_tensors="pt")
        assert torch.equal(ids, plain_generate(hf, enc, 3))

    def test_generator_output_can_be_edited(self, lm):
        with lm.generate(PROMPTS[1], max_new_tokens=2, do_sample=False) as tracer:
            lm.generator.output = lm.generator.output[:, :1]
        assert tracer.result.shape == (1, 1)

    def test_generator_output_only_in_generate(self, lm):
        with pytest.raises(nnsight_lite.NNsightError,
                           match=r"model.generator.output \(the generated ids\) exists only "
                                 r"inside `with model.generate"):
            with lm.trace("hello"):
                lm.generator.output.save()

    def test_a_keyword_on_generate_and_an_invoke(self, lm, hf):
        """generate()'s keyword applies to the whole batch: an invoke's of the same name yields
        (as in nnsight), with a warning at the invoke where the values differ."""
        with pytest.warns(UserWarning, match=r"tracer.invoke\(\.\.\., max_new_tokens=5\) is "
                                             r"overridden by model.generate\(\.\.\., "
                                             r"max_new_tokens=2\)"):
            with lm.generate(max_new_tokens=2, do_sample=False) as tracer:
                with tracer.invoke(PROMPTS[1], max_new_tokens=5):
                    ids = tracer.result.save()
                with tracer.invoke(PROMPTS[2]):
                    pass
        plain = plain_generate(hf, tokenize(lm, PROMPTS[1:]), 2)
        assert torch.equal(ids, plain[:1]) and torch.equal(tracer.result, plain)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with lm.generate(max_new_tokens=2, do_sample=False) as tracer:
                with tracer.invoke(PROMPTS[1], max_new_tokens=2):
                    pass
        assert not [w for w in caught if "overridden" in str(w.message)]
        assert torch.equal(tracer.result, plain_generate(hf, tokenize(lm, PROMPTS[1:2]), 2))

    def test_inputs_embeds_equal_plain_generate(self, lm, hf):
        """``generate(inputs_embeds=...)`` and invokes given embeddings: the ids equal plain HF
        ``generate(inputs_embeds=...)``'s (the new tokens only, as HF returns them there)."""
        emb = soft_prompt(hf, [4, 5, 6])
        plain = plain_generate(hf, {"inputs_embeds": emb}, 3)
        with lm.generate(inputs_embeds=emb, max_new_tokens=3, do_sample=False) as tracer:
            logits = lm.lm_head.output.save()
        assert torch.equal(tracer.result, plain) and plain.shape == (1, 3)
        with torch.no_grad():
            torch.testing.assert_close(logits, hf(inputs_embeds=emb).logits[:, -1:])
        short = soft_prompt(hf, [7], seed=1)
        with lm.generate(max_new_tokens=3, do_sample=False) as tracer:
            with tracer.invoke(inputs_embeds=short):
                a = lm.generator.output.save()
            with tracer.invoke(inputs_embeds=emb):
                b = lm.generator.output.save()
        padded = torch.cat([torch.cat([torch.zeros(1, 2, emb.shape[2]), short], 1), emb])
        mask = torch.tensor([[0, 0, 1], [1, 1, 1]])
        plain = plain_generate(hf, {"inputs_embeds": padded, "attention_mask": mask}, 3)
        assert torch.equal(torch.cat([a, b]), plain)
        assert torch.equal(tracer.result, plain)

    def test_nothing_left_attached(self, lm):
        with lm.generate(PROMPTS[1], max_new_tokens=2) as tracer:
            pass
        assert "generator" not in lm._module._modules


# --------------------------------------------------------------------------- errors


class TestErrors:
    @pytest.fixture
    def arch(self):
        """Input errors do not depend on the architecture: GPT-2 only (saves CI time)."""
        return "gpt2"

    @pytest.mark.parametrize("prompt, match", [
        (3.5, r"cannot use a float as a prompt; pass a string, a list of strings"),
        (["hello", 3], r"cannot use a list of int, str as a prompt"),
        ([[1, 2], ["a"]], r"row 1 of the token ids is not all integers"),
        ({"ids": [1]}, r"a dict prompt needs 'input_ids'; this one has keys \['ids'\]"),
        (torch.tensor([[0.5, 1.0]]), r"input_ids must hold integers, got a tensor of dtype "
                                     r"torch.float32"),
        (torch.zeros(1, 2, 3, dtype=torch.long), r"1-D or 2-D tensor, got shape \(1, 2, 3\)"),
        ([10_000], r"token id 10000 is outside this model's vocabulary \(valid ids: 0..\d+\)"),
    ])
    def test_wrong_prompt(self, lm, prompt, match):
        with pytest.raises(InputError, match=match):
            with lm.trace(prompt):
                pass

    def test_an_invoke_in_a_generate_given_a_prompt_names_generate(self, lm, hf):
        """An invoke opened in ``model.generate(prompt, ...)`` says generate() was given the
        inputs (it said "trace()", which the code does not call)."""
        from nnsight_lite import InvokeError

        with pytest.raises(InvokeError, match=r"model\.generate\(\.\.\.\) itself was given "
                           r"inputs, so its body is the one invoke; pass the inputs to each "
                           r"tracer\.invoke\(\.\.\.\) instead \(with `with model\.generate\(\) "
                           r"as tracer:`\)"):
            with lm.generate("hello world", max_new_tokens=1) as tracer:
                with tracer.invoke("the cat"):
                    pass
        ids = torch.tensor([[4, 5]])
        with lm.trace(ids):
            out = lm.output.save()
        torch.testing.assert_close(out.logits, hf(ids).logits)

    def test_wrong_type_is_also_a_type_error(self, lm):
        with pytest.raises(TypeError):
            with lm.trace(None):
                pass

    @pytest.mark.parametrize("prompt", ["", ["hi", ""], [], torch.tensor([], dtype=torch.long)])
    def test_empty_prompt(self, lm, prompt):
        with pytest.raises(InputError, match=r"empty prompt|has no tokens"):
            with lm.trace(prompt):
                pass

    @pytest.mark.parametrize("text, match", [("", r"empty prompt: there is no token"),
                                             ("   ", r"a prompt has no tokens")])
    def test_empty_invoke_prompt(self, lm, text, match):
        """An empty text, or one the tokenizer makes no token of, in a later invoke is
        refused before the model runs, as for a single prompt."""
        with pytest.raises(InputError, match=match):
            with lm.trace() as tracer:
                with tracer.invoke("hello"):
                    pass
                with tracer.invoke(text):
                    pass

    def test_tokenizer_options_with_token_ids(self, lm):
        with pytest.raises(InputError, match=r"tokenizer options \['max_length'\] apply to text"):
            with lm.trace([1, 2], max_length=3):
                pass

    def test_tokenizer_options_on_a_trace_without_inputs(self, lm):
        with pytest.raises(InputError, match=r"model.trace\(\) was given tokenizer options "
                                             r"\['max_length', 'truncation'\] but no prompt; .* "
                                             r"give tokenizer options to each tracer.invoke"):
            with lm.trace(max_length=3, truncation=True) as tracer:
                with tracer.invoke("hello world"):
                    pass

    def test_inputs_embeds_with_token_invokes_cannot_share_a_batch(self, lm, hf):
        emb = soft_prompt(hf, [4, 5])
        with pytest.raises(nnsight_lite.BatchingError,
                           match=r"invoke 1 gives inputs_embeds and invoke 0 gives a prompt or "
                                 r"token ids .*one forward takes embeddings or token ids, not "
                                 r"both. Give every invoke inputs_embeds"):
            with lm.trace() as tracer:
                with tracer.invoke("hello world"):
                    pass
                with tracer.invoke(inputs_embeds=emb):
                    pass

    @pytest.mark.parametrize("kwargs, match", [
        ({"inputs_embeds": torch.ones(1, 2, 32), "input_ids": torch.tensor([[4, 5]])},
         r"got inputs_embeds=\.\.\. and a prompt \(or input_ids=\.\.\.\); the model takes"),
        ({"inputs_embeds": torch.ones(1, 2, dtype=torch.long)},
         r"inputs_embeds must be a floating-point tensor of shape \(batch, positions, hidden\), "
         r"got a tensor of shape \(1, 2\) and dtype torch.int64"),
        ({"inputs_embeds": torch.ones(1, 0, 32)}, r"there is no position to run the model on"),
        ({"inputs_embeds": torch.ones(1, 2, 32),
          "attention_mask": torch.ones(1, 3, dtype=torch.long)},
         r"attention_mask has shape \(1, 3\) but inputs_embeds has shape \(1, 2, 32\); the "
         r"mask must be \(batch, positions\) = \(1, 2\)"),
        ({"inputs_embeds": torch.ones(1, 2, 32), "max_length": 3},
         r"tokenizer options \['max_length'\] apply to text prompts only, but this input is "
         r"inputs_embeds"),
    ])
    def test_wrong_inputs_embeds(self, lm, kwargs, match):
        with pytest.raises(InputError, match=match):
            with lm.trace(**kwargs):
                pass

    def test_gpt2_path_on_llama(self, model_dirs):
        """GPT-2's paths on a Llama model name the Llama equivalents."""
        lm = quiet(LanguageModel, model_dirs["llama"], dispatch=True)
        with pytest.raises(ModulePathError,
                           match=r"model \(LlamaForCausalLM\) has no submodule or attribute "
                                 r"'transformer'.*Its submodules are: model, lm_head. GPT-2 "
                                 r"keeps its blocks at model.transformer.h; Llama-style models "
                                 r"keep them at model.model.layers"):
            with lm.trace("hello"):
                lm.transformer.h[0].output.save()
        with pytest.raises(ModulePathError,
                           match=r"model.model.layers\[0\] \(LlamaDecoderLayer\) has no "
                                 r"submodule or attribute 'attn'.*Did you mean 'self_attn'"):
            with lm.trace("hello"):
                lm.model.layers[0].attn.output.save()

    def test_llama_path_on_gpt2(self, model_dirs):
        lm = quiet(LanguageModel, model_dirs["gpt2"], dispatch=True)
        with pytest.raises(ModulePathError, match=r"'layers'.*model.transformer.h"):
            lm.layers
        with pytest.raises(ModulePathError, match=r"'model'.*Its submodules are: transformer"):
            lm.model.layers


def test_traces_and_generation_leave_no_reference_cycles(lm, arch):
    """Traces, invokes and generation on a real HF model are freed by reference counting, so
    activations go when the block ends (no garbage-collector pass needed)."""
    block = layers(lm, arch)

    def trace():
        with lm.trace() as tracer:
            with tracer.invoke(PROMPTS[0]):
                h = block[0].output[0]
            with tracer.invoke(PROMPTS[1]):
                block[0].output[0][:, -1] = h[:, -1]
                out = lm.output.logits.save()
        assert out.shape[0] == 1

    def generate():
        with lm.generate(PROMPTS[1], max_new_tokens=3) as tracer:
            hs = nnsight_lite.save([])
            for _ in tracer.iter[:]:
                hs.append(block[1].output[0])
            tokens = lm.generator.output.save()
        assert len(hs) == 3 and tokens.shape[-1] > 3

    for fn in (trace, generate):
        fn()
        assert cycles_left_by(fn) == [], fn.__name__


def test_a_traced_language_model_pickles_and_traces_after(lm, hf, arch):
    """A LanguageModel pickles after a trace as before one (the trace's cache of the input
    embedding's path held weak references: "cannot pickle 'weakref.ReferenceType'"), and the
    copy traces to the same logits as plain HF."""
    import pickle

    with lm.trace(PROMPTS[0]):
        pass
    again = pickle.loads(pickle.dumps(lm))
    enc = tokenize(lm, PROMPTS[:2])
    with again.trace(PROMPTS[:2]):
        logits = again.lm_head.output.save()
    with torch.no_grad():
        want = hf(**enc, position_ids=position_ids(enc["attention_mask"])).logits
    torch.testing.assert_close(logits, want)


def test_a_generate_tracer_left_bound_does_not_keep_the_model(model_dirs):
    """``with lm.generate(...) as tracer:`` in a notebook leaves ``tracer`` bound: after
    ``del lm`` the HF model is freed (it stayed alive with the tracer), and ``tracer.result``
    still gives the ids."""
    import gc
    import weakref

    lm = quiet(LanguageModel, model_dirs["gpt2"], dispatch=True)
    hf_ref = weakref.ref(lm._module)
    with lm.generate(PROMPTS[0], max_new_tokens=2, do_sample=False) as tracer:
        ids = tracer.result.save()
    del lm
    gc.collect()
    assert hf_ref() is None
    assert torch.equal(tracer.result, ids)


def test_a_loaded_tokenizer_pads_on_the_left(lm, hf, model_dirs, arch):
    """The tokenizer a LanguageModel loads pads on the left (as nnsight's does), so a batch
    padded with ``model.tokenizer`` has each prompt's last token at ``[:, -1]``: its logits
    there equal each prompt's own forward. ``tokenizer_kwargs`` still choose."""
    from nnsight_lite import LanguageModel

    assert lm.tokenizer.padding_side == "left"
    short, long = PROMPTS[1], PROMPTS[2]
    enc = lm.tokenizer([short, long], return_tensors="pt", padding=True)
    with lm.trace(enc["input_ids"], attention_mask=enc["attention_mask"]):
        last = lm.lm_head.output[:, -1].save()
    for row, prompt in enumerate((short, long)):
        alone = hf(**lm.tokenizer(prompt, return_tensors="pt")).logits[0, -1]
        torch.testing.assert_close(last[row], alone, atol=1e-4, rtol=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        right = LanguageModel(model_dirs[arch], tokenizer_kwargs={"padding_side": "right"})
    assert right.tokenizer.padding_side == "right"
    # a tokenizer passed in is set to pad on the left too, as nnsight does
    given = make_tokenizer()
    given.padding_side = "right"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        wrapped = LanguageModel(hf, tokenizer=given)
    assert wrapped.tokenizer is given and given.padding_side == "left"
    enc = given([short, long], return_tensors="pt", padding=True)
    with wrapped.trace(enc["input_ids"], attention_mask=enc["attention_mask"]):
        again = wrapped.lm_head.output[:, -1].save()
    torch.testing.assert_close(again, last)


def test_tokenizer_kwargs_apply_to_a_given_tokenizer(model_dirs, hf, arch):
    """``LanguageModel(path, tokenizer=t, tokenizer_kwargs={"padding_side": "right"})`` sets
    them on ``t`` (as nnsight 0.8 does) instead of dropping them: two prompts are then padded
    on the right, each row's positions holding its own forward's logits."""
    given = make_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        lm = LanguageModel(model_dirs[arch], tokenizer=given,
                           tokenizer_kwargs={"padding_side": "right"})
    assert lm.tokenizer is given and given.padding_side == "right"
    long, short = PROMPTS[2], PROMPTS[1]
    with lm.trace([long, short]):
        logits = lm.lm_head.output.save()
    n = len(given(short)["input_ids"])
    alone = hf(**given(short, return_tensors="pt")).logits[0]
    torch.testing.assert_close(logits[1, :n], alone, atol=1e-4, rtol=1e-4)  # right: at 0..n


@pytest.mark.parametrize("automodel", ["AutoModel", "model class", "model class name"])
def test_automodel_takes_a_class_or_its_name(model_dirs, arch, automodel):
    """``automodel=`` may be an auto class's name (nnsight resolves names in transformers), a
    model class (``LlamaForCausalLM``, which has no ``from_config``) or its name; lazily and
    dispatched, the module is that class and a trace's output equals its plain forward."""
    cls = type(transformers.AutoModelForCausalLM.from_pretrained(model_dirs[arch]))
    chosen = {"AutoModel": "AutoModel", "model class": cls,
              "model class name": cls.__name__}[automodel]
    want = transformers.AutoModel if automodel == "AutoModel" else transformers.AutoModelForCausalLM
    ref = want.from_pretrained(model_dirs[arch])
    ids = torch.tensor([[2, 3, 4, 5]])
    with torch.no_grad():
        expected = ref(input_ids=ids)[0]
    for dispatch in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            lm = LanguageModel(model_dirs[arch], automodel=chosen, dispatch=dispatch)
        assert type(lm._module) is type(ref) and lm.dispatched is dispatch
        with lm.trace(ids):
            out = lm.output.save()
        torch.testing.assert_close(out[0], expected)


@pytest.mark.parametrize("bad", ["AutoModelForNothing", "AutoConfig", 3])
def test_automodel_that_is_no_model_class_raises_at_once(model_dirs, bad):
    """A name transformers does not have, a class that builds no model, or no class at all
    raises TypeError when the LanguageModel is made, saying what it takes."""
    with pytest.raises(TypeError, match=r"automodel=\.\.\.\) takes a transformers class"):
        LanguageModel(model_dirs["llama"], automodel=bad)


def test_a_right_padding_tokenizer_pads_prompts_and_invokes_on_the_right(model_dirs, hf, arch):
    """``tokenizer_kwargs={"padding_side": "right"}`` pads text, ragged token ids and invokes on
    the right, as nnsight does with such a tokenizer: the batch's ids are the tokenizer's own
    right-padded ones, and each prompt's positions hold its own forward's logits."""
    from nnsight_lite import LanguageModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        right = LanguageModel(model_dirs[arch], tokenizer_kwargs={"padding_side": "right"})
    short, long = PROMPTS[1], PROMPTS[2]
    enc = right.tokenizer([long, short], return_tensors="pt", padding=True)
    alone = [hf(**right.tokenizer(p, return_tensors="pt")).logits[0] for p in (long, short)]
    ragged = [right.tokenizer(p)["input_ids"] for p in (long, short)]
    for kind in ("text", "invokes", "ragged ids"):
        with right.trace() as tracer:
            if kind == "text":
                with tracer.invoke([long, short]):
                    pass
            else:
                for prompt in ((long, short) if kind == "invokes" else ragged):
                    with tracer.invoke(prompt):
                        pass
            with tracer.invoke():
                emb = right.transformer.wte if arch == "gpt2" else right.model.embed_tokens
                ids = emb.input.save()
                logits = right.lm_head.output.save()
        assert torch.equal(ids, enc["input_ids"]), kind
        for row, want in enumerate(alone):
            torch.testing.assert_close(logits[row, :len(want)], want, atol=1e-4, rtol=1e-4)


def test_per_token_inputs_of_encodings_are_padded_with_the_ids(model_dirs):
    """Invokes given encodings of different lengths with other per-token inputs (GPT-2's
    ``token_type_ids``; ``labels``): those are padded like the ids, so each invoke gets the
    plain model's logits on its own encoding, and ``labels`` padded with -100 leave the loss
    the plain one on the batch so padded. Before: BatchingError (their shapes differ)."""
    from nnsight_lite import LanguageModel
    from nnsight_lite.padding import pad_to

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dirs["gpt2"]).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no pad token: eos is used
        lm = LanguageModel(model_dirs["gpt2"], dispatch=True)
    encs = []
    for text in ("hello world", "the eiffel tower is in the city of"):
        enc = dict(lm.tokenizer(text, return_tensors="pt"))
        enc["token_type_ids"] = torch.arange(enc["input_ids"].shape[1]).remainder(2)[None]
        enc["labels"] = enc["input_ids"].clone()
        encs.append(enc)
    with lm.trace() as tracer:
        with tracer.invoke(encs[0]):
            short = lm.output.logits.save()
        with tracer.invoke(encs[1]):
            long = lm.output.logits.save()
        with tracer.invoke():  # (no input: the whole batch)
            loss = lm.output.loss.save()
    width = encs[1]["input_ids"].shape[1]
    n = encs[0]["input_ids"].shape[1]
    with torch.no_grad():
        ref_short = hf(**{k: v for k, v in encs[0].items() if k != "labels"}).logits
        ref_long = hf(**{k: v for k, v in encs[1].items() if k != "labels"}).logits
        padded = {k: torch.cat([pad_to(encs[0][k], width, v, "left"), encs[1][k]])
                  for k, v in (("input_ids", lm.tokenizer.pad_token_id), ("attention_mask", 0),
                               ("token_type_ids", 0), ("labels", -100))}
        # (positions counted from each row's first token, as the batch's are)
        padded["position_ids"] = (padded["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        ref_loss = hf(**padded).loss
    torch.testing.assert_close(short[:, -n:], ref_short, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(long, ref_long, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)


def test_an_input_that_is_not_per_token_is_not_padded_like_the_ids(model_dirs):
    """Only values with a value per token are padded with the ids: an invoke's other 3-D input
    whose second dimension happens to equal its prompt's length (audio features of 128 mel
    bins beside a 128-token prompt) reaches the forward as given, so each invoke gets the plain
    model's logits on its own inputs. Before: it was padded along that dimension with zeros
    (its first two dimensions matched the ids'), silently changing what the model saw."""
    from nnsight_lite import LanguageModel

    class WithFeatures(transformers.GPT2LMHeadModel):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                    features=None, **kwargs):
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, **kwargs)
            out.logits = out.logits + features.mean(1).sum(-1)[:, None, None]
            return out

    hf = WithFeatures.from_pretrained(model_dirs["gpt2"]).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dirs["gpt2"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no pad token: eos is used
        lm = LanguageModel(hf, tokenizer=tok)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.tensor([[5, 6, 7]]), torch.tensor([[5, 6, 7, 8, 9, 10]])]
    encs = [{"input_ids": i, "attention_mask": torch.ones_like(i),
             "features": torch.rand(1, 3, 4, generator=gen) + 1} for i in ids]
    with lm.trace() as tracer:
        with tracer.invoke(encs[0]):
            short = lm.output.logits.save()
        with tracer.invoke(encs[1]):
            long = lm.output.logits.save()
    with torch.no_grad():
        ref = [hf(**e).logits for e in encs]
    torch.testing.assert_close(short[:, -3:], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(long, ref[1], rtol=1e-5, atol=1e-5)
