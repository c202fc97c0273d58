"""Models that take more than text: ``task=`` and the processor of an image-text model.

    task_class(task)        the ``transformers`` auto class a pipeline task loads (its registry)
    takes_processor(task)   whether that task's inputs go through a processor (images, audio...)
    load_processor(source)  ``AutoProcessor.from_pretrained``, its tokenizer padding on the left
    processed(proc, ...)    an invoke's prompt and media keywords (``images=``, ``text=``...) as
                            the processor's encoding, for prompts.prepare to take as a dict prompt
                            (chat messages through the processor's chat template)
    warn_misaligned_media   warns where invokes' media rows would be split as if they were prompts
    ModelInfo               LanguageModel's task, processors, repo_id and revision (nnsight 0.8's
                            attributes)

``TransformersModel(path, task="image-text-to-text")`` (nnsight 0.8's way; its older
``VisionLanguageModel`` is modeling/vlm.py's alias) loads the model with the task's auto class
and a processor; an invoke given ``images=`` (``videos=``, ``audio=``, or the prompt as
``text=``) runs the processor over its prompt and media, and the encoding (``input_ids``,
``attention_mask``, ``pixel_values``, ...) is the invoke's input, batched with the other
invokes' like any encoding passed in (``model.trace(model.processor(...))``).
"""

from __future__ import annotations

from .chats import CHAT_KWARGS, as_chats, template_options
from .errors import InputError

#: An invoke's keywords that are the processor's input, not the forward's or generate's.
MEDIA_KWARGS = frozenset({"text", "images", "videos", "audio", "audios"})
_TEXT_TASKS = ("text-generation",)  # (the default: AutoModelForCausalLM, a tokenizer)


def _task(task: str):
    """``(its name, its registry entry)`` for a pipeline task of ``transformers``."""
    from transformers.pipelines import check_task

    try:
        name, entry, _ = check_task(task)
    except (KeyError, ValueError) as err:  # (an unknown or removed task: transformers says which)
        raise ValueError(f"task={task!r}: {err.args[0] if err.args else err}") from None
    return name, entry


def task_class(task: str):
    """The auto class ``task`` loads models with (``"text-classification"``:
    ``AutoModelForSequenceClassification``); of several (speech recognition's), the first."""
    name, entry = _task(task)
    classes = entry.get("pt") or ()
    if not classes:
        raise ValueError(f"task={task!r} names no PyTorch model class in transformers")
    return classes[0]


def takes_processor(task: "str | None") -> bool:
    """Whether ``task``'s inputs are not text alone (its registry type is not ``"text"``)."""
    if task is None or task in _TEXT_TASKS:
        return False
    return _task(task)[1].get("type") != "text"


