"""What ``model.generate(...)`` adds to a trace: the generator modules and the Generator tracer.

    Generator         the tracer ``with model.generate(prompt, max_new_tokens=k) as tracer:``
                      returns; runs HF ``generate`` with the bodies interleaved at every step
    Piper             ``with model.pipe(prompt, **kwargs) as tracer:``: the same around the
                      model's Hugging Face pipeline, end to end
    _GeneratorOutput  ``model.generator``: an identity module called once with the ids
    _Streamer         ``model.generator.streamer``: called with the prompt, then each new token

Both modules are attached to the Hugging Face model only while a generate runs, so its traces
count their calls like any other module's.
"""

from __future__ import annotations

import sys

from typing import TYPE_CHECKING

import torch

from .capture import names_read
from .envoy import Envoy
from .errors import InputError, NNsightError
from .tracing import Tracer

if TYPE_CHECKING:
    from .language import LanguageModel


class _GeneratorOutput(torch.nn.Module):
    """Identity module called once with generate's result, so bodies can read it as
    ``model.generator.output``. Attached to the model only while a generate runs."""

    attached = False  # True while a generate runs (the module sits in the model's tree then)

    def __init__(self):
        super().__init__()
        self.streamer = _Streamer()

    def forward(self, ids):
        return ids


class _Streamer(torch.nn.Module):
    """``model.generator.streamer``: handed to HF ``generate`` as its ``streamer``, so every
    ``put`` (the prompt ids, then each step's new tokens) is a call of this identity module that
    bodies can read (and edit) as ``model.generator.streamer.output``. What it returns goes on
    to the user's own streamer (``generate(..., streamer=TextIteratorStreamer(tok))``), if any.
    """

    def __init__(self):
        super().__init__()
        self.target = None  # the user's streamer, during one generate

    def forward(self, ids):
        return ids

    def put(self, value) -> None:
        value = self(value)
        if self.target is not None:
            self.target.put(value)

    def end(self) -> None:
        if self.target is not None:
            self.target.end()


class _DuringGenerate(Envoy):
    """An Envoy whose ``.output`` exists only while ``model.generate(...)`` runs (the generator
    module ``_generator`` is attached then); elsewhere it says so, with ``_elsewhere``."""

    _elsewhere = ""

    @property
    def output(self):
        if not self._generator.attached:
            raise NNsightError(self._elsewhere)
        return Envoy.output.fget(self)

    @output.setter
    def output(self, value):
        Envoy.output.fset(self, value)


class _GeneratorEnvoy(_DuringGenerate):
    """``model.generator``: its ``.output`` exists only inside ``model.generate(...)`` bodies."""

    _elsewhere = (
        "model.generator.output (the generated ids) exists only inside "
        "`with model.generate(prompt, max_new_tokens=k):`; in a trace read "
        "model.lm_head.output (the logits) instead"
    )

    def __init__(self, module, path, tree=None, mpath=""):
        super().__init__(module, path, tree, mpath)
        self.__dict__["_generator"] = module
        streamer = _StreamerEnvoy(module.streamer, f"{path}.streamer")
        streamer.__dict__["_generator"] = module
        self.__dict__["streamer"] = streamer


class _StreamerEnvoy(_DuringGenerate):
    """``model.generator.streamer``: the tokens of a ``model.generate(...)`` as they come."""

    _elsewhere = (
        "model.generator.streamer.output (the tokens as generate produces them) exists "
        "only inside `with model.generate(prompt, max_new_tokens=k):` bodies"
    )



