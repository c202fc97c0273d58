"""Image-text models: ``TransformersModel(path, task="image-text-to-text")`` and nnsight's older
``VisionLanguageModel``, on a tiny LLaVA saved offline (remote/testing.save_tiny_llava), checked
against the plain Hugging Face model run on the processor's encoding."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
np = pytest.importorskip("numpy")

import nnsight_lite  # noqa: E402
from nnsight_lite import InputError, LanguageModel, TransformersModel  # noqa: E402
from nnsight_lite.remote.testing import save_tiny, save_tiny_gpt2, save_tiny_llava  # noqa: E402

PROMPT = "<image>hello"
OTHER = "<image>hi there"


def _image(seed):
    pixels = np.random.RandomState(seed).rand(32, 32, 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    transformers.utils.logging.disable_progress_bar()
    with warnings.catch_warnings():  # (no torchvision: the PIL image processor, with a warning)
        warnings.simplefilter("ignore")
        return save_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def plain(llava_dir):
    """The plain HF model and processor."""
    hf = transformers.AutoModelForImageTextToText.from_pretrained(llava_dir).eval()
    return hf, transformers.AutoProcessor.from_pretrained(llava_dir)


@pytest.fixture(scope="module")
def model(llava_dir):
    return TransformersModel(llava_dir, task="image-text-to-text")


def _forward(plain, text, image, hook_on=None, hook=None):
    """Plain HF logits of one prompt and image, and what a forward hook on ``hook_on`` (a path
    in the HF model) saw or returned."""
    hf, proc = plain
    enc = proc(text=text, images=image, return_tensors="pt")
    seen = []
    handle = None
    if hook_on is not None:
        def keep(module, args, out):
            new = hook(out) if hook is not None else None
            seen.append(out if new is None else new)
            return new
        handle = hf.get_submodule(hook_on).register_forward_hook(keep)
    try:
        with torch.no_grad():
            logits = hf(**enc).logits
    finally:
        if handle is not None:
            handle.remove()
    return logits, seen


class TestTrace:
    def test_a_prompt_and_its_image_go_through_the_processor(self, model, plain):
        """``model.trace(prompt, images=[img])`` runs the processor: the logits and the
        projector's output are the plain model's on the processor's encoding; the loaded model
        and processor are the task's (its tokenizer pads on the left)."""
        img = _image(0)
        with model.trace(PROMPT, images=[img]):
            proj = model.model.multi_modal_projector.output.save()
            logits = model.output.logits.save()
        ref, seen = _forward(plain, PROMPT, img, "model.multi_modal_projector")
        torch.testing.assert_close(logits, ref, rtol=0, atol=0)
        torch.testing.assert_close(proj, seen[0], rtol=0, atol=0)
        assert isinstance(model._model, transformers.LlavaForConditionalGeneration)
        assert type(model.processor).__name__ == "LlavaProcessor"
        assert model.tokenizer is model.processor.tokenizer
        assert model.tokenizer.padding_side == "left"
        assert model.task == "image-text-to-text"

    def test_text_keyword_single_image_and_an_encoding_agree(self, model, plain):
        """The prompt as ``text=``, one image not in a list, and the processor's encoding
        passed in (as nnsight takes them) give the same logits."""
        img = _image(1)
        ref, _ = _forward(plain, PROMPT, img)
        with model.trace(text=PROMPT, images=img):
            a = model.output.logits.save()
        enc = model.processor(text=PROMPT, images=img, return_tensors="pt")
        with model.trace(enc):
            b = model.output.logits.save()
        with model.trace(**enc):
            c = model.output.logits.save()
        for got in (a, b, c):
            torch.testing.assert_close(got, ref, rtol=0, atol=0)

    def test_invokes_with_images_batch_and_edit_their_own_rows(self, model, plain):
        """Two invokes, each a prompt and an image, run as one left-padded batch: each gets
        the plain model's logits of its own prompt, and zeroing the projector's output in the
        second changes its logits as a hook doing it on that prompt alone does, the first's
        not at all (nnsight 0.8.1 raises NotImplementedError for several media invokes)."""
        a_img, b_img = _image(2), _image(3)
        ref_a, _ = _forward(plain, PROMPT, a_img)
        ref_b, _ = _forward(plain, OTHER, b_img, "model.multi_modal_projector",
                            lambda out: torch.zeros_like(out))
        with model.trace() as tracer:
            with tracer.invoke(PROMPT, images=[a_img]):
                a = model.output.logits.save()
            with tracer.invoke(OTHER, images=[b_img]):
                model.model.multi_modal_projector.output[:] = 0
                b = model.output.logits.save()
        n = ref_a.shape[1]
        assert a.shape[1] == b.shape[1] == ref_b.shape[1] > n  # (the first is left-padded)
        torch.testing.assert_close(a[:, -n:], ref_a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b, ref_b, rtol=1e-5, atol=1e-5)

    def test_a_list_of_prompts_with_their_images(self, model, plain):
        """One invoke of two prompts and two images: a padded batch of two rows, each the
        plain model's logits of its prompt."""
        imgs = [_image(4), _image(5)]
        with model.trace([PROMPT, OTHER], images=imgs):
            logits = model.output.logits.save()
        assert logits.shape[0] == 2
        for row, (text, img) in enumerate(zip([PROMPT, OTHER], imgs)):
            ref, _ = _forward(plain, text, img)
            torch.testing.assert_close(logits[row, -ref.shape[1]:], ref[0], rtol=1e-5, atol=1e-5)


