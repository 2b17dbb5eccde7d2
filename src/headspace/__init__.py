"""headspace: multi-head attention with every head's W_Q, W_K, W_V and W_O in plain sight."""

from .attention import KVCache, MultiHeadAttention
from .heads import Head, HeadList
from .hooks import HookPoint
from .masks import CanonicalMask, canonical_mask, causal_mask

__version__ = "0.1.0"

__all__ = [
    "CanonicalMask",
    "Head",
    "HeadList",
    "HookPoint",
    "KVCache",
    "MultiHeadAttention",
    "__version__",
    "canonical_mask",
    "causal_mask",
]