class Generator(Tracer):
    """The tracer of ``with model.generate(prompt, max_new_tokens=k) as tracer:``.

    Example::

        with model.generate("Hello", max_new_tokens=4) as tracer:
            hs = nnsight_lite.save([])
            for step in tracer.all():                       # every step, until generation ends
                hs.append(model.lm_head.output[:, -1])
            ids = model.generator.output.save()
        assert len(hs) == 4 and tracer.result.shape[1] == ids.shape[1]

    ``tracer.result`` is what HF ``generate`` returned (the ids, prompt included): inside the
    body it waits for generation to end (like ``model.generator.output``); after the block it
    is the ids.
    """

    _call_name = "model.generate"

    def __init__(self, model: LanguageModel, args: tuple, tok_kwargs: dict, gen_kwargs: dict):
        super().__init__(model, args, tok_kwargs)
        self._gen_kwargs = gen_kwargs

    def _let_go(self) -> None:
        super()._let_go()
        self._gen_kwargs = {}  # (tracer.result, the ids, stays)

    def _call_kwargs(self) -> dict:
        # generate()'s keywords win over an invoke's (as in nnsight); an invoke's max_length
        # is a tokenizer option (truncation), not generate's total length
        return {k: v for k, v in self._gen_kwargs.items() if k != "max_length"}

    def _run(self, scope):
        model = self._model
        hf = model._module
        gen = model._generator_module
        if "generator" in hf._modules:
            raise InputError(
                f"{type(hf).__name__} already has a submodule named 'generator', which "
                "model.generator would hide; rename it to trace generate on this model"
            )
        hf._modules["generator"] = gen  # so the trace counts its call and serves its output
        flags = gen.__dict__  # (plain attributes: set without Module.__setattr__'s checks)
        flags["attached"] = True
        try:
            self._run_attached(scope)
        finally:
            flags["attached"] = False
            del hf._modules["generator"]

    def _run_attached(self, scope):
        """The trace itself, while ``model.generator`` is attached."""
        super()._run(scope)

    def _interleave(self, inter, made: list, args: tuple, kwargs: dict):
        # an open `for step in tracer.all():` has one step per new token, as nnsight's has: a
        # body whose later steps read nothing ends its loop after the last token. Where a body
        # reads model.generator.streamer, which runs once more than the model (the prompt, then
        # each new token), there is one more step for the last token's streamer call; a step
        # waiting for another module there ends the loop when generation ends
        n = self._setting("max_new_tokens", kwargs)
        inter.steps = n + self._streams() if isinstance(n, int) and self._one_run() else None
        # HF generate expands each prompt's row into max(num_beams, num_return_sequences)
        # adjacent rows for the forwards, and returns num_return_sequences rows a prompt: each
        # invoke gets its prompts' rows of those (batching.narrow)
        beams, seqs = (self._setting(k, kwargs) for k in ("num_beams", "num_return_sequences"))
        beams, seqs = (v if isinstance(v, int) and v > 1 else 1 for v in (beams, seqs))
        inter.row_factors = tuple(f for f in dict.fromkeys((max(beams, seqs), seqs)) if f > 1)
        # HF generate runs the model under torch.no_grad(): the bodies start in that mode too,
        # as the model's own code would run them (a body kept in the trace's grad mode would
        # edit values the forward made without grad with grad on, and an in-place edit of a
        # view that mixes in a tensor requiring grad, a steering vector, is then an error)
        inter.no_grad_by = "model.generate (HF generate runs the model under torch.no_grad())"
        # HF generate compiles the model's forward itself with a compileable cache (static,
        # hybrid) on an accelerator: that compiled call runs eagerly in the trace (compiled.py)
        if sys.modules.get("torch._dynamo") is not None:
            inter.compiled = True
        with torch.no_grad():
            return super()._interleave(inter, made, args, kwargs)

    def _one_run(self) -> bool:
        """Whether the model generates once (a pipeline runs generate once per prompt)."""
        return True

    def _setting(self, name: str, kwargs: dict):
        """A generation setting as HF takes it: generate()'s keyword, else an invoke's (the
        batch's ``kwargs``, which _run_generate passes to HF generate beside generate()'s
        keywords: ``tracer.invoke(prompt, num_beams=2)``), else the ``generation_config``'s
        given to generate(), else the model's (None where none sets it)."""
        gen = self._gen_kwargs
        value = gen.get(name)
        if value is None:
            value = kwargs.get(name)
        for config in (gen.get("generation_config"),
                       getattr(self._model._module, "generation_config", None)):
            if value is None:
                value = getattr(config, name, None)
        return value

    def _forward(self, inter, args: tuple, kwargs: dict):
        model = self._model
        gen = self._gen_kwargs
        streamer = model._generator_module.streamer
        if self._streams():
            user = gen.get("streamer")
            gen = dict(gen, streamer=streamer)
            streamer.__dict__["target"] = user
        try:
            out = model._run_generate(args, kwargs, gen)
        finally:
            streamer.__dict__["target"] = None
        # The model makes no more calls: bodies looping over steps leave their loops now, so
        # code after the loop can read model.generator.output, served by the call below.
        inter.end_iterations()
        self._result = model._generator_module(out)
        return self._result

    def _streams(self) -> bool:
        """Whether generate streams through ``model.generator.streamer``: where the user gave a
        streamer or a body names it (HF refuses a streamer in some modes, beam search, so
        not otherwise)."""
        return self._gen_kwargs.get("streamer") is not None or \
            "streamer" in names_read(self._body.code)

    def _result_envoy(self):
        return self._model.generator


