"""``python -m headspace``: the ``headspace`` command; with no command, a short demo of the attention layer."""

from __future__ import annotations

import torch

from . import MultiHeadAttention


def demo() -> None:
    torch.manual_seed(0)
    attn = MultiHeadAttention(d_model=512, n_heads=8)  # the textbook configuration
    x = torch.randn(1, 6, 512)  # (batch, seq, d_model)
    out, pattern = attn(x, need_weights=True, is_causal=True)
    print(attn)
    print(f"W_Q {list(attn.W_Q.shape)}  W_K {list(attn.W_K.shape)}  W_V {list(attn.W_V.shape)}  W_O {list(attn.W_O.shape)}")
    print(f"x {list(x.shape)} -> out {list(out.shape)}, pattern {list(pattern.shape)} (per head)")
    print("head 0's causal pattern:")
    for row in pattern[0, 0]:
        print("  " + " ".join(f"{p:5.2f}" for p in row.tolist()))


if __name__ == "__main__":
    from .cli import main

    main()
