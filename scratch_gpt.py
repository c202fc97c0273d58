import torch, transformers, warnings
from nnsight_lite import NNsight, LanguageModel
torch.manual_seed(0)
cfg = transformers.GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_layer=2, n_head=4)
hf = transformers.GPT2LMHeadModel(cfg).eval()
model = NNsight(hf)
print(model.transformer.h[0].attn.source)
ids = torch.randint(0, 50, (2, 5))
with model.trace(ids):
    inner = model.transformer.h[0].attn.source.attention_interface_0.source
    print(inner)
    m = inner.torch_nn_functional_scaled_dot_product_attention_0.output.save() if 'torch_nn_functional_scaled_dot_product_attention_0' in dir(inner) else None
    w = model.transformer.h[0].attn.source.attention_interface_0.output.save()
    out = model.output.logits.save()
print(type(w), w[0].shape, m is None or m.shape)
print(model.transformer.h[0].__dict__.get('forward'))
with model.trace(ids):
    blk = model.transformer.h[0].source
    print(dir(blk))
    o = model.transformer.h[0].source.self_attn_0.output.save()
print(type(o))
