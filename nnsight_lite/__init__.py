"""nnsight_lite: read and edit any PyTorch model's activations with ordinary Python.

    NNsight        wrap a torch.nn.Module; ``with model.trace(x):`` runs a body interleaved
    LanguageModel  a Hugging Face causal LM + tokenizer: prompts in, ``.generate(...)``
                   (``TransformersModel``: nnsight 0.8's name for it)
    Envoy          the module proxy inside bodies: .output .input .inputs .next() .skip()
    save(obj)      keep a non-tensor object after the trace (tensors have ``.save()``)
    register(mod)  send a module of yours by value to remote replicas (remote/__init__.py)
    apply, CONFIG  older nnsight names (a plain call; settings such as ``CONFIG.APP.DEBUG``;
                   ``log`` is print, ``list``/``dict``/... the builtins, as nnsight 0.5 had them)
    errors         the exception types (all derive from NNsightError)

Example::

    import torch
    from nnsight_lite import NNsight

    model = NNsight(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    with model.trace(torch.randn(1, 4)):
        h = model[0].output.save()
        model[0].output[:] = 0
        out = model.output.save()
"""

from . import errors, intervention, modeling  # (nnsight's module paths: intervention.envoy...)
from .compat import (CONFIG, NNsightDeprecationWarning, apply, cond, iter, legacy_builtins,
                     local, log, session, stop, trace)
from .envoy import Envoy, save
from .errors import (
    BatchingError,
    BodySyntaxError,
    CacheError,
    CacheKeyError,
    GradientError,
    InferenceModeSwitchError,
    InputError,
    InvokeError,
    MissedModuleError,
    ModulePathError,
    NNsightError,
    NoSourceError,
    NotAContainerError,
    OutOfOrderError,
    OutsideTraceError,
    PolicyError,
    RemoteError,
    RemoteTimeoutError,
    ResultTooLargeError,
    ReusedContextError,
    SourceUnavailableError,
    WithBlockNotFoundError,
)
from .language import Generator, LanguageModel
from .model import NNsight
from .modeling.transformers import TransformersModel
from .modeling.vlm import VisionLanguageModel
from .diffusion import DiffusionModel
from .remote import register
from .tracing import Invoker, Tracer

# nnsight 0.5's other top-level names, for nnsight.stop() and the like (not in __all__: under
# ``import *`` iter would shadow the builtin)
_LEGACY_NAMES = (cond, iter, local, session, stop, trace)
globals().update(legacy_builtins)  # nnsight_lite.list() etc.: nnsight 0.5's legacy aliases
del legacy_builtins

__version__ = "0.1.0"

__all__ = [
    "NNsight",
    "LanguageModel",
    "TransformersModel",
    "VisionLanguageModel",
    "DiffusionModel",
    "Generator",
    "Envoy",
    "Tracer",
    "Invoker",
    "save",
    "register",
    "apply",
    "log",
    "CONFIG",
    "NNsightDeprecationWarning",
    "errors",
    "intervention",
    "modeling",
    "NNsightError",
    "OutOfOrderError",
    "MissedModuleError",
    "ModulePathError",
    "OutsideTraceError",
    "SourceUnavailableError",
    "WithBlockNotFoundError",
    "BodySyntaxError",
    "BatchingError",
    "InputError",
    "InvokeError",
    "CacheError",
    "CacheKeyError",
    "GradientError",
    "InferenceModeSwitchError",
    "NoSourceError",
    "NotAContainerError",
    "PolicyError",
    "RemoteError",
    "RemoteTimeoutError",
    "ResultTooLargeError",
    "ReusedContextError",
]
