"""``DiffusionModel`` on a tiny Stable Diffusion pipeline saved offline
(remote/testing.save_tiny_diffusion), checked against the plain diffusers pipeline run with the
same seed and forward hooks."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import nnsight_lite  # noqa: E402
from nnsight_lite import DiffusionModel, InputError  # noqa: E402
from nnsight_lite.remote.testing import save_tiny_diffusion  # noqa: E402

RUN = dict(output_type="np")  # (guidance_scale: the pipeline's 7.5)


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return save_tiny_diffusion(tmp_path_factory.mktemp("sd"))


def _load(sd_dir, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (diffusers: accelerate missing, no safety checker)
        model = DiffusionModel(sd_dir, **kw)
    model.pipeline.set_progress_bar_config(disable=True)
    return model


@pytest.fixture(scope="module")
def sd(sd_dir):
    return _load(sd_dir)


@pytest.fixture(scope="module")
def plain(sd_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = diffusers.DiffusionPipeline.from_pretrained(sd_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _plain_run(pipe, prompt, steps, seed, hook=None):
    """The plain pipeline's output and the UNet's per-call ``output[0]`` (a forward hook; it
    may replace the output)."""
    seen = []

    def keep(module, args, out):
        new = hook(out) if hook is not None else None
        seen.append((new if new is not None else out)[0].clone())
        return new

    handle = pipe.unet.register_forward_hook(keep)
    try:
        out = pipe(prompt, num_inference_steps=steps,
                   generator=torch.Generator().manual_seed(seed), **RUN)
    finally:
        handle.remove()
    return out, seen


def test_components_are_envoys_and_the_pipeline_is_reachable(sd):
    assert isinstance(sd.pipeline, diffusers.StableDiffusionPipeline)
    assert [n for n, _ in sd._module.named_children()] == ["vae", "text_encoder", "unet"]
    assert sd.unet._module is sd.pipeline.unet
    assert "UNet2DConditionModel" in repr(sd)


def test_generate_reads_the_denoiser_at_every_step(sd, plain):
    """``with sd.generate(prompt, num_inference_steps=3, seed=0)``: ``tracer.all()`` gets the
    UNet's output at each of the 3 steps and ``tracer.result`` is the pipeline's output, all
    equal to the plain pipeline run with a generator seeded 0 (and the loop's end is known:
    the body goes on after it)."""
    with sd.generate("a cat", num_inference_steps=3, seed=0, **RUN) as tracer:
        outs = nnsight_lite.save([])
        for step in tracer.all():
            outs.append(sd.unet.output[0])
        result = tracer.result.save()
    want, seen = _plain_run(plain, "a cat", 3, 0)
    assert len(outs) == len(seen) == 3
    for got, ref in zip(outs, seen):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert (result.images == want.images).all()


def test_a_trace_takes_one_step_unless_told(sd, plain):
    """``sd.trace(prompt)`` denoises once (as nnsight's traced runs do): one UNet call, the
    plain pipeline's one-step output."""
    with sd.trace("a cat", seed=1, **RUN) as tracer:
        outs = nnsight_lite.save([])
        for step in tracer.all():
            outs.append(sd.unet.output[0])
        result = sd.output.save()
    want, seen = _plain_run(plain, "a cat", 1, 1)
    assert len(outs) == 1
    torch.testing.assert_close(outs[0], seen[0], rtol=0, atol=0)
    assert (result.images == want.images).all()


def test_zeroing_the_denoiser_output_at_every_step(sd, plain):
    """An in-place edit at each step equals a hook returning zeros."""
    with sd.generate("a dog", num_inference_steps=2, seed=2, **RUN) as tracer:
        for step in tracer.iter[:2]:
            sd.unet.output[0][:] = 0
        result = tracer.result.save()
    want, _ = _plain_run(plain, "a dog", 2, 2,
                         hook=lambda out: (torch.zeros_like(out[0]),) + tuple(out[1:]))
    assert (result.images == want.images).all()


def test_a_plain_generate_call_is_the_pipeline_with_its_defaults(sd, plain):
    """Without a with-block, ``sd.generate`` returns the pipeline's output; ``seed=`` gives one
    generator per image (seed, seed + 1), so two images of a prompt differ and the run
    repeats."""
    out = sd.generate("a cat", seed=7, num_inference_steps=2, **RUN)
    want = plain("a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(7),
                 **RUN)
    assert (out.images == want.images).all()
    two = sd.generate("a cat", seed=7, num_images_per_prompt=2, num_inference_steps=2, **RUN)
    again = sd.generate("a cat", seed=7, num_images_per_prompt=2, num_inference_steps=2, **RUN)
    assert two.images.shape[0] == 2 and not (two.images[0] == two.images[1]).all()
    assert (two.images == again.images).all()


def _plain_batch(pipe, prompts, seed, hook=None, **kw):
    """The plain pipeline on several prompts (one generator per image: seed, seed + 1, ...),
    and the UNet's per-call ``output[0]`` before ``hook`` (which may return a new output)."""
    seen = []

    def keep(module, args, out):
        seen.append(out[0].clone())
        return hook(out) if hook is not None else None

    images = len(prompts) * kw.get("num_images_per_prompt", 1)
    gens = [torch.Generator().manual_seed(seed + i) for i in range(images)]
    handle = pipe.unet.register_forward_hook(keep)
    try:
        out = pipe(prompts, generator=gens, **RUN, **kw)
    finally:
        handle.remove()
    return out, seen


def _zero_rows(rows):
    def hook(out):
        x = out[0].clone()
        x[rows] = 0
        return (x,) + tuple(out[1:])
    return hook


class TestInvokes:
    """Several invokes run as one pipeline call on all their prompts. With classifier-free
    guidance the UNet's batch is [uncond cat, uncond dog, cond cat, cond dog]: each invoke
    gets its prompt's two rows, and its edits land in those rows only."""

    def test_each_invoke_reads_its_prompts_rows(self, sd, plain):
        with sd.generate(num_inference_steps=2, seed=0, **RUN) as tracer:
            with tracer.invoke("a cat"):
                cat = nnsight_lite.save([])
                for step in tracer.iter[:2]:
                    cat.append(sd.unet.output[0])
            with tracer.invoke("a dog"):
                text = sd.text_encoder.output[0].save()  # (the prompts' call: a row a prompt)
                dog = nnsight_lite.save([])
                for step in tracer.iter[:2]:
                    dog.append(sd.unet.output[0])
        texts = []
        handle = plain.text_encoder.register_forward_hook(lambda m, a, o: texts.append(o[0]))
        try:
            _, seen = _plain_batch(plain, ["a cat", "a dog"], 0, num_inference_steps=2)
        finally:
            handle.remove()
        for step in range(2):
            torch.testing.assert_close(cat[step], seen[step][[0, 2]], rtol=0, atol=0)
            torch.testing.assert_close(dog[step], seen[step][[1, 3]], rtol=0, atol=0)
        torch.testing.assert_close(text, texts[0][1:2], rtol=0, atol=0)

    @pytest.mark.parametrize("how", ["in place", "replaced"])
    def test_an_edit_in_one_invoke_changes_only_its_prompts_rows(self, sd, plain, how):
        """Zeroing the dog's UNet output (in place, or by setting a new output) gives the
        images of the plain pipeline with a hook zeroing rows 1 and 3, and the cat's image is
        the unedited run's."""
        with sd.generate(num_inference_steps=2, seed=0, **RUN) as tracer:
            with tracer.invoke("a cat"):
                pass
            with tracer.invoke("a dog"):
                for step in tracer.iter[:2]:
                    if how == "in place":
                        sd.unet.output[0][:] = 0
                    else:
                        sd.unet.output = (torch.zeros_like(sd.unet.output[0]),)
            with tracer.invoke():  # (no input: the whole batch)
                result = tracer.result.save()
        edited, _ = _plain_batch(plain, ["a cat", "a dog"], 0, _zero_rows([1, 3]),
                                 num_inference_steps=2)
        unedited, _ = _plain_batch(plain, ["a cat", "a dog"], 0, num_inference_steps=2)
        assert (result.images == edited.images).all()
        assert (result.images[0] == unedited.images[0]).all()
        assert not (result.images[1] == unedited.images[1]).all()

    def test_several_images_per_prompt(self, sd, plain):
        """``num_images_per_prompt=2``: the UNet's batch is two blocks of 2 x 2 rows; the
        second invoke's rows are 2, 3, 6 and 7, and the images are the plain run's."""
        with sd.generate(num_inference_steps=1, num_images_per_prompt=2, seed=5, **RUN) as tracer:
            with tracer.invoke("a cat"):
                pass
            with tracer.invoke("a dog"):
                dog = sd.unet.output[0].save()
                latents = sd.vae.decoder.conv_in.input.save()  # (the VAE: 2 rows a prompt)
            with tracer.invoke():
                result = tracer.result.save()
        want, seen = _plain_batch(plain, ["a cat", "a dog"], 5, num_inference_steps=1,
                                  num_images_per_prompt=2)
        torch.testing.assert_close(dog, seen[0][[2, 3, 6, 7]], rtol=0, atol=0)
        assert latents.shape[0] == 2
        assert (result.images == want.images).all()

    @pytest.mark.parametrize("guidance", [1.0, 7.5])
    def test_invokes_of_one_two_and_one_prompts_with_three_images_each(self, sd, guidance):
        """nnsight's own batching cases: invokes of 1, 2 and 1 prompts, 3 images a prompt. The
        text encoder's rows are a prompt each (1, 2, 1), the VAE's 3 a prompt, the UNet's 3 a
        prompt in each guidance half (without guidance: one half); each invoke's rows are its
        share of the whole batch (an invoke with no input), and a value each invoke sets lands
        in its rows only."""
        prompts = ["a cat", ["a panda", "a cake"], "a wave"]
        layer = sd.text_encoder.encoder.layers[-1]
        with sd.generate(num_inference_steps=1, num_images_per_prompt=3, seed=4,
                         guidance_scale=guidance, **RUN) as tracer:
            got = nnsight_lite.save([])
            for i, prompt in enumerate(prompts):
                with tracer.invoke(prompt):
                    text = layer.output.save()
                    sd.unet.output = (torch.full_like(sd.unet.output[0], float(i)),)
                    unet = sd.unet.output[0].save()
                    vae = sd.vae.decoder.output.save()
                    got.append((text, unet, vae))
            with tracer.invoke():
                whole = nnsight_lite.save((layer.output, sd.unet.output[0],
                                           sd.vae.decoder.output))
        halves = 2 if guidance > 1 else 1
        first = [0, 1, 3]  # (each invoke's first prompt)
        for i, (text, unet, vae) in enumerate(got):
            n = [1, 2, 1][i]
            torch.testing.assert_close(text, whole[0][first[i]:first[i] + n], rtol=0, atol=0)
            rows = [h * 12 + first[i] * 3 + r for h in range(halves) for r in range(3 * n)]
            assert unet.shape[0] == 3 * n * halves
            assert (whole[1][rows] == float(i)).all() and (unet == float(i)).all()
            torch.testing.assert_close(vae, whole[2][first[i] * 3:(first[i] + n) * 3],
                                       rtol=0, atol=0)

    def test_a_list_in_one_invoke_and_other_keywords_must_agree(self, sd):
        with sd.generate(num_inference_steps=1, seed=0, **RUN) as tracer:
            with tracer.invoke(["a cat", "a dog"]):
                both = sd.unet.output[0].save()
        assert both.shape[0] == 4
        with pytest.raises(InputError, match="'num_inference_steps' different values"):
            with sd.generate(seed=0, **RUN) as tracer:
                with tracer.invoke("a cat", num_inference_steps=1):
                    pass
                with tracer.invoke("a dog", num_inference_steps=2):
                    pass
        with sd.trace("a cat", seed=0, **RUN):  # nothing left behind
            again = sd.output.save()
        assert again.images.shape == (1, 8, 8, 3)


def test_cache_and_rename(sd_dir, sd):
    """``tracer.cache(modules=[sd.unet])`` keeps the UNet's output at each step; a renamed
    component reads the same values."""
    with sd.generate("a cat", num_inference_steps=2, seed=3, **RUN) as tracer:
        cache = tracer.cache(modules=[sd.unet]).save()
        for step in tracer.iter[:2]:
            direct = sd.unet.output[0].save()
    steps = cache["model.unet"].output  # (a list: one value per call, as in nnsight)
    assert len(steps) == 2
    torch.testing.assert_close(steps[1][0], direct, rtol=0, atol=0)
    renamed = _load(sd_dir, rename={"unet": "denoiser"})
    with renamed.generate("a cat", num_inference_steps=2, seed=3, **RUN) as tracer:
        for step in tracer.iter[:2]:
            last = renamed.denoiser.output[0].save()
    torch.testing.assert_close(last, direct, rtol=0, atol=0)


def test_a_dropped_model_and_its_pipeline_are_freed(sd_dir):
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):
            model = _load(sd_dir)
            with model.trace("a cat", seed=0, **RUN):
                out = model.output.save()
            refs = [weakref.ref(model), weakref.ref(model.pipeline),
                    weakref.ref(model.pipeline.unet)]
            del model, out
            assert [r() for r in refs] == [None] * 3
    finally:
        gc.enable()


