# %% [markdown]
# # Gradients
#
# `with loss.backward():` runs its body alongside backpropagation: inside it, `h.grad` is the
# gradient with respect to `h` as backprop reaches it, and assigning to it changes what flows on
# to earlier layers. This notebook shows reading, ablating, replacing, stopping and scaling
# gradients on a small network, then uses gradients for **attribution patching** on SmolLM2-135M.
# Each claim is checked against plain PyTorch (`retain_grad`, `register_hook`).
#
# Built from `notebooks/src/gradients.py` by `python scripts/build_notebooks.py gradients`.

# %%
import matplotlib.pyplot as plt
import torch

import nnsight_lite
from nnsight_lite import NNsight

torch.manual_seed(0)
net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()) for _ in range(4)])
model = NNsight(net)
x = torch.randn(3, 6)

def plain_grads(edit=None):
    """Plain PyTorch: each block's output gradient (retain_grad) and each block's weight
    gradient; ``edit=(i, fn)`` attaches ``fn`` as a gradient hook on block i's output."""
    net.zero_grad()
    hs, h = [], x
    for i, block in enumerate(net):
        h = block(h)
        h.retain_grad()
        if edit is not None and edit[0] == i:
            h.register_hook(edit[1])
        hs.append(h)
    h.sum().backward()
    weights = [block[0].weight.grad.clone() for block in net]
    net.zero_grad()
    return [t.grad for t in hs], weights

model

# %% [markdown]
# ## The gradient at one layer
# Inside the backward block, `h.grad` waits until backprop reaches `h` and is its gradient.

# %%
with model.trace(x):
    h2 = model[2].output
    with model.output.sum().backward():
        g2 = h2.grad.save()

reference, _ = plain_grads()
assert torch.allclose(g2, reference[2])
g2.shape

# %% [markdown]
# ## Several layers: read in reverse order
# Backprop runs from the loss towards the input, so gradients arrive last layer first; a loop over `reversed(...)` reads them all in one backward pass.

# %%
with model.trace(x):
    hs = [model[i].output for i in range(4)]
    with model.output.sum().backward():
        grads = nnsight_lite.save({i: hs[i].grad for i in reversed(range(4))})

for i in range(4):
    assert torch.allclose(grads[i], reference[i])
{i: round(g.norm().item(), 4) for i, g in grads.items()}

# %% [markdown]
# Reading them in forward order is a mistake the library names (this cell is meant to raise): the first layer's gradient arrives last, so asking for it first would leave the later ones already gone.

# %% tags=["raises-exception"]
with model.trace(x):
    h0, h3 = model[0].output, model[3].output
    with model.output.sum().backward():
        first = h0.grad.save()   # arrives last of all
        last = h3.grad.save()    # by now backprop has passed this one

# %% [markdown]
# ## Ablating and replacing gradients
# Assigning into `h.grad[...]` edits the gradient that flows on to earlier layers; `h.grad = g` replaces it. Earlier weights see the change.

# %%
net.zero_grad()                      # earlier cells' backward passes accumulated into .grad
with model.trace(x):
    h2 = model[2].output
    with model.output.sum().backward():
        h2.grad[:, :3] = 0           # ablate half the units' gradient
w0_ablated = net[0][0].weight.grad.clone()
net.zero_grad()

def ablate(g):
    g = g.clone()
    g[:, :3] = 0
    return g
_, plain_w = plain_grads(edit=(2, ablate))
assert torch.allclose(w0_ablated, plain_w[0])

with model.trace(x):
    h2 = model[2].output
    with model.output.sum().backward():
        h2.grad = torch.ones_like(h2.grad)    # pretend d loss / d h2 is all ones
w0_replaced = net[0][0].weight.grad.clone()
net.zero_grad()
_, plain_w = plain_grads(edit=(2, torch.ones_like))
assert torch.allclose(w0_replaced, plain_w[0])
print("ablated and replaced gradients reach layer 0's weights as plain gradient hooks make them")

