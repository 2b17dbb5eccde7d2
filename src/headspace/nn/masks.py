"""Mask building and checking: causal, padding and user masks -> one canonical form.

The one mask convention of headspace (as in ``torch.nn.functional.scaled_dot_product_attention``):

* boolean masks mean **True = may attend**;
* ``key_padding`` is a boolean ``[batch, seq_k]`` tensor, **True for real tokens**;
* a floating-point ``attn_mask`` is *additive*: it is added to the scaled scores, ``-inf`` blocks;
* integer masks are refused (their polarity cannot be guessed);
* a float ``attn_mask`` together with a bool ``key_padding`` is refused (fold one into the other);
* ``is_causal=True`` is combined with any other mask by logical AND (a key must pass every mask).
  Causality is aligned *bottom-right*: the ``seq_q`` queries are the last ``seq_q`` positions of the
  ``seq_k`` keys, so query ``i`` may see keys ``j <= i + (seq_k - seq_q)``. With ``seq_q == seq_k`` this is
  the usual lower triangle; with a KV cache it is exactly incremental decoding.

A query row left with no key to attend to ("dead row") produces an all-zero output and an all-zero
pattern row, with finite gradients, on every backend: :func:`canonical_mask` records those rows and
opens them up, so that no softmax ever sees a row of ``-inf``; the backends then zero them.

Accepted ``attn_mask`` shapes (each dimension either full or 1, where it broadcasts):
``[seq_q, seq_k]``, ``[batch, seq_q, seq_k]`` and ``[batch, n_heads, seq_q, seq_k]``, so a Hugging
Face-style padding mask ``[batch, 1, 1, seq_k]`` works as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ACCEPTED_MASK_SHAPES = "[seq_q, seq_k], [batch, seq_q, seq_k] or [batch, n_heads, seq_q, seq_k]"


@dataclass(frozen=True)
class CanonicalMask:
    """A mask in the form every backend understands.

    Attributes:
        mask: ``None`` (attend everywhere), a bool tensor ``[batch|1, n_heads|1, seq_q, seq_k]`` with
            True = may attend, or a float tensor of the same shape that is added to the scores.
            Dead rows have been opened up (so a softmax over them is finite).
        is_causal: True only when causality is the *sole* constraint and ``seq_q == seq_k``; then
            ``mask`` is None and a backend may use its causal kernel.
        dead_rows: ``None`` or a bool tensor ``[batch|1, n_heads|1, seq_q, 1]``, True where a query had
            nothing to attend to; backends zero the output and the pattern there.
    """

    mask: Tensor | None
    is_causal: bool
    dead_rows: Tensor | None


def causal_mask(seq_q: int, seq_k: int, device: torch.device | str | None = None) -> Tensor:
    """Bool ``[seq_q, seq_k]`` lower-triangular mask, aligned bottom-right (True = may attend)."""
    for name, n in (("seq_q", seq_q), ("seq_k", seq_k)):
        if isinstance(n, (bool, float, str)) or (isinstance(n, int) and n < 0):  # SymInts pass (compile)
            raise ValueError(f"causal_mask: {name} must be an int >= 0; got {n!r}")
    offset = seq_k - seq_q
    return torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril(diagonal=offset)


def check_window(window: object, name: str = "window") -> None:
    """``window`` must be None or an int >= 1 (a sliding window's width in keys); else a one-line error."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"{name} must be None (no sliding window) or an int >= 1 (keys a query sees); got {window!r}"
        )


