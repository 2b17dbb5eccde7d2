"""The explorer's differential maps (DiffLlama, :mod:`headspace.attention.differential`).

Heads pair up, ``j`` with ``j + P`` (``P = n_heads / 2``), and pair ``j``'s map is
``D_j = P_j - lambda P_{j+P}`` (``hook_diff_pattern``). The page stores, per differential layer::

    differential  {"lambda": the layer's lambda, "lambda_init", "n_pairs": P, "eps": the pair norm's eps,
                   "recomputed": whether the page recomputes D_j from its stored q and k (float32 pages),
                   "label": one line saying what the page draws}
    diff_maps     [P, seq, seq]   hook_diff_pattern of this run (what a float16 page draws, said so)
    shares        [seq, n_heads]  each head's pair's share of the output (hook_result is per pair)

and nothing for another layer. The page computes each pair's ``y_j = (1 - lambda_init) RMSNorm(D_j
[v_g, v_{g + n_kv_heads/2}])`` and ``out = sum_j y_j W_O[2j : 2j + 2] + b_O`` itself
(assets/explorer_mechanisms.js).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...analysis import shares_from_result
from ...attention.differential import DifferentialAttention

#: The hook point of a differential layer's pair maps.
DIFF_HOOK = "hook_diff_pattern"
#: D_j recomputed from the page's float32 q, k must equal the traced map within this.
RECOMPUTE_ATOL = 1e-5


def traced_diff(t: Any, name: str) -> Tensor | None:
    """Layer ``name``'s traced pair maps [n_pairs, seq, seq] (batch 1 dropped, float32), or None."""
    key = f"{name}.{DIFF_HOOK}"
    return t[key][0].float() if key in t else None


def diff_fields(
    attn: Any, diff: Tensor | None, pattern: Tensor, result: Tensor, pack: Any, dtype: str
) -> dict[str, Any]:
    """The page fields of a differential layer (module docstring): {} for another layer. ``diff`` [P, seq,
    seq] is the traced ``hook_diff_pattern``, ``pattern`` [n_heads, seq, seq] the traced per-head maps
    (what the page recomputes from q, k), ``result`` [seq, P, d_model] each pair's part; ``pack(tensor,
    dtype)`` packs an array for the page."""
    if not isinstance(attn, DifferentialAttention) or diff is None:
        return {}
    P = attn.n_pairs
    lam = float(attn.lambda_full().detach())
    with torch.no_grad():
        mine = pattern[:P].double() - lam * pattern[P:].double()  # (P, S, S): D_j from the per-head maps
    pair_shares = shares_from_result(result.unsqueeze(0))[0][0]  # (S, P)
    recomputed = dtype == "float32" and bool((mine - diff.double()).abs().max() <= RECOMPUTE_ATOL)
    where = "recomputed from q, k" if recomputed else "the stored hook_diff_pattern"
    return {
        "differential": {
            "lambda": lam,
            "lambda_init": attn.lambda_init,
            "n_pairs": P,
            "eps": float(attn.norm_eps),
            "recomputed": recomputed,
            "label": f"differential pairs (j, j + {P}): D_j = p_1 - lambda p_2 ({where}), a norm per pair; "
            "a head's share is its pair's",
        },
        "diff_maps": pack(diff, dtype),
        "shares": pack(pair_shares[:, torch.arange(attn.n_heads) % P], "float32"),  # (S, H): h's pair
    }
