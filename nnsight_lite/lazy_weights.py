"""A LanguageModel's weights, loaded late: its tree is built on the meta device, the weights
load at its first local use.

    LazyWeights           the mixin LanguageModel takes these from:
      _auto, _build_meta, _load   the auto class; the tree from the config on meta; the model
      dispatched, dispatch()      whether the weights are in memory; load them now
      _load_deferred(method)      load first, before a module method that changes the model
                                  or hands out its tensors (Envoy._load_first) or an attribute set
    _auto_class(automodel)  ``automodel=`` (a class, or its name in transformers) as the class
    _rebind(envoy, module)  point an Envoy, and the child Envoys it handed out, at a new tree
    _on_meta(module)        whether a module's parameters are on the meta device
    _CONFIG_KWARGS          ``LanguageModel(...)`` keywords that also apply to the config
    _NOT_CONFIG             keywords for loading only, never set on the config
    _LOADS_FIRST            the module methods that load the weights first

Apart from language.py because loading is a concern of its own (transformers' auto classes,
the meta device, keeping the Envoys users hold valid across the swap), with nothing to do with
prompts or generate. It reads the model only through ``self`` (``_source``, ``_load_kwargs``,
``_automodel``), so it imports nothing of language.py (but its name, for type checkers).
"""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING

import torch

from .envoy import Envoy

if TYPE_CHECKING:
    from .language import LanguageModel

#: Keyword arguments of ``LanguageModel(...)`` that also apply to loading the config.
_CONFIG_KWARGS = frozenset({
    "revision", "trust_remote_code", "cache_dir", "local_files_only", "token", "subfolder",
    "gguf_file", "code_revision",
})


#: Keyword arguments of ``LanguageModel(...)`` that are for loading only, never config
#: attributes, even where the config has an attribute of that name (``dtype``).
_NOT_CONFIG = frozenset({
    "config", "dtype", "torch_dtype", "device", "device_map", "attn_implementation",
    "quantization_config", "generation_config", "low_cpu_mem_usage", "max_memory",
    "offload_folder", "use_safetensors", "variant", "key_mapping", "tp_plan", "state_dict",
})


class LazyWeights:
    """The loading side of :class:`~nnsight_lite.language.LanguageModel` (see above)."""

    def _auto(self):
        if self._automodel is not None:
            return self._automodel
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM

    def _build_meta(self) -> torch.nn.Module:
        """The model built from its config on the meta device: the module tree, no weights."""
        from transformers import AutoConfig

        kw = self._load_kwargs
        config = kw.get("config")
        if config is None or isinstance(config, (str, os.PathLike)):
            config = AutoConfig.from_pretrained(
                self._source if config is None else config,
                **{k: v for k, v in kw.items() if k in _CONFIG_KWARGS}
            )
        else:  # a config object, as from_pretrained(config=...) takes it
            config = copy.deepcopy(config)
        # keywords that name config attributes set them, as from_pretrained's do
        # (LanguageModel(path, num_hidden_layers=2)): the tree must be the one that loads
        for k, v in kw.items():
            if k not in _NOT_CONFIG and k not in _CONFIG_KWARGS and hasattr(config, k):
                setattr(config, k, v)
        build = {k: kw[k] for k in ("trust_remote_code", "attn_implementation") if k in kw}
        for key in ("dtype", "torch_dtype"):  # the name the user gave (transformers < 4.56:
            dtype = kw.get(key)                 # torch_dtype only)
            if dtype is not None and dtype != "auto":
                build[key] = dtype
        auto = self._auto()
        # (an Auto class builds with from_config, a model class such as LlamaForCausalLM with
        # its _from_config, which is what from_config calls)
        make = getattr(auto, "from_config", None) or auto._from_config
        with torch.device("meta"):
            module = make(config, **build)
        # what the config and generation config were when built: the changes made to them
        # before loading are carried over to the loaded model's (dispatch)
        self.__dict__["_config_built"] = {
            name: _config_state(getattr(module, name, None)) for name in _CONFIGS}
        return module

    def _load(self) -> torch.nn.Module:
        kw = self._load_kwargs
        device = kw.get("device")  # (nnsight's keyword: HF's from_pretrained has none)
        if "device" in kw:
            kw = {k: v for k, v in kw.items() if k != "device"}
        module = self._auto().from_pretrained(self._source, **kw)
        return module if device is None else module.to(device)

    @property
    def dispatched(self) -> bool:
        """Whether the real weights are loaded (False while the model lives on the meta device)."""
        return self._source is None or not _on_meta(self._module)

    def dispatch(self) -> "LanguageModel":
        """Load the real weights now (``LanguageModel(path)`` defers it to the first use).

        Example::

            model = LanguageModel(path)     # meta device
            model.dispatch()                # weights in memory; model.dispatched is True
        """
        if not self.dispatched:
            shared = self.__dict__.get("_weights_from")  # an edited copy: the original's weights
            if shared is not None:
                _rebind(self, shared.dispatch()._module)
                return self
            loaded = self._load()
            built = self.__dict__.pop("_config_built", None) or {}
            for name, state in built.items():
                if state is not None:
                    _carry_config(getattr(self._module, name, None), state,
                                  getattr(loaded, name, None))
            _rebind(self, loaded)
        return self

    def _load_deferred(self, method: "str | None" = None) -> bool:
        """Load the weights if still on the meta device, before a module ``method`` in
        ``_LOADS_FIRST`` or an attribute set (``method`` None) on this model or one of its
        Envoys (Envoy._load_first); True if they were loaded now."""
        if self.dispatched or (method is not None and method not in _LOADS_FIRST):
            return False
        self.dispatch()
        return True


