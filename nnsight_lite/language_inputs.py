"""A LanguageModel's invokes made one batch for the forward (tokenizing itself: prompts.py).

    LanguageInputs          the mixin LanguageModel takes these from:
      _prepare_inputs         one invoke's prompt as ``((), {"input_ids", ...}, rows)`` (chat
                              messages through the tokenizer's template: chats.py)
      _batch_inputs           the invokes' rows padded to one length and stacked, the ids
                              checked against the vocabulary, moved to the embedding's device
      _input_embedding        the model's input embedding, remembered while the path holds
      _takes_position_ids     whether the model's forward takes ``position_ids``
    _path_refs(root, target)  weak references along the path from ``root`` to a submodule

Batching: every invoke gets the rows it would get tokenized on its own, padded to one length
on the tokenizer's side, the left unless ``tokenizer_kwargs={"padding_side": "right"}`` (or
``model.tokenizer.padding_side = "right"``) asks for the right, as in nnsight; on the left
the last position holds every prompt's last token (text without tokenizer options
goes through the tokenizer in one call for all invokes; token-id tensors are taken as they
are). Where there is padding and the model's forward takes ``position_ids``, they count from
each row's first unmasked token (``prompts._with_position_ids``), so a prompt's activations do
not depend on the other prompts of the batch (GPT-2's absolute position embeddings would
otherwise shift with the padding).

Apart from language.py because it is the seam ``NNsight`` leaves a wrapper for its own kind of
input (``_prepare_inputs``/``_batch_inputs``, model.py). It reads the model only through
``self`` (``_module``, the tokenizer, its own look-ups ``_emb_hit``/``_pos_hit``, which
LanguageModel's ``__getstate__`` leaves out of a pickle), so it imports nothing of language.py.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from . import prompts
from .chats import CHAT_KWARGS, as_chats, chat_ids
from .processors import MEDIA_KWARGS, processed, warn_misaligned_media


class LanguageInputs:
    """Prompts to a batch for a ``LanguageModel`` (a mixin: see the module's docstring)."""

    def _prepare_inputs(self, *args, **kwargs):
        """One invoke's prompt as ``((), {"input_ids", "attention_mask", ...}, rows)``; given
        media keywords (``images=``...), the processor's encoding of the prompt and media;
        chat messages become their template's token ids (chats.py)."""
        if kwargs and not MEDIA_KWARGS.isdisjoint(kwargs):
            args, kwargs = processed(self.__dict__.get("_processor"), args, kwargs,
                                     prompts.TOKENIZER_KWARGS)
        elif len(args) == 1 and (chats := as_chats(args[0])) is not None:
            opts = {k: kwargs.pop(k) for k in list(kwargs)
                    if k in prompts.TOKENIZER_KWARGS or k in CHAT_KWARGS}
            args = (chat_ids(self.tokenizer, chats, opts),)
        return prompts.prepare(self.tokenizer, args, kwargs)

    def _batch_inputs(self, prepared: list):
        """Left-pad every invoke's rows to one length and stack them (one forward); check the
        ids against the vocabulary; move them to the input embedding's device."""
        emb = self._input_embedding()
        if len(prepared) > 1:
            warn_misaligned_media(prepared)
        args, kwargs, sizes = prompts.batch(prepared, self._tokenizer,
                                            getattr(emb, "num_embeddings", None),
                                            self._takes_position_ids())
        try:
            device = emb.weight.device
        except AttributeError:
            return args, kwargs, sizes
        if any(isinstance(v, torch.Tensor) and v.device != device for v in kwargs.values()):
            kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                      for k, v in kwargs.items()}
        return args, kwargs, sizes

    def _input_embedding(self):
        """``get_input_embeddings()`` of the model (None where it has none), remembered while
        every module on the path from the root to it is still the one there: a new embedding
        (``set_input_embeddings``, ``resize_token_embeddings``), a replaced module on the way
        or a new root asks the model again. Held by weak references only."""
        root = self._module
        hit = self.__dict__.get("_emb_hit")
        if hit is not None and hit[0]() is root:
            module = root
            for name, ref in hit[1]:
                module = module._modules.get(name)
                if module is None or module is not ref():
                    break
            else:
                return module
        try:
            emb = root.get_input_embeddings()
        except (AttributeError, NotImplementedError):
            emb = None
        self.__dict__["_emb_hit"] = _path_refs(root, emb)
        return emb

    def _takes_position_ids(self) -> bool:
        cls = type(self._module)
        hit = self.__dict__.get("_pos_hit")
        if hit is not None and hit[0] is cls:
            return hit[1]
        try:
            params = inspect.signature(cls.forward).parameters
        except (TypeError, ValueError):
            params = {}
        # (a multimodal-RoPE model, Qwen2-VL's kind, works its 3-D positions out of the mask
        # and the image grid itself: plain ones would place the image tokens wrong)
        takes = "position_ids" in params and not _multimodal_rope(self._module)
        self.__dict__["_pos_hit"] = (cls, takes)
        return takes


def _multimodal_rope(module) -> bool:
    """Whether the model's rotary embedding is multimodal (M-RoPE: Qwen2-VL and its kind),
    by its config's rope parameters (``mrope_section``)."""
    config = getattr(module, "config", None)
    configs = [config]
    try:
        configs.append(config.get_text_config())
    except AttributeError:
        pass
    for c in configs:
        for name in ("rope_parameters", "rope_scaling"):
            rope = getattr(c, name, None)
            if isinstance(rope, dict) and "mrope_section" in rope:
                return True
    return False


def _path_refs(root: torch.nn.Module, target) -> "tuple | None":
    """``(weakref(root), ((name, weakref(child)), ...))`` along the path from ``root`` down to
    the submodule ``target``; None where ``target`` is not in ``root``'s tree."""
    if not isinstance(target, torch.nn.Module):
        return None
    for path, module in root.named_modules(remove_duplicate=False):
        if module is target:
            break
    else:
        return None
    steps, module = [], root
    for name in path.split(".") if path else ():
        module = module._modules[name]
        steps.append((name, weakref.ref(module)))
    return weakref.ref(root), tuple(steps)


__all__ = ["LanguageInputs"]
