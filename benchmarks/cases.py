"""Rows 1-3 of the benchmark table: a Linear stack, a tiny GPT-2, gradients.

Every function takes ``lib`` (the module ``nnsight_lite``, or ``nnsight`` in the peer process:
the bodies are the same code, only the import differs) and returns a :class:`Group`. Case keys:
``plain`` (the model alone), ``hooks.*`` (bare PyTorch hooks doing the same work), ``lib.*``
(the library's trace). ``checks`` pairs each ``lib.*`` case with the ``hooks.*`` case it must
equal before anything is timed.
"""

from __future__ import annotations

import torch

from _timing import Group

N_LAYERS, WIDTH, BATCH = 24, 64, 8
GPT_LAYERS, GPT_WIDTH, PROMPT_LEN = 12, 64, 10
INVOKES = (1, 4, 16, 64)
WORDS = ("the eiffel tower is in city of paris colosseum rome when mary and john went to store "
         "gave a drink hello world hi big small red blue dog cat sat on mat").split()
PROMPT = "the eiffel tower is in the city of paris hello"  # 10 words, 10 tokens


def with_hooks(run, modules, hook):
    """``run()`` with ``hook`` registered as a forward hook on each of ``modules`` (removed after,
    as a user's hand-written hooks would be)."""
    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        return run()
    finally:
        for h in handles:
            h.remove()


def saved_by_hooks(run, modules) -> list:
    """The outputs of ``modules`` during ``run()``, kept by forward hooks, in call order."""
    saved = []
    with_hooks(run, modules, lambda m, i, o: saved.append(o))
    return saved


# --------------------------------------------------------------------------- row 1


def linear_stack(lib, scale: int = 1) -> Group:
    """24 x Linear(64) on a (8, 64) input."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(N_LAYERS)])
    x = torch.randn(BATCH, WIDTH)
    model = lib.NNsight(net)
    layers = list(net)
    save = lib.save

    def plain():
        return net(x)

    def hooks_empty():
        return net(x)

    def hooks_save_last():
        return saved_by_hooks(plain, [layers[-1]])[0]

    def hooks_save_all():
        return saved_by_hooks(plain, layers)

    def _edit(m, i, o):
        o[:, 0] = 0

    def hooks_edit_all():
        return with_hooks(plain, layers, _edit)

    def hooks_replace_all():
        return with_hooks(plain, layers, lambda m, i, o: o * 2)

    def lib_empty():
        with model.trace(x):
            out = model.output.save()
        return out

    def lib_save_last():
        with model.trace(x):
            out = model[23].output.save()
        return out

    def lib_save_all():
        with model.trace(x):
            hs = save([model[i].output.save() for i in range(24)])
        return hs

    def lib_edit_all():
        with model.trace(x):
            for i in range(24):
                model[i].output[:, 0] = 0
            out = model.output.save()
        return out

    def lib_replace_all():
        with model.trace(x):
            for i in range(24):
                model[i].output = model[i].output * 2
            out = model.output.save()
        return out

    cases = {"plain": plain}
    for name in ("empty", "save_last", "save_all", "edit_all", "replace_all"):
        cases[f"hooks.{name}"] = locals()[f"hooks_{name}"]
        cases[f"lib.{name}"] = locals()[f"lib_{name}"]
    cases["hooks.empty"] = hooks_empty
    checks = [(f"lib.{n}", f"hooks.{n}")
              for n in ("save_last", "save_all", "edit_all", "replace_all")]
    checks.append(("lib.empty", "plain"))
    reads = {"run": plain, "one": layers[-1:], "all": layers,
             "cases": ("hooks.save_last", "hooks.save_all", "lib.save_last", "lib.save_all")}
    return Group("linear", cases, checks, rounds=30, inner=40, warmup=50, reads=reads)


# --------------------------------------------------------------------------- rows 2 and 3


def tokenizer():
    """A word-level fast tokenizer over WORDS (built offline, no hub)."""
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                eos_token="<eos>", pad_token="<eos>")


def tiny_gpt2():
    """GPT-2 from a config: 12 blocks, width 64, random weights (seeded), eval mode."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=GPT_LAYERS, n_embd=GPT_WIDTH, n_head=4,
                                     vocab_size=len(WORDS) + 2, n_positions=128,
                                     bos_token_id=1, eos_token_id=1, pad_token_id=1)
    return transformers.GPT2LMHeadModel(config).eval()


def _detached(out):
    """A module output with its tensors detached, comparable across runs: a model output
    object as a plain tuple of its values, any other object by its type's name."""
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, dict):
        return tuple(_detached(v) for v in out.values())
    if isinstance(out, (tuple, list)):
        return tuple(_detached(v) for v in out)
    return type(out).__name__  # (a KV cache object: each forward makes its own)


