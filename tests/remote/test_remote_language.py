"""A LanguageModel held on the meta device runs traces and generate on the served GPT-2; the
results equal the same code run on a local copy with the weights loaded."""

from __future__ import annotations

import pytest
import torch

import nnsight_lite

PROMPT = "the tower is in"


def same(a, b):
    """Equal up to float rounding: the replica is another process, whose CPU kernels may sum
    in another order (thread count); differences are ~1e-6 on values of ~10."""
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5)


class TestLanguageModelRemote:
    def test_trace_equals_local_and_client_stays_meta(self, gpt2_meta, gpt2_local):
        """Hidden states and logits equal the local run; the client never loads weights."""
        model = gpt2_meta
        with model.trace(PROMPT, remote=True, backend=None):
            h = model.transformer.h[1].output.save()
            logits = model.lm_head.output.save()
        assert not model.dispatched
        with gpt2_local.trace(PROMPT):
            h_l = gpt2_local.transformer.h[1].output.save()
            logits_l = gpt2_local.lm_head.output.save()
        same(h, h_l)
        same(logits, logits_l)

    def test_patching_across_invokes_and_tokenizer(self, gpt2_meta, gpt2_local):
        """The demo's patching: one invoke's hidden state patched into another; the body's
        `model.tokenizer` and a caller variable holding it both mean the server's tokenizer."""
        tok = gpt2_meta.tokenizer

        def run(model, **kw):
            with model.trace(**kw) as tracer:
                with tracer.invoke("the tower is in"):
                    clean = model.transformer.h[0].output[:, -1].save()
                with tracer.invoke("the arena is in"):
                    model.transformer.h[0].output[:, -1] = clean
                    top = model.lm_head.output[0, -1].argmax().save()
                    word = nnsight_lite.save(model.tokenizer.decode(top))
                    eos = nnsight_lite.save(tok.eos_token)
            return clean, top, word, eos

        remote = run(gpt2_meta, remote=True)
        local = run(gpt2_local)
        same(remote[0], local[0])
        assert remote[1:] == local[1:]

    def test_generate_iter_all_next(self, gpt2_meta, gpt2_local):
        """generate with tracer.all(), .next() and model.generator.output equals local; the
        result of the traced call (tracer.result) is the generated ids."""

        def run(model, **kw):
            with model.generate(PROMPT, max_new_tokens=3, do_sample=False, **kw) as tracer:
                steps = nnsight_lite.save([])
                for _ in tracer.all():
                    steps.append(model.lm_head.output[0, -1].argmax().item())
                ids = model.generator.output.save()
            return steps, ids, tracer.result

        (rs, rids, rres), (ls, lids, lres) = run(gpt2_meta, remote=True), run(gpt2_local)
        assert rs == ls and len(rs) == 3
        assert torch.equal(rids, lids) and torch.equal(rres, lres)

        def two_steps(model, **kw):
            with model.generate(PROMPT, max_new_tokens=2, do_sample=False, **kw):
                first = model.transformer.h[0].output.save()
                second = model.transformer.h[0].next().output.save()
            return first, second

        remote, local = two_steps(gpt2_meta, remote=True), two_steps(gpt2_local)
        assert remote[0].shape[1] == len(PROMPT) and remote[1].shape[1] == 1
        same(remote[0], local[0])
        same(remote[1], local[1])


class TestWire:
    def test_reply_is_about_the_saved_tensor(self, gpt2_meta, served):
        """A trace that saves one hidden state returns about that tensor's bytes; the request
        carries no weights."""
        from nnsight_lite import remote

        backend = remote.Backend()
        model = gpt2_meta
        with model.trace(PROMPT, backend=backend):
            h = model.transformer.h[0].output.save()
        size = h.numel() * h.element_size()
        weights = sum(p.numel() * 4 for p in model._module.parameters())
        assert size <= backend.last_received <= size + 2048
        assert backend.last_sent < 4096 < weights

    def test_edit_of_a_meta_model_runs_remotely_without_loading(self, gpt2_meta, gpt2_local):
        """``model.edit()`` on the client's meta model loads nothing; the edited copy's remote
        trace equals the same edit run locally, and the unedited model is unchanged."""
        def run(model, **kw):
            with model.edit() as edited:
                edited.transformer.h[0].output[:] = 0
            with edited.trace(PROMPT, **kw):
                logits = edited.lm_head.output.save()
            with model.trace(PROMPT, **kw):
                plain = model.lm_head.output.save()
            return logits, plain

        remote = run(gpt2_meta, remote=True)
        assert not gpt2_meta.dispatched
        local = run(gpt2_local)
        same(remote[0], local[0])
        same(remote[1], local[1])
        assert not torch.allclose(remote[0], remote[1])  # the edit changed the logits


class TestOtherServedModel:
    def test_a_trace_sent_to_another_kind_of_model_says_so(self, gpt2_meta):
        """A GPT-2 trace sent to the served MLP (a default backend naming another model) fails
        with RemoteError naming both model classes and the block's line, whether the body
        reaches modules itself or reads an Envoy from the caller; the MLP still serves."""
        from nnsight_lite import remote
        from nnsight_lite.errors import RemoteError
        from nnsight_lite.remote.testing import mlp

        model = gpt2_meta
        layer = model.transformer.h[0]
        want = "traces a GPT2LMHeadModel, but the model served as 'mlp' is a Sequential"
        with pytest.raises(RemoteError, match=want) as info:
            with model.trace(PROMPT, backend="mlp"):
                model.transformer.h[0].output.save()
        assert f"{__file__}:" in str(info.value)
        with pytest.raises(RemoteError, match=want):
            with model.trace(PROMPT, backend=remote.Backend("mlp")):
                layer.output.save()
        net = mlp()
        x = torch.ones(2, 8)
        with net.trace(x, backend="mlp"):
            out = net.output.save()
        torch.testing.assert_close(out, net._module(x))