def load_processor(source: str, kwargs: "dict | None" = None):
    """``AutoProcessor.from_pretrained(source)``, its tokenizer padding on the left (a batch
    keeps each prompt's last token at ``[:, -1]``, as the tokenizers LanguageModel loads do)."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(source, **(kwargs or {}))
    tok = getattr(proc, "tokenizer", None)
    if tok is not None and getattr(tok, "padding_side", "left") != "left":
        tok.padding_side = "left"
    return proc


def processed(proc, args: tuple, kwargs: dict, tokenizer_kwargs) -> "tuple[tuple, dict]":
    """``(args, kwargs)`` of an invoke given media keywords, with its prompt and media replaced
    by the processor's encoding of them (as one dict prompt); the other keywords stay for the
    forward (or ``generate``). Tokenizer options (``max_length``, ...) go to the processor."""
    kwargs = dict(kwargs)
    text = kwargs.pop("text", None)
    if args and text is not None:
        raise InputError("got the prompt both positionally and as text=...; pass only one of them")
    if len(args) > 1:
        raise InputError(
            f"an invoke takes one prompt (or one list of prompts) with its media, got {len(args)} "
            "positional inputs"
        )
    if proc is None:
        media = sorted(k for k in kwargs if k in MEDIA_KWARGS)
        raise InputError(
            f"this model has no processor for {media}: load it with the task that takes them "
            "(TransformersModel(path, task='image-text-to-text')) or give one "
            "(processor=AutoProcessor.from_pretrained(path))"
        )
    prompt = args[0] if args else text
    if (chats := as_chats(prompt)) is not None:  # (chat messages: the processor's template)
        prompt = _chat_texts(proc, chats, {k: kwargs.pop(k) for k in list(kwargs)
                                           if k in CHAT_KWARGS})
    if prompt is not None and not isinstance(prompt, (str, list, tuple)):
        raise InputError(
            f"with media (images=, ...) the prompt goes to the processor as text: a string or a "
            f"list of strings, got {type(prompt).__name__}; to pass an encoding you made, give it "
            "alone: model.trace(model.processor(text=..., images=..., return_tensors='pt'))"
        )
    call = {k: kwargs.pop(k) for k in list(kwargs) if k in MEDIA_KWARGS}
    call.update({k: kwargs.pop(k) for k in list(kwargs) if k in tokenizer_kwargs})
    if isinstance(prompt, (list, tuple)) and len(prompt) > 1:
        call.setdefault("padding", True)  # several prompts: one batch, padded on the left
    enc = proc(text=prompt, return_tensors="pt", **call)
    return (dict(enc),), kwargs


def _chat_texts(proc, chats: list, options: dict):
    """Each conversation as the text of the processor's chat template (the generation prompt
    added unless it ends with an assistant message, as chats.py does for tokenizers and the
    image-text-to-text pipeline does): one string, or a list of them for several."""
    if getattr(proc, "chat_template", None) is None:
        raise InputError(
            f"a chat prompt (a list of messages) with media is turned into text by the "
            f"processor's chat template, and this processor ({type(proc).__name__}) has none: "
            "pass the prompt as text (with the model's image tokens), or set "
            "model.processor.chat_template")
    texts = [proc.apply_chat_template(messages, tokenize=False,
                                      **template_options(messages, options))
             for messages in chats]
    return texts[0] if len(texts) == 1 else texts


def warn_misaligned_media(prepared: list) -> None:
    """Warn where several invokes' encodings hold a value with a row per image (or other
    medium: ``pixel_values``, ``image_grid_thw``) whose rows add up to the batch's prompts
    while some invoke has more or fewer of them than prompts: values computed from it row for
    row (the vision tower's, the projector's) look batch-shaped, so each invoke would be served
    rows that are not its own images, silently (where the counts do not add up, every invoke
    gets them whole, as the README says)."""
    sizes = [rows for _, _, rows in prepared]
    total = sum(sizes)
    for key, first in prepared[0][1].items():
        if key in ("input_ids", "attention_mask") or getattr(first, "dim", None) is None \
                or first.dim() == 0:
            continue
        counts = [kw[key].shape[0] if getattr(kw.get(key), "dim", None) and kw[key].dim() else None
                  for _, kw, _ in prepared]
        if None in counts or counts == sizes or sum(counts) != total:
            continue
        import warnings

        from .workers import user_location

        warnings.warn(
            f"the invokes' {key!r} have {counts} rows (images) for {sizes} prompts (at "
            f"{user_location()}): the {total} rows add up to the batch's {total} prompts, so "
            "the values computed from them a row an image (the vision tower's and projector's "
            "outputs) would be split among the invokes as if they were prompts, and an invoke's "
            "share of them is not its own images. Read or edit those modules in a trace of one "
            "invoke, or give every prompt one image; the language model's values are split "
            "right.", UserWarning, stacklevel=2)
        return


class ModelInfo:
    """What a LanguageModel was loaded as, under nnsight 0.8's attribute names (a mixin: it
    reads ``_task``, ``_processor``, ``_source``, ``_load_kwargs`` and ``_module``)."""

    @property
    def processor(self):
        """The processor of a model loaded for a task that takes more than text
        (``task="image-text-to-text"``) or given one (``processor=``); else None."""
        return self.__dict__.get("_processor")

    @property
    def task(self) -> str:
        """The pipeline task the model was loaded for (``task=``; ``"text-generation"`` by
        default), as nnsight 0.8's ``model.task``."""
        return self.__dict__.get("_task") or "text-generation"

    @property
    def repo_id(self) -> str | None:
        """The directory or hub id the model was loaded from (a built model's ``name_or_path``),
        as nnsight 0.8's ``model.repo_id``."""
        return self._source or getattr(self._module, "name_or_path", None) or None

    @property
    def revision(self) -> str | None:
        """The ``revision=`` the weights were loaded at (None: the default branch)."""
        return self._load_kwargs.get("revision")

    @property
    def image_processor(self):
        """The processor's image processor (None where the model has no processor)."""
        return getattr(self.processor, "image_processor", None)

    @property
    def feature_extractor(self):
        """The processor's feature extractor (audio models; None where there is none)."""
        return getattr(self.processor, "feature_extractor", None)


__all__ = ["MEDIA_KWARGS", "task_class", "takes_processor", "load_processor", "processed",
           "warn_misaligned_media", "ModelInfo"]
