"""A drop-in for ``torch.nn.MultiheadAttention`` built on headspace's :class:`~headspace.MultiHeadAttention`.

``headspace.compat.MultiheadAttention`` takes torch's constructor arguments, holds torch's parameters
under torch's names (so ``load_state_dict`` works both ways), and speaks torch's conventions in
``forward``:

* inputs are ``(seq, batch, embed)`` unless ``batch_first=True``; 2-D inputs are one unbatched sequence;
* boolean masks mean **True = NOT allowed** (the opposite of the rest of headspace); float masks are
  additive;
* ``key_padding_mask`` is ``[batch, seq_k]`` (``[seq_k]`` unbatched), True = padding;
* ``attn_mask`` is ``[seq_q, seq_k]`` or ``[batch * num_heads, seq_q, seq_k]`` (``[num_heads, seq_q, seq_k]``
  unbatched);
* ``need_weights=True`` by default, and the returned weights are averaged over heads unless
  ``average_attn_weights=False``; in training they are the weights after dropout, as in torch;
* ``is_causal`` is a *hint* that ``attn_mask`` is the causal mask and needs ``attn_mask``. As in torch,
  when neither ``key_padding_mask`` nor ``need_weights`` asks for the explicit mask, the hint replaces
  ``attn_mask`` by the causal mask aligned top-left (query ``i`` sees keys ``j <= i``), and then, as
  torch, only the rank of ``attn_mask`` and its kind (bool or float) are checked, not its size or float
  dtype; otherwise ``attn_mask`` is used as given. Where torch's own module would take its inference fast
  path (eval, no grad, ``batch_first`` self-attention, bool masks, ...), which ignores ``is_causal``, the
  mask is used as given there too. A wrong hint therefore gives the same (wrong) answer as torch;
* an ``in_proj_bias`` of another dtype than the weights (a half bias on float64 weights) is added to the
  projections as torch's ``batch_first`` path adds it: in the promoted dtype, rounded to the weights'.
  torch itself runs that case only where its input reaches ``F.linear`` non-contiguous (``batch_first``
  input, which it transposes); a contiguous one goes to ``addmm``, which raises. The drop-in runs either
  way;
* ``add_bias_kv`` appends ``bias_k``/``bias_v`` as one extra key/value position, ``add_zero_attn`` appends
  a zero key/value position after it; masks get an "allowed" column for each.

Where it differs from torch, on purpose:

* a query row with nothing to attend to (every key masked) gets an all-zero weight row and a zero
  value mix, so its output is ``out_proj.bias``; torch returns NaN there. Gradients stay finite;
* key length 0 (with neither ``add_bias_kv`` nor ``add_zero_attn``) raises ``ValueError``; torch returns
  ``out_proj.bias``;
* torch's inference fast path (``torch._native_multi_head_attention``) is not used; the results agree
  to float32 tolerance;
* TorchScript is not supported: ``torch.jit.script`` on the drop-in, or on a model holding it, raises
  :class:`TorchScriptNotSupportedError` (torch has deprecated TorchScript; use ``torch.compile`` or
  ``torch.export``).

Bad inputs raise exceptions that are both the ``ValueError``/``TypeError`` of headspace's contract
(naming the argument, what was expected and what came) and the class torch raises for the same input:
``AssertionError`` exactly where torch asserts (wrong ranks, a mask of 0, 1 or 4 dimensions, an unbatched
3-D ``attn_mask`` not ``[num_heads, seq_q, seq_k]``, ``key_padding_mask`` shapes, integer masks, nested
tensors it cannot take ...), ``RuntimeError`` where torch's computation fails (a 2-D/3-D ``attn_mask`` of
the wrong size, batch sizes that differ, dtypes that differ from the weights'). A non-tensor argument is
a plain ``TypeError``. The tests compare the classes with torch's case by case.

Inside torch's transformer layers: ``nn.TransformerEncoderLayer``, ``nn.TransformerDecoderLayer`` and
``nn.TransformerEncoder`` holding the drop-in (by construction or through :func:`swap_into`) work in every
mode (train/eval, with or without grad, ``batch_first`` either way, masks, key padding, ``is_causal``),
equal to torch's own layers with the same weights, and headspace's hook points fire. Two things make
that so:

* torch's encoder layer has a fused inference fast path (``torch._transformer_encoder_layer_fwd``) that
  would run torch's kernel on these weights and skip the hook points. torch skips it when any module of
  the layer has forward hooks or pre-hooks (its ``why_not_sparsity_fast_path`` then reads "forward
  pre-/hooks are attached to the module"), so every drop-in carries one do-nothing forward pre-hook,
  :func:`keep_off_torch_fast_path`. (:meth:`MultiheadAttention.merge_masks` exists too, as torch's, for
  code that calls it.)
* ``nn.TransformerEncoder`` in eval without grad turns a padded batch with ``src_key_padding_mask``
  into a nested tensor before the first layer. The drop-in takes such nested self-attention input (and
  only that: ``query is key is value``, no masks, ``batch_first=True``): it pads it again with the
  matching ``key_padding_mask``, runs, and returns a nested tensor of the input's layout (and, with
  ``need_weights``, the padded weights, zero at padding, as torch's nested path returns them). Any
  other nested input is refused by name (``TypeError``, also torch's ``AssertionError``): pass padded
  tensors and a ``key_padding_mask``.

:func:`swap_into` replaces every ``torch.nn.MultiheadAttention`` of an existing model by the drop-in,
sharing its parameters.

The per-head views of headspace work here too: ``mha.W_Q`` ``[num_heads, embed_dim, head_dim]``,
``mha.heads[3].W_O``, and the hook points (``hook_q`` ... ``hook_result``) fire while traced (``hook_k``,
``hook_v`` and the patterns include the appended ``bias_k``/zero-attention positions, as the scores do).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.checks import is_int
from ..nn.hooks import keep_off_torch_fast_path as keep_off_torch_fast_path  # its old home: here
from ..nn.hooks import keep_torch_fast_path_off
from ..nn.masks import canonical_mask
from .compat_torch import MultiheadAttentionCausalHintError as MultiheadAttentionCausalHintError
from .compat_torch import MultiheadAttentionDtypeError as MultiheadAttentionDtypeError
from .compat_torch import MultiheadAttentionInputError as MultiheadAttentionInputError
from .compat_torch import MultiheadAttentionMaskShapeError as MultiheadAttentionMaskShapeError
from .compat_torch import MultiheadAttentionShapeError as MultiheadAttentionShapeError
from .compat_torch import MultiheadAttentionTypeError as MultiheadAttentionTypeError
from .compat_torch import TorchConventions, _shape
from .compat_torch import TorchScriptNotSupportedError as TorchScriptNotSupportedError
from .functional import get_backend, reference_parts
from .layer import MultiHeadAttention, _check_finite

try:  # the class torch uses for out_proj (it only changes how quantization treats the layer)
    from torch.nn.modules.linear import NonDynamicallyQuantizableLinear as _OutProj
except ImportError:  # pragma: no cover - older/newer torch without it
    _OutProj = nn.Linear  # type: ignore[misc,assignment]

__all__ = [
    "MultiheadAttention",
    "MultiheadAttentionInputError",
    "MultiheadAttentionShapeError",
    "MultiheadAttentionTypeError",
    "TorchScriptNotSupportedError",
    "swap_into",
]


def _alias(torch_name: str, headspace_name: str) -> property:
    """A property that reads and writes torch's parameter ``torch_name`` under headspace's ``headspace_name``.

    See :meth:`MultiheadAttention._get_alias` / :meth:`MultiheadAttention._set_alias`.
    """
    return property(
        lambda self: self._get_alias(torch_name, headspace_name),
        lambda self, v: self._set_alias(torch_name, headspace_name, v),
    )


#: The tensor arguments of :meth:`MultiheadAttention.forward`, in order (named when nested).
_TENSOR_ARGS = ("query", "key", "value", "key_padding_mask", "attn_mask")


class MultiheadAttention(TorchConventions, MultiHeadAttention):
    r"""``torch.nn.MultiheadAttention`` with headspace inside.

    For each head ``h`` of ``num_heads``, with ``head_dim = embed_dim // num_heads`` and torch's [out, in]
    weights split into row blocks of ``head_dim``::

        q_h = query W_q[h]^T + b_q[h]          W_q = in_proj_weight[:E]      (or q_proj_weight)
        k_h = key   W_k[h]^T + b_k[h]          W_k = in_proj_weight[E:2E]    (or k_proj_weight)
        v_h = value W_v[h]^T + b_v[h]          W_v = in_proj_weight[2E:]     (or v_proj_weight)
        (optionally one more key/value position: bias_k[h], bias_v[h]; then a zero one)
        z_h = softmax(q_h k_h^T / sqrt(head_dim) + mask) v_h
        out = concat_h(z_h) out_proj.weight^T + out_proj.bias

    which is headspace's ``out = sum_h z_h W_O[h] + b_O`` with ``W_Q[h] = W_q[h]^T`` and so on: the
    properties ``W_Q``, ``W_K``, ``W_V``, ``W_O``, ``b_Q`` ... and ``heads[h]`` are views of torch's
    parameters.

    Parameters (the names and shapes of torch): ``in_proj_weight`` [3 E, E] when ``kdim == vdim == E``,
    else ``q_proj_weight`` [E, E], ``k_proj_weight`` [E, kdim], ``v_proj_weight`` [E, vdim];
    ``in_proj_bias`` [3 E]; ``bias_k``, ``bias_v`` [1, 1, E] with ``add_bias_kv``; ``out_proj.weight``
    [E, E] and ``out_proj.bias`` [E]. Initialisation follows torch step by step, so under the same seed
    both modules start with identical weights.

    See the module docstring for the conventions of ``forward`` and the deliberate differences (a fully
    masked row gives 0, never NaN).
    """

    #: :func:`headspace.prune_heads` refuses this layer: torch's layout needs
    #: num_heads * head_dim == embed_dim.
    prunable = False

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if not is_int(value):
                raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"embed_dim and num_heads must be greater than 0, got embed_dim={embed_dim} and "
                f"num_heads={num_heads} instead"
            )
        if embed_dim % num_heads != 0:
            raise MultiheadAttentionInputError(
                f"embed_dim must be divisible by num_heads; got embed_dim={embed_dim}, num_heads={num_heads} "
                f"(head_dim would be {embed_dim / num_heads:g})"
            )
        super().__init__(
            d_model=embed_dim,
            n_heads=num_heads,
            kdim=kdim,
            vdim=vdim,
            bias=bias,
            dropout=dropout,
            device=device,
            dtype=dtype,
        )
        # headspace's constructor made its parameters under headspace's names (still uninitialised: the
        # reset_parameters below skips until the torch layout exists). Re-register them under torch's
        # names, in torch's order, so that state_dict() and named_parameters() read exactly like torch's.
        made = dict(self._parameters)
        self._parameters.clear()
        if self.fused:
            self.in_proj_weight = made["qkv_weight"]  # [3 E, E]
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.register_parameter("in_proj_weight", None)
            self.q_proj_weight = made["q_weight"]  # [E, E]
            self.k_proj_weight = made["k_weight"]  # [E, kdim]
            self.v_proj_weight = made["v_weight"]  # [E, vdim]
        self.register_parameter("in_proj_bias", made["qkv_bias"])  # [3 E] or None
        factory = {"device": device, "dtype": dtype}
        self.out_proj = _OutProj(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
        else:
            self.bias_k = self.bias_v = None
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self._qkv_same_embed_dim = self.fused
        self.add_zero_attn = add_zero_attn
        self.batch_first = batch_first
        self._reset_parameters()
        # torch's TransformerEncoderLayer runs its own fused kernel on our weights (skipping headspace's
        # hook points) unless a module of the layer has hooks: the hook machinery keeps it off
        keep_torch_fast_path_off(self)

    # ------------------------------------------------------------------ headspace's names, torch's storage
    # headspace's methods (views W_Q ..., project_qkv, heads) read these names; here they are aliases of
    # torch's parameters. While headspace's constructor runs, they fall back to its own registrations
    # (and raise AttributeError before those exist, so that nn.Module can register them).
    def _get_alias(self, torch_name: str, headspace_name: str) -> Tensor | None:
        params = self.__dict__["_parameters"]
        owner, name = self._alias_owner(torch_name)
        if owner is not None and name in owner.__dict__["_parameters"]:
            return owner.__dict__["_parameters"][name]
        if headspace_name in params:
            return params[headspace_name]
        raise AttributeError(f"{type(self).__name__} has no parameter {torch_name!r} yet")

    def _set_alias(self, torch_name: str, headspace_name: str, value: Tensor | None) -> None:
        owner, name = self._alias_owner(torch_name)
        if owner is not None and name in owner.__dict__["_parameters"]:
            setattr(owner, name, value)
        else:
            self.__dict__["_parameters"][headspace_name] = value

    def _alias_owner(self, torch_name: str) -> tuple[nn.Module | None, str]:
        if torch_name.startswith("out_proj."):
            return self.__dict__["_modules"].get("out_proj"), torch_name.split(".", 1)[1]
        return self, torch_name

    qkv_weight = _alias("in_proj_weight", "qkv_weight")  # type: ignore[assignment]
    q_weight = _alias("q_proj_weight", "q_weight")  # type: ignore[assignment]
    k_weight = _alias("k_proj_weight", "k_weight")  # type: ignore[assignment]
    v_weight = _alias("v_proj_weight", "v_weight")  # type: ignore[assignment]
    qkv_bias = _alias("in_proj_bias", "qkv_bias")  # type: ignore[assignment]
    o_weight = _alias("out_proj.weight", "o_weight")  # type: ignore[assignment]
    o_bias = _alias("out_proj.bias", "o_bias")  # type: ignore[assignment]

    def _reset_parameters(self) -> None:
        """torch's initialisation, step by step: xavier-uniform in-projection, zero biases, xavier-normal
        ``bias_k``/``bias_v`` (``out_proj.weight`` keeps ``nn.Linear``'s own initialisation)."""
        if "out_proj" not in self._modules:  # called by headspace's constructor, before the torch layout
            return
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            nn.init.xavier_normal_(self.bias_v)

    def reset_parameters(self) -> None:
        """Re-initialise as torch does (see :meth:`_reset_parameters`)."""
        self._reset_parameters()

    def extra_repr(self) -> str:
        s = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}"
        if not self._qkv_same_embed_dim:
            s += f", kdim={self.kdim}, vdim={self.vdim}"
        s += f", bias={self.in_proj_bias is not None}, dropout={self.dropout}"
        if self.bias_k is not None:
            s += ", add_bias_kv=True"
        if self.add_zero_attn:
            s += ", add_zero_attn=True"
        return s + f", batch_first={self.batch_first}"

    # ------------------------------------------------------------------ forward
    def forward(  # type: ignore[override]
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """torch's ``MultiheadAttention.forward``: same arguments, conventions and outputs.

        Notation used for tensor shapes:
            batch (N), seq_q (L), seq_k (S), embed_dim (E), kdim, vdim, num_heads (H),
            head_dim = E // H. Batched tensors are (seq, batch, dim) unless ``batch_first``.

        Args:
            query: (L, N, E), (N, L, E) with ``batch_first``, or (L, E) unbatched.
            key: (S, N, kdim), (N, S, kdim) or (S, kdim).
            value: (S, N, vdim), (N, S, vdim) or (S, vdim).
            key_padding_mask: bool (True = padding) or float (additive), (N, S) or (S,) unbatched.
            need_weights: also return the attention weights (default True, as torch).
            attn_mask: bool (True = not allowed) or float (additive), (L, S) or (N * H, L, S)
                ((H, L, S) unbatched).
            average_attn_weights: average the returned weights over heads (default True).
            is_causal: hint that ``attn_mask`` is the causal mask (requires ``attn_mask``; see the
                module docstring for when the hint replaces it).

        Returns:
            ``(attn_output, attn_weights)``: attn_output (L, N, E), (N, L, E) or (L, E); attn_weights
            (N, L, S') averaged or (N, H, L, S') per head ((L, S') / (H, L, S') unbatched), with
            ``S' = S + add_bias_kv + add_zero_attn``; None when ``need_weights=False``. Rows with
            nothing to attend to are zero (torch: NaN).
        """
        tensors = (query, key, value, key_padding_mask, attn_mask)
        nested = [name for name, t in zip(_TENSOR_ARGS, tensors) if isinstance(t, Tensor) and t.is_nested]
        if nested:
            return self._forward_nested(
                nested, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                is_causal,
            )  # fmt: skip
        batched, causal_hint = self._check_call(
            query, key, value, need_weights=need_weights, is_causal=is_causal,
            key_padding_mask=key_padding_mask, attn_mask=attn_mask,
        )  # fmt: skip
        q_in, k_in, v_in, kpm = self._to_batch_first(query, key, value, key_padding_mask, batched)
        if self.check_finite:
            for name, t in (("query", query), ("key", key), ("value", value)):
                _check_finite(name, t)
        B, L, _ = q_in.shape
        mask4, causal_square, S_total = self._call_masks(
            key, kpm, attn_mask, causal_hint, B, L, k_in.shape[1]
        )
        if B == 0 or L == 0:
            z = q_in.new_zeros(B, L, self.num_heads * self.head_dim)  # (N, L, H dh)
            weights: Tensor | None = q_in.new_zeros(B, self.num_heads, L, S_total) if need_weights else None
            return self._finish(
                F.linear(z, self.o_weight, self.o_bias), weights, batched, average_attn_weights
            )
        q, k, v = self._project_with_extras(q_in, k_in, v_in)  # (N, H, L, dh), (N, H, S', dh) x 2
        out, weights = self._attend(q, k, v, mask4, causal_square, need_weights)  # (N, L, E), weights
        return self._finish(out, weights if need_weights else None, batched, average_attn_weights)

    def _call_masks(
        self,
        key: Tensor,
        kpm: Tensor | None,
        attn_mask: Tensor | None,
        causal_hint: bool,
        B: int,
        L: int,
        S: int,
    ) -> tuple[Tensor | None, bool, int]:
        """The call's mask over the S' = S + extra keys (``bias_k``/``bias_v`` and zero attention
        appended): (mask [N|1, H|1, L, S'] or None, whether it is the square causal mask, S').
        ``key`` (as given) only names its shape in the error for S' == 0."""
        extra = int(self.bias_k is not None) + int(self.add_zero_attn)
        S_total = S + extra
        if S_total == 0:
            raise ValueError(
                f"key length seq_k must be at least 1; got key of shape {_shape(key)} (and neither "
                "add_bias_kv nor add_zero_attn adds a position)"
            )
        if not causal_hint:
            return self._combined_mask(kpm, attn_mask, B, L, S, extra), False, S_total  # (N|1, H|1, L, S')
        if L == S_total:
            return None, True, S_total
        return torch.ones(L, S_total, dtype=torch.bool, device=key.device).tril(), False, S_total  # (L, S')

    def _to_batch_first(
        self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None, batched: bool
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """query/key/value in headspace's batch-first layout ((N, L, E), (N, S, kdim), (N, S, vdim)) and
        the padding mask as (N, S); unbatched inputs get a batch of 1. ``query is key is value`` stays
        true of the results (so the fused projection applies)."""

        def to_bf(t: Tensor) -> Tensor:
            if not batched:
                return t.unsqueeze(0)  # (L, E) -> (1, L, E)
            return t if self.batch_first else t.transpose(0, 1)  # (L, N, E) -> (N, L, E)

        kpm = key_padding_mask
        if kpm is not None and not batched:
            kpm = kpm.unsqueeze(0)  # (S,) -> (1, S)
        q_in = to_bf(query)  # (N, L, E)
        k_in = q_in if key is query else to_bf(key)  # (N, S, kdim)
        v_in = k_in if value is key else to_bf(value)  # (N, S, vdim)
        return q_in, k_in, v_in, kpm

    def _project_with_extras(self, q_in: Tensor, k_in: Tensor, v_in: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per-head q (N, H, L, dh) and k, v (N, H, S', dh): the projections, then ``bias_k``/``bias_v``
        appended as one more key position (``add_bias_kv``) and a zero key/value (``add_zero_attn``)."""
        B, H, dh = q_in.shape[0], self.num_heads, self.head_dim
        q, k, v = self._project(q_in, k_in, v_in)  # (N, H, L, dh), (N, H, S, dh) x 2
        if self.bias_k is not None and self.bias_v is not None:
            bk = self.bias_k.view(1, H, 1, dh).expand(B, H, 1, dh)  # (N, H, 1, dh)
            bv = self.bias_v.view(1, H, 1, dh).expand(B, H, 1, dh)  # (N, H, 1, dh)
            k = torch.cat([k, bk], dim=2)  # (N, H, S + 1, dh)
            v = torch.cat([v, bv], dim=2)  # (N, H, S + 1, dh)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(B, H, 1, dh)], dim=2)  # (N, H, S', dh)
            v = torch.cat([v, v.new_zeros(B, H, 1, dh)], dim=2)  # (N, H, S', dh)
        return q, k, v

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask4: Tensor | None, causal_square: bool, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Attention of per-head q (N, H, L, dh) on k, v (N, H, S', dh) and the output projection.

        Returns the output (N, L, E) and the per-head weights (N, H, L, S'), after dropout as in torch,
        or None where the backend computes none. With hooks set, runs through the hook points
        (``hook_q``, ``hook_pattern`` ...) like :class:`~headspace.MultiHeadAttention`.
        """
        B, H, L, dh = q.shape
        traced = self.hooks_active
        if traced:
            q = self.hook_q(q.transpose(1, 2)).transpose(1, 2)  # (N, H, L, dh)
            k = self.hook_k(k.transpose(1, 2)).transpose(1, 2)  # (N, H, S', dh)
            v = self.hook_v(v.transpose(1, 2)).transpose(1, 2)  # (N, H, S', dh)
        mask = canonical_mask(
            batch=B,
            n_heads=H,
            seq_q=L,
            seq_k=k.shape[2],
            attn_mask=mask4,
            is_causal=causal_square,
            dtype=q.dtype,
            device=q.device,
        )
        dropout_p = self.dropout if self.training else 0.0
        if traced:
            z, _, weights = self.traced_attention(q, k, v, mask, dropout_p)  # (N, L, H, dh), (N, H, L, S')
            return self.output_from_heads(z), weights  # (N, L, E)
        if need_weights and dropout_p > 0.0:  # torch returns the weights after dropout
            z, _, weights = reference_parts(q, k, v, mask, scale=self.scale, dropout_p=dropout_p)
        else:
            backend = get_backend("explicit" if need_weights else "sdpa")
            z, weights = backend(q, k, v, mask, scale=self.scale, dropout_p=dropout_p)  # (N, H, L, dh)
        out = F.linear(z.transpose(1, 2).reshape(B, L, H * dh), self.o_weight, self.o_bias)  # (N, L, E)
        return out, weights

    def _forward_nested(
        self,
        nested: list[str],
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        need_weights: bool,
        attn_mask: Tensor | None,
        average_attn_weights: bool,
        is_causal: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """Nested-tensor self-attention, as ``nn.TransformerEncoder`` passes it in eval + no_grad.

        The sequences are padded (``key_padding_mask`` marks the padding), run through :meth:`forward` (so
        hooks fire, on the padded [batch, seq_max, ...] values) and nested again, in the input's layout.
        With ``need_weights`` the weights come back padded, as torch returns them: [batch, (heads,)
        seq_max, seq_max], zero in the rows and columns of padding. Anything else nested is refused by
        name.
        """
        why = ""
        if not (query.is_nested and key is query and value is query):
            why = "self-attention only (query is key is value, all one nested tensor)"
        elif key_padding_mask is not None or attn_mask is not None:
            why = "no attn_mask or key_padding_mask (a nested tensor carries its lengths)"
        elif not self.batch_first:
            why = "batch_first=True"
        elif query.dim() != 3:
            why = "3-D nested tensors [batch, (seq), embed]"
        if why:
            raise MultiheadAttentionTypeError(
                f"{nested[0]} is a nested tensor; headspace.compat.MultiheadAttention takes nested tensors "
                f"only as torch's nn.TransformerEncoder passes them, which needs {why}. Pass padded tensors "
                "with a key_padding_mask (True = padding) instead (torch.nested.to_padded_tensor(x, 0.0))"
            )
        lengths = [t.shape[0] for t in query.unbind()]
        padded = torch.nested.to_padded_tensor(query, 0.0)  # (N, L_max, E)
        n, longest = padded.shape[0], padded.shape[1]
        real = torch.tensor(lengths, device=padded.device)  # (N,)
        kpm = torch.arange(longest, device=padded.device)[None, :] >= real[:, None]  # (N, L_max), True = pad
        out, weights = self.forward(
            padded,
            padded,
            padded,
            key_padding_mask=kpm,
            need_weights=need_weights,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
        )  # (N, L_max, E), (N, [H,] L_max, L_max) or None
        if weights is not None:  # padded queries' rows are zero, as torch's nested fast path returns them
            rows_of_padding = kpm[:, :, None] if weights.dim() == 3 else kpm[:, None, :, None]
            weights = weights.masked_fill(rows_of_padding, 0.0)
        rows = [out[i, : lengths[i]] for i in range(n)]  # (L_i, E) each
        return torch.nested.as_nested_tensor(rows, layout=query.layout), weights

    def merge_masks(
        self, attn_mask: Tensor | None, key_padding_mask: Tensor | None, query: Tensor
    ) -> tuple[Tensor | None, int | None]:
        """torch's ``MultiheadAttention.merge_masks`` (the masks of its fused kernels, in its convention).

        torch calls it only on its fast path, which a layer holding this drop-in does not take (see the
        module docstring); it is here so that code written for torch's module finds it.
        """
        return nn.MultiheadAttention.merge_masks(self, attn_mask, key_padding_mask, query)  # type: ignore[arg-type]

    def __prepare_scriptable__(self) -> nn.Module:
        """``torch.jit.script`` calls this first: the drop-in does not support TorchScript (deprecated)."""
        raise TorchScriptNotSupportedError(
            "headspace.compat.MultiheadAttention does not support TorchScript (torch.jit.script), which "
            "torch has deprecated; compile the model with torch.compile, or export it with torch.export, "
            "instead (or keep torch.nn.MultiheadAttention in the model you script)"
        )

    def _project(self, q_in: Tensor, k_in: Tensor, v_in: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """headspace's projections, fused where the inputs are the same tensor (as torch does)."""
        b = self.in_proj_bias
        w = self.in_proj_weight if self.fused else self.q_proj_weight
        if b is not None and b.dtype != w.dtype:
            return self._project_other_bias_dtype(q_in, k_in, v_in, b)
        if q_in is k_in and k_in is v_in and self.fused:
            return self.project_qkv(q_in)
        return self.project_qkv(q_in, k_in, v_in)

    def _project_other_bias_dtype(
        self, q_in: Tensor, k_in: Tensor, v_in: Tensor, bias: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The projections with an ``in_proj_bias`` of another dtype than the weights, added as torch adds it.

        torch's ``F.linear`` on a non-contiguous 3-D input (``batch_first=True`` input, which torch
        transposes) is ``matmul`` then ``out.add_(bias)``: the sum in the promoted dtype, rounded to the
        weights' dtype. (On a contiguous input its fused ``addmm`` raises instead; the drop-in runs either
        way.) q [N, H, L, dh]; k, v [N, H, S, dh].
        """
        E, H, dh = self.embed_dim, self.num_heads, self.head_dim
        if self.fused:
            w_q, w_k, w_v = self.in_proj_weight.split([E, E, E])  # [E, E] each
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q, b_k, b_v = bias.split([E, E, E])  # [E] each
        out = []
        for x, w, b in ((q_in, w_q, b_q), (k_in, w_k, b_k), (v_in, w_v, b_v)):
            y = F.linear(x, w)  # (N, L|S, E), the weights' dtype
            y = (y + b).to(y.dtype)  # torch's y.add_(b)
            out.append(y.view(*x.shape[:2], H, dh).transpose(1, 2))  # (N, H, L|S, dh)
        return out[0], out[1], out[2]

    def _finish(
        self, out: Tensor, weights: Tensor | None, batched: bool, average_attn_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """The output in torch's layout, and the weights averaged/squeezed as torch returns them.

        out [N, L, E] (batch first); weights [N, H, L, S'] or None.
        """
        if batched and not self.batch_first:
            out = out.transpose(0, 1)  # (L, N, E)
        if not batched:
            out = out.squeeze(0)  # (L, E)
        if self.check_finite:
            _check_finite("attention output (inputs were finite: check the weights)", out)
        if weights is not None:
            if average_attn_weights:
                weights = weights.mean(dim=1)  # (N, L, S')
            if not batched:
                weights = weights.squeeze(0)  # (L, S') or (H, L, S')
        return out, weights


def _from_torch(old: nn.MultiheadAttention) -> MultiheadAttention:
    """The drop-in for ``old``, holding ``old``'s own parameters (and ``out_proj`` module), not copies."""
    ref = old.out_proj.weight
    new = MultiheadAttention(
        old.embed_dim,
        old.num_heads,
        dropout=old.dropout,
        bias=old.in_proj_bias is not None,
        add_bias_kv=old.bias_k is not None,
        add_zero_attn=old.add_zero_attn,
        kdim=old.kdim,
        vdim=old.vdim,
        batch_first=old.batch_first,
        device="meta",  # allocates nothing: every parameter is replaced by old's below
        dtype=ref.dtype,
    )
    names = (
        ["in_proj_weight"] if old._qkv_same_embed_dim else ["q_proj_weight", "k_proj_weight", "v_proj_weight"]
    )
    for name in [*names, "in_proj_bias", "bias_k", "bias_v"]:
        value = getattr(old, name)
        if value is not None:  # the constructor made the same layout: None stays None
            setattr(new, name, value)
    new.out_proj = old.out_proj
    if list(new.state_dict()) != list(old.state_dict()):  # pragma: no cover - a torch layout we do not know
        raise RuntimeError(f"internal: swapping changed the parameter names {list(old.state_dict())}")
    return new.train(old.training)


def swap_into(model: nn.Module) -> nn.Module:
    """Replace every ``torch.nn.MultiheadAttention`` inside ``model`` by the drop-in, in place.

    Each drop-in holds the replaced module's own parameters (the same ``nn.Parameter`` objects and its
    ``out_proj``), so the weights, their gradients, optimizers built on ``model.parameters()`` and tied
    weights carry over; the constructor settings (``batch_first``, ``dropout``, ``kdim``/``vdim``,
    ``add_bias_kv``, ``add_zero_attn``, bias) and the train/eval mode are kept. A module shared at
    several places stays one shared drop-in. Only modules whose class is exactly
    ``torch.nn.MultiheadAttention`` are replaced (subclasses may compute something else). Hooks
    registered on a replaced module do not carry over.

    Returns ``model`` (or, when ``model`` itself is a ``torch.nn.MultiheadAttention``, its drop-in).
    ``ValueError`` when ``model`` holds neither a ``torch.nn.MultiheadAttention`` nor a drop-in.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if type(model) is nn.MultiheadAttention:
        return _from_torch(model)
    targets = [
        (n, m) for n, m in model.named_modules(remove_duplicate=False) if type(m) is nn.MultiheadAttention
    ]
    if not targets:
        if any(isinstance(m, MultiheadAttention) for m in model.modules()):
            return model  # swapped already
        raise ValueError(
            f"model ({type(model).__name__}) holds no torch.nn.MultiheadAttention to replace "
            "(subclasses of it are left alone)"
        )
    made: dict[int, MultiheadAttention] = {}
    for name, old in targets:
        new = made.get(id(old))
        if new is None:
            new = made[id(old)] = _from_torch(old)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
    return model
