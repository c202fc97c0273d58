"""Prompts to model inputs: tokenizing, checking and padding (LanguageModel's helpers; not
exported from the package).

    TOKENIZER_KWARGS    the keywords that go to the tokenizer (per invoke)
    INPUT_KWARGS        the keywords that are the prompt itself (input_ids, inputs_embeds, mask)
    prepare(...)        one invoke's prompt as ((), {"input_ids", "attention_mask", ...}, rows)
    batch(...)          several invokes' prepared inputs padded into one batch, ids checked
    encode(...)         one prompt as (input_ids, attention_mask, other keys)
    tokenize(...)       texts as (input_ids, attention_mask, other keys), padded
    with_pad_token(tok) give a tokenizer without a pad token its eos token (with a warning)

(``with_pad_token`` and the padding itself are padding.py's; turning token ids and masks into
checked tensors, ``check_vocab`` and ``check_not_empty`` included, is token_ids.py's: neither
knows prompts, so each can be read alone.)

Accepted prompts: a string, a list of strings, token ids (a list of ints, a list of lists of
ints, a 1-D or 2-D integer tensor), or a dict / ``BatchEncoding`` with ``input_ids`` (and
optionally ``attention_mask``); or embeddings, ``inputs_embeds=`` a (batch, positions, hidden)
float tensor (and optionally ``attention_mask``). Anything else raises ``InputError`` saying
what was given.

Padding goes on the tokenizer's ``padding_side``, as nnsight pads: the left (so ``[:, -1]`` is
every prompt's last token) unless the user set ``padding_side="right"`` on it
(``LanguageModel(..., tokenizer_kwargs={"padding_side": "right"})``); left without a tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .batching import concat_inputs
from .errors import BatchingError, InputError
from .padding import _pad_id, _pad_ragged, _stack, pad_to, side, with_pad_token
from .token_ids import (
    ACCEPTS,
    _as_ids,
    _describe,
    _mask_rows,
    _rows,
    check_not_empty,
    check_vocab,
    drop_none_mask,
)

#: Keyword arguments of ``tokenizer(...)`` that may be given per invoke; every other keyword
#: goes to the model's forward (trace) or to ``generate``.
TOKENIZER_KWARGS = frozenset({
    "add_special_tokens", "padding", "truncation", "max_length", "stride", "is_split_into_words",
    "pad_to_multiple_of", "padding_side", "return_token_type_ids", "verbose",
})
#: Keyword arguments that are an invoke's input rather than an option of the forward or of
#: ``generate``: ``model.generate(**tokenizer(...))`` is given its prompt this way.
INPUT_KWARGS = frozenset({"input_ids", "inputs_embeds", "attention_mask"})
_MASK_WITH_TEXT = (
    "attention_mask=... was given with a text prompt; the tokenizer makes the mask for text. "
    "Pass token ids with their mask instead"
)


def prepare(tokenizer, args: tuple, kwargs: dict):
    """One invoke's prompt as ``((), {"input_ids", "attention_mask", ...}, rows)``.

    Example::

        _, kw, rows = prepare(tokenizer, (["Hello world", "Hi"],), {"max_length": 8})
        kw["input_ids"].shape, kw["attention_mask"][1]     # (2, 2), tensor([0, 1]) for GPT-2

    ``attention_mask`` is None where every position is a token (token ids given as a tensor,
    no mask): ``batch`` makes one mask for all such rows. Text without tokenizer options is
    left as ``input_ids=Texts([...])``: ``batch`` tokenizes every such invoke in one tokenizer
    call. Token ids are checked against the vocabulary in ``batch``, once for the whole batch.
    """
    if not kwargs and len(args) == 1:  # token ids as a tensor, nothing else: the usual loop
        ids = args[0]
        if type(ids) is torch.Tensor and ids.dtype is torch.long and 0 < ids.dim() <= 2 and \
                ids.numel():
            if ids.dim() == 1:
                ids = ids.unsqueeze(0)
            return (), {"input_ids": ids, "attention_mask": None}, ids.shape[0]
    kwargs = dict(kwargs)
    drop_none_mask(kwargs)
    tok_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in TOKENIZER_KWARGS}
    if len(args) > 1:
        raise InputError(
            f"an invoke takes one prompt (or one list of prompts), got {len(args)} "
            "positional inputs; pass a list for a batch: tracer.invoke(['a', 'b'])"
        )
    if "inputs_embeds" in kwargs:
        return _prepare_embeds(args, kwargs, tok_kwargs)
    if args:
        prompt = args[0]
        if "input_ids" in kwargs:
            raise InputError("got both a prompt and input_ids=...; pass only one of them")
    elif "input_ids" in kwargs:
        prompt = {"input_ids": kwargs.pop("input_ids")}
        if "attention_mask" in kwargs:
            prompt["attention_mask"] = kwargs.pop("attention_mask")
    else:
        raise InputError(f"no prompt given; pass {ACCEPTS}, or inputs_embeds=...")
    if not tok_kwargs and _is_text(prompt):  # tokenized with the other invokes' text, in batch
        texts = Texts(_texts(prompt))
        if "attention_mask" in kwargs:
            raise InputError(_MASK_WITH_TEXT)
        return (), {"input_ids": texts, "attention_mask": None, **kwargs}, len(texts)
    ids, mask, extra = encode(tokenizer, prompt, tok_kwargs)
    check_not_empty(ids, mask)
    if "attention_mask" in kwargs:
        if extra.get("_from_text"):
            raise InputError(_MASK_WITH_TEXT)
        mask = _as_ids(kwargs.pop("attention_mask"), "attention_mask")
        if mask.dim() == 1 and ids.shape[0] == 1:  # (one prompt's mask, as its 1-D ids)
            mask = mask.unsqueeze(0)
        if mask.shape != ids.shape:
            raise InputError(
                f"attention_mask has shape {tuple(mask.shape)} but input_ids has shape "
                f"{tuple(ids.shape)}; they must match"
            )
    extra.pop("_from_text", None)
    kwargs.update(extra)
    return (), {"input_ids": ids, "attention_mask": mask, **kwargs}, ids.shape[0]


def _prepare_embeds(args: tuple, kwargs: dict, tok_kwargs: dict):
    """``prepare`` of an invoke given ``inputs_embeds=`` (and maybe ``attention_mask=``)."""
    if args or "input_ids" in kwargs:
        raise InputError(
            "got inputs_embeds=... and a prompt (or input_ids=...); the model takes token ids or "
            "embeddings, not both: pass only one of them"
        )
    if tok_kwargs:
        raise InputError(
            f"tokenizer options {sorted(tok_kwargs)} apply to text prompts only, but this "
            "input is inputs_embeds=...; drop them"
        )
    emb = kwargs.pop("inputs_embeds")
    if not (isinstance(emb, torch.Tensor) and emb.is_floating_point() and emb.dim() == 3):
        raise InputError(
            f"inputs_embeds must be a floating-point tensor of shape (batch, positions, hidden), "
            f"got {_describe(emb)}"
        )
    if not emb.shape[0] or not emb.shape[1]:
        raise InputError(
            f"inputs_embeds has shape {tuple(emb.shape)}: there is no position to run the model "
            "on; give every row at least one position"
        )
    mask = kwargs.pop("attention_mask", None)
    if mask is not None:
        mask = _mask_rows(mask, emb, "inputs_embeds")
        check_not_empty(mask, mask)
    return (), {"inputs_embeds": emb, "attention_mask": mask, **kwargs}, emb.shape[0]


def encode(tokenizer, prompt, tok_kwargs: dict):
    """``(input_ids, attention_mask, other_keys)`` of one prompt, padded on the tokenizer's
    side."""
    if _is_text(prompt):
        ids, mask, extra = tokenize(tokenizer, _texts(prompt), tok_kwargs)
        extra["_from_text"] = True
        return ids, mask, extra
    if tok_kwargs:
        raise InputError(
            f"tokenizer options {sorted(tok_kwargs)} apply to text prompts only, but this "
            f"prompt is {type(prompt).__name__}; tokenize it yourself or pass text"
        )
    if isinstance(prompt, Mapping):
        if "input_ids" not in prompt:
            raise InputError(
                f"a dict prompt needs 'input_ids'; this one has keys {sorted(prompt)}"
            )
        ids = _rows(prompt["input_ids"])
        mask = prompt.get("attention_mask")
        if mask is None:
            ids, mask = _pad_ragged(ids, _pad_id(tokenizer), side(tokenizer))
        else:
            ids = _as_ids(ids if isinstance(ids, torch.Tensor) else _stack(ids), "input_ids")
            mask = _mask_rows(mask, ids, "input_ids")
        extra = {k: v for k, v in prompt.items() if k not in ("input_ids", "attention_mask")}
        return ids, mask, extra
    ids, mask = _pad_ragged(_rows(prompt), _pad_id(tokenizer), side(tokenizer))
    return ids, mask, {}


class Texts(list):
    """The texts of one invoke, left by ``prepare`` for ``batch`` to tokenize."""

    __slots__ = ()


def tokenize(tokenizer, texts: list, tok_kwargs: dict):
    """``(input_ids, attention_mask, other_keys)`` of ``texts``, padded on the tokenizer's
    side (an invoke's ``padding_side=`` option wins)."""
    if tokenizer is None:
        raise InputError(
            f"a text prompt ({texts[0]!r}{', ...' if len(texts) > 1 else ''}) needs a tokenizer, "
            "and this LanguageModel was given a built model without one: pass token ids "
            "(a tensor or lists of ints), or give it one: LanguageModel(model, "
            "tokenizer=AutoTokenizer.from_pretrained(...)), or model.tokenizer = ..."
        )
    tok_kwargs = {"padding": True, "padding_side": side(tokenizer), **tok_kwargs}
    enc = tokenizer(texts, return_tensors="pt", **tok_kwargs)
    ids = enc["input_ids"]
    mask = enc.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(ids)
    extra = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    return ids, mask.to(ids.dtype), extra


def _is_text(prompt) -> bool:
    return isinstance(prompt, str) or (
        isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt))


