# %% [markdown]
# # Activation patching and the logit lens
#
# Two classic pictures of where a language model keeps what it knows, on SmolLM2-135M:
#
# 1. **Activation patching**: run "The Colosseum is in the city of" but copy in the residual stream
#    of "The Eiffel Tower is in the city of" at one layer and one token position. Where the copy
#    makes the model say " Paris" instead of " Rome", that activation carries the answer.
# 2. **Logit lens**: read every layer's residual stream through the model's final norm and
#    unembedding, to see the prediction forming layer by layer.
#
# Every number in the pictures is checked against plain Hugging Face forwards with hooks.
#
# Built from `notebooks/src/patching_and_lens.py` by `python scripts/build_notebooks.py patching_and_lens`.

# %%
import matplotlib.pyplot as plt
import torch
import transformers
from tqdm.auto import tqdm

import nnsight_lite
from nnsight_lite.models import smollm2

transformers.utils.logging.disable_progress_bar()
lm = smollm2(dispatch=True)
tok, hf = lm.tokenizer, lm._module   # hf: the plain Hugging Face model, for ground truth
layers = hf.model.layers
N_LAYERS = len(layers)
PARIS, ROME = tok(" Paris")["input_ids"][0], tok(" Rome")["input_ids"][0]
CLEAN = "The Eiffel Tower is in the city of"
CORRUPT = "The Colosseum is in the city of"
clean_tokens = [tok.decode(i) for i in tok(CLEAN)["input_ids"]]
corrupt_tokens = [tok.decode(i) for i in tok(CORRUPT)["input_ids"]]
assert len(clean_tokens) == len(corrupt_tokens)   # position p means the same slot in both
N_POS = len(clean_tokens)
list(zip(clean_tokens, corrupt_tokens))

# %% [markdown]
# ## The metric: how much more the model says " Paris" than " Rome"
# The logit difference at the last token is high for the clean prompt and low for the corrupt one; patching results are reported as the share of that gap they restore.

# %%
def logit_diff(logits):
    """logit(' Paris') - logit(' Rome') at the last position, one value per batch row."""
    return logits[:, -1, PARIS] - logits[:, -1, ROME]

def plain_logits(prompt, hooks=()):
    """Logits of a plain HF forward, with (module, hook) pairs attached for the call."""
    handles = [m.register_forward_hook(fn) for m, fn in hooks]
    try:
        with torch.no_grad():
            return hf(**tok(prompt, return_tensors="pt")).logits
    finally:
        for handle in handles:
            handle.remove()

with lm.trace() as tracer:
    with tracer.invoke(CLEAN):
        clean_diff = nnsight_lite.save(logit_diff(lm.lm_head.output).item())
    with tracer.invoke(CORRUPT):
        corrupt_diff = nnsight_lite.save(logit_diff(lm.lm_head.output).item())

assert abs(clean_diff - logit_diff(plain_logits(CLEAN)).item()) < 1e-3
assert abs(corrupt_diff - logit_diff(plain_logits(CORRUPT)).item()) < 1e-3
print(f"logit(' Paris') - logit(' Rome'): clean {clean_diff:.2f}, corrupt {corrupt_diff:.2f}")

# %% [markdown]
# ## Patching every layer × position
# One trace per layer: the first invoke runs the clean prompt, and one invoke per position runs the corrupt prompt with that position's clean activation written in, all in one batched forward.

# %%
restored = torch.zeros(N_LAYERS, N_POS)
for layer in tqdm(range(N_LAYERS), desc="layers"):
    with lm.trace() as tracer:
        with tracer.invoke(CLEAN):
            clean_h = lm.model.layers[layer].output
        diffs = nnsight_lite.save([])
        for pos in range(N_POS):
            with tracer.invoke(CORRUPT):
                lm.model.layers[layer].output[:, pos] = clean_h[:, pos]
                diffs.append(logit_diff(lm.lm_head.output).item())
    restored[layer] = (torch.tensor(diffs) - corrupt_diff) / (clean_diff - corrupt_diff)

# %% [markdown]
# Four cells, re-done with plain forward hooks on the Hugging Face model, one prompt at a time:

# %%
def patched_by_hooks(layer, pos):
    """The restored share for one cell, from plain HF forwards and hooks."""
    seen = {}
    plain_logits(CLEAN, [(layers[layer], lambda m, i, o: seen.update(h=o.clone()))])
    def write(mod, inp, out):
        out = out.clone()
        out[:, pos] = seen["h"][:, pos]
        return out
    diff = logit_diff(plain_logits(CORRUPT, [(layers[layer], write)])).item()
    return (diff - corrupt_diff) / (clean_diff - corrupt_diff)

best = divmod(int(restored.argmax()), N_POS)
CHECKED = [best, (12, 3), (23, N_POS - 1), (N_LAYERS - 1, N_POS - 1)]
for layer, pos in CHECKED:
    assert abs(restored[layer, pos].item() - patched_by_hooks(layer, pos)) < 1e-3, (layer, pos)
# the answer moves: at the subject's tokens early, at the last token late
assert restored[:8, 1:4].max() > 0.8 and restored[:8, -1].abs().max() < 0.1
assert restored[-1, -1] > 0.99
print("checked against plain hooks at (layer, position):", CHECKED)

# %%
fig, ax = plt.subplots(figsize=(7, 8))
im = ax.imshow(restored, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto", origin="lower")
ax.set_xticks(range(N_POS), [f"{c!r}\n{k!r}" for c, k in zip(clean_tokens, corrupt_tokens)],
              rotation=60, ha="right", fontsize=8)
ax.set_yticks(range(0, N_LAYERS, 2))
ax.set_xlabel("position patched (clean token / corrupt token)")
ax.set_ylabel("layer whose output is patched")
ax.set_title("Eiffel Tower → Colosseum: share of the ' Paris' − ' Rome'\nlogit difference restored by patching one activation")
fig.colorbar(im, ax=ax, label="restored share (1 = clean, 0 = corrupt)", shrink=0.8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The logit lens
# Each layer's output, read through the final norm and the unembedding (calling the model's own modules inside the body), gives that layer's guess at the next token; the picture shows the top guess and its probability at every layer and position.

# %%
PROMPT = "When Mary and John went to the store, John gave a drink to"
tokens = [tok.decode(i) for i in tok(PROMPT)["input_ids"]]
with lm.trace(PROMPT):
    top_p = nnsight_lite.save([])
    top_id = nnsight_lite.save([])
    for layer in range(N_LAYERS):
        probs = lm.lm_head(lm.model.norm(lm.model.layers[layer].output)).softmax(-1)
        p, i = probs[0].max(-1)
        top_p.append(p)
        top_id.append(i)
    final = lm.lm_head.output.save()
top_p, top_id = torch.stack(top_p).detach(), torch.stack(top_id)

# ground truth: the hidden states HF returns (its last one is already normed)
with torch.no_grad():
    out = hf(**tok(PROMPT, return_tensors="pt"), output_hidden_states=True)
    states = list(out.hidden_states[1:-1]) + [None]
    plain = [hf.lm_head(hf.model.norm(h)) if h is not None else out.logits for h in states]
plain_p, plain_id = torch.stack([x[0].softmax(-1).max(-1)[0] for x in plain]), torch.stack([x[0].argmax(-1) for x in plain])
assert torch.allclose(top_p, plain_p, atol=1e-4) and torch.equal(top_id, plain_id)
assert torch.equal(top_id[-1], final[0].argmax(-1))           # the last layer's lens is the model
assert tok.decode(int(top_id[-1, -1])) == " Mary"
print("lens matches HF's hidden states; final guess:", repr(tok.decode(int(top_id[-1, -1]))))

# %%
fig, ax = plt.subplots(figsize=(12, 11))
im = ax.imshow(top_p, cmap="viridis", vmin=0, vmax=1, aspect="auto", origin="lower")
for layer in range(N_LAYERS):
    for pos in range(len(tokens)):
        word = tok.decode(int(top_id[layer, pos])).strip()[:7] or "␣"
        ax.text(pos, layer, word, ha="center", va="center", fontsize=7,
                color="black" if top_p[layer, pos] > 0.6 else "white")
ax.set_xticks(range(len(tokens)), [repr(t) for t in tokens], rotation=45, ha="right")
ax.set_yticks(range(0, N_LAYERS, 2))
ax.set_xlabel("input token (the guess is for the token after it)")
ax.set_ylabel("layer")
ax.set_title(f"Logit lens on SmolLM2-135M: top next-token guess at each layer\n{PROMPT!r}")
fig.colorbar(im, ax=ax, label="probability of the top guess", shrink=0.8)
fig.tight_layout()
plt.show()