# %% [markdown]
# ## Stopping and scaling gradient flow at a module
# Zeroing a module's output gradient stops learning upstream of it (a `detach` after the fact); multiplying it scales everything upstream.

# %%
def weight_grad_norms(scale):
    """Each block's weight-gradient norm when block 1's output gradient is multiplied by scale."""
    net.zero_grad()
    with model.trace(x):
        h1 = model[1].output
        with model.output.sum().backward():
            h1.grad = h1.grad * scale
    norms = [block[0].weight.grad.norm().item() for block in net]
    net.zero_grad()
    return norms

normal, stopped, halved = weight_grad_norms(1.0), weight_grad_norms(0.0), weight_grad_norms(0.5)
assert stopped[0] == stopped[1] == 0 and stopped[2:] == normal[2:]
assert all(abs(h - n / 2) < 1e-6 for h, n in zip(halved[:2], normal[:2])) and halved[2:] == normal[2:]

fig, ax = plt.subplots(figsize=(6, 3))
for i, (label, norms) in enumerate([("unchanged", normal), ("× 0.5 at block 1", halved), ("× 0 at block 1", stopped)]):
    ax.bar([b + (i - 1) * 0.27 for b in range(4)], norms, width=0.27, label=label)
ax.set_xticks(range(4), [f"block {b}" for b in range(4)])
ax.set_ylabel("‖∂loss/∂weight‖")
ax.set_title("editing block 1's output gradient changes blocks 0 and 1 only")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## `retain_graph`: two backward passes over one forward
# As in PyTorch, `retain_graph=True` keeps the graph so a second backward block can run over the same forward.

# %%
with model.trace(x):
    h1 = model[1].output
    out = model.output
    with out[:, 0].sum().backward(retain_graph=True):
        g_first = h1.grad.save()
    with out[:, 1].sum().backward():
        g_second = h1.grad.save()
net.zero_grad()

ref_h1 = net[1](net[0](x))
ref_out = net[3](net[2](ref_h1))
plain_first = torch.autograd.grad(ref_out[:, 0].sum(), ref_h1, retain_graph=True)[0]
plain_second = torch.autograd.grad(ref_out[:, 1].sum(), ref_h1)[0]
assert torch.allclose(g_first, plain_first) and torch.allclose(g_second, plain_second)
print("two backward blocks over one forward match torch.autograd.grad")

# %% [markdown]
# ## A backward outside any trace
# `with loss.backward():` works on any graph, such as tensors saved from a trace: the forward is over, and the gradients still come.

# %%
with model.trace(x):
    early = model[0].output.save()
    logits = model.output.save()

with logits.pow(2).mean().backward():
    g_early = early.grad.save()
net.zero_grad()

ref_early = net[0](x)
plain_early = torch.autograd.grad(net[3](net[2](net[1](ref_early))).pow(2).mean(), ref_early)[0]
assert torch.allclose(g_early, plain_early)
g_early.shape

# %% [markdown]
# ## Attribution patching on SmolLM2
# Activation patching needs a forward per (layer, position). Attribution patching estimates all of them at once from one clean forward, one corrupt forward and one backward: the effect of patching `h` is about `(h_clean - h_corrupt) · ∂metric/∂h`, with the gradient taken on the corrupt run.

# %%
import transformers
from tqdm.auto import tqdm
from nnsight_lite.models import smollm2

transformers.utils.logging.disable_progress_bar()
lm = smollm2(dispatch=True)
tok, hf = lm.tokenizer, lm._module
N_LAYERS = len(hf.model.layers)
PARIS, ROME = tok(" Paris")["input_ids"][0], tok(" Rome")["input_ids"][0]
CLEAN, CORRUPT = "The Eiffel Tower is in the city of", "The Colosseum is in the city of"
tokens = [tok.decode(i) for i in tok(CORRUPT)["input_ids"]]

def logit_diff(logits):
    return logits[:, -1, PARIS] - logits[:, -1, ROME]