class TestGenerate:
    def test_generate_with_an_image_gives_plain_generate_s_ids(self, model, plain):
        """``model.generate(prompt, images=[img], max_new_tokens=3)``: ``tracer.result`` is
        plain HF generate's ids on the processor's encoding, and a module's output is readable
        at every step (the language model's last layer: prompt, then one position a step)."""
        hf, proc = plain
        img = _image(6)
        enc = proc(text=PROMPT, images=img, return_tensors="pt")
        want = hf.generate(**enc, max_new_tokens=3, do_sample=False)
        with model.generate(PROMPT, images=[img], max_new_tokens=3, do_sample=False) as tracer:
            widths = nnsight_lite.save([])
            for step in tracer.all():
                widths.append(model.model.language_model.layers[-1].output.shape[1])
            ids = tracer.result.save()
        torch.testing.assert_close(ids, want, rtol=0, atol=0)
        assert widths == [enc["input_ids"].shape[1], 1, 1]

    def test_vision_language_model_is_the_deprecated_name(self, llava_dir, plain):
        """``VisionLanguageModel(path)`` (nnsight_lite and nnsight_lite.modeling.vlm) warns
        NNsightDeprecationWarning at the caller's line and is the image-text-to-text model;
        its ``generate(text=..., images=...)`` gives plain generate's ids."""
        from nnsight_lite.modeling.vlm import VisionLanguageModel

        assert VisionLanguageModel is nnsight_lite.VisionLanguageModel
        with pytest.warns(nnsight_lite.NNsightDeprecationWarning, match="TransformersModel") \
                as record:
            vm = VisionLanguageModel(llava_dir, dispatch=True)
        assert record[0].filename == __file__
        hf, proc = plain
        img = _image(7)
        want = hf.generate(**proc(text=PROMPT, images=img, return_tensors="pt"),
                           max_new_tokens=3, do_sample=False)
        with vm.generate(text=PROMPT, images=[img], max_new_tokens=3, do_sample=False) as tracer:
            ids = tracer.result.save()
        torch.testing.assert_close(ids, want, rtol=0, atol=0)


class TestMistakes:
    def test_the_prompt_twice(self, model):
        with pytest.raises(InputError, match="both positionally and as text="):
            with model.trace(PROMPT, text=PROMPT, images=[_image(0)]):
                pass

    def test_images_for_a_model_without_a_processor(self, tmp_path):
        """A text model given ``images=`` says which task or processor takes them (before: the
        forward's TypeError about an unexpected keyword)."""
        lm = LanguageModel(save_tiny_gpt2(tmp_path / "gpt2"))
        assert lm.task == "text-generation" and lm.processor is None
        with pytest.raises(InputError, match=r"no processor for \['images'\].*"
                                             r"task='image-text-to-text'"):
            with lm.trace("hello", images=[_image(0)]):
                pass
        with lm.trace("hello"):  # nothing left behind
            out = lm.output.logits.save()
        assert out.shape[:2] == (1, 5)

    def test_a_text_only_invoke_beside_an_image_invoke_says_what_to_do(self, model):
        """A text-only invoke and an image invoke cannot be one batch: the error names the
        keys that differ and says to give images to every invoke or trace apart (before: the
        keys only); nothing is left behind."""
        from nnsight_lite import BatchingError

        with pytest.raises(BatchingError, match=r"invoke 0: \[\], invoke 1: \['pixel_values'\]"
                                                r".*images= in every invoke or in none"):
            with model.trace() as tracer:
                with tracer.invoke("hello"):
                    pass
                with tracer.invoke(PROMPT, images=[_image(0)]):
                    pass
        with model.trace("hello"):
            out = model.output.logits.save()
        assert out.shape[0] == 1

    def test_a_peft_adapter_is_refused_at_once(self, llava_dir):
        """``peft=`` (nnsight 0.8's adapter keyword) says how to load the adapter yourself,
        when the model is made (before: passed to from_pretrained at the first trace)."""
        with pytest.raises(InputError, match="PeftModel.from_pretrained"):
            TransformersModel(llava_dir, task="image-text-to-text", peft="some/adapter")

    def test_an_unknown_task(self, llava_dir):
        with pytest.raises(ValueError, match="task='image-to-nonsense'"):
            TransformersModel(llava_dir, task="image-to-nonsense")


