"""``LanguageModel``: a Hugging Face causal LM and its tokenizer, traced like any module.

    LanguageModel(path_or_model, tokenizer=None, dispatch=False, **from_pretrained_kwargs)
        .trace(prompt)      one batched forward; prompts are tokenized and padded (left)
        .generate(prompt, max_new_tokens=k)   HF generate with the body at every step
        .tokenizer          the tokenizer
        .generator.output   the generated ids (inside a generate body, after its loop)
        .generator.streamer.output   the tokens as generate makes them (prompt, then one a step);
                            ``generate(..., streamer=TextIteratorStreamer(tok))`` streams them out
        .dispatch()         load the real weights now (otherwise: on first trace/generate/call)
    Generator           the tracer ``model.generate(...)`` returns (generation.py)

Loading (the tree on the meta device, the weights at first use, ``dispatch``) is
lazy_weights.py's; tokenizing and batching prompts, prompts.py's.

Inputs (to ``trace``, ``invoke`` and ``generate``): a string, a list of strings, token ids (a
list of ints, a list of lists, a 1-D or 2-D integer tensor), or a dict / ``BatchEncoding`` with
``input_ids`` (and optionally ``attention_mask``), which may also come as keywords
(``model.generate(**tokenizer(prompt, return_tensors="pt"))``); or embeddings,
``inputs_embeds=`` a (batch, positions, hidden) float tensor (with ``attention_mask`` if some
positions are padding; invokes given embeddings batch together, not with token prompts).
Keyword arguments the tokenizer understands (``max_length``, ``truncation``,
``add_special_tokens``, ...) go to the tokenizer, per invoke; the others go to the model's
forward (``trace``) or to HF ``generate`` (``generate``). A keyword given both to
``trace()``/``generate()`` and to an invoke applies to the whole batch with the call's value.

Batching (every invoke's rows padded to one length on the tokenizer's side, position ids
from the mask where the forward takes them) is language_inputs.py's.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings

import torch

from . import processors, prompts
from .envoy import Envoy
from .envoy_names import _module_first
from .errors import InputError
from .generation import Generator, _GeneratorEnvoy, _GeneratorOutput
from .language_inputs import LanguageInputs
from .lazy_weights import LazyWeights, _auto_class
from .model import NNsight
from .processors import ModelInfo
from .remote.hook import take_backend, wants_remote
from .tracing import Tracer
from .with_calls import _called_as_context
from .workers import user_location

# (a mask alone is no prompt; media go to the processor with the prompt, or are one)
_PROMPT_KWARGS = frozenset({"input_ids", "inputs_embeds"}) | processors.MEDIA_KWARGS
# generate's options, which the forward a trace runs takes and ignores (trace warns)
_GENERATE_ONLY = frozenset({"max_new_tokens", "min_new_tokens", "do_sample", "num_beams",
                            "num_return_sequences", "temperature", "top_k", "top_p", "streamer"})


def _keywords_only(call: str, inputs: tuple, kwargs: dict) -> bool:
    """Whether ``model.<call>(...)`` was given keywords but no input (no prompt, ``input_ids``
    or ``inputs_embeds``): they are for the forward (or generate) of the batch its invokes make,
    an ``attention_mask`` too (it replaces the mask of the padded batch; nnsight does so in a
    trace). Tokenizer options there raise InputError."""
    prompts.drop_none_mask(kwargs)
    if inputs or not kwargs or not _PROMPT_KWARGS.isdisjoint(kwargs):
        return False
    tok = sorted(k for k in kwargs if k in prompts.TOKENIZER_KWARGS)
    if tok:
        raise InputError(
            f"model.{call}() was given tokenizer options {tok} but no prompt; without a prompt "
            f"model.{call}() takes {'generate' if call == 'generate' else 'forward'} keywords "
            "only: give tokenizer options to each tracer.invoke(prompt, ...) that should use them"
        )
    return True


class LanguageModel(ModelInfo, LazyWeights, LanguageInputs, NNsight):
    """A Hugging Face causal LM with its tokenizer, traced with ``with model.trace(prompt):``.

    Example::

        from nnsight_lite import LanguageModel
        from nnsight_lite.models import smollm2_path

        model = LanguageModel(smollm2_path())      # any local dir or hub id; meta: no weights yet
        with model.trace("The Eiffel Tower is in the city of"):
            hidden = model.model.layers[-1].output.save()        # Llama; GPT-2: transformer.h
            logits = model.lm_head.output.save()
        print(model.tokenizer.decode(logits[0, -1].argmax()))     # ' Paris'

        with model.generate("Hello", max_new_tokens=5) as tracer:
            ids = model.generator.output.save()
        print(model.tokenizer.decode(tracer.result[0]))

    ``model`` is a local directory or hub id (loaded with ``AutoModelForCausalLM``), or an
    already built ``PreTrainedModel`` (without ``tokenizer`` it takes token ids only; a text
    prompt then raises ``InputError``).

    - ``tokenizer``: a tokenizer to use instead of loading one from ``model``'s directory.
    - ``dispatch``: load the weights now. Without it the model is built on the meta device
      (no weight memory): it can be printed, scanned and traced code can be written; the
      weights load on the first ``trace``, ``generate`` or call.
    - ``dtype`` (or the older ``torch_dtype``), ``device_map`` ("auto" needs accelerate) and
      any other keyword: passed to ``from_pretrained``; ``device`` ("cpu", "cuda:0", as
      nnsight takes it): the device the loaded model is moved to.
    - ``tokenizer_kwargs``: passed to ``AutoTokenizer.from_pretrained``; with ``tokenizer``
      given, set as its attributes (``{"padding_side": "right"}``), as nnsight 0.8 does.
    - ``task``: nnsight 0.8's way to pick the model class: a pipeline task of transformers
      (``"text-generation"``, the default; ``"text-classification"``, ``"fill-mask"``...)
      loads with that task's auto class; a task whose inputs are not text alone
      (``"image-text-to-text"``) loads the checkpoint's processor too, and invokes take
      ``images=`` (``videos=``, ``audio=``; the prompt also as ``text=``) through it.
    - ``processor``: a processor to use instead of loading one (its tokenizer is the model's
      unless ``tokenizer`` is given).
    - ``automodel``: the class to load with (default ``AutoModelForCausalLM``): an auto class
      (``AutoModelForSeq2SeqLM``, ``AutoModel``), a model class (``LlamaForCausalLM``) or the
      name of either in ``transformers`` (``automodel="AutoModelForSeq2SeqLM"``, as in nnsight).

    A tokenizer without a pad token gets its eos token as pad token, with a warning (what HF
    users do); prompts are padded on the tokenizer's side: the left, since a tokenizer passed
    in is set to pad on the left and one loaded pads there unless ``tokenizer_kwargs`` say
    ``"padding_side": "right"`` (``model.tokenizer(prompts, padding=True)`` and the invokes'
    batch keep each last token at ``[:, -1]``).
    """

    def __init__(self, model, *, tokenizer=None, dispatch: bool = False, automodel=None,
                 tokenizer_kwargs: dict | None = None, rename: dict | None = None,
                 envoys: dict | None = None, task: str | None = None, processor=None, **kwargs):
        if kwargs.get("peft") is not None:
            raise InputError(
                f"{type(self).__name__}(..., peft=...): PEFT adapters are not loaded by "
                "nnsight_lite; load the model with its adapter yourself (peft's "
                "PeftModel.from_pretrained(base_model, adapter)) and wrap the result: "
                f"{type(self).__name__}(peft_model, tokenizer=tokenizer)")
        kwargs.pop("peft", None)
        d = self.__dict__
        d["_task"] = task
        if task not in (None, "text-generation") and automodel is None:
            automodel = processors.task_class(task)  # (its auto class; ValueError if unknown)
        if processor is None and isinstance(model, (str, os.PathLike)) and \
                processors.takes_processor(task):
            processor = processors.load_processor(os.fspath(model), tokenizer_kwargs)
        d["_processor"] = processor
        if tokenizer is None and processor is not None:
            tokenizer = getattr(processor, "tokenizer", None)
        if tokenizer is not None:
            if getattr(tokenizer, "padding_side", "left") != "left":
                tokenizer.padding_side = "left"  # as nnsight does to a tokenizer it is given
            for key, value in (tokenizer_kwargs or {}).items():
                setattr(tokenizer, key, value)  # ({"padding_side": "right"}: as nnsight 0.8)
        d["_load_kwargs"] = kwargs
        d["_automodel"] = _auto_class(automodel)
        if isinstance(model, (str, os.PathLike)):
            source = os.fspath(model)
            d["_source"] = source
            if tokenizer is None:
                from transformers import AutoTokenizer

                # left padding unless asked otherwise, as nnsight loads it: a batch the user
                # pads with model.tokenizer keeps each prompt's last token at [:, -1]
                kw = {"padding_side": "left", **(tokenizer_kwargs or {})}
                tokenizer = AutoTokenizer.from_pretrained(source, **kw)
            if dispatch:
                module = self._load()
            else:
                module = self._build_meta()
        elif isinstance(model, torch.nn.Module):
            if kwargs:
                raise TypeError(
                    f"LanguageModel got an already built {type(model).__name__} and loading "
                    f"options {sorted(kwargs)}; loading options apply to a path or hub id only "
                    "(move or cast the model yourself before wrapping it)"
                )
            # (no tokenizer: token-id prompts work; a text prompt says to give one)
            d["_source"] = None
            module = model
        else:
            raise TypeError(
                "LanguageModel(model) takes a directory, a hub id or a torch.nn.Module, got "
                f"{type(model).__name__}"
            )
        super().__init__(module, rename=rename, envoys=envoys)
        d["_tokenizer"] = prompts.with_pad_token(tokenizer)
        d["_generator_module"] = _GeneratorOutput()
        d["_generator"] = _GeneratorEnvoy(d["_generator_module"], "model.generator")

    # ---- the tokenizer and the generator

    @property
    def tokenizer(self):
        """The tokenizer prompts go through (its padding side, left unless set otherwise, is
        the batch's; a pad token is always set)."""
        return self._tokenizer

    @property
    def generator(self) -> Envoy:
        """``model.generator.output``: the ids ``generate`` returns, readable in its body once
        generation is over (after the body's step loop)."""
        return self._generator

    @_module_first
    def pipeline(self):
        """The Hugging Face pipeline of the model's task (text-generation unless loaded with
        another ``task=``) over this model and its tokenizer (and processor, where it has one),
        made once per module; the weights load first. nnsight 0.8's ``model.pipeline``."""
        self.dispatch()
        d = self.__dict__
        made = d.get("_pipe")
        if made is None or made[0] is not self._module:
            from transformers import pipeline

            parts = {"tokenizer": self.tokenizer}
            if self.processor is not None:
                parts["processor"] = self.processor
            made = d["_pipe"] = (self._module, pipeline(
                self.task, model=self._module, **parts))
        return made[1]

    @_module_first
    def pipe(self):
        """nnsight 0.8's ``model.pipe(prompt, **kwargs)``: the text-generation pipeline end to
        end, for decoded records (``[{"generated_text": ...}]``) where ``generate`` gives token
        ids. Called plainly it returns them (no trace: persistent edits do not apply); as
        ``with model.pipe(prompt, max_new_tokens=k) as tracer:`` the block's body runs in every
        forward the pipeline makes, as in a generate, and ``tracer.result`` is the records.

        Example::

            with model.pipe("The Eiffel Tower is in", max_new_tokens=3) as tracer:
                logits = nnsight_lite.save([])
                for step in tracer.all():
                    logits.append(model.lm_head.output[:, -1])
                text = tracer.result.save()
        """
        return self._pipe_call

    def _pipe_call(self, *inputs, **kwargs):
        # (remote=False / backend=None, as a trace takes them, are not the pipeline's)
        if kwargs.pop("remote", False) or kwargs.pop("backend", None) is not None:
            raise InputError("model.pipe runs here only; a remote block: `with model.generate("
                             "prompt, remote=True):`, decoding its ids with model.tokenizer")
        if not _called_as_context(sys._getframe(1)):
            return self.pipeline(*inputs, **kwargs)
        from .generation import Piper

        self.dispatch()
        return Piper(self, inputs, kwargs)

    def __setattr__(self, name, value):
        if name == "tokenizer":
            self.__dict__["_tokenizer"] = prompts.with_pad_token(value)
            return
        if name == "processor":  # (media keywords go through it from now on)
            self.__dict__["_processor"] = value
            return
        super().__setattr__(name, value)

    # ---- contexts

    def trace(self, *inputs, trace: bool = True, **kwargs):
        """``with model.trace(prompt, **kwargs) as tracer:`` - one batched forward.

        Example::

            with model.trace(["Hello world", "Hi"]):        # one invoke, two rows
                logits = model.lm_head.output.save()

        Given no input (no prompt, ``input_ids`` or ``inputs_embeds``), its keywords go to the
        forward of the batch the invokes make (``model.trace(use_cache=False)``; an
        ``attention_mask`` replaces the padded batch's); an invoke's keyword of the same name
        yields to them (a warning says so where the values differ). With ``trace=False`` it
        runs the plain forward on the tokenized inputs and returns the model's output.
        """
        if not (kwargs and wants_remote(kwargs)):  # remote: the weights stay on the server
            self.dispatch()
        if gen := [k for k in kwargs if k in _GENERATE_ONLY]:  # (nnsight ignores them silently)
            warnings.warn(
                f"model.trace(..., {gen[0]}=...) at {user_location()} runs one forward, which "
                f"ignores {', '.join(gen)}: to generate several tokens, use `with "
                f"model.generate(prompt, {gen[0]}=...) as tracer:`", UserWarning, stacklevel=2)
        if not trace:
            args, kw, _ = self._batch_inputs([self._prepare_inputs(*inputs, **kwargs)])
            return self._run_forward(args, kw)
        if _keywords_only("trace", inputs, kwargs):
            return Tracer(self, (), {}, forward=kwargs)
        return super().trace(*inputs, **kwargs)

    def scan(self, *inputs, **kwargs):
        """``model.scan(...)``: ``trace`` on fake tensors (see :meth:`NNsight.scan`); given no
        input, its keywords go to the forward of the invokes' batch, as in ``trace``."""
        if _keywords_only("scan", inputs, kwargs):
            return Tracer(self, (), {}, scan=True, forward=kwargs)
        return super().scan(*inputs, **kwargs)

    def edit(self, *, inplace: bool = False):
        """``with model.edit() as edited:`` - see :meth:`NNsight.edit`. The edited copy and this
        model share one set of weights; on a model still on meta neither loads them until one of
        them is used locally (a remote trace of either never does)."""
        editor = super().edit(inplace=inplace)
        if not inplace and not self.dispatched:
            editor._target.__dict__["_weights_from"] = self
        return editor

    def generate(self, *inputs, trace: bool = True, **kwargs) -> "Generator":
        """``with model.generate(prompt, max_new_tokens=k, **generate_kwargs) as tracer:``.

        Example::

            with model.generate("The Eiffel Tower is in", max_new_tokens=3) as tracer:
                logits = nnsight_lite.save([model.lm_head.output])   # step 0 (the prompt)
                for step in tracer.iter[1:]:                         # steps 1, 2
                    logits.append(model.lm_head.output)
                ids = model.generator.output.save()                 # prompt + 3 new tokens
            print(len(logits), tracer.result.shape)

        Runs HF ``generate`` once with the body interleaved at every step: a module's call
        ``i`` is generation step ``i``, addressed with ``.next()``, ``tracer.iter[...]`` or
        ``tracer.all()``. Tokenizer keywords go to the tokenizer, every other keyword to
        ``generate`` (``max_length`` too: here it is generate's total length; give it to
        ``tracer.invoke`` to truncate a prompt); an invoke's keyword that is also given here
        yields to this one (with a warning where the values differ). Without
        ``max_new_tokens``/``max_length`` the model's generation config decides the length, as
        with HF ``generate``. Called without a ``with`` (or with ``trace=False``) it returns
        generate's output directly.
        """
        # max_length means generate's total length here; per-invoke truncation can still use it
        # (input_ids=..., attention_mask=...: the prompt, as `generate(**tokenizer(...))` gives it)
        tok, gen = {}, {}
        for k, v in kwargs.items():
            (tok if k in prompts.INPUT_KWARGS or k in processors.MEDIA_KWARGS or
             k in prompts.TOKENIZER_KWARGS and k != "max_length" else gen)[k] = v
        prompts.drop_none_mask(tok)
        if "attention_mask" in tok and not inputs and tok.keys().isdisjoint(_PROMPT_KWARGS):
            gen["attention_mask"] = tok.pop("attention_mask")  # (the invokes' batch's mask)
        _keywords_only("generate", inputs, tok)  # (tokenizer options without a prompt: raises)
        backend = take_backend(gen) if gen else None  # remote: the weights stay on the server
        if backend is None or backend.local:
            self.dispatch()
        elif not trace or not _called_as_context(sys._getframe(1)):
            raise InputError("a remote generate runs as a with-block: `with model.generate("
                             "prompt, remote=True): ...`, saving what it needs")
        if not trace or not _called_as_context(sys._getframe(1)):
            # `ids = model.generate(prompt)` without a with-block: the ids, as HF (and nnsight)
            args, kw, _ = self._batch_inputs([self._prepare_inputs(*inputs, **tok)])
            return self._run_generate(args, kw, gen)
        generator = Generator(self, inputs, tok, gen)
        generator._backend = backend
        return generator

    def __call__(self, *args, **kwargs):
        self.dispatch()
        return self._module(*args, **kwargs)

    # ---- pickling

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_emb_hit", None)  # (weak references: asked again after unpickling)
        state.pop("_pipe", None)  # (model.pipe's pipeline: made again when asked)
        return state

    # ---- generation

    def _run_generate(self, args: tuple, kwargs: dict, gen: dict):
        """HF ``generate`` on the batched inputs (its defaults: the model's generation config)."""
        gen = dict(gen)
        given = gen.get("generation_config")
        if gen.get("pad_token_id") is None and getattr(given, "pad_token_id", None) is None:
            config = getattr(self._module, "generation_config", None)
            if getattr(config, "pad_token_id", None) is None:
                pad = prompts._pad_id(self.tokenizer)
                if given is None:
                    gen["pad_token_id"] = pad
                else:  # (into a copy of the user's config: HF warns at a config plus keywords)
                    gen["generation_config"] = given = copy.deepcopy(given)
                    given.pad_token_id = pad
        kwargs = {**kwargs, **gen}  # (generate()'s attention_mask replaces the batch's)
        kwargs.pop("position_ids", None)  # generate makes its own from the attention mask
        return self._module.generate(*args, **kwargs)

    def _no_such(self, name: str):
        err = super()._no_such(name)
        hint = _ARCH_HINTS.get(name)
        if hint is not None:
            err.args = (f"{err.args[0]} {hint}",)
        return err


# --------------------------------------------------------------------------- helpers

#: GPT-2 names (and a few others) users bring to a Llama-style model, and where to look instead.
_ARCH_HINTS = {
    "transformer": "GPT-2 keeps its blocks at model.transformer.h; Llama-style models keep "
                   "them at model.model.layers (print(model) shows the tree).",
    "h": "GPT-2's blocks are transformer.h; Llama-style models call them model.layers.",
    "wte": "GPT-2's token embedding is transformer.wte; Llama-style: model.embed_tokens.",
    "ln_f": "GPT-2's final norm is transformer.ln_f; Llama-style: model.norm.",
    "layers": "Llama-style models keep blocks at model.model.layers; GPT-2 at "
              "model.transformer.h.",
    "model": "Llama-style models keep the decoder at model.model; GPT-2 at model.transformer.",
}


__all__ = ["LanguageModel", "Generator"]