#: Module methods that load the weights first on a LanguageModel still on the meta device, when
#: called on it or any of its Envoys: loading builds a new module tree, so a mode, flag, hook or
#: state set on the placeholder would otherwise be dropped, silently. Methods that only read
#: (``parameters()``, ``state_dict()``, ``eval()``: a loaded model is in eval mode) do not load:
#: a client that only runs remote traces (or counts parameters) never needs the weights here.
_LOADS_FIRST = frozenset({
    "to", "cuda", "cpu", "half", "float", "double", "bfloat16", "type", "xpu", "mps",
    "train", "requires_grad_", "apply", "load_state_dict", "register_forward_hook",
    "register_forward_pre_hook", "register_full_backward_hook",
    "register_full_backward_pre_hook", "register_backward_hook", "register_buffer",
    "register_parameter", "register_module", "add_module", "set_submodule", "share_memory",
    "compile", "tie_weights", "resize_token_embeddings", "set_input_embeddings",
    "set_output_embeddings", "gradient_checkpointing_enable",
})
# (``set_attn_implementation`` and the like change the config only: carried over at loading)

#: the model's attributes whose changes before loading are carried over to the loaded model
#: (``model.config.use_cache = False``, ``model.generation_config.max_new_tokens = 8``)
_CONFIGS = ("config", "generation_config")


def _config_state(config) -> "dict | None":
    """A copy of an HF config's attributes (its sub-configs' too), to compare against later."""
    if config is None or not hasattr(config, "to_dict"):
        return None
    try:
        return {k: (_config_state(v) if hasattr(v, "to_dict") and hasattr(v, "__dict__")
                    else copy.deepcopy(v)) for k, v in vars(config).items()}
    except Exception:  # (an attribute that cannot be copied: nothing is carried over)
        return None


def _carry_config(meta, built: dict, loaded) -> None:
    """Set on ``loaded`` (the loaded model's config or generation config) the attributes of
    ``meta`` (the placeholder model's) changed since it was built (``built``):
    ``model.config.use_cache = False``, ``model.set_attn_implementation("eager")`` or
    ``model.generation_config.max_new_tokens = 8`` before the first trace, which loading the
    weights would otherwise drop, silently (nnsight 0.8.1 drops them)."""
    if meta is None or loaded is None:
        return
    for key, value in vars(meta).items():
        before = built.get(key, _NOT_SET)
        if isinstance(before, dict) and hasattr(value, "to_dict") and hasattr(value, "__dict__"):
            _carry_config(value, before, getattr(loaded, key, None))  # a sub-config, in place
        elif before is _NOT_SET or not _same(before, value):
            setattr(loaded, key, copy.deepcopy(value))


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # (tensors and the like: compared by identity of their copies)
        return False


_NOT_SET = object()


def _auto_class(automodel):
    """``LanguageModel(automodel=...)`` as a class with ``from_pretrained`` (None: the default):
    a name is looked up in ``transformers``, as nnsight does; anything else raises TypeError
    now rather than at the first trace."""
    if automodel is None:
        return None
    found = automodel
    if isinstance(automodel, str):
        import transformers

        found = getattr(transformers, automodel, None)
    if not (isinstance(found, type) and hasattr(found, "from_pretrained")
            and (hasattr(found, "from_config") or hasattr(found, "_from_config"))):
        what = (f"{automodel!r}, which names no model class in transformers"
                if isinstance(automodel, str) else repr(automodel))
        raise TypeError(
            f"LanguageModel(automodel=...) takes a transformers class to load the model with "
            f"(AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModel, a model class such as "
            f"LlamaForCausalLM) or its name, got {what}"
        )
    return found


def _on_meta(module: torch.nn.Module) -> bool:
    for p in module.parameters():
        return p.is_meta
    return False


def _rebind(envoy: Envoy, module: torch.nn.Module) -> None:
    """Point ``envoy`` and the child Envoys it has handed out at ``module``'s tree.

    Envoys users already hold (``layers = model.model.layers``) keep working after dispatch.
    """
    d = envoy.__dict__
    d["_module"] = module
    subs = d.get("_subs", {})
    for name, child in list(subs.items()):
        sub = module._modules.get(name)
        if sub is None:
            del subs[name]
        else:
            _rebind(child, sub)
    # The index cache (``envoy[i]``) holds the child Envoy, alone or first in a tuple.
    items = d.get("_items", {})
    for key, hit in list(items.items()):
        child = hit[0] if isinstance(hit, tuple) else hit
        try:
            sub = module[key]
        except (IndexError, KeyError, TypeError):
            sub = None
        if isinstance(sub, torch.nn.Module) and isinstance(child, Envoy):
            _rebind(child, sub)
        else:
            del items[key]


__all__ = ["LazyWeights"]
