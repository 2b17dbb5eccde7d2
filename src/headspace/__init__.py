"""headspace: multi-head attention with every head's W_Q, W_K, W_V and W_O in plain sight.

``import headspace`` is the public face. Its names load on first use (module ``__getattr__``), so
``import headspace`` and ``headspace --help`` do not import torch; ``from headspace import X`` works as
it always did.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import TYPE_CHECKING, Any

from .model import decoding as _decoding

__version__ = "0.1.0"

#: public name -> the module that defines it (relative to this package).
_NAMES = {
    "CanonicalMask": ".nn.masks",
    "canonical_mask": ".nn.masks",
    "causal_mask": ".nn.masks",
    "CheckpointError": ".train.checkpoint",
    "Decoder": ".model.models",
    "Encoder": ".model.models",
    "EncoderDecoder": ".model.encdec",
    "EncDecConfig": ".model.encdec",
    "ModelConfig": ".model.config",
    "FactoredMatrix": ".attention.circuits",
    "Head": ".attention.heads",
    "HeadList": ".attention.heads",
    "HookPoint": ".nn.hooks",
    "KVCache": ".nn.kv_cache",
    "MultiHeadAttention": ".attention.layer",
    "Trace": ".analysis.trace.trace",
    "trace": ".analysis.trace.trace",
    "TransformerBlock": ".model.block",
    "ablate": ".analysis.causal.interventions",
    "prune_heads": ".analysis.causal.interventions",
    "load": ".pretrained",
    "load_bert": ".pretrained",
    "load_gpt2": ".pretrained",
    "load_llama": ".pretrained",
    "load_gguf": ".pretrained",
}
#: submodules that are public names themselves (``headspace.analysis.head_roles`` ...).
_MODULES = ("analysis", "train")

__all__ = [
    "CanonicalMask",
    "CheckpointError",
    "Decoder",
    "EncDecConfig",
    "Encoder",
    "EncoderDecoder",
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


#: the modules that moved into packages (#26): old name -> new home. ``import headspace.masks`` (and
#: ``from headspace.masks import X``) keeps working: the finder below hands out the new module itself,
#: so the two names are one module object (a monkeypatch of either is seen by both).
_MOVED = {
    "checks": "core.checks", "errors": "core.errors", "defaults": "core.defaults", "fileio": "core.fileio",
    "html": "core.html", "progress": "core.progress", "process_group": "core.process_group",
    "masks": "nn.masks", "positions": "nn.positions", "norms": "nn.norms", "hooks": "nn.hooks",
    "inputs": "nn.inputs",
    "functional": "attention.functional", "heads": "attention.heads", "circuits": "attention.circuits",
    "pruning": "attention.pruning", "compat": "attention.compat",
    "block": "model.block", "config": "model.config", "layouts": "model.layouts", "models": "model.models",
    "parallel": "distributed.head_parallel", "model.parallel": "distributed.head_parallel",
    "train.distributed": "distributed.data_parallel",
    "trace": "analysis.trace.trace", "interventions": "analysis.causal.interventions",
    "explain": "analysis.lesson.explain",
    "tokenization": "pretrained.tokenization",
    "decoding": "decode.plan", "generate": "decode.loop", "workspace": "kernels.workspace",
    "decode.kv_cache": "nn.kv_cache",
    "train.plots": "viz.training",
    # analysis/ in rooms (#37); analysis.atlas, .circuits and .trace are the rooms' packages, which
    # re-export their old modules' public names (the modules: atlas.run, circuits.edges, trace.trace)
    "analysis.atlas_state": "analysis.atlas.state", "analysis.atlas_measure": "analysis.atlas.measure",
    "analysis.atlas_ablation": "analysis.atlas.ablation", "analysis.corpus": "analysis.atlas.corpus",
    "analysis.atlas_guard": "analysis.atlas.guard",
    "analysis.patching": "analysis.causal.patching", "analysis.attribution": "analysis.causal.attribution",
    "analysis.interventions": "analysis.causal.interventions",
    "analysis.causal_inputs": "analysis.causal.causal_inputs",
    "analysis.ablation": "analysis.causal.ablation",
    "analysis.targets": "analysis.causal.targets", "analysis.atp_star": "analysis.circuits.atp_star",
    "analysis.causal.atp_star": "analysis.circuits.atp_star",
    "analysis.atp_edges": "analysis.circuits.atp_edges",
    "analysis.atlas_importance": "analysis.atlas.importance",
    "analysis.cross_lesson": "analysis.lesson.cross",
    "analysis.alignment": "analysis.lesson.alignment",
    "analysis.encdec_patching": "analysis.causal.encdec_patching",
    "analysis.budget": "analysis.causal.budget",
    "analysis.graph": "analysis.circuits.graph", "analysis.decomposition": "analysis.circuits.decomposition",
    "analysis.tasks": "analysis.circuits.tasks",
    "analysis.explain": "analysis.lesson.explain", "analysis.roles": "analysis.lesson.roles",
    "analysis.subspaces": "analysis.lesson.subspaces", "analysis.rotary": "analysis.lesson.rotary",
    "analysis.mixing": "analysis.lesson.mixing", "analysis.chunked": "analysis.lesson.chunked",
    "analysis.content_tokens": "analysis.lesson.content_tokens",
}  # fmt: skip


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``headspace.<old name>`` for every module that moved: the module at its new home."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        head, _, tail = fullname.partition(".")
        if head != __name__ or tail not in _MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        module = importlib.import_module(f"{__name__}.{_MOVED[spec.name.partition('.')[2]]}")
        spec.loader_state = module.__spec__  # the import system sets the old name's spec on it next
        return module

    def exec_module(self, module: Any) -> None:
        """Nothing runs (the module ran at its new home); its own spec is put back."""
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def _load_decoding() -> None:
    """Import :mod:`headspace.decode`, which registers what ``Decoder.generate`` runs."""
    importlib.import_module(f"{__name__}.decode")


# The decoding package sits above the model, which never imports it (headspace.model.decoding): the
# package's face tells the model's registry how to load it on the first generate (torch is not imported).
_decoding.load_with(_load_decoding)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name], __name__), name)
    elif name in _MODULES:
        value = importlib.import_module(f".{name}", __name__)
    elif name in _MOVED:
        value = importlib.import_module(f"{__name__}.{name}")  # through the finder below
    else:
        raise AttributeError(f"module 'headspace' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__ (and `trace` stays the function)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, eagerly
    from . import analysis, train
    from .analysis.causal.interventions import ablate, prune_heads
    from .analysis.trace.trace import Trace, trace
    from .attention import compat
    from .attention.circuits import FactoredMatrix
    from .attention.heads import Head, HeadList
    from .attention.layer import MultiHeadAttention
    from .model import layouts
    from .model.block import TransformerBlock
    from .model.config import ModelConfig
    from .model.encdec import EncDecConfig, EncoderDecoder
    from .model.models import Decoder, Encoder
    from .nn.hooks import HookPoint
    from .nn.kv_cache import KVCache
    from .nn.masks import CanonicalMask, canonical_mask, causal_mask
    from .pretrained import load, load_bert, load_gguf, load_gpt2, load_llama
    from .train.checkpoint import CheckpointError
