"""nnsight 0.5-0.8 forms met running nnsight's own test suite with the import changed, on tiny
GPT-2 and Llama, each checked against plain transformers."""

from __future__ import annotations

import warnings

import pytest
import torch

from nnsight_lite import LanguageModel

PROMPT = "the eiffel tower is in the city of"


def load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no pad token: eos is used
        return LanguageModel(path, **kw)


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


def test_a_dotted_rename_key_below_the_root_binds_where_it_resolves(model_dirs, hf, arch):
    """`rename={"h.0": "first_layer"}` (nnsight's test_cache_alias): a dotted key that names
    nothing from the root binds on the module it resolves from (`transformer.first_layer` is
    `transformer.h[0]`), in bodies and in cache navigation; a key that resolves from the root
    still mounts there."""
    from tests.integration.conftest import layers

    stack = "h" if arch == "gpt2" else "layers"
    lm = load(model_dirs[arch], dispatch=True,
                       rename={f"{stack}.0": "first_layer", f"{stack}.1.mlp": "mlp1"})
    parent = lm.transformer if arch == "gpt2" else lm.model
    assert parent.first_layer is layers(lm, arch)[0]
    assert parent.mlp1 is layers(lm, arch)[1].mlp
    seen = {}
    handle = layers(hf, arch)[0].register_forward_hook(lambda m, i, o: seen.update(h=o))
    try:
        enc = lm.tokenizer(PROMPT, return_tensors="pt")
        hf(**enc)
    finally:
        handle.remove()
    with lm.trace(PROMPT) as tracer:
        cache = tracer.cache()
        h = parent.first_layer.output.save()
    root_name = "transformer" if arch == "gpt2" else "model"
    cached = getattr(cache.model, root_name).first_layer.output
    assert torch.allclose(h, seen["h"], atol=1e-5)
    assert torch.equal(cached, h)
    rooted = load(model_dirs[arch], dispatch=True,
                           rename={f"{root_name}.{stack}.0": "first_layer"})
    assert rooted.first_layer is layers(rooted, arch)[0]
    assert "first_layer" not in dir(rooted.transformer if arch == "gpt2" else rooted.model)


def test_remote_local_trace_and_generate_on_a_language_model(model_dirs, hf, arch):
    """nnsight 0.5.16's `remote="local"` on a LanguageModel not yet dispatched: the trace and
    the generate run shipped-and-answered in this process, loading the weights here; the
    logits and the ids equal plain HF's."""
    lm = load(model_dirs[arch])  # meta weights until a local run needs them
    enc = lm.tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        want_logits = hf(**enc).logits
        want_ids = hf.generate(**enc, max_new_tokens=3, do_sample=False,
                               pad_token_id=lm.tokenizer.pad_token_id)
    with lm.trace(PROMPT, remote="local"):
        logits = lm.lm_head.output.save()
    with lm.generate(PROMPT, max_new_tokens=3, do_sample=False, remote="local") as tracer:
        ids = tracer.result.save()
    assert torch.allclose(logits, want_logits, atol=1e-5)
    assert torch.equal(ids, want_ids)


def test_nnsight_08_names_and_module_paths(model_dirs, hf, arch):
    """nnsight 0.8's imports run with the package name changed: `TransformersModel` (the 0.8
    tutorials' wrapper) loads the checkpoint and traces like plain HF, and the module paths
    `modeling.language`, `modeling.transformers`, `modeling.base`, `intervention.envoy` and
    `intervention.interleaver` give the package's own classes."""
    import warnings as _warnings

    import nnsight_lite
    from nnsight_lite import TransformersModel
    from nnsight_lite.intervention.envoy import Envoy
    from nnsight_lite.intervention.interleaver import OutOfOrderError
    from nnsight_lite.modeling.base import NNsight
    from nnsight_lite.modeling.language import LanguageModel
    from nnsight_lite.modeling.transformers import TransformersModel as Same

    assert (Envoy, OutOfOrderError, NNsight, LanguageModel, Same) == (
        nnsight_lite.Envoy, nnsight_lite.OutOfOrderError, nnsight_lite.NNsight,
        nnsight_lite.LanguageModel, TransformersModel)
    assert issubclass(nnsight_lite.NNsightDeprecationWarning, FutureWarning)
    with _warnings.catch_warnings():
        _warnings.simplefilter("ignore", UserWarning)  # no pad token: eos is used
        model = TransformersModel(model_dirs[arch], task="text-generation", dispatch=True)
    assert isinstance(model, LanguageModel)
    with pytest.raises(ValueError, match="AutoModelForImageClassification"):
        TransformersModel(model_dirs[arch], task="image-classification")
    enc = model.tokenizer(PROMPT, return_tensors="pt")
    with model.trace(PROMPT):
        logits = model.output.logits.save()
    torch.testing.assert_close(logits, hf(**enc).logits)


