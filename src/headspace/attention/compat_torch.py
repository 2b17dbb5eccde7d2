"""torch's conventions for the drop-in :class:`~headspace.compat.MultiheadAttention`: the exceptions that
are both headspace's ``ValueError`` / ``TypeError`` and the class torch raises for the same input, the
checks of a call in torch's layout (:class:`TorchConventions`, a mixin of the drop-in), whether torch's
own module would take its inference fast path, and torch's masks turned into one headspace mask.

See :mod:`headspace.compat` for the conventions themselves.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor


class MultiheadAttentionInputError(ValueError, AssertionError):
    """A bad input value or shape where torch raises ``AssertionError``: a ``ValueError`` and that class."""


class MultiheadAttentionTypeError(TypeError, AssertionError):
    """A bad input type or dtype where torch raises ``AssertionError``: a ``TypeError`` and that class."""


class MultiheadAttentionShapeError(ValueError, RuntimeError):
    """A bad input shape where torch raises ``RuntimeError``: a ``ValueError`` and that class."""


class MultiheadAttentionMaskShapeError(MultiheadAttentionShapeError):
    """An ``attn_mask`` of a wrong shape where torch raises ``RuntimeError`` (a ``ValueError`` too)."""


class MultiheadAttentionCausalHintError(ValueError, RuntimeError):
    """``is_causal=True`` without ``attn_mask``: a ``ValueError`` and torch's ``RuntimeError``."""


class MultiheadAttentionDtypeError(TypeError, RuntimeError):
    """A dtype torch refuses with ``RuntimeError`` (an input or float mask not of the weights' or query's
    dtype): a ``TypeError`` and that class."""


class TorchScriptNotSupportedError(TypeError, RuntimeError):
    """``torch.jit.script`` on the drop-in (or a model holding it): not supported, use torch.compile."""


def _shape(t: Tensor) -> list[int]:
    return list(t.shape)