def _texts(prompt) -> list:
    """A text prompt as a list of texts; an empty text is refused."""
    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    for i, t in enumerate(texts):
        if not t:
            where = "" if isinstance(prompt, str) else f" (item {i} of the list)"
            raise InputError(
                f"empty prompt{where}: there is no token to run the model on; give it some text"
            )
    return texts


def _tokenized(kws: list, tokenizer) -> list:
    """``kws`` with the texts ``prepare`` left tokenized: in one tokenizer call when it
    gives only ids and mask (left-padded to the longest text: the batch pads every invoke to
    its longest row anyway), else (``token_type_ids``, ...) each invoke's on its own."""
    pending = [k["input_ids"] for k in kws if type(k["input_ids"]) is Texts]
    ids, mask, extra = tokenize(tokenizer, [t for texts in pending for t in texts], {})
    if not extra:
        check_not_empty(ids, mask)
    out, row = [], 0
    for k in kws:
        texts = k["input_ids"]
        if type(texts) is not Texts:
            out.append(k)
            continue
        if extra:
            i, m, e = tokenize(tokenizer, texts, {})
            check_not_empty(i, m)
        else:
            i, m, e = ids[row:row + len(texts)], mask[row:row + len(texts)], {}
            row += len(texts)
        out.append({**k, "input_ids": i, "attention_mask": m, **e})
    return out


