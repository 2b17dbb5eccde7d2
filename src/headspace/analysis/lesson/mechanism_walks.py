r"""What ``explain`` records to walk latent attention, differential attention and shared keys/values.

The one-head walk of :mod:`.explain` reads every layer's hook values. Three attention fields
(:data:`headspace.attention.walkable.RECORDED_FIELDS`) need more than the plain hook points:

* ``kv_source`` (Gemma 3n / 4): the layer has no keys and values of its own. Its ``k``, ``v``,
  ``rot_k`` and ``k_normed`` are its owner's recorded values (layer ``kv_source``, the same tensors),
  and ``shared_k`` / ``shared_v`` [batch, n_kv_heads, seq_k, d_head] are the keys and values the layer
  read from the model's shared store as its forward began (a forward pre-hook): the walk
  ``scores = q_rot k_shared^T * scale``, ``z_h = p v_shared`` is exact on them.
* ``latent`` (DeepSeek MLA): ``hook_q`` is before the rotation, ``hook_k`` after it; ``rot_q``
  [batch, seq, n_heads, qk_head_dim] is ``[q_nope, R(i) q_rope]`` recomputed with the layer's rotary
  tables, and ``rot_k`` is ``hook_k`` (``[c W_kb[h], R(j) x W_kr]``), so that
  ``q_rot . k_rot_j * scale == hook_scores``; ``latent`` (``c``) and ``rope_k`` are recorded too.
* ``differential`` (DiffLlama): ``diff_pattern`` (``p_1 - lambda p_2`` per pair) and ``z_normed`` are
  recorded; ``hook_result`` is per pair, so :func:`head_results` splits each pair's output into its two
  heads at the run's frozen pair-norm scale ``s = 1 / rms(z_j - lambda z_{j+P})``::

      c_j     = (1 - lambda_init) s z_j W_pair[j]             (head j < P: the positive map)
      c_{j+P} = -(1 - lambda_init) s lambda z_{j+P} W_pair[j]  (its partner)

  with ``W_pair[j]`` the [2 d_head, d_model] rows of ``W_O`` of pair ``j``: ``c_j + c_{j+P}`` is the
  pair's ``hook_result`` exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ...nn.hooks import on_call
from ...nn.positions import rotary_tables, rotate_fused
from . import walk_steps  # noqa: F401  (register the steps kv_source, latent, differential)

__all__ = [
    "capture_shared_kv",
    "flow_norms",
    "head_results",
    "mechanism_names",
    "recorded",
]

#: the owner's recorded values a ``kv_source`` layer reads as its own
SHARED_NAMES = ("k", "v", "rot_k", "k_normed")


def _spec_field(attn: Any, name: str) -> Any:
    return getattr(getattr(attn, "spec", None), name, None)


def mechanism_names(model: nn.Module) -> list[str]:
    """The extra hook points (short names) ``explain`` records on ``model``'s layers: ``latent`` and
    ``rope_k`` where a layer is latent, ``diff_pattern`` and ``z_normed`` where one is differential."""
    attns = [b.attn for b in getattr(model, "blocks", ())]
    names: list[str] = []
    if any(_spec_field(a, "latent") is not None for a in attns):
        names += ["latent", "rope_k"]
    if any(_spec_field(a, "differential") is not None for a in attns):
        names += ["diff_pattern", "z_normed"]
    return names


def capture_shared_kv(model: nn.Module) -> tuple[dict[int, tuple[Tensor, Tensor]], Callable[[], None]]:
    """({block index: (k, v)}, remove): before every call of each ``kv_source`` layer of ``model`` (the
    hook machinery's :func:`~headspace.nn.hooks.on_call`), keep the keys and values [batch, n_kv_heads,
    seq_k, d_head] it reads from the shared store."""
    kept: dict[int, tuple[Tensor, Tensor]] = {}
    removers: list[Callable[[], None]] = []
    for i, block in enumerate(getattr(model, "blocks", ())):
        source = _spec_field(block.attn, "kv_source")
        if source is None:
            continue

        def keep(module: nn.Module, _args: Any, _kwargs: Any, i: int = i, source: int = source) -> None:
            store = getattr(module, "kv_store", None)
            if store is not None and source in store:
                k, v = store[source]
                kept[i] = (k.detach().clone(), v.detach().clone())  # (B, Hkv, Sk, dh) x 2

        removers.append(on_call(block.attn, keep))

    def remove() -> None:
        for r in removers:
            r()

    return kept, remove


def _read(t: Any, path: str, name: str) -> Tensor | None:
    try:
        return t[f"{path}.hook_{name}"]
    except KeyError:
        return None


def recorded(
    t: Any,
    model: nn.Module,
    index: Sequence[int | None],
    names: Sequence[str],
    shared: dict[int, tuple[Tensor, Tensor]],
) -> dict[str, list[Tensor | None]]:
    """Per name of ``names``, per block of ``model``: the trace ``t``'s value (None for a Gated DeltaNet
    block, ``index[block]`` None, or a hook point that layer lacks), with the module docstring's
    additions: a ``kv_source`` layer's keys and values from its owner and ``shared_k`` / ``shared_v``,
    a latent layer's ``rot_q`` / ``rot_k``."""
    blocks = list(getattr(model, "blocks", ()))
    rec: dict[str, list[Tensor | None]] = {
        n: [None if j is None else _read(t, t.layer_paths[j], n) for j in index] for n in names
    }
    for name in ("shared_k", "shared_v"):
        if shared:
            rec[name] = [None] * len(blocks)
    for b, (k, v) in shared.items():
        rec["shared_k"][b], rec["shared_v"][b] = k, v
    for b, block in enumerate(blocks):
        source = _spec_field(block.attn, "kv_source")
        if source is not None:
            for n in SHARED_NAMES:
                if n in rec and rec[n][b] is None:
                    rec[n][b] = rec[n][source]
    latent = [b for b, block in enumerate(blocks) if _spec_field(block.attn, "latent") is not None]
    if latent and "rot_q" not in rec and "q" in rec:
        rec["rot_q"], rec["rot_k"] = [None] * len(blocks), [None] * len(blocks)
        for b in latent:
            rec["rot_q"][b] = latent_rotated_q(blocks[b].attn, rec["q"][b])
            rec["rot_k"][b] = rec["k"][b]
    return rec