def gpt2(lib, scale: int = 1) -> Group:
    """Row 2: one block, all blocks, all MLP outputs zeroed; N invokes each saving the last
    block (the plain side: one forward of the N prompts batched, one hook), through
    LanguageModel and through the plain NNsight wrapper (``nn_invokes``: no tokenizer, no
    attention mask; the difference is LanguageModel's own input handling)."""
    hf = tiny_gpt2()
    tok = tokenizer()
    model = lib.LanguageModel(hf, tokenizer=tok)
    bare = lib.NNsight(hf)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    assert ids.shape == (1, PROMPT_LEN), ids.shape
    blocks = list(hf.transformer.h)
    mlps = [b.mlp for b in blocks]
    save = lib.save
    prompts = {n: [ids.roll(i, 1) for i in range(n)] for n in INVOKES}
    batched = {n: torch.cat(prompts[n]) for n in INVOKES}

    def plain():
        return hf(ids).logits

    def hooks_save_one():
        return saved_by_hooks(plain, [blocks[5]])[0]

    def hooks_save_all():
        return saved_by_hooks(plain, blocks)

    def _zero(m, i, o):
        o[:] = 0

    def hooks_zero_mlps():
        return with_hooks(plain, mlps, _zero)

    def lib_save_one():
        with model.trace(ids):
            h = model.transformer.h[5].output.save()
        return h

    def lib_save_all():
        with model.trace(ids):
            hs = save([model.transformer.h[i].output.save() for i in range(12)])
        return hs

    def lib_zero_mlps():
        with model.trace(ids):
            for i in range(12):
                model.transformer.h[i].mlp.output[:] = 0
            out = model.lm_head.output.save()
        return out

    named = [(f"model.{n}" if n else "model", m) for n, m in hf.named_modules()]

    def hooks_cache_all():
        # every module's output, detached, by path (what a hand-written run_with_cache keeps)
        kept = {}
        handles = [m.register_forward_hook(
            lambda m, i, o, n=n: kept.__setitem__(n, _detached(o))) for n, m in named]
        try:
            plain()
        finally:
            for h in handles:
                h.remove()
        return kept

    def lib_cache_all():
        with model.trace(ids) as tracer:
            cache = tracer.cache()
        return {k: _detached(cache[k].output) for k in cache.keys()}  # (nnsight's view has
        # keys() and [], not items())

    def hooks_invokes(n):
        return list(saved_by_hooks(lambda: hf(batched[n]), [blocks[-1]])[0].split(1))

    def lib_invokes(n, wrapper=model):
        with wrapper.trace() as tracer:
            outs = save([])
            for p in prompts[n]:
                with tracer.invoke(p):
                    outs.append(wrapper.transformer.h[-1].output)
        return outs

    cases = {"plain": plain}
    for name in ("save_one", "save_all", "zero_mlps", "cache_all"):
        cases[f"hooks.{name}"] = locals()[f"hooks_{name}"]
        cases[f"lib.{name}"] = locals()[f"lib_{name}"]
    checks = [(f"lib.{n}", f"hooks.{n}") for n in ("save_one", "save_all", "zero_mlps",
                                                    "cache_all")]
    for n in INVOKES:
        cases[f"hooks.invokes_{n}"] = lambda n=n: hooks_invokes(n)
        cases[f"lib.invokes_{n}"] = lambda n=n: lib_invokes(n)
        cases[f"lib.nn_invokes_{n}"] = lambda n=n: lib_invokes(n, bare)
        checks.append((f"lib.invokes_{n}", f"hooks.invokes_{n}"))
        checks.append((f"lib.nn_invokes_{n}", f"hooks.invokes_{n}"))
    reads = {"run": plain, "one": blocks[5:6], "all": blocks,
             "cases": ("hooks.save_one", "hooks.save_all", "lib.save_one", "lib.save_all")}
    return Group("gpt2", cases, checks, rounds=20, inner=10, warmup=10, reads=reads)


def grads(lib, scale: int = 1) -> Group:
    """Row 3: a trace whose backward block reads 1 and 12 block grads, against ``retain_grad``
    in forward hooks; plain ``loss.backward()`` with and without nnsight_lite's patch."""
    hf = tiny_gpt2()
    tok = tokenizer()
    model = lib.LanguageModel(hf, tokenizer=tok)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    blocks = list(hf.transformer.h)
    save = lib.save
    original = getattr(lib, "unpatched_backward", None)

    def plain():
        hf.zero_grad(set_to_none=True)
        loss = hf(ids).logits.sum()
        loss.backward()
        return loss

    def _retain(kept):
        def hook(m, i, o):
            o.retain_grad()
            kept.append(o)
        return hook

    def hooks_grads(n):
        hf.zero_grad(set_to_none=True)
        kept = []
        loss = with_hooks(lambda: hf(ids).logits.sum(), blocks[-n:], _retain(kept))
        loss.backward()
        return [h.grad for h in reversed(kept)]

    def lib_grad_1():
        hf.zero_grad(set_to_none=True)
        with model.trace(ids):
            h = model.transformer.h[11].output
            loss = model.lm_head.output.sum()
            with loss.backward():
                g = save([h.grad])
        return g

    def lib_grad_12():
        hf.zero_grad(set_to_none=True)
        with model.trace(ids):
            hs = [model.transformer.h[i].output for i in range(12)]
            loss = model.lm_head.output.sum()
            with loss.backward():
                gs = save([h.grad for h in reversed(hs)])
        return gs

    cases = {"plain": plain,
             "hooks.grad_1": lambda: hooks_grads(1), "hooks.grad_12": lambda: hooks_grads(12),
             "lib.grad_1": lib_grad_1, "lib.grad_12": lib_grad_12}
    checks = [("lib.grad_1", "hooks.grad_1"), ("lib.grad_12", "hooks.grad_12")]
    if original is not None:  # nnsight_lite only: Tensor.backward patched against unpatched

        def hooks_backward():  # (named hooks.* to sit in the hooks column: it is the floor)
            hf.zero_grad(set_to_none=True)
            loss = hf(ids).logits.sum()
            original(loss)
            return loss

        cases["hooks.backward"] = hooks_backward
        cases["lib.backward"] = plain
        checks.append(("lib.backward", "hooks.backward"))
    return Group("grads", cases, checks, rounds=20, inner=10, warmup=10)
