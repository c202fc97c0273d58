"""Rows 4 and 5 of the benchmark table: generation on the tiny GPT-2, the real SmolLM2-135M.

Same conventions as cases.py (``lib`` is nnsight_lite or, in the peer process, nnsight).
"""

from __future__ import annotations

import torch

from _timing import Group
from cases import PROMPT, saved_by_hooks, tiny_gpt2, tokenizer, with_hooks

NEW_TOKENS = 50
SMOL_PROMPT = "The Eiffel Tower is in the city of"


def generation(lib, scale: int = 1) -> Group:
    """Row 4: 50 new tokens, the last block's last position saved at every step."""
    hf = tiny_gpt2()
    tok = tokenizer()
    model = lib.LanguageModel(hf, tokenizer=tok)
    enc = tok(PROMPT, return_tensors="pt")
    ids = enc["input_ids"]
    last = hf.transformer.h[-1]
    kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
              pad_token_id=1)
    save = lib.save

    def plain():
        return hf.generate(**enc, **kw)

    def hooks_generate():
        hs = []
        with_hooks(lambda: hf.generate(**enc, **kw), [last], lambda m, i, o: hs.append(o[:, -1]))
        return hs

    def lib_generate():
        with model.generate(ids, **kw) as tracer:
            hs = save([])
            for step in tracer.iter[:NEW_TOKENS]:
                hs.append(model.transformer.h[-1].output[:, -1])
        return hs

    cases = {"plain": plain, "hooks.generate": hooks_generate, "lib.generate": lib_generate}
    return Group("generate", cases, [("lib.generate", "hooks.generate")],
                 rounds=8, inner=2, warmup=2)


def smollm2(lib, path, scale: int = 1) -> Group:
    """Row 5: SmolLM2-135M, one prompt, every decoder layer's output and the logits saved.
    ``plain`` gets token ids; ``lib.*_prompt`` tokenizes inside the trace, ``tokenize`` is the
    tokenizer's own time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = lib.LanguageModel(hf, tokenizer=tok)
    enc = dict(tok(SMOL_PROMPT, return_tensors="pt"))
    ids = enc["input_ids"]
    layers = list(hf.model.layers)
    n = len(layers)
    save = lib.save

    def plain():
        return hf(**enc).logits

    def tokenize():
        return dict(tok(SMOL_PROMPT, return_tensors="pt"))["input_ids"]

    def hooks_save_all():
        return saved_by_hooks(plain, layers + [hf.lm_head])

    def hooks_save_all_prompt():
        e = dict(tok(SMOL_PROMPT, return_tensors="pt"))
        return saved_by_hooks(lambda: hf(**e), layers + [hf.lm_head])

    def lib_save_all():
        with model.trace(ids):
            hs = save([model.model.layers[i].output.save() for i in range(n)])
            hs.append(model.lm_head.output.save())
        return hs

    def lib_save_all_prompt():
        with model.trace(SMOL_PROMPT):
            hs = save([model.model.layers[i].output.save() for i in range(n)])
            hs.append(model.lm_head.output.save())
        return hs

    def lib_empty():
        with model.trace(ids):
            out = model.output.save()
        return out.logits

    cases = {"plain": plain, "hooks.tokenize": tokenize, "lib.tokenize": tokenize,
             "hooks.save_all": hooks_save_all, "lib.save_all": lib_save_all,
             "hooks.save_all_prompt": hooks_save_all_prompt,
             "lib.save_all_prompt": lib_save_all_prompt,
             "hooks.empty": plain, "lib.empty": lib_empty}
    probe = getattr(lib, "install_probe", None)
    if probe is not None:  # nnsight_lite only: putting the counting wrappers on and off
        cases["hooks.install"] = _nothing
        cases["lib.install"] = probe(model)
    checks = [("lib.save_all", "hooks.save_all"), ("lib.save_all_prompt", "hooks.save_all"),
              ("lib.empty", "plain"), ("lib.tokenize", "hooks.tokenize")]
    return Group("smollm2", cases, checks, rounds=10, inner=4, warmup=4)


def _nothing():
    return None