def test_tiled_edits_of_traces_on_two_threads_are_each_written_back(sd_dir, plain):
    """Two threads trace two DiffusionModels at once, each zeroing its dog's UNet rows in place
    (a copy: tiles.Tiles). Thread A's body edits and finishes while B's body still holds its
    copy; B's edit must still be written back (before: the copies served were one list for the
    process, so A's write-back dropped B's pending copy and B's edit was lost). Both images
    equal the plain pipeline with a hook zeroing rows 1 and 3."""
    import threading

    models = [_load(sd_dir), _load(sd_dir)]
    a_holds, b_holds, a_done = threading.Event(), threading.Event(), threading.Event()
    results, errors = {}, []

    def run(name, model, hold, wait_for, then_set):
        try:
            with model.generate(num_inference_steps=1, seed=0, **RUN) as tracer:
                with tracer.invoke("a cat"):
                    pass
                with tracer.invoke("a dog"):
                    x = model.unet.output[0]
                    hold.set()
                    assert wait_for.wait(30)
                    x[:] = 0
                with tracer.invoke():
                    out = tracer.result.save()
            results[name] = out.images
        except BaseException as err:  # noqa: BLE001 - (reported below)
            errors.append(err)
        finally:
            if then_set is not None:
                then_set.set()
            hold.set()

    def start_b():
        assert a_holds.wait(30)
        run("b", models[1], b_holds, a_done, None)

    ta = threading.Thread(target=run, args=("a", models[0], a_holds, b_holds, a_done))
    tb = threading.Thread(target=start_b)
    ta.start()
    tb.start()
    ta.join(60)
    tb.join(60)
    assert not errors, errors
    want, _ = _plain_batch(plain, ["a cat", "a dog"], 0, _zero_rows([1, 3]),
                           num_inference_steps=1)
    assert (results["a"] == want.images).all()
    assert (results["b"] == want.images).all()
    assert not nnsight_lite.tiles._TILED