def window_mask(
    seq_q: int,
    seq_k: int,
    window: int,
    device: torch.device | str | None = None,
    query: Tensor | None = None,
    sides: str | None = None,
) -> Tensor:
    """Bool ``[seq_q, seq_k]`` sliding-window mask, aligned bottom-right (True = may attend).

    Query ``i`` sits at key position ``p_i = i + seq_k - seq_q`` (the last ``seq_q`` of the ``seq_k``
    positions, as with a KV cache: positions are absolute) and sees key ``j`` iff
    ``p_i - window < j <= p_i``: itself and the ``window - 1`` keys before it. The window includes
    causality. ``query``: a 1-D int tensor of query rows to build instead of all ``seq_q`` (rows
    ``[len(query), seq_k]``). ``sides="both"``: the bidirectional band ``|p_i - j| < window`` instead
    (``window - 1`` keys on each side: ModernBERT's local attention; :data:`~headspace.nn.spec.WINDOW_SIDES`).
    """
    check_window(window)
    if sides not in (None, "both"):
        raise ValueError(f"window sides must be None (causal) or 'both'; got {sides!r}")
    rows = torch.arange(seq_q, device=device) if query is None else query.to(device)  # (rows,)
    pos = rows + (seq_k - seq_q)  # (rows,): each query's key position
    keys = torch.arange(seq_k, device=device)  # (seq_k,)
    if sides == "both":
        return (keys[None, :] - pos[:, None]).abs() < window  # (rows, seq_k)
    return (keys[None, :] <= pos[:, None]) & (keys[None, :] > pos[:, None] - window)  # (rows, seq_k)


def chunk_mask(
    seq_q: int,
    seq_k: int,
    chunk: int,
    device: torch.device | str | None = None,
    query: Tensor | None = None,
    left: Tensor | None = None,
) -> Tensor:
    """Bool ``[seq_q, seq_k]`` chunked causal mask (Llama 4's chunked attention), aligned bottom-right as
    :func:`window_mask` (True = may attend): query ``i`` at key position ``p_i = i + seq_k - seq_q`` sees
    key ``j`` iff ``j <= p_i`` and ``(j - l) // chunk == (p_i - l) // chunk`` (the keys of its own chunk
    of ``chunk`` positions, counted from position ``l``). ``left``: int [batch], each row's ``l`` (its
    left-padding columns, as transformers' chunked mask counts them) -> ``[batch, seq_q, seq_k]``;
    None: ``l = 0``. ``query``: a 1-D int tensor of query rows to build instead of all ``seq_q``."""
    check_window(chunk, "chunk")
    rows = torch.arange(seq_q, device=device) if query is None else query.to(device)  # (rows,)
    pos = rows + (seq_k - seq_q)  # (rows,): each query's key position
    keys = torch.arange(seq_k, device=device)  # (seq_k,)
    causal = keys[None, :] <= pos[:, None]  # (rows, seq_k)
    offset = torch.zeros(1, 1, dtype=torch.long, device=device) if left is None else left.to(device)[:, None]
    k_chunk = torch.div(keys[None, :] - offset, chunk, rounding_mode="floor")  # (batch|1, seq_k)
    q_chunk = torch.div(pos[None, :] - offset, chunk, rounding_mode="floor")  # (batch|1, rows)
    same = k_chunk[:, None, :] == q_chunk[:, :, None]  # (batch|1, rows, seq_k)
    return causal & same[0] if left is None else causal[None] & same  # (rows, sk) or (batch, rows, sk)


def _left_padding(key_padding: Tensor | None) -> Tensor | None:
    """Each row's left-padding columns (the False before its first True) of bool key_padding [batch,
    seq_k] -> int [batch]; None for None."""
    if key_padding is None:
        return None
    return (key_padding.cumsum(dim=-1) == 0).sum(dim=-1)  # (batch,)


def _and_bool(mask: Tensor | None, allowed: Tensor, is_float: bool) -> Tensor:
    """``mask`` (None, bool or additive float, broadcastable) combined by AND with bool ``allowed``."""
    if mask is None:
        return allowed
    if is_float:
        return torch.where(allowed, mask, float("-inf"))  # broadcasts both ways (no in-place expand)
    return mask & allowed


