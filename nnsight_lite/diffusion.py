"""``DiffusionModel``: a diffusers pipeline (UNet- or transformer-based) traced like any module.

    DiffusionModel(path_or_pipeline, **from_pretrained_kwargs)
        .trace(prompt, **pipeline_kwargs)      the whole pipeline; one denoising step unless
                                               ``num_inference_steps=`` says more
        .generate(prompt, **pipeline_kwargs)   the same in a with-block; called plainly, the
                                               pipeline's own output with its own defaults
        .pipeline                              the diffusers pipeline
        .unet / .transformer / .vae / .text_encoder   its module components, as Envoys

The wrapped module is a :class:`PipelineModule`: the pipeline's ``torch.nn.Module``
components as its children and the pipeline's call as its forward, so ``model.output`` (and
``tracer.result``) is the pipeline's output object and the denoiser's call ``i`` is denoising
step ``i`` (``tracer.iter[...]``, ``tracer.all()``, ``.next()``). ``seed=`` gives the pipeline
reproducible generators (one per image: ``seed``, ``seed + 1``, ...); a ``generator=`` of your
own wins over it. Requires ``diffusers`` (the ``diffusion`` extra).

Several invokes, each a prompt (or a list of them), run as one pipeline call on all their
prompts; each body gets its own prompts' rows of every tensor. With classifier-free guidance
the denoiser's batch holds every prompt's unconditional rows, then every prompt's conditional
ones, so there an invoke's rows are one span in each half: it is served a copy of them, and
what it edits in place is written back (tiles.Tiles).
"""

from __future__ import annotations

import copy
import inspect
import os
import sys

import torch

from .tiles import Tiles
from .errors import InputError
from .invoke_kwargs import _same
from .model import NNsight
from .tracing import Tracer
from .with_calls import _called_as_context

#: Keywords of the pipeline that are an invoke's input rather than an option of the run.
_PROMPT_KWARGS = frozenset({"prompt", "prompt_embeds", "image"})
#: Keywords with which the pipeline, not ``scheduler.set_timesteps(num_inference_steps)``,
#: decides how many denoising calls it makes.
_STEPS_DECIDED_BY_SCHEDULER = frozenset({"image", "strength", "timesteps", "sigmas",
                                         "denoising_end", "denoising_start"})


class PipelineModule(torch.nn.Module):
    """The module a DiffusionModel traces: a pipeline's ``torch.nn.Module`` components as
    children (in the pipeline's order) and the pipeline's call as ``forward``."""

    def __init__(self, pipeline):
        super().__init__()
        self.__dict__["pipeline"] = pipeline  # (not a child: the pipeline is no Module)
        for name, part in pipeline.components.items():
            if isinstance(part, torch.nn.Module):
                self.add_module(name, part)

    def forward(self, *args, **kwargs):
        return self.pipeline(*args, **kwargs)


class DiffusionTracer(Tracer):
    """The tracer of a DiffusionModel's ``trace`` / ``generate``: an open step loop
    (``tracer.all()``) has as many steps as the denoiser makes calls, where the scheduler
    says how many beforehand, so the body goes on after the loop."""

    def _interleave(self, inter, made: list, args: tuple, kwargs: dict):
        model = self._model
        inter.steps = model._denoiser_calls(kwargs)
        if any(m.batch is not None and m.batch[1] != inter.total for m in inter.mediators):
            inter.row_factors = model._row_factors(kwargs)  # (invokes have rows of their own)
        return super()._interleave(inter, made, args, kwargs)


