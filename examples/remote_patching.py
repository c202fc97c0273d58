"""The demo's patching example, run on a model served by a Ray cluster.

    ray start --head --num-cpus 2 && python -m nnsight_lite.remote serve smollm2
    python examples/remote_patching.py

The model here stays on the meta device: the weights live only on the replica.
"""

import nnsight_lite
from nnsight_lite import remote
from nnsight_lite.models import smollm2

remote.connect("auto")                   # the cluster `ray start --head` made on this machine
model = smollm2()                        # meta device; served as "SmolLM2-135M-Instruct"

with model.trace(remote=True) as tracer:
    with tracer.invoke("The Eiffel Tower is in the city of"):
        eiffel = model.model.layers[20].output[:, -1]
    with tracer.invoke("The Colosseum is in the city of"):
        model.model.layers[20].output[:, -1] = eiffel        # patch the residual stream
        patched = model.lm_head.output.save()                # only this comes back
print("patched:", model.tokenizer.decode(patched[-1, -1].argmax()))

with model.generate("The Eiffel Tower is in", max_new_tokens=5, remote=True) as tracer:
    ids = model.generator.output.save()
print(model.tokenizer.decode(ids[0]), "| weights here:", model.dispatched)
