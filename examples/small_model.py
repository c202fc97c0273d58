"""A two-minute tour of nnsight_lite on a small model: read, edit, compare, patch.

Run: .venv/bin/python examples/small_model.py (needs only torch)
"""

import torch

import nnsight_lite
from nnsight_lite import NNsight

torch.manual_seed(0)
net = torch.nn.Sequential(
    torch.nn.Linear(4, 16), torch.nn.ReLU(),
    torch.nn.Linear(16, 16), torch.nn.ReLU(),
    torch.nn.Linear(16, 3),
)
model = NNsight(net)
print(model)

clean = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
corrupt = torch.tensor([[-1.0, 0.5, 1.0, -0.5]])

# 1. Read: the hidden activations and the output, in one forward.
with model.trace(clean):
    hidden = model[1].output.save()
    logits = model.output.save()
print(f"\n1. read: {int((hidden > 0).sum())} of 16 first-layer units fire; logits {logits.tolist()}")

# 2. Edit: silence the most active unit and see what changes.
top = int(hidden.argmax())
with model.trace(clean):
    model[1].output[:, top] = 0
    ablated = model.output.save()
shift = (ablated - logits).abs().max().item()
print(f"2. edit: zeroing unit {top} moves the logits by at most {shift:.4f}")

# 3. Compare: how different are the two inputs' second hidden layers?
with model.trace() as tracer:
    with tracer.invoke(clean):
        h_clean = model[3].output.save()
    with tracer.invoke(corrupt):
        h_corrupt = model[3].output.save()
        corrupt_logits = model.output.save()
cos = torch.nn.functional.cosine_similarity(h_clean, h_corrupt).item()
print(f"3. compare: cosine similarity of layer-3 activations, clean vs corrupt = {cos:.3f}")

# 4. Patch: put the clean layer-3 activations into the corrupt run, one batched forward.
with model.trace() as tracer:
    with tracer.invoke(clean):
        source = model[3].output
    with tracer.invoke(corrupt):
        model[3].output[:] = source
        patched = model.output.save()
restored = torch.allclose(patched, logits, atol=1e-6)
print(f"4. patch: corrupt logits {corrupt_logits.tolist()}\n"
      f"          after patching layer 3 from clean: {patched.tolist()} "
      f"(equal to the clean logits: {restored})")

# 5. Shapes without compute: scan runs on fake tensors.
with model.scan(torch.zeros(128, 4)):
    shape = nnsight_lite.save(tuple(model[2].output.shape))
print(f"5. scan: layer 2 output shape for a batch of 128 is {shape}, computed without running it")
