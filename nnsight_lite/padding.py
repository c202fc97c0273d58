"""Padding token ids, masks and embeddings to one length (prompts.py's helpers).

    side(tok)           the side prompts are padded on: the tokenizer's ``padding_side``
    _pad_id(tok)        the id padding is made of (the tokenizer's pad token, else 0)
    with_pad_token(tok) give a tokenizer without a pad token its eos token (with a warning)
    _pad_ragged(rows)   ragged rows of ids as ``(ids, mask)``, padded
    _stack(rows)        ragged rows of ids as one padded tensor (no mask)
    pad_to(x, width)    rows of ids, mask or embeddings padded to ``width`` positions

Apart from prompts.py because it knows nothing of prompts: only tensors, a width and the
tokenizer's two padding settings. prompts.py imports it (``prompts.with_pad_token`` and
``prompts._pad_id`` are these), not the other way round.
"""

from __future__ import annotations

import warnings

import torch

from .errors import InputError


def side(tokenizer) -> str:
    """The side prompts are padded on: the tokenizer's ``padding_side`` ("left" unless set to
    "right"; "left" without a tokenizer)."""
    return "right" if getattr(tokenizer, "padding_side", "left") == "right" else "left"


def _pad_id(tokenizer) -> int:
    """The id padding is made of (masked out, so any id does where there is no tokenizer)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return 0 if pad is None else pad


def with_pad_token(tokenizer):
    """Give ``tokenizer`` its eos token as pad token (with a warning) if it has none."""
    if tokenizer is not None and tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise InputError(
                f"the tokenizer ({type(tokenizer).__name__}) has neither a pad token nor an "
                "eos token to pad with; set tokenizer.pad_token = '...' before wrapping"
            )
        warnings.warn(
            f"the tokenizer has no pad token; using its eos token {tokenizer.eos_token!r} for "
            "padding (tokenizer.pad_token = tokenizer.eos_token). Padded positions are masked "
            "out, so this does not change results.",
            UserWarning,
            stacklevel=3,
        )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _pad_ragged(rows, pad: int, on: str = "left"):
    """Ragged rows (or a 2-D tensor) as ``(ids, mask)`` padded on side ``on``."""
    if isinstance(rows, torch.Tensor):
        return rows, torch.ones_like(rows)
    width = max(r.shape[0] for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = r.shape[0]
        if n:
            cols = slice(width - n, width) if on == "left" else slice(0, n)
            ids[i, cols] = r
            mask[i, cols] = 1
    return ids, mask


def _stack(rows):
    ids, _ = _pad_ragged(rows, 0)
    return ids


def pad_to(x: torch.Tensor, width: int, value: int, on: str = "left") -> torch.Tensor:
    """``x`` (rows of ids, mask or embeddings) padded on side ``on`` with ``value`` to
    ``width`` positions (dim 1)."""
    n = width - x.shape[1]
    if n == 0:
        return x
    fill = x.new_full((x.shape[0], n, *x.shape[2:]), value)
    return torch.cat([fill, x] if on == "left" else [x, fill], 1)


__all__ = ["side", "with_pad_token", "pad_to"]
