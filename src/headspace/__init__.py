"""headspace: multi-head attention with every head's W_Q, W_K, W_V and W_O in plain sight.

``import headspace`` is the public face. Its names load on first use (module ``__getattr__``), so
``import headspace`` and ``headspace --help`` do not import torch; ``from headspace import X`` works as
it always did.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it (relative to this package).
_NAMES = {
    "CanonicalMask": ".masks",
    "canonical_mask": ".masks",
    "causal_mask": ".masks",
    "CheckpointError": ".train.checkpoint",
    "Decoder": ".models",
    "Encoder": ".models",
    "ModelConfig": ".config",
    "FactoredMatrix": ".circuits",
    "Head": ".heads",
    "HeadList": ".heads",
    "HookPoint": ".hooks",
    "KVCache": ".decode",
    "MultiHeadAttention": ".attention",
    "Trace": ".trace",
    "trace": ".trace",
    "TransformerBlock": ".block",
    "ablate": ".interventions",
    "prune_heads": ".interventions",
    "load": ".pretrained",
    "load_bert": ".pretrained",
    "load_gpt2": ".pretrained",
    "load_llama": ".pretrained",
    "load_gguf": ".pretrained",
}
#: submodules that are public names themselves (``headspace.analysis.head_roles`` ...).
_MODULES = ("analysis", "compat", "layouts", "train")

__all__ = [
    "CanonicalMask",
    "CheckpointError",
    "Decoder",
    "Encoder",
    "FactoredMatrix",
    "Head",
    "HeadList",
    "HookPoint",
    "KVCache",
    "ModelConfig",
    "MultiHeadAttention",
    "Trace",
    "TransformerBlock",
    "__version__",
    "ablate",
    "analysis",
    "canonical_mask",
    "causal_mask",
    "compat",
    "layouts",
    "load",
    "load_bert",
    "load_gguf",
    "load_gpt2",
    "load_llama",
    "prune_heads",
    "trace",
    "train",
]


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name], __name__), name)
    elif name in _MODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'headspace' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__ (and `trace` stays the function)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, eagerly
    from . import analysis, compat, layouts, train
    from .attention import MultiHeadAttention
    from .block import TransformerBlock
    from .circuits import FactoredMatrix
    from .config import ModelConfig
    from .decode import KVCache
    from .heads import Head, HeadList
    from .hooks import HookPoint
    from .interventions import ablate, prune_heads
    from .masks import CanonicalMask, canonical_mask, causal_mask
    from .models import Decoder, Encoder
    from .pretrained import load, load_bert, load_gguf, load_gpt2, load_llama
    from .trace import Trace, trace
    from .train.checkpoint import CheckpointError