def _check_mask_dtype(name: str, mask: Tensor) -> None:
    if mask.dtype == torch.bool or mask.is_floating_point():
        return
    raise TypeError(
        f"{name} must be a bool tensor (True = may attend) or a float tensor (additive, -inf blocks); "
        f"got dtype {mask.dtype}. Integer masks are refused because their polarity cannot be guessed: "
        f"convert with {name}.bool() if 1 means 'may attend', or ({name} == 0) if 1 means 'masked'."
    )


def _as_4d(attn_mask: Tensor, batch: int, n_heads: int, seq_q: int, seq_k: int) -> Tensor:
    """Return ``attn_mask`` viewed as [batch|1, n_heads|1, seq_q, seq_k], or raise naming the shapes."""
    shape = tuple(attn_mask.shape)
    if attn_mask.dim() == 2:
        m = attn_mask[None, None]  # (1, 1, seq_q, seq_k)
    elif attn_mask.dim() == 3:
        m = attn_mask[:, None]  # (batch, 1, seq_q, seq_k)
    elif attn_mask.dim() == 4:
        m = attn_mask
    else:
        m = None
    want = (batch, n_heads, seq_q, seq_k)
    if m is None or any(got not in (1, full) for got, full in zip(m.shape, want)):
        raise ValueError(
            f"attn_mask has shape {list(shape)}, which does not fit batch={batch}, n_heads={n_heads}, "
            f"seq_q={seq_q}, seq_k={seq_k}; accepted shapes: {ACCEPTED_MASK_SHAPES} "
            "(any of them may be 1 to broadcast, e.g. [batch, 1, 1, seq_k] for padding)"
        )
    return m  # (batch|1, n_heads|1, seq_q|1, seq_k|1): broadcast where it is used, never copied


def check_key_padding(key_padding: Tensor, batch: int, seq_k: int, device: torch.device) -> None:
    """Validate a ``key_padding`` tensor: bool ``[batch, seq_k]`` on ``device``, True = real token."""
    if not isinstance(key_padding, Tensor):
        raise TypeError(f"key_padding must be a bool tensor [batch, seq_k]; got {type(key_padding).__name__}")
    if key_padding.dtype != torch.bool:
        raise TypeError(
            f"key_padding must be a bool tensor [batch, seq_k] with True for real tokens; got dtype "
            f"{key_padding.dtype} (integer and float padding masks are refused: their polarity cannot be "
            "guessed; for a 1 = real token convention pass key_padding.bool())"
        )
    if tuple(key_padding.shape) != (batch, seq_k):
        raise ValueError(
            f"key_padding must have shape [batch, seq_k] = [{batch}, {seq_k}]; got {list(key_padding.shape)}"
        )
    if key_padding.device != device:
        raise ValueError(f"key_padding is on {key_padding.device} but the inputs are on {device}")


def _checked_masks(
    batch: int,
    n_heads: int,
    seq_q: int,
    seq_k: int,
    key_padding: Tensor | None,
    attn_mask: Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[Tensor | None, bool]:
    """The checks of :func:`canonical_mask`; returns (attn_mask viewed as 4-D or None, is it float)."""
    if key_padding is not None:
        check_key_padding(key_padding, batch, seq_k, device)
    if attn_mask is None:
        return None, False
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"attn_mask must be a tensor; got {type(attn_mask).__name__}")
    _check_mask_dtype("attn_mask", attn_mask)
    if attn_mask.device != device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but the inputs are on {device}")
    is_float = attn_mask.is_floating_point()
    if is_float and attn_mask.dtype != dtype:
        raise TypeError(
            f"attn_mask is a float (additive) mask of dtype {attn_mask.dtype}, but the scores are "
            f"{dtype}; pass attn_mask.to({dtype})"
        )
    if is_float and key_padding is not None:
        raise TypeError(
            "attn_mask is a float (additive) mask but key_padding is bool: a float mask mixed with a "
            "bool mask is refused; either pass a bool attn_mask, or fold the padding into the float mask "
            "(attn_mask.masked_fill(~key_padding[:, None, None, :], float('-inf')))"
        )
    return _as_4d(attn_mask, batch, n_heads, seq_q, seq_k), is_float


