r"""The lesson's steps for shared keys/values, latent attention and differential attention (issue 39).

Each reads the explained layer's recorded values (:attr:`SchemeContext.values`, batch row 0, as
:mod:`.mechanism_walks` records them) and checks the walk against the layer's hook points; a layer
without the field gets no step. Registered on import (:mod:`.mechanism_walks` imports this module):

* ``"kv_source"`` (Gemma 3n / 4, ``spec.kv_source = s``): the layer reads layer ``s``'s keys and values
  (its ``W_K`` / ``W_V`` are layer ``s``'s tensors). ``max |k - k_owner|`` between the keys the layer
  read and layer ``s``'s own recorded keys (``hook_rot_k``, else ``hook_k_normed``, else ``hook_k``),
  and the walk on them: ``max |scale q_rot . k_j - hook_scores|`` over the row's visible keys and
  ``max |sum_j p_j v_j - hook_z[h]|``.
* ``"latent"`` (DeepSeek MLA, ``spec.latent``): ``c = RMSNorm(x W_kva)`` [kv_lora_rank] at the top keys;
  each top key's score split into its non-rotary part ``scale q_nope . c_j W_kb[h]`` and its shared
  rotary part ``scale R(i) q_rope . R(j) x_j W_kr`` (their sum against ``hook_scores``); ``k_nope = c
  W_kb[h]`` and ``v = c W_vb[h]`` recomputed from ``hook_latent`` against ``hook_k`` / ``hook_v``; the
  cache's numbers per token, ``kv_lora_rank + qk_rope_head_dim`` against ``n_heads (qk_head_dim +
  v_head_dim)`` (``2 n_heads d_head`` where the widths agree) for per-head keys and values.
* ``"differential"`` (DiffLlama, ``spec.differential = lambda_init``): head ``h``'s pair ``j = h mod P``:
  ``p_1`` (head ``j``) and ``p_2`` (head ``j + P``) on the top keys, ``lambda``, ``p_1 - lambda p_2``
  against ``hook_diff_pattern``, and the pair's norm before ``W_O``: ``y = (1 - lambda_init)
  (z_1 - lambda z_2) / rms(z_1 - lambda z_2)`` against ``hook_z_normed``.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from ...nn.norms import rms_inverse
from .scheme_steps import SchemeContext, SchemeStep, register_scheme_step

__all__ = ["differential_step", "kv_source_step", "latent_step"]


def _value(c: SchemeContext, name: str) -> Tensor | None:
    v = (c.values or {}).get(name)
    return None if v is None else v[0].detach()


def _visible(c: SchemeContext) -> list[int]:
    return [int(j) for j in c.keys if c.scores is None or math.isfinite(float(c.scores[j]))]


def _gap(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def kv_source_step(c: SchemeContext) -> SchemeStep | None:
    """Shared keys and values: the owner layer and the walk on the keys and values read from it."""
    source = getattr(getattr(c.attn, "spec", None), "kv_source", None)
    k_read, v_read = _value(c, "shared_k"), _value(c, "shared_v")
    if source is None or k_read is None or v_read is None or c.index is None:
        return None
    k_read, v_read = k_read.transpose(0, 1), v_read.transpose(0, 1)  # (Sk, Hkv, dh) x 2
    owner = next((n for n in ("rot_k", "k_normed", "k") if _value(c, n) is not None), "k")
    k_owner = _value(c, owner)  # (Sk, Hkv, dh): layer `source`'s own recorded keys
    assert k_owner is not None
    i, kv = int(c.index), c.head // c.attn.group_size
    q = next(v for v in (_value(c, "rot_q"), _value(c, "q_normed"), _value(c, "q")) if v is not None)
    keys = _visible(c)
    scores = c.attn.scale * (k_read[:, kv].float() @ q[i, c.head].float())  # (Sk,)
    numbers: dict[str, Any] = {"owner": int(source), "owner_keys": f"hook_{owner}",
                               "max_k_gap": _gap(k_read, k_owner), "keys": keys,
                               "scores": [float(scores[j]) for j in keys]}  # fmt: skip
    lines = [
        f"this layer has no W_K, W_V of its own: it reads layer {source}'s keys and values, computed",
        f"from layer {source}'s input in the same forward (its W_K / W_V are layer {source}'s tensors);",
        f"max |k - k_owner| between the keys it read and layer {source}'s hook_{owner}: "
        f"{numbers['max_k_gap']:.3g}",
    ]
    if c.scores is not None and keys:
        numbers["max_score_gap"] = _gap(scores[keys], c.scores[keys])
        lines.append(
            f"scale q . k_owner_j on the top keys: max |. - hook_scores| = {numbers['max_score_gap']:.3g}"
        )
    z = _value(c, "z")
    if c.pattern is not None and z is not None:
        again = c.pattern.float() @ v_read[:, kv].float()  # (dh,)
        numbers["max_z_gap"] = _gap(again, z[i, c.head])
        lines.append(f"z = sum_j p_j v_owner_j: max |z - hook_z| = {numbers['max_z_gap']:.3g}")
    return SchemeStep("kv_source", f"keys and values shared from layer {source}", lines, numbers)


def _latent_numbers(c: SchemeContext, keys: list[int]) -> dict[str, Any] | None:
    lat = c.attn.latent
    q, k, v, latent = (_value(c, n) for n in ("rot_q", "k", "v", "latent"))
    if q is None or k is None or v is None or latent is None or c.index is None:
        return None
    nope, h, s = lat.qk_nope_head_dim, c.head, float(c.attn.scale)
    q_i = q[int(c.index), h].float()  # (dqk,)
    k_h = k[:, h].float()  # (Sk, dqk)
    nope_part = s * (k_h[:, :nope] @ q_i[:nope])  # (Sk,)
    rope_part = s * (k_h[:, nope:] @ q_i[nope:])  # (Sk,)
    k_nope = latent.float() @ c.attn.W_KB[h].detach().float()  # (Sk, nope)
    v_again = latent.float() @ c.attn.W_VB[h].detach().float()  # (Sk, dv)
    rope_k = _value(c, "rope_k")
    numbers: dict[str, Any] = {
        "kv_lora_rank": lat.kv_lora_rank, "qk_nope_head_dim": nope, "qk_rope_head_dim": lat.qk_rope_head_dim,
        "v_head_dim": lat.v_head_dim, "keys": keys,
        "latent_norms": [float(latent[j].float().norm()) for j in keys],
        "nope": [float(nope_part[j]) for j in keys], "rope": [float(rope_part[j]) for j in keys],
        "max_k_nope_gap": _gap(k_nope, k_h[:, :nope]), "max_v_gap": _gap(v_again, v[:, h]),
        "max_rope_k_gap": None if rope_k is None else _gap(k_h[:, nope:], rope_k),
        "cache_per_token": lat.kv_lora_rank + lat.qk_rope_head_dim,
        "kv_per_token": c.attn.n_heads * (lat.qk_head_dim + lat.v_head_dim),
    }  # fmt: skip
    if c.scores is not None:
        numbers["scores"] = [float(c.scores[j]) for j in keys]
        numbers["max_score_gap"] = _gap((nope_part + rope_part)[keys], c.scores[keys]) if keys else 0.0
    return numbers


def latent_step(c: SchemeContext) -> SchemeStep | None:
    """Multi-head latent attention: the latent, the score's two parts and the cache's size."""
    if getattr(getattr(c.attn, "spec", None), "latent", None) is None:
        return None
    n = _latent_numbers(c, _visible(c))
    if n is None:
        return None
    r, rope, H = n["kv_lora_rank"], n["qk_rope_head_dim"], c.attn.n_heads
    lines = [
        f"keys and values come from one latent c = RMSNorm(x W_kva), {r} numbers per token:",
        f"k_h = [c W_kb[h] ({n['qk_nope_head_dim']}), R(j) x W_kr ({rope}, the same for every head)],",
        f"v_h = c W_vb[h] ({n['v_head_dim']} wide); from hook_latent, max |c W_kb[h] - k_nope| = "
        f"{n['max_k_nope_gap']:.3g}",
        f"and max |c W_vb[h] - v| = {n['max_v_gap']:.3g}",
        "each score = scale q_nope . k_nope_j (no positions) + scale R(i) q_rope . R(j) k_rope_j:",
    ]
    for j, cn, a, b, s in zip(n["keys"], n["latent_norms"], n["nope"], n["rope"], n.get("scores", n["nope"])):
        lines.append(f"key {j}: |c_j| = {cn:.4f}; {a:.4f} + {b:.4f} = {a + b:.4f} (hook_scores {s:.4f})")
    lines.append(
        f"the cache holds c and R(j) x W_kr: {r} + {rope} = {n['cache_per_token']} numbers per token, "
        f"not {H} x ({n['qk_nope_head_dim'] + rope} + {n['v_head_dim']}) = {n['kv_per_token']}"
    )
    title = f"latent attention: keys and values from a {r}-wide latent"
    return SchemeStep("latent", title, lines, n)


def differential_step(c: SchemeContext) -> SchemeStep | None:
    """Differential attention: the pair's two maps, lambda, their difference and the pair's norm."""
    lambda_init = getattr(getattr(c.attn, "spec", None), "differential", None)
    pattern, diff = _value(c, "pattern"), _value(c, "diff_pattern")
    if lambda_init is None or pattern is None or diff is None or c.index is None:
        return None
    a, i, keys = c.attn, int(c.index), list(c.keys)
    P = a.n_pairs
    j = c.head % P
    lam = float(a.lambda_full().detach())
    p1, p2 = pattern[j, i].float(), pattern[j + P, i].float()  # (Sk,) x 2
    d = p1 - lam * p2  # (Sk,)
    numbers: dict[str, Any] = {
        "pair": j, "heads": [j, j + P], "lambda": lam, "lambda_init": float(lambda_init), "keys": keys,
        "p1": [float(p1[k]) for k in keys], "p2": [float(p2[k]) for k in keys],
        "diff": [float(d[k]) for k in keys], "max_diff_gap": _gap(d, diff[j, i]),
    }  # fmt: skip
    lines = [
        f"head {c.head} is in pair {j}: p_1 = head {j}'s map, p_2 = head {j + P}'s (transformers' layout);",
        "lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init",
        f"       = ... + {float(lambda_init):.4g} = {lam:.4f}",
    ]
    lines += [f"key {k}: {x:.4f} - {lam:.4f} x {y:.4f} = {v:.4f}" for k, x, y, v in
              zip(keys, numbers["p1"], numbers["p2"], numbers["diff"])]  # fmt: skip
    lines.append(f"p_1 - lambda p_2 against hook_diff_pattern: max gap {numbers['max_diff_gap']:.3g}")
    z, normed = _value(c, "z"), _value(c, "z_normed")
    if z is not None and normed is not None:
        pair = z[i, j].float() - lam * z[i, j + P].float()  # (2 dh,)
        inv = float(rms_inverse(pair, a.norm_eps))
        y = (1.0 - float(lambda_init)) * inv * pair  # (2 dh,)
        numbers.update(rms=1.0 / inv, max_norm_gap=_gap(y, normed[i, j]))
        lines += [
            f"the pair's z_1 - lambda z_2 ({2 * a.d_head} wide) has RMS {1.0 / inv:.4f}; before W_O it is",
            f"(1 - {float(lambda_init):.4g}) (z_1 - lambda z_2) / RMS: max |. - hook_z_normed| = "
            f"{numbers['max_norm_gap']:.3g}",
            f"W_O reads each pair's y; head h's part of out (step 7) is (1 - {float(lambda_init):.4g}) / RMS",
            f"x (1 for head {j}, -lambda for head {j + P}) x z_h W_O[pair {j}], at this run's RMS",
        ]
    return SchemeStep(
        "differential", f"differential attention: pair {j}, p_1 - {lam:.4f} p_2", lines, numbers
    )


register_scheme_step("kv_source", kv_source_step)
register_scheme_step("latent", latent_step)
register_scheme_step("differential", differential_step)