def batch(prepared: list, tokenizer, vocab: int | None, position_ids: bool):
    """Several invokes' ``prepare`` results padded to one length (on the tokenizer's
    ``padding_side``) and stacked; every invoke's ids checked against ``vocab`` (the padding the
    batch adds is not checked).

    With ``position_ids`` and some padding, adds position ids counted over the attention mask.
    Invokes given ``inputs_embeds`` are padded with zero vectors the same way; they cannot
    share a batch with invokes given token ids (``BatchingError``).
    """
    if len(prepared) == 1:  # one invoke (a trace given its prompt): nothing to pad
        _, kwargs, size = prepared[0]
        if "inputs_embeds" not in kwargs:
            if type(kwargs["input_ids"]) is Texts:
                kwargs = _tokenized([kwargs], tokenizer)[0]
            check_vocab(kwargs["input_ids"], vocab)
        kwargs = dict(kwargs)
        if kwargs["attention_mask"] is None:
            kwargs["attention_mask"] = _mask_of(kwargs)
            return (), kwargs, [size]
        return (), _with_position_ids(kwargs, position_ids), [size]
    sizes = [n for _, _, n in prepared]
    kws = [k for _, k, _ in prepared]
    embeds = [i for i, k in enumerate(kws) if "inputs_embeds" in k]
    if embeds:
        return _batch_embeds(kws, sizes, embeds, position_ids, side(tokenizer))
    if any(type(k["input_ids"]) is Texts for k in kws):
        kws = _tokenized(kws, tokenizer)
    width = kws[0]["input_ids"].shape[1]
    if all(len(k) == 2 and k["input_ids"].shape[1] == width for k in kws):
        # one length and no other keys (a loop over token-id prompts): no padding to add
        ids = torch.cat([k["input_ids"] for k in kws])
        check_vocab(ids, vocab)
        full = all(k["attention_mask"] is None for k in kws)
        mask = torch.ones_like(ids) if full else torch.cat([_mask_of(k) for k in kws])
        kwargs = {"input_ids": ids, "attention_mask": mask}
    else:
        full = False
        check_vocab(torch.cat([k["input_ids"].reshape(-1) for k in kws]), vocab)
        width = max(k["input_ids"].shape[1] for k in kws)
        pad, on = _pad_id(tokenizer), side(tokenizer)
        ids = torch.cat([pad_to(k["input_ids"], width, pad, on) for k in kws])
        mask = torch.cat([pad_to(_mask_of(k), width, 0, on) for k in kws])
        rest = [((), {n: _pad_per_token(n, v, k["input_ids"], width, on) for n, v in k.items()
                      if n not in ("input_ids", "attention_mask")}) for k in kws]
        _, kwargs, _ = concat_inputs(rest, sizes)
        kwargs = {"input_ids": ids, "attention_mask": mask, **kwargs}
    if full:
        return (), kwargs, sizes
    return (), _with_position_ids(kwargs, position_ids), sizes