def test_device_and_task_keywords_of_nnsight_08(model_dirs, hf, arch):
    """``device=`` (nnsight's MoE routing tutorial loads with ``device="cpu"``) puts the loaded
    model on that device, dispatched now or at the first trace, for ``LanguageModel`` and
    ``TransformersModel``; ``task="text-generation"`` is accepted by ``LanguageModel`` too, as
    nnsight 0.8.1's is. Found by a docs hunt: both raised transformers' TypeError
    (``__init__() got an unexpected keyword argument 'device'`` / ``'task'``)."""
    import warnings as _warnings

    from nnsight_lite import LanguageModel, TransformersModel

    want = None
    for cls, kw in ((LanguageModel, dict(device="cpu", dispatch=True)),
                    (LanguageModel, dict(device=torch.device("cpu"), task="text-generation")),
                    (TransformersModel, dict(device="cpu", task="text-generation",
                                             dispatch=True))):
        with _warnings.catch_warnings():
            _warnings.simplefilter("ignore", UserWarning)  # no pad token: eos is used
            model = cls(model_dirs[arch], **kw)
        enc = model.tokenizer(PROMPT, return_tensors="pt")
        with model.trace(PROMPT):
            logits = model.output.logits.save()
        assert next(model.parameters()).device == torch.device("cpu")
        if want is None:
            want = hf(**enc).logits
        torch.testing.assert_close(logits, want)
    with pytest.raises(ValueError, match="AutoModelForImageClassification"):
        LanguageModel(model_dirs[arch], task="image-classification")


def test_wrapper_module_makes_an_attached_sae_readable(model_dirs, hf, arch):
    """nnsight's SAE-evaluation tutorial imports ``WrapperModule`` from
    ``nnsight.modeling.transformers`` (an identity module that makes a value a module's
    output), attaches the SAE to a decoder layer and splices it in with an edit: the SAE's
    ``encode`` / ``decode`` outputs read in a trace equal the SAE applied to the plain layer
    output, and the logits equal plain HF with the layer's output replaced. Found by a docs hunt:
    the import raised ImportError."""
    import warnings as _warnings

    from nnsight_lite import LanguageModel
    from nnsight_lite.modeling.transformers import WrapperModule

    class SAE(torch.nn.Module):
        def __init__(self, d, k):
            super().__init__()
            self.encode = WrapperModule()
            self.decode = WrapperModule()
            self.W_enc = torch.nn.Parameter(torch.randn(d, k) * 0.3)
            self.W_dec = torch.nn.Parameter(torch.randn(k, d) * 0.3)

        def forward(self, x):
            acts = self.encode(torch.relu(x @ self.W_enc))
            return self.decode(acts @ self.W_dec)

    assert WrapperModule()(3) == 3 and WrapperModule()(1, 2) == (1, 2)
    torch.manual_seed(0)
    sae = SAE(hf.config.hidden_size, 16)
    with _warnings.catch_warnings():
        _warnings.simplefilter("ignore", UserWarning)  # no pad token: eos is used
        model = LanguageModel(model_dirs[arch], dispatch=True)
    layer = model.transformer.h[1] if arch == "gpt2" else model.model.layers[1]
    layer.sae = sae
    with model.edit(inplace=True):
        layer.output[:] = layer.sae(layer.output, hook=True)
    with torch.no_grad(), model.trace(PROMPT):
        acts = layer.sae.encode.output.save()
        recon = layer.sae.decode.output.save()
        logits = model.output.logits.save()
    model.clear_edits()
    enc = model.tokenizer(PROMPT, return_tensors="pt")
    block = hf.transformer.h[1] if arch == "gpt2" else hf.model.layers[1]
    seen = {}

    def splice(m, a, o):
        seen["h"] = o.clone()
        return sae(o)

    handle = block.register_forward_hook(splice)
    try:
        with torch.no_grad():
            want = hf(**enc).logits
    finally:
        handle.remove()
    with torch.no_grad():
        torch.testing.assert_close(acts, torch.relu(seen["h"] @ sae.W_enc))
        torch.testing.assert_close(recon, sae(seen["h"]))
    torch.testing.assert_close(logits, want)