def test_a_text_task_loads_its_auto_class(tmp_path):
    """``task="text-classification"`` loads AutoModelForSequenceClassification (nnsight 0.8's
    way to pick the class; before: ValueError), traced against the plain model."""
    from nnsight_lite.remote.testing import char_tokenizer

    tok = char_tokenizer()
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=len(tok),
                                     n_positions=64, num_labels=3, pad_token_id=0)
    torch.manual_seed(0)
    save_tiny(transformers.GPT2ForSequenceClassification(config).eval(), tok, tmp_path)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    model = TransformersModel(tmp_path, task="text-classification")
    with model.trace("hello"):
        h = model.transformer.h[0].output.save()
        logits = model.output.logits.save()
    seen = []
    handle = hf.transformer.h[0].register_forward_hook(lambda m, a, o: seen.append(o))
    try:
        ref = hf(**tok("hello", return_tensors="pt")).logits
    finally:
        handle.remove()
    assert type(model._model) is transformers.GPT2ForSequenceClassification
    torch.testing.assert_close(logits, ref, rtol=0, atol=0)
    torch.testing.assert_close(h, seen[0], rtol=0, atol=0)


def test_a_processor_set_on_a_model_loaded_without_one(llava_dir, plain):
    """``model.processor = AutoProcessor...`` on a model loaded by class (``automodel=``, no
    task) makes ``images=`` go through it (before: set on the HF module, and images= raised)."""
    model = LanguageModel(llava_dir, automodel="AutoModelForImageTextToText")
    assert model.processor is None
    model.processor = plain[1]
    img = _image(8)
    with model.trace(PROMPT, images=[img]):
        logits = model.output.logits.save()
    ref, _ = _forward(plain, PROMPT, img)
    torch.testing.assert_close(logits, ref, rtol=0, atol=0)
    assert not hasattr(model._model, "processor")


def test_a_dropped_image_text_model_is_freed(llava_dir):
    """The model, its HF module and the processor go when the user drops the wrapper, after a
    trace with an image (weakrefs, garbage collection off)."""
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):
            model = TransformersModel(llava_dir, task="image-text-to-text")
            with model.trace(PROMPT, images=[_image(0)]):
                out = model.output.logits.save()
            refs = [weakref.ref(model), weakref.ref(model._model),
                    weakref.ref(model.processor)]
            del model, out
            assert [r() for r in refs] == [None] * 3
    finally:
        gc.enable()


def _tiny_qwen2_vl():
    """A tiny Qwen2-VL (multimodal RoPE) from a config, its image processor and tokenizer (its
    processor needs torchvision for videos: encodings are made here as it makes them)."""
    from nnsight_lite.remote.testing import char_tokenizer

    special = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": special})
    start, end, pad, video = tok.convert_tokens_to_ids(special)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        images = transformers.Qwen2VLImageProcessor(
            min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 4, patch_size=14, merge_size=2,
            temporal_patch_size=2)
    config = transformers.Qwen2VLConfig(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                         max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1],
                                          "rope_theta": 10000.0}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=pad, video_token_id=video, vision_start_token_id=start,
        vision_end_token_id=end)
    torch.manual_seed(0)
    hf = transformers.Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)

    def encode(text, seed):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pixels = images(images=_image(seed).resize((56, 56)), return_tensors="pt")
        n = int(pixels["image_grid_thw"].prod()) // 4
        enc = tok("<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>" + text,
                  return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                "mm_token_type_ids": (enc["input_ids"] == pad).long(), **pixels}

    return hf, tok, encode