def _batch_embeds(kws: list, sizes: list, embeds: list, position_ids: bool, on: str):
    """``batch`` of invokes given ``inputs_embeds`` (``embeds``: their indices in ``kws``)."""
    if len(embeds) != len(kws):
        ids = [i for i in range(len(kws)) if i not in embeds]
        raise BatchingError(
            f"invoke {', '.join(map(str, embeds))} gives inputs_embeds and invoke "
            f"{', '.join(map(str, ids))} gives a prompt or token ids (counting the invokes that "
            "have inputs); one forward takes embeddings or token "
            "ids, not both. Give every invoke inputs_embeds (embed token ids with "
            "model.get_input_embeddings()(ids)), or run them in separate traces"
        )
    width = max(k["inputs_embeds"].shape[1] for k in kws)
    full = all(k["attention_mask"] is None and k["inputs_embeds"].shape[1] == width for k in kws)
    mask = torch.cat([pad_to(_mask_of(k), width, 0, on) for k in kws])
    rest = [((), {n: pad_to(v, width, 0, on) if n == "inputs_embeds" else v
                  for n, v in k.items() if n != "attention_mask"}) for k in kws]
    _, kwargs, _ = concat_inputs(rest, sizes)  # (BatchingError for other hidden sizes, dtypes)
    kwargs["attention_mask"] = mask
    if full:
        return (), kwargs, sizes
    return (), _with_position_ids(kwargs, position_ids), sizes


def _with_position_ids(kwargs: dict, position_ids: bool) -> dict:
    """``kwargs`` with position ids where the attention mask has padding (and the model takes
    them, and none were given): each row's positions count from its first unmasked token, so
    left padding does not shift a prompt's positions, and a masked token after it (a mask
    with a hole) does not shift the later ones, as in the plain forward of that prompt alone
    (counting over the mask, as HF generate does, moved them)."""
    mask = kwargs["attention_mask"]
    if position_ids and "position_ids" not in kwargs and not bool(mask.all()):
        lead = ((mask != 0).long().cummax(-1).values == 0).sum(-1, keepdim=True)  # padding
        pos = torch.arange(mask.shape[-1], device=mask.device).expand(mask.shape)
        kwargs["position_ids"] = (pos - lead).clamp(min=0)
    return kwargs


#: Inputs with a value per token whatever their other dimensions (TAPAS' 3-D token types).
_PER_TOKEN = frozenset({"token_type_ids", "mm_token_type_ids", "labels"})


def _pad_per_token(name: str, value, ids: torch.Tensor, width: int, on: str):
    """An invoke's other input padded like its ids where it has a value per token (the ids'
    shape, or a known per-token name whose first two dimensions are the ids': ``token_type_ids``,
    ``mm_token_type_ids``, ``labels``), with 0 (``labels``: -100, which losses ignore); anything
    else as it is (a 3-D input, such as audio features, whose second dimension only happens to
    be the prompt's length is no per-token value)."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and (
            value.shape == ids.shape or name in _PER_TOKEN and value.shape[:2] == ids.shape):
        return pad_to(value, width, -100 if name == "labels" else 0, on)
    return value


def _mask_of(kw: dict) -> torch.Tensor:
    """The attention mask of one prepared invoke (all ones where ``prepare`` left it None)."""
    mask = kw["attention_mask"]
    if mask is not None:
        return mask
    emb = kw.get("inputs_embeds")
    if emb is not None:
        return torch.ones(emb.shape[:2], dtype=torch.long, device=emb.device)
    return torch.ones_like(kw["input_ids"])


__all__ = ["TOKENIZER_KWARGS", "INPUT_KWARGS", "Texts", "prepare", "batch", "encode", "tokenize",
           "check_not_empty", "check_vocab", "with_pad_token"]