def test_pipe_gives_the_text_generation_pipelines_records(model_dirs, hf, arch):
    """``model.pipe(prompt, **kwargs)`` (nnsight 0.8's multiple-token page: decoded records
    instead of token ids) equals the Hugging Face text-generation pipeline over the same model
    and tokenizer. Found by a docs hunt: it raised ModulePathError (no attribute 'pipe')."""
    import warnings as _warnings

    import transformers

    from nnsight_lite import LanguageModel

    with _warnings.catch_warnings():
        _warnings.simplefilter("ignore", UserWarning)  # no pad token: eos is used
        model = LanguageModel(model_dirs[arch])  # on meta: pipe loads the weights first
    got = model.pipe(PROMPT, max_new_tokens=3, do_sample=False)
    assert model.dispatched and model.pipeline is model.pipeline  # (made once)
    want = transformers.pipeline("text-generation", model=hf, tokenizer=model.tokenizer)(
        PROMPT, max_new_tokens=3, do_sample=False)
    assert got == want and got[0]["generated_text"].startswith(PROMPT)
    import pickle

    again = pickle.loads(pickle.dumps(model))  # (the pipeline is made again, not pickled)
    assert "_pipe" not in again.__dict__


def test_pipe_as_a_block_traces_every_forward_of_the_pipeline(model_dirs, hf, arch):
    """``with model.pipe(prompt, max_new_tokens=k) as tracer:`` (nnsight 0.8.1 traces the
    pipeline; here it ran the pipeline, then raised TypeError at the with-statement): the body
    reads each step's logits as a hook on the plain pipeline sees them, an edit at every step
    changes the text as the same edit by a hook does, and ``tracer.result`` is the pipeline's
    records. Several prompts run as one batch (``batch_size`` their number), as nnsight 0.8.1
    hands them to the pipeline (here they ran one by one, 1 row a step, 6 steps for 2 prompts).
    An invoke in a block given its prompts is refused with an error saying where prompts go."""
    import warnings as _warnings

    import transformers

    import nnsight_lite
    from nnsight_lite import LanguageModel
    from nnsight_lite.errors import InputError
    from tests.integration.conftest import layers

    with _warnings.catch_warnings():
        _warnings.simplefilter("ignore", UserWarning)  # no pad token: eos is used
        model = LanguageModel(model_dirs[arch])
    kw = dict(max_new_tokens=3, do_sample=False)
    plain = transformers.pipeline("text-generation", model=hf, tokenizer=model.tokenizer)
    head, mlp = hf.lm_head, (hf.transformer.h if arch == "gpt2" else hf.model.layers)[1].mlp

    def hooked(edit):
        seen = []
        hooks = [head.register_forward_hook(lambda m, i, o: seen.append(o[:, -1].clone()))]
        if edit:
            hooks.append(mlp.register_forward_hook(lambda m, i, o: o * 0))
        try:
            return plain(PROMPT, **kw), seen
        finally:
            for h in hooks:
                h.remove()

    for edit in (False, True):
        with model.pipe(PROMPT, **kw) as tracer:
            logits = nnsight_lite.save([])
            for step in tracer.all():
                if edit:
                    layers(model, arch)[1].mlp.output = layers(model, arch)[1].mlp.output * 0
                logits.append(model.lm_head.output[:, -1])
            records = tracer.result.save()
        want, seen = hooked(edit)
        assert records == want and tracer.result == want
        assert len(logits) == len(seen) == 3
        for got, ref in zip(logits, seen):
            torch.testing.assert_close(got, ref)
    assert hooked(True)[0] != hooked(False)[0]  # (the edit changed the text)
    two = [PROMPT, "hello world"]  # (one batched generate: 3 steps of 2 rows)
    with model.pipe(two, **kw) as tracer:
        logits = nnsight_lite.save([])
        for step in tracer.all():
            logits.append(model.lm_head.output[:, -1])
    seen = []
    handle = head.register_forward_hook(lambda m, i, o: seen.append(o[:, -1].clone()))
    try:
        assert tracer.result == plain(two, batch_size=2, **kw)
    finally:
        handle.remove()
    assert len(logits) == len(seen) == 3 and logits[0].shape[0] == 2
    for got, ref in zip(logits, seen):
        torch.testing.assert_close(got, ref)
    with pytest.raises(InputError, match=r"model\.pipe\(\.\.\.\) was given its prompts in the call"):
        with model.pipe(PROMPT, **kw) as tracer:
            with tracer.invoke(PROMPT):
                pass
    with pytest.raises(InputError, match=r"model\.pipe runs here only"):
        with model.pipe(PROMPT, remote=True, **kw):
            pass