def test_invokes_of_a_multimodal_rope_model_get_their_own_positions():
    """Qwen2-VL works its 3-D (M-RoPE) positions out of the attention mask and the image grid:
    two invokes of different lengths, each an encoding with an image, give each the plain
    model's logits on its encoding alone. Before: the per-token ``mm_token_type_ids`` of the
    shorter one was not padded (BatchingError), and the batch got plain 2-D position ids from
    the padding (logits off by ~6)."""
    hf, tok, encode = _tiny_qwen2_vl()
    a, b = encode("hello", 0), encode("hi there you", 1)
    with torch.no_grad():
        ref_a, ref_b = hf(**a).logits, hf(**b).logits
    model = LanguageModel(hf, tokenizer=tok)
    with model.trace() as tracer:
        with tracer.invoke(a):
            got_a = model.output.logits.save()
        with tracer.invoke(b):
            got_b = model.output.logits.save()
    n = ref_a.shape[1]
    assert got_a.shape[1] == ref_b.shape[1] > n
    torch.testing.assert_close(got_a[:, -n:], ref_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_b, ref_b, rtol=1e-5, atol=1e-5)


class TestMisalignedMedia:
    """The vision tower and projector have a row an image. Where several invokes' images add
    up to their prompts but one prompt has two images and another none, those values look
    batch-shaped and each invoke would be served rows that are not its images: a warning says
    so (found in review: the plain model's projector output for the first prompt has two rows,
    its invoke was served one, and the second invoke was served the first's second image)."""

    TWO = "<image><image>two"

    def test_images_that_add_up_to_the_prompts_but_not_per_invoke_warn(self, model, plain):
        a_img, b_img, c_img = _image(6), _image(7), _image(8)
        _, seen = _forward(plain, self.TWO, [a_img, b_img], "model.multi_modal_projector")
        with pytest.warns(UserWarning, match=r"'pixel_values' have \[2, 1\] rows \(images\) "
                                             r"for \[1, 2\] prompts .*trace of one invoke"):
            with model.trace() as tracer:
                with tracer.invoke(self.TWO, images=[a_img, b_img]):
                    a = model.model.multi_modal_projector.output.save()
                with tracer.invoke(["<image>x", "y"], images=[c_img]):
                    b = model.model.multi_modal_projector.output.save()
        assert seen[0].shape[0] == 2 and a.shape[0] == 1  # (what the warning is about)
        torch.testing.assert_close(b[0], seen[0][1], rtol=1e-5, atol=1e-5)

    def test_one_image_a_prompt_does_not_warn(self, model):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            with model.trace() as tracer:
                with tracer.invoke(PROMPT, images=[_image(6)]):
                    pass
                with tracer.invoke([PROMPT, OTHER], images=[_image(7), _image(8)]):
                    pass


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% for c in m['content'] %}"
                 "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}"
                 "{% endfor %} | {% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def test_chat_messages_with_images_go_through_the_processor_s_template(llava_dir, plain):
    """Chat messages given with ``images=`` are templated by the processor (the generation
    prompt added, as the image-text-to-text pipeline does) and then processed with the images:
    the plain model's logits on ``proc(text=proc.apply_chat_template(...), images=...)``.
    Without a template the error says to set one or pass text. (Found in review: the messages
    went to the processor as text, whose ValueError said only that text must be strings.)"""
    hf, proc = plain
    img = _image(9)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    model = TransformersModel(llava_dir, task="image-text-to-text")
    with pytest.raises(InputError, match="processor's chat template.*has none.*"
                                         "model.processor.chat_template"):
        with model.trace(msgs, images=[img]):
            pass
    model.processor.chat_template = CHAT_TEMPLATE
    with model.trace(msgs, images=[img]):
        got = model.output.logits.save()
    proc = transformers.AutoProcessor.from_pretrained(llava_dir)
    proc.chat_template = CHAT_TEMPLATE
    text = proc.apply_chat_template(msgs, add_generation_prompt=True)
    assert text == "user: <image>hi | assistant:"
    with torch.no_grad():
        want = hf(**proc(text=text, images=[img], return_tensors="pt")).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
