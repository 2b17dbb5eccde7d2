"""headspace: multi-head attention with every head's W_Q, W_K, W_V and W_O in plain sight."""

from .attention import KVCache, MultiHeadAttention
from .block import TransformerBlock
from .heads import Head, HeadList
from .hooks import HookPoint
from .masks import CanonicalMask, canonical_mask, causal_mask
from .models import Decoder, Encoder, ModelConfig
from .pretrained import load, load_bert, load_gpt2

__version__ = "0.1.0"

__all__ = [
    "CanonicalMask",
    "Decoder",
    "Encoder",
    "Head",
    "HeadList",
    "HookPoint",
    "KVCache",
    "ModelConfig",
    "MultiHeadAttention",
    "TransformerBlock",
    "__version__",
    "canonical_mask",
    "causal_mask",
    "load",
    "load_bert",
    "load_gpt2",
]