def test_pipe_with_invokes_batches_their_prompts_as_nnsight_081(model_dirs, hf, arch):
    """nnsight's barrier page: ``with model.pipe(max_new_tokens=3) as tracer:`` with a
    ``tracer.invoke(prompt)`` per prompt (nnsight 0.8.1 runs the pipeline once over the invokes'
    prompts, batch_size their number; here invokes raised InputError). Each invoke reads its own
    row of the batch, a barrier hands invoke 0's embeddings to invoke 1, and the records equal
    the plain pipeline's over both prompts with a hook making the same edit."""
    import transformers

    import nnsight_lite
    from tests.integration.conftest import layers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no pad token: eos is used
        model = LanguageModel(model_dirs[arch])
    kw = dict(max_new_tokens=3, do_sample=False)
    donor, receiver = PROMPT, "_ _ _ _ _ _ _ _ _ _ _ _ _"
    emb = hf.get_input_embeddings()
    plain = transformers.pipeline("text-generation", model=hf, tokenizer=model.tokenizer)
    with model.pipe(**kw) as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(donor):
            embeddings = (model.transformer.wte if arch == "gpt2"
                          else model.model.embed_tokens).output
            barrier()
            mine = layers(model, arch)[-1].output.save()
        with tracer.invoke(receiver):
            barrier()
            (model.transformer.wte if arch == "gpt2" else model.model.embed_tokens).output = \
                embeddings
            theirs = layers(model, arch)[-1].output.save()
        with tracer.invoke():
            result = tracer.result.save()
    calls, seen = [], []

    def transfer(m, i, o):
        calls.append(1)
        if len(calls) == 1:  # (the prompt's forward: step 0)
            o = o.clone()
            o[1] = o[0]
            return o

    hooks = [emb.register_forward_hook(transfer),
             layers(hf, arch)[-1].register_forward_hook(
                 lambda m, i, o: seen.append((o[0] if isinstance(o, tuple) else o).clone()))]
    try:
        want = plain([donor, receiver], batch_size=2, **kw)
    finally:
        for h in hooks:
            h.remove()
    assert result == want and tracer.result == want
    torch.testing.assert_close(mine, seen[0][:1])
    torch.testing.assert_close(theirs, seen[0][1:])
    with model.pipe(**kw) as tracer:  # (one invoke: its prompt alone, the pipeline's records)
        with tracer.invoke(donor):
            one = nnsight_lite.save(tracer.result)
    assert one == plain(donor, **kw)


def test_pipe_takes_remote_false_as_generate_does(model_dirs, hf, arch):
    """``model.pipe(prompt, remote=False)`` (nnsight code switching one REMOTE flag for every
    trace) runs here as without it, as a block and called plainly, like ``model.generate``; it
    passed remote=False on to the pipeline, which raised ValueError (unused model_kwargs). A
    plain call with remote=True says a remote run is a with-block, as generate does."""
    import warnings as _warnings

    import transformers

    import nnsight_lite
    from nnsight_lite import LanguageModel
    from nnsight_lite.errors import InputError

    with _warnings.catch_warnings():
        _warnings.simplefilter("ignore", UserWarning)  # no pad token: eos is used
        model = LanguageModel(model_dirs[arch])
    kw = dict(max_new_tokens=3, do_sample=False)
    plain = transformers.pipeline("text-generation", model=hf, tokenizer=model.tokenizer)
    seen = []
    handle = hf.lm_head.register_forward_hook(lambda m, i, o: seen.append(o[:, -1].clone()))
    try:
        want = plain(PROMPT, **kw)
    finally:
        handle.remove()
    assert model.pipe(PROMPT, remote=False, backend=None, **kw) == want
    with model.pipe(PROMPT, remote=False, **kw) as tracer:
        logits = nnsight_lite.save([])
        for step in tracer.all():
            logits.append(model.lm_head.output[:, -1])
    assert tracer.result == want and len(logits) == len(seen) == 3
    for got, ref in zip(logits, seen):
        torch.testing.assert_close(got, ref)
    with pytest.raises(InputError, match=r"model\.pipe runs here only"):
        model.pipe(PROMPT, remote=True, **kw)