class DiffusionModel(NNsight):
    """A diffusers pipeline, traced with ``with model.generate(prompt, ...):``.

    Example::

        import nnsight_lite
        from nnsight_lite import DiffusionModel

        sd = DiffusionModel("path/to/stable-diffusion")
        with sd.generate("a photo of a cat", num_inference_steps=4, seed=0) as tracer:
            noise = nnsight_lite.save([])
            for step in tracer.all():                   # every denoising step
                noise.append(sd.unet.output[0])
            result = tracer.result.save()
        image = result.images[0]

    ``model`` is a local directory or hub id (loaded with ``DiffusionPipeline.from_pretrained``
    and the keywords given: ``torch_dtype``, ``variant``, ``safety_checker=None``, ...; or with
    ``automodel=``, a pipeline class or its name in ``diffusers``, such as
    ``AutoPipelineForImage2Image``), or a pipeline already built. The pipeline loads when the
    model is made (``dispatch=`` is accepted for nnsight code; there is no meta placeholder).
    ``device=`` moves the loaded pipeline there.
    """

    def __init__(self, model, *, dispatch: bool = True, automodel=None,
                 rename: dict | None = None, envoys: dict | None = None, device=None,
                 **kwargs):
        if isinstance(model, (str, os.PathLike)):
            model = _pipeline_class(automodel).from_pretrained(os.fspath(model), **kwargs)
        elif kwargs:
            raise TypeError(
                f"DiffusionModel got an already built {type(model).__name__} and loading "
                f"options {sorted(kwargs)}; loading options apply to a path or hub id only"
            )
        if not isinstance(getattr(model, "components", None), dict):
            raise TypeError("DiffusionModel wraps a diffusers pipeline (DiffusionPipeline) or "
                            f"a path to one, got {type(model).__name__}")
        if device is not None:
            model = model.to(device)
        super().__init__(PipelineModule(model), rename=rename, envoys=envoys)

    @property
    def pipeline(self):
        """The diffusers pipeline (its scheduler and other parts that are not modules too)."""
        return self._module.pipeline

    # ---- contexts

    def trace(self, *inputs, trace: bool = True, **kwargs):
        """``with model.trace(prompt, **pipeline_kwargs):`` runs the whole pipeline with the
        body interleaved; ``num_inference_steps`` is 1 unless given (a probe of the denoiser,
        as in nnsight). Given no prompt, the keywords are the run's and the body's invokes
        give the prompt."""
        if not trace:
            args, kwargs, _ = self._batch_inputs([self._prepare_inputs(*inputs, **kwargs)])
            return self._run_forward(args, kwargs)
        if not inputs and _PROMPT_KWARGS.isdisjoint(kwargs):
            return DiffusionTracer(self, (), {}, forward=kwargs)
        return DiffusionTracer(self, inputs, kwargs)

    def generate(self, *inputs, trace: bool = True, **kwargs):
        """``with model.generate(prompt, num_inference_steps=n, **pipeline_kwargs):`` - as
        ``trace`` (one step unless ``num_inference_steps`` is given). Called plainly (no
        with-block, or ``trace=False``) it runs the pipeline with its own defaults and returns
        its output (``seed=`` still applies)."""
        if not trace or not _called_as_context(sys._getframe(1)):
            return self.pipeline(*inputs, **_seeded(kwargs, inputs))
        return self.trace(*inputs, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.pipeline(*args, **_seeded(kwargs, args))

    def _denoiser_calls(self, kwargs: dict) -> "int | None":
        """How many times the denoiser runs for ``kwargs`` (``len(scheduler.timesteps)`` after
        ``set_timesteps``, on a copy: PNDM makes one call more than it takes steps), or None
        where the run decides otherwise (an input image's ``strength``, given timesteps)."""
        if not _STEPS_DECIDED_BY_SCHEDULER.isdisjoint(kwargs):
            return None
        try:
            scheduler = copy.deepcopy(self.pipeline.scheduler)
            scheduler.set_timesteps(kwargs.get("num_inference_steps", 1))
            return len(scheduler.timesteps)
        except Exception:  # noqa: BLE001 - (a scheduler that needs more: the loop stays open)
            return None

    def _row_factors(self, kwargs: dict) -> tuple:
        """How the rows of the pipeline's values relate to the prompts (batching.narrow):
        ``num_images_per_prompt`` adjacent rows a prompt (the latents, the images); with
        classifier-free guidance, the denoiser's batch is two blocks of those, every prompt's
        unconditional rows and then every prompt's conditional ones (``Tiles``)."""
        per = int(kwargs.get("num_images_per_prompt") or 1)
        factors = (per,) if per > 1 else ()
        # guidance is on where the scale is above 1 (SD's rule; a pipeline that runs the
        # unconditional pass apart, or guides otherwise, has no value of twice the rows to
        # match): only a scale known to be 1 or less rules the doubled batch out
        scale = kwargs.get("guidance_scale", _default(self.pipeline, "guidance_scale"))
        if not (isinstance(scale, (int, float)) and scale <= 1):
            factors += (Tiles(2, per),)
        return factors

    # ---- inputs

    def _prepare_inputs(self, *args, **kwargs):
        if len(args) > 1:
            raise InputError(f"an invoke of a DiffusionModel takes one prompt (or a list of "
                             f"them), got {len(args)} positional inputs")
        if args:
            if "prompt" in kwargs:
                raise InputError("got a prompt both positionally and as prompt=...; pass one")
            kwargs = {"prompt": args[0], **kwargs}
        return (), kwargs, _prompt_rows(kwargs.get("prompt"))

    def _batch_inputs(self, prepared: list):
        if len(prepared) == 1:
            args, kwargs, rows = prepared[0]
            return args, kwargs, [rows]
        sizes = [rows for _, _, rows in prepared]
        kws = [kw for _, kw, _ in prepared]
        for i, kw in enumerate(kws):
            if not isinstance(kw.get("prompt"), (str, list, tuple)):
                raise InputError(
                    f"invoke {i} of a DiffusionModel trace has no text prompt; several invokes "
                    "batch text prompts only (give embeddings or images to a single invoke)")
        batch = {"prompt": [p for kw, n in zip(kws, sizes) for p in _listed(kw["prompt"], n)]}
        if any(kw.get("negative_prompt") is not None for kw in kws):
            batch["negative_prompt"] = [p for kw, n in zip(kws, sizes)
                                        for p in _listed(kw.get("negative_prompt") or "", n)]
        rest = [{k: v for k, v in kw.items() if k not in ("prompt", "negative_prompt")}
                for kw in kws]
        for key in set().union(*rest):
            values = [r.get(key, _UNSET) for r in rest]
            if any(not _same(values[0], v) for v in values[1:]):
                raise InputError(
                    f"the invokes of a DiffusionModel trace give {key!r} different values; "
                    "they run as one pipeline call, so give it once, to the trace "
                    f"(model.generate({key}=...)) or equally to every invoke")
            batch[key] = values[0]
        return (), batch, sizes

    def _run_forward(self, args: tuple, kwargs: dict):
        kwargs = _seeded(kwargs, args)
        kwargs.setdefault("num_inference_steps", 1)
        return self._module(*args, **kwargs)


_UNSET = object()


def _prompt_rows(prompt) -> int:
    """How many prompts ``prompt`` is (a list or tuple of them, or one)."""
    return len(prompt) if isinstance(prompt, (list, tuple)) else 1


def _listed(prompt, rows: int) -> list:
    """An invoke's prompt (or negative prompt) as a list of its ``rows`` prompts."""
    return list(prompt) if isinstance(prompt, (list, tuple)) else [prompt] * rows


def _default(pipe, name: str):
    """The default of keyword ``name`` of the pipeline's call (None where it has none)."""
    try:
        param = inspect.signature(type(pipe).__call__).parameters.get(name)
    except (TypeError, ValueError):
        return None
    return None if param is None or param.default is inspect.Parameter.empty else param.default


def _seeded(kwargs: dict, args: tuple) -> dict:
    """``kwargs`` with ``seed=`` turned into the pipeline's ``generator=`` (one generator per
    image, seeded ``seed + i``), unless a generator is given."""
    if "seed" not in kwargs:
        return kwargs
    kwargs = dict(kwargs)
    seed = kwargs.pop("seed")
    if kwargs.get("generator") is not None or seed is None:
        return kwargs
    prompt = args[0] if args else kwargs.get("prompt")
    images = _prompt_rows(prompt) * int(kwargs.get("num_images_per_prompt") or 1)
    gens = [torch.Generator().manual_seed(int(seed) + i) for i in range(images)]
    kwargs["generator"] = gens[0] if images == 1 else gens
    return kwargs


def _pipeline_class(automodel):
    """The class to load a pipeline with: ``DiffusionPipeline``, or ``automodel`` (a class or
    its name in diffusers)."""
    try:
        import diffusers
    except ImportError as err:
        raise ImportError("DiffusionModel needs diffusers: pip install diffusers (or the "
                          "'diffusion' extra of nnsight_lite)") from err
    if automodel is None:
        return diffusers.DiffusionPipeline
    found = getattr(diffusers, automodel, None) if isinstance(automodel, str) else automodel
    if not hasattr(found, "from_pretrained"):
        raise TypeError(f"DiffusionModel(automodel=...) takes a diffusers pipeline class or its "
                        f"name (AutoPipelineForImage2Image), got {automodel!r}")
    return found


__all__ = ["DiffusionModel", "PipelineModule"]