class TorchConventions:
    """The drop-in's checks and masks in torch's conventions (a mixin of
    :class:`~headspace.compat.MultiheadAttention`, which owns ``num_heads``, ``embed_dim``, ``kdim`` /
    ``vdim``, ``batch_first``, ``_qkv_same_embed_dim``, torch's parameters and ``out_proj``)."""

    # ------------------------------------------------------------------ input checks
    def _check_call(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        *,
        need_weights: bool,
        is_causal: bool,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
    ) -> tuple[bool, bool]:
        """Check a (non-nested) call as torch does; return (batched, whether the causal hint applies).

        The causal hint: torch drops ``attn_mask`` and asks SDPA for its (top-left) causal mask, except on
        its inference fast path, which ignores ``is_causal`` and uses ``attn_mask`` as given. Masks of
        different dtypes are accepted with torch's deprecation warning.
        """
        causal_hint = (
            is_causal
            and key_padding_mask is None
            and not need_weights
            and not self._torch_takes_fast_path(query, key, value, attn_mask)
        )
        batched = self._check_inputs_torch(query, key, value, key_padding_mask, attn_mask, causal_hint)
        if is_causal and attn_mask is None:
            raise MultiheadAttentionCausalHintError(
                "is_causal=True is a hint that attn_mask is the causal mask, so attn_mask is needed with it "
                "(as in torch); got attn_mask=None. Pass attn_mask="
                "nn.Transformer.generate_square_subsequent_mask(seq_len), or use "
                "headspace.MultiHeadAttention, whose is_causal needs no mask"
            )
        if (
            key_padding_mask is not None
            and attn_mask is not None
            and key_padding_mask.dtype != attn_mask.dtype
        ):
            warnings.warn(
                "Support for mismatched key_padding_mask and attn_mask is deprecated. Use same type for both "
                "instead.",
                stacklevel=3,
            )
        return batched, causal_hint

    def _check_inputs_torch(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        causal_hint: bool = False,
    ) -> bool:
        """Check ranks, sizes, dtypes and devices in torch's layout; return whether the input is batched.

        Each error is the ``ValueError``/``TypeError`` of headspace's contract and, where torch raises
        ``AssertionError`` or ``RuntimeError`` for the same input, that class too (tests compare case by
        case); a non-tensor argument is a plain ``TypeError`` (torch: ``TypeError`` or ``AttributeError``).

        ``causal_hint``: the ``is_causal`` hint replaces ``attn_mask`` by the causal mask (no
        ``key_padding_mask``, no weights asked for). torch then checks only its rank, its unbatched 3-D
        shape and that it is bool or float; its size, float dtype and device go unchecked (it is never
        used), so here too.
        """
        # first: every argument a tensor of an allowed rank (an unbatched 3-D attn_mask of its one shape)
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a tensor; got {type(t).__name__}")
        layout = "(batch, seq, embed)" if self.batch_first else "(seq, batch, embed)"
        if query.dim() == 3:
            batched = True
            if key.dim() != 3 or value.dim() != 3:
                raise MultiheadAttentionInputError(
                    f"for a batched (3-D) query, key and value must be 3-D {layout} too; got key of shape "
                    f"{_shape(key)} and value of shape {_shape(value)}"
                )
        elif query.dim() == 2:
            batched = False
            if key.dim() != 2 or value.dim() != 2:
                raise MultiheadAttentionInputError(
                    "for an unbatched (2-D) query [seq_q, embed_dim], key and value must be 2-D [seq_k, dim] "
                    f"too; got key of shape {_shape(key)} and value of shape {_shape(value)}"
                )
        else:
            raise MultiheadAttentionInputError(
                f"query must be 2-D [seq_q, embed_dim] (unbatched) or 3-D {layout} (batched); got a "
                f"{query.dim()}-D tensor of shape {_shape(query)}"
            )
        for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if mask is not None and not isinstance(mask, Tensor):
                raise TypeError(f"{name} must be a tensor or None; got {type(mask).__name__}")
        if key_padding_mask is not None and key_padding_mask.dim() != (2 if batched else 1):
            want = "2-D [batch, seq_k]" if batched else "1-D [seq_k] (unbatched input)"
            raise MultiheadAttentionInputError(
                f"key_padding_mask must be {want} or None; got a {key_padding_mask.dim()}-D tensor of shape "
                f"{_shape(key_padding_mask)}"
            )
        heads = self.num_heads
        if attn_mask is not None and attn_mask.dim() not in (2, 3):
            three = "[batch * num_heads, seq_q, seq_k]" if batched else "[num_heads, seq_q, seq_k]"
            raise MultiheadAttentionInputError(
                f"attn_mask must be 2-D [seq_q, seq_k] or 3-D {three}; got a {attn_mask.dim()}-D tensor of "
                f"shape {_shape(attn_mask)} (a [batch, num_heads, seq_q, seq_k] mask: reshape it to "
                "[batch * num_heads, seq_q, seq_k])"
            )
        if attn_mask is not None and not batched and attn_mask.dim() == 3:
            want3 = (heads, query.shape[0], key.shape[0])
            if tuple(attn_mask.shape) != want3:
                raise MultiheadAttentionInputError(
                    f"attn_mask for an unbatched query must be [seq_q, seq_k] = {list(want3[1:])} or "
                    f"[num_heads, seq_q, seq_k] = {list(want3)}; got {_shape(attn_mask)}"
                )
        self._check_sizes_torch(query, key, value, batched)
        self._check_masks_torch(query, key, key_padding_mask, attn_mask, batched, causal_hint)
        return batched

    def _batch_seq_dims(self, batched: bool) -> tuple[int, int]:
        """The batch and sequence dimensions of query/key/value in this layer's layout (batch 0 unbatched)."""
        batch_dim = 0 if (self.batch_first or not batched) else 1
        seq_dim = 1 - batch_dim if batched else 0
        return batch_dim, seq_dim

    def _check_sizes_torch(self, query: Tensor, key: Tensor, value: Tensor, batched: bool) -> None:
        """Second checks: embedding widths, key/value lengths, batch sizes, then dtypes and devices
        against the layer's weights."""
        if query.shape[-1] != self.embed_dim:
            raise MultiheadAttentionInputError(
                f"query must have last dimension embed_dim={self.embed_dim}; got shape {_shape(query)}"
            )
        batch_dim, seq_dim = self._batch_seq_dims(batched)
        layout = "(batch, seq, embed)" if self.batch_first else "(seq, batch, embed)"
        # torch asserts on key against value (their whole shapes with the fused projection, their
        # sequence and batch sizes with separate ones) and on separate weights' widths; a fused projection
        # of the wrong width, or a batch other than the query's, fails in its matmul (RuntimeError)
        same = key.shape == value.shape if self._qkv_same_embed_dim else key.shape[:-1] == value.shape[:-1]
        for name, t, dim, dim_name in (("key", key, self.kdim, "kdim"), ("value", value, self.vdim, "vdim")):
            if t.shape[-1] != dim:
                cls = (
                    MultiheadAttentionShapeError
                    if same and self._qkv_same_embed_dim
                    else MultiheadAttentionInputError
                )
                raise cls(f"{name} must have last dimension {dim_name}={dim}; got shape {_shape(t)}")
        if key.shape[seq_dim] != value.shape[seq_dim]:
            raise MultiheadAttentionInputError(
                f"key and value must have the same length seq_k (dimension {seq_dim}); got key "
                f"{_shape(key)}, value {_shape(value)}"
            )
        if batched and not key.shape[batch_dim] == value.shape[batch_dim] == query.shape[batch_dim]:
            cls = MultiheadAttentionShapeError if same else MultiheadAttentionInputError
            raise cls(
                f"query, key and value must have the same batch size (dimension {batch_dim} for {layout}); "
                f"got query {_shape(query)}, key {_shape(key)}, value {_shape(value)}"
            )
        w = self.out_proj.weight
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dtype != w.dtype:
                raise MultiheadAttentionDtypeError(
                    f"{name} has dtype {t.dtype} but the layer's weights are {w.dtype}"
                )
            if t.device != w.device:
                raise MultiheadAttentionInputError(
                    f"{name} is on {t.device} but the layer's weights are on {w.device}"
                )

    def _check_masks_torch(
        self,
        query: Tensor,
        key: Tensor,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        batched: bool,
        causal_hint: bool,
    ) -> None:
        """Last checks: each mask's dtype (bool or float like the query) and device, then its shape; under
        ``causal_hint`` only ``attn_mask``'s dtype class (bool or float) is checked."""
        batch_dim, seq_dim = self._batch_seq_dims(batched)
        batch = query.shape[batch_dim] if batched else 1
        seq_q, seq_k = query.shape[seq_dim], key.shape[seq_dim]
        for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if mask is None:
                continue
            if mask.dtype != torch.bool and not mask.is_floating_point():
                raise MultiheadAttentionTypeError(
                    f"{name} must be a bool tensor (True = not allowed, torch's convention) or a float "
                    f"tensor (additive); got dtype {mask.dtype}. Integer masks are refused: their polarity "
                    f"cannot be guessed (use {name}.bool() if 1 means 'masked')"
                )
            if name == "attn_mask" and causal_hint:
                continue  # replaced by the causal mask, unused: torch checks no more of it
            if mask.is_floating_point() and mask.dtype != query.dtype:
                raise MultiheadAttentionDtypeError(
                    f"{name} is a float (additive) mask of dtype {mask.dtype} but query is {query.dtype}; "
                    f"pass {name}.to({query.dtype})"
                )
            if mask.device != query.device:
                raise MultiheadAttentionInputError(
                    f"{name} is on {mask.device} but query is on {query.device}"
                )
        if key_padding_mask is not None:
            want = (batch, seq_k) if batched else (seq_k,)
            if tuple(key_padding_mask.shape) != want:
                expected = "[batch, seq_k]" if batched else "[seq_k] (unbatched input)"
                raise MultiheadAttentionInputError(
                    f"key_padding_mask must have shape {expected} = {list(want)}; "
                    f"got {_shape(key_padding_mask)}"
                )
        if attn_mask is not None and not causal_hint:
            n = batch * self.num_heads if batched else self.num_heads
            ok = tuple(attn_mask.shape) in ((seq_q, seq_k), (n, seq_q, seq_k))
            if not ok:
                three = "[batch * num_heads, seq_q, seq_k]" if batched else "[num_heads, seq_q, seq_k]"
                raise MultiheadAttentionMaskShapeError(
                    f"attn_mask must have shape [seq_q, seq_k] = {[seq_q, seq_k]} or {three} = "
                    f"{[n, seq_q, seq_k]}; got {_shape(attn_mask)}"
                )

    def _torch_takes_fast_path(
        self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None
    ) -> bool:
        """Whether ``torch.nn.MultiheadAttention.forward`` would run ``torch._native_multi_head_attention``
        on these inputs (no ``key_padding_mask``), the conditions of its forward in order.

        That path ignores ``is_causal`` and uses ``attn_mask`` (and checks its size); the drop-in never
        runs it, but follows the hint as torch does on either path. (torch also leaves the fast path
        while make_fx traces; that case is not mirrored.)
        """
        b, w = self.in_proj_bias, self.in_proj_weight
        if attn_mask is not None and attn_mask.is_floating_point():
            return False
        if not torch.backends.mha.get_fastpath_enabled() or query.dim() != 3:
            return False
        if not (query is key and key is value) or query.is_nested:
            return False
        if b is None or w is None or query.dtype != b.dtype or query.dtype != w.dtype:
            return False  # (without in_proj_bias torch falls through to its general path)
        if self.training or self.num_heads % 2 or not self.batch_first:
            return False
        if self.bias_k is not None or self.bias_v is not None or self.add_zero_attn:
            return False
        if torch.is_autocast_enabled():
            return False
        tensors = (query, w, b, self.out_proj.weight, self.out_proj.bias)
        devices = ("cpu", "cuda", torch._C._get_privateuse1_backend_name())
        if any(t is not None and t.device.type not in devices for t in tensors):
            return False
        return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))

    # ------------------------------------------------------------------ masks
    def _combined_mask(
        self,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        batch: int,
        seq_q: int,
        seq_k: int,
        extra: int,
    ) -> Tensor | None:
        """torch's masks -> one headspace mask [batch|1, n_heads|1, seq_q, seq_k + extra].

        All-bool masks stay bool and flip to headspace's polarity (True = may attend); as soon as one is a
        float, every mask becomes additive (bool True -> -inf) and they are summed, as torch does. The
        ``extra`` appended key positions (bias_k/bias_v, zero attention) are always allowed.
        """
        if key_padding_mask is None and attn_mask is None:
            return None
        H = self.num_heads
        am4 = None
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                am4 = attn_mask[None, None]  # (1, 1, seq_q, seq_k)
            else:
                am4 = attn_mask.reshape(batch, H, seq_q, seq_k)  # (batch, H, seq_q, seq_k)
        kp4 = None
        if key_padding_mask is not None:
            kp4 = key_padding_mask.reshape(batch, 1, 1, seq_k)  # (batch, 1, 1, seq_k)
        parts = [m for m in (am4, kp4) if m is not None]
        if all(m.dtype == torch.bool for m in parts):
            allowed = ~parts[0]
            for m in parts[1:]:
                allowed = allowed & ~m  # (b|1, H|1, seq_q|1, seq_k)
            allowed = allowed.expand(*allowed.shape[:2], seq_q, seq_k)  # (b|1, H|1, seq_q, seq_k)
            if extra:
                pad = allowed.new_ones(*allowed.shape[:3], extra)  # (b|1, H|1, seq_q, extra)
                allowed = torch.cat([allowed, pad], dim=-1)  # (b|1, H|1, seq_q, seq_k + extra)
            return allowed
        dtype = next(m.dtype for m in parts if m.is_floating_point())
        additive = None
        for m in parts:
            f = (
                m
                if m.is_floating_point()
                else torch.zeros_like(m, dtype=dtype).masked_fill_(m, float("-inf"))
            )
            additive = f if additive is None else additive + f  # (b|1, H|1, seq_q|1, seq_k)
        assert additive is not None
        additive = additive.expand(*additive.shape[:2], seq_q, seq_k)  # (b|1, H|1, seq_q, seq_k)
        if extra:
            pad = additive.new_zeros(*additive.shape[:3], extra)  # (b|1, H|1, seq_q, extra)
            additive = torch.cat([additive, pad], dim=-1)  # (b|1, H|1, seq_q, seq_k + extra)
        return additive