class Piper(Generator):
    """The tracer of ``with model.pipe(prompt, max_new_tokens=k) as tracer:`` (nnsight 0.8's
    traced pipeline): runs the model's Hugging Face text-generation pipeline end to end, which
    tokenizes, generates and decodes, with the block's body interleaved in every forward it
    makes (a module's call ``i`` is generation step ``i``, as in a generate). Several prompts
    go to the pipeline as one batch (``batch_size`` = their number, as nnsight 0.8.1 hands
    them), so one generate runs over all of them; a ``batch_size=`` you give smaller than that
    runs one generate per batch, and the steps count on across them. ``tracer.result`` (and
    ``model.generator.output``) is what the pipeline returned, ``[{"generated_text": ...}]``.

    With no prompts in the call, the prompts come from invokes, as nnsight 0.8.1 takes them:
    ``with model.pipe(max_new_tokens=k) as tracer:`` then ``with tracer.invoke(prompt):``
    bodies, each of which sees its own rows of the batch (``tracer.barrier`` included).
    """

    _call_name = "model.pipe"

    def __init__(self, model: LanguageModel, inputs: tuple, kwargs: dict):
        super().__init__(model, (), {}, kwargs)
        self._pipe_inputs = inputs
        self._prompts: list = []  # the invokes' (prompts, keywords), where the call gave none

    def _let_go(self) -> None:
        super()._let_go()
        self._pipe_inputs = ()
        self._prompts = []

    def _run_attached(self, scope):
        if not self._pipe_inputs:
            return super()._run_attached(scope)  # invokes: a trace's run, the pipeline as forward
        x = self._pipe_inputs[0] if len(self._pipe_inputs) == 1 else None
        rows = len(x) if _texts(x) else 1
        self._run_own_body(scope, rows, (), {})  # (the pipeline gets its own inputs: _forward)

    def _pipe_call(self) -> tuple[tuple, dict]:
        """The pipeline's inputs and keywords: the call's, or the invokes' prompts (one string
        alone, as nnsight passes it); several prompts with ``batch_size`` their number."""
        call = dict(self._gen_kwargs)
        inputs = self._pipe_inputs
        if not inputs:
            texts = []
            for prompt, kwargs in self._prompts:
                texts.extend([prompt] if isinstance(prompt, str) else prompt)
                for k, v in kwargs.items():  # (the call's own keywords win, as in a generate)
                    call.setdefault(k, v)
            inputs = (texts[0] if len(texts) == 1 else texts,)
        if len(inputs) == 1 and _texts(inputs[0]) and len(inputs[0]) > 1:
            call.setdefault("batch_size", len(inputs[0]))
        return inputs, call

    def _forward(self, inter, args: tuple, kwargs: dict):
        inputs, call = self._pipe_call()
        out = self._model.pipeline(*inputs, **call)
        inter.end_iterations()  # (as generate's: step loops end, the code after them runs)
        self._result = self._model._generator_module(out)
        return self._result

    def _streams(self) -> bool:
        return False  # (the pipeline takes a streamer= of the user's itself)

    def _one_run(self) -> bool:
        # (prompts in several batches: one generate each, so an open step loop runs on until a
        # read finds no further call, not max_new_tokens steps)
        inputs, call = self._pipe_call()
        if len(inputs) != 1:
            return False
        x = inputs[0]
        return isinstance(x, str) or (_texts(x) and call.get("batch_size", 1) >= len(x))

    def invoke(self, *args, **kwargs):
        if self._pipe_inputs:
            raise InputError(
                "model.pipe(...) was given its prompts in the call, so its block is their one "
                "body: give the prompts to the invokes instead, in `with model.pipe(max_new_"
                "tokens=k) as tracer:` (no prompt), or drop the invoke")
        inv = super().invoke(*args, **kwargs)
        if args or kwargs:
            if len(args) != 1 or not (isinstance(args[0], str) or _texts(args[0])):
                raise InputError(
                    "an invoke of model.pipe(...) takes one text prompt (a string or a list of "
                    f"strings), which the pipeline tokenizes; got {len(args)} positional "
                    "input(s)" + (f" ({type(args[0]).__name__})" if len(args) == 1 else ""))
            self._prompts.append((args[0], kwargs))
        return inv


def _texts(x) -> bool:
    """Whether ``x`` is a non-empty list of strings (several prompts)."""
    return isinstance(x, list) and bool(x) and all(isinstance(p, str) for p in x)
