"""headspace: multi-head attention with every head's W_Q, W_K, W_V and W_O in plain sight."""

from . import analysis, compat, layouts, train  # train: headspace.train.train(TrainConfig(...), run_dir)
from .attention import KVCache, MultiHeadAttention
from .block import TransformerBlock
from .heads import FactoredMatrix, Head, HeadList
from .hooks import HookPoint
from .interventions import ablate, prune_heads
from .masks import CanonicalMask, canonical_mask, causal_mask
from .models import Decoder, Encoder, ModelConfig
from .pretrained import load, load_bert, load_gpt2
from .trace import Trace, trace  # trace() shadows the submodule: use `from headspace.trace import ...`
from .train.checkpoint import CheckpointError

__version__ = "0.1.0"

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
    "load_gpt2",
    "prune_heads",
    "trace",
    "train",
]
