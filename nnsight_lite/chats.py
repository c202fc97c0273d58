"""Chat messages as prompts: ``model.trace([{"role": "user", "content": "Hi"}])``, as nnsight 0.8
and Hugging Face pipelines take them (LanguageModel's helper; not exported from the package).

    CHAT_KWARGS              the keywords that shape a chat's template (not the forward's)
    as_chats(prompt)         the conversations in a prompt (one, or a list of them), or None
    chat_ids(tok, chats, kw) each conversation's token ids, from the tokenizer's chat template
    template_options(m, kw)  the chat template's keywords for one conversation (also processors.py)

A conversation is a list of messages, dicts with ``"role"`` and ``"content"``; a list of
conversations is a batch, one row each. Each is templated as the text-generation pipeline does
it: with the generation prompt (the assistant's turn opened), unless it ends with an assistant
message, which is then continued (``continue_final_message=`` decides where given). The ids are
the template's own (no special tokens added on top), so a prompt is what the model sees in
``model.pipe(messages)``.
"""

from __future__ import annotations

from .errors import InputError

#: Keywords of a chat prompt's invoke that go to ``apply_chat_template``, not to the model.
CHAT_KWARGS = frozenset({"continue_final_message", "add_generation_prompt", "tools", "documents"})


def _is_message(m) -> bool:
    return isinstance(m, dict) and "role" in m and "content" in m


def as_chats(prompt):
    """``[conversation, ...]`` where ``prompt`` is one conversation or a list of them, else
    None (any other prompt)."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return None
    if _is_message(prompt[0]):
        return [list(prompt)]
    if all(isinstance(c, (list, tuple)) and c and _is_message(c[0]) for c in prompt):
        return [list(c) for c in prompt]
    return None


def template_options(messages: list, options: dict) -> dict:
    """``apply_chat_template``'s keywords for one conversation: ``options`` with the
    conversation continued where it ends with an assistant message (``continue_final_message=``
    decides where given), and the generation prompt added where it is not."""
    kw = dict(options)
    cont = kw.pop("continue_final_message", None)
    if cont is None:
        cont = messages[-1].get("role") == "assistant"
    kw.setdefault("add_generation_prompt", not cont)
    kw["continue_final_message"] = cont
    return kw


def chat_ids(tokenizer, chats: list, options: dict) -> list:
    """The token ids of each conversation (a list of lists of ints), through the tokenizer's
    chat template. ``options``: tokenizer options (``max_length``, ``truncation``) and
    ``CHAT_KWARGS``."""
    if tokenizer is None:
        raise InputError(
            "a chat prompt (a list of messages) needs a tokenizer with a chat template, and this "
            "LanguageModel was given a built model without one: give it one "
            "(LanguageModel(model, tokenizer=...)) or pass token ids"
        )
    if getattr(tokenizer, "chat_template", None) is None:
        raise InputError(
            f"a chat prompt (a list of messages) is turned into tokens by the tokenizer's chat "
            f"template, and this tokenizer ({type(tokenizer).__name__}) has none: pass the "
            "conversation as text, or set model.tokenizer.chat_template"
        )
    options = {k: v for k, v in options.items() if k != "add_special_tokens"}
    rows = []
    for messages in chats:
        for i, m in enumerate(messages):
            if not _is_message(m):
                raise InputError(
                    f"message {i} of a chat prompt is {type(m).__name__} "
                    f"{m!r:.60}; every message is a dict with 'role' and 'content'"
                )
        enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            **template_options(messages, options))
        rows.append(list(enc["input_ids"]))
    return rows
