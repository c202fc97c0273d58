"""Token ids and attention masks as given by the user: made tensors, and checked.

    ACCEPTS             what a prompt may be, as error messages say it
    _rows(x)            token ids as a 2-D tensor or a list of 1-D tensors (ragged rows)
    _as_ids(x, what)    ids or a mask as an integer tensor (a float mask of 0s and 1s too)
    _mask_rows(m, of)   a mask as integer rows of the prompt's (batch, positions)
    drop_none_mask(kw)  take HF's default ``attention_mask=None`` out of the keywords
    check_not_empty     every row of one prompt has a token
    check_vocab         every id is in the model's vocabulary
    _describe(x)        a value as these errors name it (a list's item types, a tensor's shape)

Apart from prompts.py because it decides nothing about how a prompt is tokenized or batched:
each function takes one value and gives a tensor or an ``InputError`` saying what was given.
prompts.py imports it (``prompts.drop_none_mask``, ``prompts.check_vocab`` are these), not the
other way round.
"""

from __future__ import annotations

import torch

from .errors import InputError

ACCEPTS = (
    "a string, a list of strings, token ids (a list of ints, a list of lists of ints, or a "
    "1-D/2-D integer tensor), or a dict/BatchEncoding with 'input_ids'"
)


def check_not_empty(ids: torch.Tensor, mask: torch.Tensor) -> None:
    """Every row of one prompt has a token."""
    if ids.shape[-1] == 0 or (mask.shape[-1] and bool((mask.sum(-1) == 0).any())):
        raise InputError(
            "a prompt has no tokens (the tokenizer produced none, or the ids are empty); "
            "give every prompt at least one token"
        )


def check_vocab(ids: torch.Tensor, vocab: int | None) -> None:
    """Every id is in ``0..vocab-1`` (skipped on the meta device)."""
    if ids.is_meta:
        return
    lo, hi = ids.aminmax()
    lo, hi = int(lo), int(hi)
    if lo < 0 or (vocab is not None and hi >= vocab):
        bad = lo if lo < 0 else hi
        valid = f"0..{vocab - 1}" if vocab is not None else "non-negative"
        raise InputError(
            f"token id {bad} is outside this model's vocabulary (valid ids: {valid}); "
            "were the ids made by another tokenizer?"
        )


def _is_int(x) -> bool:
    return (isinstance(x, int) and not isinstance(x, bool)) or (
        isinstance(x, torch.Tensor) and x.dim() == 0 and not x.is_floating_point())


def _mask_rows(mask, of: torch.Tensor, what: str) -> torch.Tensor:
    """``mask`` as integer rows (a 1-D mask is one row) of ``of``'s (batch, positions); ``of``
    is the prompt's ``what`` (``input_ids``, ``inputs_embeds``)."""
    mask = _as_ids(mask, "attention_mask")
    if mask.dim() == 1:
        mask = mask.unsqueeze(0)
    if mask.shape != of.shape[:2]:
        raise InputError(
            f"attention_mask has shape {tuple(mask.shape)} but {what} has shape "
            f"{tuple(of.shape)}; the mask must be (batch, positions) = {tuple(of.shape[:2])}"
        )
    return mask


def drop_none_mask(kwargs: dict) -> None:
    """Take ``attention_mask=None`` out of ``kwargs``: HF's default, no mask given (code that
    passes an optional mask on gives it), so the tokenizer's or the batch's mask stays."""
    if kwargs.get("attention_mask", 0) is None:
        del kwargs["attention_mask"]


def _as_ids(x, what: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if what == "attention_mask" and x.is_floating_point() and bool(((x == 0) | (x == 1)).all()):
            return x.long()  # (a float mask of 0s and 1s, as HF takes it)
        if x.is_floating_point() or x.is_complex() or (
                x.dtype == torch.bool and what == "input_ids"):
            raise InputError(f"{what} must hold integers, got a tensor of dtype {x.dtype}")
        return x.long() if x.dtype != torch.long else x
    try:
        return torch.as_tensor(x, dtype=torch.long)
    except (TypeError, ValueError, RuntimeError):
        raise InputError(f"{what} must be integers, got {_describe(x)}") from None


def _rows(x) -> list | torch.Tensor:
    """Token ids as a 2-D tensor or a list of 1-D tensors (ragged rows)."""
    if isinstance(x, torch.Tensor):
        x = _as_ids(x, "input_ids")
        if x.dim() == 1:
            return x.unsqueeze(0)
        if x.dim() == 2:
            return x
        raise InputError(
            f"token ids must be a 1-D or 2-D tensor, got shape {tuple(x.shape)}"
        )
    if isinstance(x, (list, tuple)):
        if not x:
            raise InputError(f"empty prompt list: nothing to run the model on; pass {ACCEPTS}")
        if all(_is_int(v) for v in x):
            return _as_ids(list(x), "input_ids").unsqueeze(0)
        if all(isinstance(v, (list, tuple)) or (isinstance(v, torch.Tensor) and v.dim() == 1)
               for v in x):
            rows = []
            for i, v in enumerate(x):
                if isinstance(v, torch.Tensor):
                    rows.append(_as_ids(v, "input_ids"))
                elif all(_is_int(t) for t in v):
                    rows.append(_as_ids(list(v), "input_ids"))
                else:
                    raise InputError(f"row {i} of the token ids is not all integers: "
                                     f"{_describe(v)}; pass {ACCEPTS}")
            return rows
    raise InputError(f"cannot use {_describe(x)} as a prompt; pass {ACCEPTS}")


def _describe(x) -> str:
    if isinstance(x, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in x})
        return f"a {type(x).__name__} of {', '.join(kinds) or 'nothing'}"
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"a {type(x).__name__}"


__all__ = ["ACCEPTS", "check_not_empty", "check_vocab", "drop_none_mask"]