with lm.trace(CLEAN):
    clean_acts = nnsight_lite.save([lm.model.layers[i].output.detach() for i in range(N_LAYERS)])
    clean_diff = nnsight_lite.save(logit_diff(lm.lm_head.output).item())

with lm.trace(CORRUPT):
    acts = [lm.model.layers[i].output for i in range(N_LAYERS)]
    metric = logit_diff(lm.lm_head.output).sum()
    corrupt_diff = nnsight_lite.save(metric.item())
    corrupt_acts = nnsight_lite.save([a.detach() for a in acts])
    with metric.backward():
        grads = nnsight_lite.save([acts[i].grad for i in reversed(range(N_LAYERS))][::-1])
lm.zero_grad(set_to_none=True)

attribution = torch.stack([((c - k) * g).sum(-1)[0] for c, k, g in zip(clean_acts, corrupt_acts, grads)])
attribution = attribution / (clean_diff - corrupt_diff)

# ground truth for the gradients: retain_grad on every layer output in a plain HF forward
kept = []
def keep(module, inputs, output):
    output.retain_grad()
    kept.append(output)
handles = [layer.register_forward_hook(keep) for layer in hf.model.layers]
try:
    plain_metric = logit_diff(hf(**tok(CORRUPT, return_tensors="pt")).logits).sum()
    plain_metric.backward()
finally:
    for handle in handles:
        handle.remove()
for g, o in zip(grads, kept):
    assert torch.allclose(g, o.grad, atol=1e-5)
lm.zero_grad(set_to_none=True)
del kept
print("gradients at all", N_LAYERS, "layers match retain_grad on a plain HF forward")

# %% [markdown]
# Real activation patching on a few cells (the three the estimate ranks highest and three it ranks near zero) shows how far to trust the picture. The estimate is linear: it is good at the last token in late layers, and poor at the subject's tokens in early layers, where real patching restores most of the gap (compare the heatmap in `patching_and_lens.ipynb`).

# %%
def really_patched(layer, pos):
    """The restored share when the clean activation is actually patched in (one forward)."""
    with lm.trace(CORRUPT):
        lm.model.layers[layer].output[:, pos] = clean_acts[layer][:, pos]
        diff = nnsight_lite.save(logit_diff(lm.lm_head.output).item())
    return (diff - corrupt_diff) / (clean_diff - corrupt_diff)

order = attribution.flatten().argsort(descending=True)
top = [divmod(int(i), attribution.shape[1]) for i in order[:3]]
small = [divmod(int(i), attribution.shape[1]) for i in order[attribution.flatten().abs()[order] < 0.01][:3]]
checks = {cell: (attribution[cell].item(), really_patched(*cell)) for cell in tqdm(top + small, desc="patching")}
for cell in top:
    assert checks[cell][1] > 0.5, (cell, checks[cell])      # what the estimate ranks highest matters
for cell in small:
    assert abs(checks[cell][1]) < 0.05, (cell, checks[cell])  # what it calls negligible is
{f"layer {l}, {tokens[p]!r}": f"estimate {a:+.2f}, patched {r:+.2f}" for (l, p), (a, r) in checks.items()}

# %%
fig, ax = plt.subplots(figsize=(7, 8))
lim = attribution.abs().max().item()
im = ax.imshow(attribution.detach(), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", origin="lower")
ax.set_xticks(range(len(tokens)), [repr(t) for t in tokens], rotation=45, ha="right")
ax.set_yticks(range(0, N_LAYERS, 2))
ax.set_xlabel("position in the corrupt prompt")
ax.set_ylabel("layer output")
ax.set_title("Attribution patching: estimated share of the ' Paris' − ' Rome'\n"
             "logit difference restored by patching in the Eiffel Tower's activation")
for (l, p), (a, r) in checks.items():
    ax.add_patch(plt.Rectangle((p - 0.5, l - 0.5), 1, 1, fill=False, edgecolor="black", lw=1.5))
fig.colorbar(im, ax=ax, label="estimated restored share (black boxes: checked by real patching)",
             shrink=0.8)
fig.tight_layout()
plt.show()