def latent_rotated_q(attn: Any, q: Tensor | None) -> Tensor | None:
    """A latent layer's queries after the rotation, ``[q_nope, R(i) q_rope]``: q [batch, seq, n_heads,
    qk_head_dim] (``hook_q``, positions ``0 .. seq - 1``) -> the same shape (q itself without rotary)."""
    if q is None or attn.rotary is None:
        return q
    nope = attn.latent.qk_nope_head_dim
    pos = torch.arange(q.shape[1], device=q.device)  # (seq,)
    cos, sin = rotary_tables(attn.rotary, pos, q.dtype, q.device)  # (1, 1, seq, rope) x 2
    rope = rotate_fused(q[..., nope:].transpose(1, 2), cos, sin, attn.rotary)  # (B, H, seq, rope)
    return torch.cat((q[..., :nope], rope.transpose(1, 2)), dim=-1)  # (B, seq, H, dqk)


def _pair_rows(attn: Any) -> Tensor:
    """``W_pair`` [n_pairs, 2 d_head, d_model]: each pair's rows of ``W_O`` (a differential layer)."""
    P = attn.n_pairs
    return attn.o_weight.detach().view(attn.d_model, P, 2 * attn.d_head).permute(1, 2, 0)  # (P, 2 dh, d)


def head_results(attn: Any, result: Tensor, z: Tensor) -> Tensor:
    """Each head's part of the layer's output for one token, [n_heads, d_model]: ``result`` [n_heads,
    d_model] (``hook_result`` at the token) itself, except on a differential layer, whose ``result`` is
    per pair [n_pairs, d_model]: there each head's part at the frozen pair-norm scale (module docstring;
    :meth:`~headspace.attention.differential.DifferentialAttention.head_parts`), from ``z`` [n_heads,
    2 d_head] (``hook_z`` at the token). The rows sum to ``result.sum(0)``."""
    if _spec_field(attn, "differential") is None:
        return result
    return attn.head_parts(z)  # (H, d_model)


def flow_norms(attn: Any, values: Tensor) -> Tensor:
    """``|| v_j W_O[h] ||`` for every head h and key j, [n_heads, seq_k], from one sequence's ``hook_v``
    ``values`` [seq_k, n_kv_heads, d_v]: query head h reads key/value head ``h // group_size``. On a
    differential layer, head h of pair j reads ``[v_g, v_{g + n_kv_heads/2}]`` through ``W_pair[j]``,
    weighted by ``(1 - lambda_init)`` (and ``|lambda|`` for the partner ``j + P``), before the pair's norm."""
    if _spec_field(attn, "differential") is None:
        W_O = attn.W_O.detach().float()  # (H, d_v, d_model)
        v = values.float().repeat_interleave(W_O.shape[0] // values.shape[1], dim=1)  # (seq_k, H, d_v)
        return torch.einsum("khd,hdm->hkm", v, W_O).norm(dim=-1)  # (H, seq_k)
    half = attn.n_kv_heads // 2
    wide = torch.cat((values[:, :half], values[:, half:]), dim=-1).float()  # (seq_k, Hkv/2, 2 dh)
    wide = wide.repeat_interleave(attn.group_size, dim=1)  # (seq_k, P, 2 dh): pair j's values
    norms = torch.einsum("kpd,pdm->pkm", wide, _pair_rows(attn).float()).norm(dim=-1)  # (P, seq_k)
    lam = float(attn.lambda_full().detach().abs())
    return (1.0 - attn.lambda_init) * torch.cat((norms, lam * norms), dim=0)  # (H, seq_k)