def canonical_mask(
    *,
    batch: int,
    n_heads: int,
    seq_q: int,
    seq_k: int,
    key_padding: Tensor | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    window: int | None = None,
    chunk: int | None = None,
    window_sides: str | None = None,
) -> CanonicalMask:
    """Combine ``key_padding``, ``attn_mask``, ``is_causal`` and ``window`` into one :class:`CanonicalMask`.

    Args:
        batch, n_heads, seq_q, seq_k: the sizes of the attention the mask is for.
        key_padding: bool ``[batch, seq_k]``, True for real tokens.
        attn_mask: bool (True = may attend) or float (additive) in one of the accepted shapes.
        is_causal: add the bottom-right-aligned causal constraint (combined by AND).
        dtype: the dtype of the scores; a float ``attn_mask`` must have it.
        device: the device of the inputs; masks must be on it.
        window: None, or a sliding window (:func:`window_mask`, bottom-right aligned, causal by
            itself) combined by AND with every other mask.
        chunk: None, or chunked attention (:func:`chunk_mask`, likewise) combined by AND.
        window_sides: None (the causal band) or ``"both"`` (:func:`window_mask`'s ``sides``).

    Raises:
        TypeError: integer masks; a float mask with a bool ``key_padding``; a float mask of another dtype.
        ValueError: shapes that do not broadcast; masks on another device.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    mask, is_float = _checked_masks(batch, n_heads, seq_q, seq_k, key_padding, attn_mask, dtype, device)
    check_window(window)
    check_window(chunk, "chunk")

    # The causal kernel path: causality alone, square.
    plain = window is None and chunk is None
    if is_causal and mask is None and key_padding is None and seq_q == seq_k and plain:
        return CanonicalMask(mask=None, is_causal=True, dead_rows=None)
    if is_causal and mask is None and key_padding is None and chunk is None and window is not None:
        return _remembered_band(seq_q, seq_k, window, window_sides, device)  # every sliding layer's

    if key_padding is not None:
        pad = key_padding[:, None, None, :]  # (batch, 1, 1, seq_k)
        mask = pad if mask is None else mask & pad
    if is_causal:
        tri = causal_mask(seq_q, seq_k, device)[None, None]  # (1, 1, seq_q, seq_k)
        if mask is None:
            mask = tri
        elif is_float:
            mask = mask.masked_fill(~tri, float("-inf"))
        else:
            mask = mask & tri
    if window is not None:
        band = window_mask(seq_q, seq_k, window, device, sides=window_sides)  # (seq_q, seq_k)
        mask = _and_bool(mask, band[None, None], is_float)
    if chunk is not None:
        left = _left_padding(key_padding)  # chunks count from each row's first real token
        block = chunk_mask(seq_q, seq_k, chunk, device, left=left)  # (rows, sk) or (batch, rows, sk)
        mask = _and_bool(mask, block[None, None] if left is None else block[:, None], is_float)
    if mask is None:
        return CanonicalMask(mask=None, is_causal=False, dead_rows=None)

    # Dead rows (a query with nothing to attend to) are opened up so the softmax stays finite, and
    # reported so backends zero them. Eagerly the work is skipped when no row is dead (one check);
    # under torch.compile the branch-free form is used (a data-dependent branch would break the graph).
    compiling = torch.compiler.is_compiling()
    if is_float:
        dead = torch.isneginf(mask).all(dim=-1, keepdim=True)  # (b|1, h|1, seq_q, 1)
        if compiling or bool(dead.any()):
            mask = mask.masked_fill(dead, 0.0)
            return CanonicalMask(mask=mask, is_causal=False, dead_rows=dead)
        return CanonicalMask(mask=mask, is_causal=False, dead_rows=None)
    dead = ~mask.any(dim=-1, keepdim=True)  # (b|1, h|1, seq_q, 1)
    if seq_k > 0 and (compiling or bool(dead.any())):
        return CanonicalMask(mask=mask | dead, is_causal=False, dead_rows=dead)
    return CanonicalMask(mask=mask, is_causal=False, dead_rows=None)


#: The last mask :func:`_remembered_band` built: ((its sizes, window, sides, device, inference mode), mask).
_LAST_BAND: list[tuple[tuple[object, ...], CanonicalMask] | None] = [None]
#: :func:`_remembered_band` keeps masks of at most this many entries (seq_q * seq_k); larger ones are built
#: afresh on every call rather than held between calls.
BAND_MEMO_MAX = 1 << 22


def _remembered_band(
    seq_q: int, seq_k: int, window: int, sides: str | None, device: torch.device
) -> CanonicalMask:
    """:func:`canonical_mask` of causality AND a sliding window alone (no padding, no user mask), built by
    the same ops as its general path (the same values); the last one is kept and returned again, the
    same object, for the same sizes, window, sides, device and inference mode: every sliding layer of a
    forward asks for the same mask. Not kept under ``torch.compile`` or past :data:`BAND_MEMO_MAX`
    entries. No caller writes into a canonical mask (they make new tensors from it)."""
    compiling = torch.compiler.is_compiling()
    keep = not compiling and seq_q * seq_k <= BAND_MEMO_MAX
    key = (seq_q, seq_k, window, sides, device, torch.is_inference_mode_enabled())
    last = _LAST_BAND[0]
    if keep and last is not None and last[0] == key:
        return last[1]
    tri = causal_mask(seq_q, seq_k, device)[None, None]  # (1, 1, seq_q, seq_k)
    m = _and_bool(tri, window_mask(seq_q, seq_k, window, device, sides=sides)[None, None], False)
    dead = ~m.any(dim=-1, keepdim=True)  # (1, 1, seq_q, 1)
    if seq_k > 0 and (compiling or bool(dead.any())):
        made = CanonicalMask(mask=m | dead, is_causal=False, dead_rows=dead)
    else:
        made = CanonicalMask(mask=m, is_causal=False, dead_rows=None)
    if keep:
        _LAST_BAND[0] = (key, made)
    return made


class RowMasks:
    """:func:`canonical_mask` for blocks of query rows, without the [seq_q, seq_k] mask.

    Checks the arguments once (exactly as :func:`canonical_mask` does, same errors), then
    :meth:`rows` builds the canonical mask of some query rows only: the rows ``start .. end - 1`` or any
    1-D int tensor of query indices (``window`` as :func:`canonical_mask`'s).
    ``RowMasks(**kw).rows(s, e)`` equals ``canonical_mask(**kw)``'s
    rows ``s:e`` (``mask[..., s:e, :]`` and ``dead_rows[..., s:e, :]``, where they are not broadcast
    over the rows), with two differences: a causal constraint is always an explicit mask (never the
    ``is_causal`` kernel flag), and ``dead_rows`` is None when no row of the block is dead. Peak memory
    is that of one block's mask [batch|1, n_heads|1, rows, seq_k], whatever seq_q.

    Used where attention is computed a block of queries at a time (:mod:`headspace.analysis.chunked`).
    """

    def __init__(
        self,
        *,
        batch: int,
        n_heads: int,
        seq_q: int,
        seq_k: int,
        key_padding: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        window: int | None = None,
        chunk: int | None = None,
        window_sides: str | None = None,
    ) -> None:
        device = torch.device(device) if device is not None else torch.device("cpu")
        check_window(window)
        check_window(chunk, "chunk")
        self.window, self.chunk, self.window_sides = window, chunk, window_sides
        self.attn_mask, self.is_float = _checked_masks(
            batch, n_heads, seq_q, seq_k, key_padding, attn_mask, dtype, device
        )  # (b|1, h|1, sq|1, sk|1) or None: a view, never expanded
        self.batch, self.n_heads, self.seq_q, self.seq_k = batch, n_heads, seq_q, seq_k
        self.key_padding = key_padding
        self.is_causal = bool(is_causal)
        self.device = device

    @property
    def empty(self) -> bool:
        """True when nothing is masked (every block's mask is None)."""
        return (
            self.attn_mask is None
            and self.key_padding is None
            and not self.is_causal
            and self.window is None
            and self.chunk is None
        )

    def rows(self, start: int | Tensor, end: int | None = None) -> CanonicalMask:
        """The canonical mask of query rows ``start .. end - 1`` (ints) or of the indices ``start`` (a 1-D
        int tensor, ``end`` None): mask [batch|1, n_heads|1, rows|1, seq_k], dead_rows [.., rows, 1]."""
        if isinstance(start, Tensor):
            index: Tensor | None = start.to(self.device)
            n = int(index.shape[0])
        else:
            if end is None or not 0 <= start <= end <= self.seq_q:
                raise ValueError(f"rows({start}, {end}): need 0 <= start <= end <= seq_q={self.seq_q}")
            index, n = None, end - start
        mask: Tensor | None = None
        m = self.attn_mask
        if m is not None:
            if m.shape[2] == 1:
                mask = m  # broadcast over the rows
            elif index is None:
                mask = m[:, :, start:end]  # (b|1, h|1, rows, sk|1)
            else:
                mask = m.index_select(2, index)  # (b|1, h|1, rows, sk|1)
        if self.key_padding is not None:
            pad = self.key_padding[:, None, None, :]  # (batch, 1, 1, seq_k)
            mask = pad if mask is None else mask & pad
        if self.is_causal:
            query = torch.arange(start, end, device=self.device) if index is None else index  # (rows,)
            keys = torch.arange(self.seq_k, device=self.device)  # (seq_k,)
            offset = self.seq_k - self.seq_q  # bottom-right alignment
            tri = (keys[None, :] <= query[:, None] + offset)[None, None]  # (1, 1, rows, seq_k)
            if mask is None:
                mask = tri
            elif self.is_float:
                mask = mask.masked_fill(~tri, float("-inf"))
            else:
                mask = mask & tri
        if self.window is not None:
            query = torch.arange(start, end, device=self.device) if index is None else index  # (rows,)
            band = window_mask(
                self.seq_q, self.seq_k, self.window, self.device, query, self.window_sides
            )  # (rows, seq_k)
            mask = _and_bool(mask, band[None, None], self.is_float)
        if self.chunk is not None:
            query = torch.arange(start, end, device=self.device) if index is None else index  # (rows,)
            left = _left_padding(self.key_padding)  # chunks count from each row's first real token
            block = chunk_mask(self.seq_q, self.seq_k, self.chunk, self.device, query, left)  # (.., rows, sk)
            mask = _and_bool(mask, block[None, None] if left is None else block[:, None], self.is_float)
        if mask is None or n == 0:
            return CanonicalMask(mask=mask, is_causal=False, dead_rows=None)
        if self.is_float:
            dead = torch.isneginf(mask).all(dim=-1, keepdim=True)  # (b|1, h|1, rows|1, 1)
            if bool(dead.any()):
                return CanonicalMask(mask=mask.masked_fill(dead, 0.0), is_causal=False, dead_rows=dead)
            return CanonicalMask(mask=mask, is_causal=False, dead_rows=None)
        dead = ~mask.any(dim=-1, keepdim=True)  # (b|1, h|1, rows|1, 1)
        if self.seq_k > 0 and bool(dead.any()):
            return CanonicalMask(mask=mask | dead, is_causal=False, dead_rows=dead)
        return CanonicalMask(mask=mask, is_causal=False, dead_rows=None)
