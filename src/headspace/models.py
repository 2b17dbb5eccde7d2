"""Encoder (BERT family), Decoder (GPT family) and their one configuration dataclass.

Both models are a stack of :class:`~headspace.block.TransformerBlock` between an embedding layer and an
output::

    Encoder (BERT):  e = LN_emb(E_tok[t] + E_pos[p] + E_type[s]);  h_l = Block_l(h_{l-1}) (post-LN)
                     out = h_L
    Decoder (GPT-2): e = E_tok[t] + E_pos[p];  h_l = Block_l(h_{l-1}) (pre-LN, causal)
                     logits = LN_f(h_L) E_tok^T

Every intermediate has a named hook point (``hook_embed``, ``blocks.3.attn.hook_pattern``,
``blocks.0.hook_resid_post`` ...).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import KVCache, resolve_head_dims
from .block import ACTIVATIONS, NORMS, TransformerBlock
from .hooks import HookPoint
from .kernels.workspace import Workspace
from .masks import check_key_padding
from .pruning import kept_kv_heads, shrink_attention

ARCHS = ("encoder", "decoder")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive int; got {value!r}")


def _probability(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"ModelConfig.{name} must be a float in [0, 1); got {value!r}")


@dataclass
class ModelConfig:
    """Everything that fixes the shape and behaviour of an :class:`Encoder` or :class:`Decoder`.

    Fields left as ``None`` are derived in ``__post_init__`` (their documented default), so a stored
    config always lists concrete values. Invalid values raise ``ValueError`` naming the field.
    ``to_dict()``/``from_dict()`` round-trip through JSON.
    """

    #: "encoder" (BERT family: bidirectional, token-type embeddings) or "decoder" (GPT family: causal).
    arch: str = "encoder"
    #: Number of token ids (rows of the token embedding, columns of the logits).
    vocab_size: int = 30522
    #: Width of the residual stream.
    d_model: int = 512
    #: Number of transformer blocks.
    n_layers: int = 6
    #: Query heads per attention layer.
    n_heads: int = 8
    #: Width of one head; derived: d_model // n_heads (d_model must then be divisible by n_heads).
    d_head: int | None = None
    #: Key/value heads (grouped-query attention; must divide n_heads); derived: n_heads.
    n_kv_heads: int | None = None
    #: Hidden width of the feed-forward network (the paper's d_ff); derived: 4 * d_model.
    d_mlp: int | None = None
    #: Rows of the learned position table: the longest sequence the model accepts.
    max_seq_len: int = 512
    #: Feed-forward activation, one of "gelu" (exact), "gelu_tanh", "relu"; derived: encoder "gelu",
    #: decoder "gelu_tanh" (GPT-2's gelu_new).
    act: str | None = None
    #: "post" (LN after each residual add: BERT) or "pre" (LN before each sublayer: GPT-2); derived:
    #: encoder "post", decoder "pre".
    norm: str | None = None
    #: Dropout on each sublayer's output before the residual add, in [0, 1).
    dropout: float = 0.0
    #: Dropout on the attention pattern, in [0, 1).
    attn_dropout: float = 0.0
    #: Dropout on the embeddings; derived: dropout.
    emb_dropout: float | None = None
    #: LayerNorm epsilon (BERT 1e-12, GPT-2 1e-5).
    ln_eps: float = 1e-5
    #: Biases in the attention and feed-forward projections.
    bias: bool = True
    #: Rows of the token-type (segment) embedding; 0 = none; derived: encoder 2, decoder 0.
    type_vocab_size: int | None = None
    #: Decoder: the output projection is the token embedding transposed; derived: decoder True,
    #: encoder False (an encoder has no output projection).
    tie_embeddings: bool | None = None
    #: Id of the padding token (None = no padding token); must be < vocab_size.
    pad_token_id: int | None = None
    #: LayerNorm on the embeddings (BERT); derived: norm == "post".
    embed_ln: bool | None = None
    #: LayerNorm after the last block (GPT-2's ln_f); derived: norm == "pre".
    final_ln: bool | None = None
    #: Standard deviation of the normal initialisation of embeddings and feed-forward weights.
    init_std: float = 0.02
    #: A free-form name shown in summaries (e.g. "all-MiniLM-L6-v2").
    name: str = ""
    #: Free-form extra information (e.g. where the weights came from); must be JSON-serialisable.
    extra: dict[str, Any] = field(default_factory=dict)
    #: Heads removed for good, ``{layer: [original head indices]}`` (empty: none): the model is built
    #: with those heads' rows of W_Q (and of W_K/W_V for a key/value group that loses all its query
    #: heads) and columns of W_O left out, as :func:`headspace.prune_heads` leaves them, so a pruned
    #: model's config rebuilds it and its saved weights load back. Sorted and checked here: layers in
    #: [0, n_layers), heads in [0, n_heads), at least one head kept per layer, equal group sizes under
    #: grouped-query attention. JSON keys (strings) are read back as ints.
    pruned_heads: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"ModelConfig.arch must be one of {list(ARCHS)}; got {self.arch!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            _positive_int(name, getattr(self, name))
        try:
            self.d_head, self.n_kv_heads = resolve_head_dims(
                self.d_model, self.n_heads, self.d_head, self.n_kv_heads
            )
        except ValueError as e:
            raise ValueError(f"ModelConfig: {e}") from None
        encoder = self.arch == "encoder"
        if self.d_mlp is None:
            self.d_mlp = 4 * self.d_model
        _positive_int("d_mlp", self.d_mlp)
        if self.act is None:
            self.act = "gelu" if encoder else "gelu_tanh"
        if self.act not in ACTIVATIONS:
            raise ValueError(f"ModelConfig.act must be one of {list(ACTIVATIONS)}; got {self.act!r}")
        if self.norm is None:
            self.norm = "post" if encoder else "pre"
        if self.norm not in NORMS:
            raise ValueError(f"ModelConfig.norm must be one of {list(NORMS)}; got {self.norm!r}")
        if self.emb_dropout is None:
            self.emb_dropout = self.dropout
        for name in ("dropout", "attn_dropout", "emb_dropout"):
            _probability(name, getattr(self, name))
        if (
            isinstance(self.ln_eps, bool)
            or not isinstance(self.ln_eps, (int, float))
            or not math.isfinite(self.ln_eps)
            or not self.ln_eps > 0
        ):
            raise ValueError(f"ModelConfig.ln_eps must be a finite positive float; got {self.ln_eps!r}")
        if self.type_vocab_size is None:
            self.type_vocab_size = 2 if encoder else 0
        if (
            not isinstance(self.type_vocab_size, int)
            or isinstance(self.type_vocab_size, bool)
            or self.type_vocab_size < 0
        ):
            raise ValueError(f"ModelConfig.type_vocab_size must be an int >= 0; got {self.type_vocab_size!r}")
        if self.tie_embeddings is None:
            self.tie_embeddings = not encoder
        if self.embed_ln is None:
            self.embed_ln = self.norm == "post"
        if self.final_ln is None:
            self.final_ln = self.norm == "pre"
        for name in ("bias", "tie_embeddings", "embed_ln", "final_ln"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool; got {getattr(self, name)!r}")
        if self.pad_token_id is not None and (
            not isinstance(self.pad_token_id, int)
            or isinstance(self.pad_token_id, bool)
            or not 0 <= self.pad_token_id < self.vocab_size
        ):
            raise ValueError(
                f"ModelConfig.pad_token_id must be None or an int in [0, vocab_size={self.vocab_size}); "
                f"got {self.pad_token_id!r}"
            )
        if (
            isinstance(self.init_std, bool)
            or not isinstance(self.init_std, (int, float))
            or not math.isfinite(self.init_std)
            or self.init_std <= 0
        ):
            raise ValueError(f"ModelConfig.init_std must be a finite positive float; got {self.init_std!r}")
        if not isinstance(self.name, str):
            raise ValueError(f"ModelConfig.name must be a str; got {self.name!r}")
        if not isinstance(self.extra, dict):
            raise ValueError(f"ModelConfig.extra must be a dict; got {type(self.extra).__name__}")
        self.pruned_heads = _checked_pruned_heads(
            self.pruned_heads, self.n_layers, self.n_heads, self.n_kv_heads
        )

    def kept_heads(self, layer: int) -> list[int]:
        """The original indices of the heads layer ``layer`` keeps (all ``n_heads`` unless pruned)."""
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.n_layers:
            raise ValueError(f"layer must be an int in [0, n_layers={self.n_layers}); got {layer!r}")
        pruned = set(self.pruned_heads.get(layer, ()))
        return [h for h in range(self.n_heads) if h not in pruned]

    def to_dict(self) -> dict[str, Any]:
        """Every field, derived ones included, as JSON values (``pruned_heads`` keys as strings)."""
        d = dataclasses.asdict(self)
        d["pruned_heads"] = {str(layer): heads for layer, heads in self.pruned_heads.items()}
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build a config from :meth:`to_dict` output; unknown keys are an error that lists them."""
        if not isinstance(data, dict):
            raise TypeError(f"ModelConfig.from_dict expects a dict; got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"ModelConfig.from_dict: unknown fields {unknown}; known fields: {sorted(known)}"
            )
        return cls(**data)

    def summary(self) -> str:
        """One line: architecture and sizes."""
        name = f"{self.name}: " if self.name else ""
        return (
            f"{name}{self.arch}, {self.n_layers} layers x {self.n_heads} heads, d_model {self.d_model}, "
            f"d_head {self.d_head}, d_mlp {self.d_mlp}, vocab {self.vocab_size}, "
            f"max_seq_len {self.max_seq_len}, "
            f"{self.norm}-LN, {self.act}"
            + (f", {sum(map(len, self.pruned_heads.values()))} heads pruned" if self.pruned_heads else "")
        )


def _checked_pruned_heads(value: Any, n_layers: int, n_heads: int, n_kv_heads: int) -> dict[int, list[int]]:
    """``ModelConfig.pruned_heads`` normalised to ``{layer: sorted heads}`` (int keys, no empty lists)."""
    what = "ModelConfig.pruned_heads must be a dict {layer: [head, ...]}"
    if not isinstance(value, dict):
        raise ValueError(f"{what}; got {type(value).__name__}")
    out: dict[int, list[int]] = {}
    for key, heads in value.items():
        layer = int(key) if isinstance(key, str) and key.isdigit() else key
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < n_layers:
            raise ValueError(f"{what} with layers in [0, n_layers={n_layers}); got layer {key!r}")
        if layer in out:
            raise ValueError(f"{what}; layer {layer} is given twice ({key!r})")
        if isinstance(heads, (str, bytes, dict)) or not hasattr(heads, "__iter__"):
            raise ValueError(f"{what}; got {heads!r} for layer {layer}")
        heads = list(heads)
        for h in heads:
            if not isinstance(h, int) or isinstance(h, bool) or not 0 <= h < n_heads:
                raise ValueError(f"{what} with heads in [0, n_heads={n_heads}); got {h!r} for layer {layer}")
        heads = sorted(set(heads))
        if len(heads) == n_heads:
            raise ValueError(
                f"ModelConfig.pruned_heads[{layer}] prunes all {n_heads} heads; a layer needs at least one"
            )
        kept_kv_heads(
            n_heads,
            n_kv_heads,
            [h for h in range(n_heads) if h not in heads],
            f"ModelConfig.pruned_heads[{layer}]",
        )
        if heads:
            out[layer] = heads
    return dict(sorted(out.items()))


def _check_config(config: Any, arch: str, cls_name: str) -> ModelConfig:
    if not isinstance(config, ModelConfig):
        raise TypeError(f"{cls_name}(config) expects a headspace.ModelConfig; got {type(config).__name__}")
    if config.arch != arch:
        raise ValueError(f"{cls_name} needs ModelConfig(arch={arch!r}); got arch={config.arch!r}")
    return config


def _check_integer_matrix(t: Any, name: str, what: str) -> None:
    """``t`` must be an integer tensor (``what``: "token ids", "position indices"); errors name it."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be an int64 tensor [batch, seq] of {what}; got {type(t).__name__}")
    if t.dtype not in (torch.int64, torch.int32):  # the dtypes torch's embedding lookup takes
        raise TypeError(
            f"{name} must be an integer tensor (int64 or int32) [batch, seq] of {what}; got dtype {t.dtype}"
        )


def _check_below(t: Tensor, name: str, bound: int, outside: str, noun: str = "") -> None:
    """Every value of ``t`` in [0, bound); else ``"{name} contains {noun}{value}, outside {outside}"``."""
    if t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= bound:
            raise ValueError(f"{name} contains {noun}{lo if lo < 0 else hi}, outside {outside}")


def check_tokens(
    tokens: Any,
    config: ModelConfig,
    *,
    start: int = 0,
    name: str = "tokens",
    check_length: bool = True,
    device: torch.device | None = None,
) -> None:
    """Tokens must be an integer tensor [batch, seq] of ids < vocab_size fitting the position table.

    ``check_length=False`` leaves the length to the caller: with per-row positions (left-padded
    batches) the columns may outnumber the position table while every position stays inside it.
    ``device``: the model's device, which the tokens must be on (None: not checked).
    """
    _check_integer_matrix(tokens, name, "token ids")
    if device is not None and tokens.device != device:
        raise ValueError(
            f"{name} are on device {tokens.device} but the model's weights are on {device}; "
            f"move them with {name}.to({str(device)!r})"
        )
    if tokens.dim() != 2:
        hint = " (for one sequence use .unsqueeze(0))" if tokens.dim() == 1 else ""
        raise ValueError(f"{name} must be 2-D [batch, seq]; got shape {list(tokens.shape)}{hint}")
    seq = tokens.shape[1]
    if check_length and start + seq > config.max_seq_len:
        where = f" starting at position {start}" if start else ""
        raise ValueError(
            f"{name} has length {seq}{where}, longer than the position table "
            f"(max_seq_len={config.max_seq_len}); "
            f"refused, not truncated: truncate the input to at most {config.max_seq_len - start} tokens"
        )
    _check_below(tokens, name, config.vocab_size, f"[0, vocab_size={config.vocab_size})", noun="id ")


def check_positions(positions: Any, tokens: Tensor, config: ModelConfig) -> None:
    """Positions must be an integer tensor shaped like ``tokens`` with values in [0, max_seq_len)."""
    _check_integer_matrix(positions, "positions", "position indices")
    if positions.shape != tokens.shape:
        raise ValueError(
            f"positions must have the shape of tokens [batch, seq] = {list(tokens.shape)}; "
            f"got {list(positions.shape)}"
        )
    if positions.device != tokens.device:
        raise ValueError(f"positions is on {positions.device} but tokens is on {tokens.device}")
    table = f"the position table [0, max_seq_len={config.max_seq_len})"
    _check_below(positions, "positions", config.max_seq_len, table)


def check_left_padding(key_padding: Any, tokens: Tensor) -> None:
    """A prompt mask for :meth:`Decoder.generate`: bool, shaped like ``tokens``, left-padded, no empty row.

    Left padding: in every row the real tokens (True) are right-aligned, ``[F, F, T, T]``; a False after
    a True (``[T, F, T]``, ``[T, T, F]``) is refused, and so is a row with no True.
    """
    check_key_padding(key_padding, tokens.shape[0], tokens.shape[1], tokens.device)

    def show(row: int) -> str:
        flags = "".join("T" if x else "F" for x in key_padding[row].tolist())
        return flags if len(flags) <= 40 else f"{flags[:18]}...{flags[-18:]}"

    empty = (~key_padding.any(dim=1)).nonzero()  # (n_empty, 1)
    if len(empty):
        row = int(empty[0, 0])
        raise ValueError(
            f"key_padding row {row} has no real token (all False); every prompt needs at least 1 token"
        )
    # a real token followed by padding: the real tokens of that row are not right-aligned
    gaps = (key_padding[:, :-1] & ~key_padding[:, 1:]).any(dim=1).nonzero()  # (n_bad, 1)
    if len(gaps):
        row = int(gaps[0, 0])
        raise ValueError(
            "key_padding must be left padding: each row's real tokens (True) right-aligned after its "
            f"padding (False), like FFTTT; row {row} is {show(row)}"
        )


class _Stack(nn.Module):
    """What Encoder and Decoder share: embeddings, blocks, optional LayerNorms, initialisation."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.tok_embed = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_embed = nn.Embedding(c.max_seq_len, c.d_model)
        self.type_embed = nn.Embedding(c.type_vocab_size, c.d_model) if c.type_vocab_size else None
        self.embed_ln = nn.LayerNorm(c.d_model, eps=c.ln_eps) if c.embed_ln else None
        self.embed_dropout = nn.Dropout(c.emb_dropout)
        self.hook_embed = HookPoint()  # [batch, seq, d_model]: the residual stream entering block 0
        self.blocks = nn.ModuleList(
            TransformerBlock(
                c.d_model,
                c.n_heads,
                c.d_mlp,
                d_head=c.d_head,
                n_kv_heads=c.n_kv_heads,
                act=c.act,
                norm=c.norm,
                dropout=c.dropout,
                attn_dropout=c.attn_dropout,
                ln_eps=c.ln_eps,
                bias=c.bias,
            )
            for _ in range(c.n_layers)
        )
        self.ln_final = nn.LayerNorm(c.d_model, eps=c.ln_eps) if c.final_ln else None
        self._init_weights()
        for layer in c.pruned_heads:  # built as prune_heads leaves them: (H', ...) fused storage
            shrink_attention(self.blocks[layer].attn, c.kept_heads(layer))

    def _init_weights(self) -> None:
        """Normal(0, init_std) embeddings and feed-forward weights, zero biases, unit LayerNorms.

        Attention layers keep their own initialisation (Xavier-uniform, as torch.nn.MultiheadAttention).
        """
        std = self.config.init_std
        for m in self.modules():
            if isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def embed(
        self,
        tokens: Tensor,
        *,
        start: int = 0,
        token_type_ids: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Token + position (+ token-type) embeddings, LayerNorm and dropout as configured.

        Shapes: tokens [batch, seq] -> [batch, seq, d_model]; positions are ``start .. start + seq - 1``
        for every row, or the given per-row ``positions`` int64 [batch, seq] (left-padded batches:
        each row counts from 0 at its first real token). Give ``start`` or ``positions``, not both.
        """
        if positions is None:
            seq = tokens.shape[1]
            positions = torch.arange(start, start + seq, device=tokens.device)  # (seq,)
        elif start:
            raise ValueError(f"embed takes start or positions, not both; got start={start} and positions")
        e = self.tok_embed(tokens) + self.pos_embed(positions)  # (batch, seq, d_model)
        if self.type_embed is not None:
            if token_type_ids is None:
                e = e + self.type_embed.weight[0]  # every token of segment 0
            else:
                e = e + self.type_embed(token_type_ids)  # (batch, seq, d_model)
        if self.embed_ln is not None:
            e = self.embed_ln(e)
        e = self.embed_dropout(e)
        if self.hook_embed.fns:
            e = self.hook_embed(e)
        return e

    def extra_repr(self) -> str:
        return self.config.summary()


class Encoder(_Stack):
    r"""A BERT-family encoder: embeddings, then bidirectional post-LN transformer blocks.

    Formula::

        h_0 = Dropout(LN_emb(E_tok[t_i] + E_pos[i] + E_type[s_i]))
        h_l = Block_l(h_{l-1}, key_padding)          l = 1 .. n_layers
        out = h_L  (LN_final(h_L) when config.final_ln, i.e. pre-LN encoders)

    Padding tokens are never attended to (their own rows are computed, as in BERT, and can be ignored).
    ``.blocks[l]`` is a :class:`~headspace.block.TransformerBlock`; ``.hook_embed`` sees ``h_0``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(_check_config(config, "encoder", "Encoder"))

    def forward(
        self, tokens: Tensor, key_padding: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """Token states for a (padded) batch.

        Notation used for tensor shapes:
            batch, seq (<= config.max_seq_len), d_model.

        Args:
            tokens: int64 [batch, seq] token ids.
            key_padding: bool [batch, seq], True for real tokens (None: every token is real).
            token_type_ids: int64 [batch, seq] segment ids (None: all segment 0).

        Returns:
            hidden states [batch, seq, d_model].
        """
        check_tokens(tokens, self.config, device=self.tok_embed.weight.device)
        if token_type_ids is not None:
            if self.type_embed is None:
                raise ValueError("token_type_ids were given but this encoder has type_vocab_size=0")
            if not isinstance(token_type_ids, Tensor) or token_type_ids.shape != tokens.shape:
                got = (
                    list(token_type_ids.shape) if isinstance(token_type_ids, Tensor) else type(token_type_ids)
                )
                raise ValueError(
                    f"token_type_ids must have the shape of tokens {list(tokens.shape)}; got {got}"
                )
            check_tokens(
                token_type_ids,
                dataclasses.replace(self.config, vocab_size=self.config.type_vocab_size),
                name="token_type_ids",
                device=self.tok_embed.weight.device,
            )
        x = self.embed(tokens, token_type_ids=token_type_ids)  # (batch, seq, d_model)
        for block in self.blocks:
            x = block(x, key_padding=key_padding)  # (batch, seq, d_model)
        if self.ln_final is not None:
            x = self.ln_final(x)
        return x

    def infer(
        self,
        tokens: Tensor,
        key_padding: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        workspace: Workspace | None = None,
    ) -> Tensor:
        """:meth:`forward` for inference: the same token states with fewer passes over memory.

        The blocks share one :class:`~headspace.workspace.Workspace` for their large intermediate
        matrices; pass your own ``workspace`` to keep that memory across calls (as ``encode`` does
        across batches). The returned tensor is always fresh memory, never part of the workspace.

        Falls back to :meth:`forward` whenever the fast path could differ from it: with autograd on,
        in training mode (dropout), while any hook point has a function, or with ``check_finite`` set.

        Notation used for tensor shapes:
            batch, seq (<= config.max_seq_len), d_model.

        Args:
            tokens: int64 [batch, seq] token ids.
            key_padding: bool [batch, seq], True for real tokens (None: every token is real).
            token_type_ids: int64 [batch, seq] segment ids (None: all segment 0).
            workspace: scratch memory to reuse (None: a fresh one for this call).

        Returns:
            hidden states [batch, seq, d_model].
        """
        if (
            torch.is_grad_enabled()
            or self.training
            or token_type_ids is not None
            or any(m.fns for m in self.modules() if isinstance(m, HookPoint))
            or any(b.attn.check_finite for b in self.blocks)
        ):
            return self(tokens, key_padding, token_type_ids)
        check_tokens(tokens, self.config, device=self.tok_embed.weight.device)
        batch, seq = tokens.shape
        mask = None
        if key_padding is not None:
            check_key_padding(key_padding, batch, seq, tokens.device)
            if not bool(key_padding.all()):
                if not bool(key_padding.any(dim=1).all()):
                    return self(tokens, key_padding)  # a sample with no real token: forward's dead-row rule
                mask = key_padding[:, None, None, :]  # (batch, 1, 1, seq)
        ws = Workspace() if workspace is None else workspace
        x = self.embed(tokens).contiguous()  # (batch, seq, d_model)
        for block in self.blocks:
            x = block.infer(x, mask, ws)  # (batch, seq, d_model)
        if self.ln_final is not None:
            x = self.ln_final(x)
        return x


class Decoder(_Stack):
    r"""A GPT-family decoder: embeddings, causal pre-LN transformer blocks, final LayerNorm, logits.

    Formula::

        h_0 = Dropout(E_tok[t_i] + E_pos[i])
        h_l = Block_l(h_{l-1}, causal)               l = 1 .. n_layers
        logits = LN_f(h_L) W_U                       W_U = E_tok^T when config.tie_embeddings

    ``generate()`` samples continuations with a KV cache (temperature, top-k, reproducible with a seed);
    prompts of different lengths go in one left-padded batch with their ``key_padding``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(_check_config(config, "decoder", "Decoder"))
        c = self.config
        self.lm_head = None if c.tie_embeddings else nn.Linear(c.d_model, c.vocab_size, bias=False)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=c.init_std)

    @property
    def W_U(self) -> Tensor:
        """The unembedding [d_model, vocab_size]: ``logits = LN_f(h_L) @ W_U`` (a view)."""
        w = self.tok_embed.weight if self.lm_head is None else self.lm_head.weight
        return w.T  # (d_model, vocab_size)

    def make_kv_caches(self, batch: int, capacity: int | None = None) -> list[KVCache]:
        """One :class:`~headspace.KVCache` per block, for ``capacity`` positions (default max_seq_len)."""
        capacity = self.config.max_seq_len if capacity is None else capacity
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be None or an int >= 1 (positions to cache); got {capacity!r}")
        if capacity > self.config.max_seq_len:
            raise ValueError(
                f"capacity={capacity} exceeds the position table (max_seq_len={self.config.max_seq_len})"
            )
        return [block.attn.make_kv_cache(batch, capacity) for block in self.blocks]

    def hidden_states(
        self,
        tokens: Tensor,
        key_padding: Tensor | None = None,
        kv_caches: list[KVCache] | None = None,
        *,
        positions: Tensor | None = None,
    ) -> Tensor:
        """The final residual stream after LN_f, [batch, seq, d_model]: ``forward`` without unembedding."""
        start = 0
        if kv_caches is not None:
            if not isinstance(kv_caches, (list, tuple)) or len(kv_caches) != len(self.blocks):
                got = len(kv_caches) if isinstance(kv_caches, (list, tuple)) else type(kv_caches).__name__
                raise ValueError(
                    f"kv_caches must be a list of {len(self.blocks)} KVCache (one per block, from "
                    f"make_kv_caches); got {got}"
                )
            bad = [i for i, c in enumerate(kv_caches) if not isinstance(c, KVCache)]
            if bad:
                raise TypeError(
                    f"kv_caches must hold one KVCache per block (from make_kv_caches); item {bad[0]} is "
                    f"{type(kv_caches[bad[0]]).__name__}"
                )
            start = kv_caches[0].length
        # with per-row positions the table bounds the positions (checked below), not the columns
        check_tokens(
            tokens,
            self.config,
            start=start,
            check_length=positions is None,
            device=self.tok_embed.weight.device,
        )
        if positions is None:
            x = self.embed(tokens, start=start)  # (batch, seq, d_model)
        else:
            check_positions(positions, tokens, self.config)
            x = self.embed(tokens, positions=positions)  # (batch, seq, d_model)
        # one new query after the cached positions sees every key: causality is vacuous there, and
        # dropping it lets attention run without building a mask in every layer
        causal = not (kv_caches is not None and tokens.shape[1] == 1)
        for i, block in enumerate(self.blocks):
            cache = None if kv_caches is None else kv_caches[i]
            x = block(x, key_padding=key_padding, is_causal=causal, kv_cache=cache)  # (batch, seq, d_model)
        if self.ln_final is not None:
            x = self.ln_final(x)
        return x

    def forward(
        self,
        tokens: Tensor,
        key_padding: Tensor | None = None,
        kv_caches: list[KVCache] | None = None,
        *,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Next-token logits at every position.

        Notation used for tensor shapes:
            batch, seq (new positions), seq_k (seq plus cached positions), d_model, vocab_size.

        Args:
            tokens: int64 [batch, seq] token ids.
            key_padding: bool [batch, seq_k], True for real tokens (None: all real).
            kv_caches: from :meth:`make_kv_caches`; the new positions follow the cached ones and their
                keys/values are appended.
            positions: int64 [batch, seq] indices into the position table, per row (None: the column
                index, after any cached positions). Left-padded batches pass ``cumsum(key_padding) - 1``
                (clamped at 0) so that each row counts from 0 at its first real token, as
                :meth:`generate` does.

        Returns:
            logits [batch, seq, vocab_size].
        """
        h = self.hidden_states(tokens, key_padding, kv_caches, positions=positions)  # (batch, seq, d_model)
        if self.lm_head is None:
            return F.linear(h, self.tok_embed.weight)  # (batch, seq, vocab_size)
        return self.lm_head(h)  # (batch, seq, vocab_size)

    @torch.no_grad()
    def generate(
        self,
        tokens: Tensor,
        max_new_tokens: int,
        *,
        key_padding: Tensor | None = None,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int | None = None,
        use_cache: bool = True,
    ) -> Tensor:
        """Sample ``max_new_tokens`` continuation tokens after each prompt.

        Prompts of different lengths are left-padded into one batch, with ``key_padding`` marking the
        real tokens. Each row then behaves as if generated alone: its positions count from 0 at its first
        real token (``cumsum(key_padding) - 1``, as transformers' GPT-2 ``generate`` derives
        ``position_ids`` from the attention mask) and its padded keys are never attended, neither by the
        prompt nor by any generated token, with or without the KV cache. Greedy decoding
        (``temperature=0``) of a padded batch equals decoding each prompt alone; sampling draws for the
        whole batch at once, so with a seed it is reproducible but not equal to per-prompt sampling.

        Notation used for tensor shapes:
            batch, prompt_len (the longest prompt; shorter ones are left-padded to it),
            new (= max_new_tokens).

        Args:
            tokens: int64 [batch, prompt_len] prompts; left-padded when they differ in length (any
                valid id at padded positions: they never affect the real rows).
            max_new_tokens: number of tokens to add: the longest prompt's real tokens + max_new_tokens
                <= max_seq_len (left padding takes no position, so it is not counted).
            key_padding: bool [batch, prompt_len], True for real tokens; every row's real tokens must be
                right-aligned (``[F, F, T, T]``) and at least one (None: every token is real).
            temperature: logits are divided by it before sampling; 0 means greedy (argmax).
            top_k: sample only among the k most likely tokens (None: all).
            seed: seeds a private generator, so the same seed gives the same tokens (None: torch's
                global RNG).
            use_cache: decode with a KV cache (default); False recomputes the whole sequence each step
                (the reference the cache is tested against).

        Returns:
            [batch, prompt_len + new]: the prompts (padding included, as given) followed by the sampled
            tokens.

        The model is put in eval mode for the call (no dropout) and restored afterwards.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0; got {max_new_tokens!r}")
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, (int, float))
            or not math.isfinite(temperature)
            or temperature < 0
        ):
            raise ValueError(f"temperature must be a float >= 0, finite (0 = greedy); got {temperature!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k must be None or an int >= 1; got {top_k!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be None or an int; got {seed!r}")
        check_tokens(
            tokens, self.config, check_length=key_padding is None, device=self.tok_embed.weight.device
        )
        batch, prompt_len = tokens.shape
        if prompt_len == 0:
            raise ValueError("tokens must hold a prompt of at least 1 token; got prompt_len=0")
        longest = prompt_len
        if key_padding is not None:
            check_left_padding(key_padding, tokens)
            longest = int(key_padding.sum(dim=1).max())
            if bool(key_padding.all()):
                key_padding = None  # nothing padded: the unmasked path, as without key_padding
        total = prompt_len + max_new_tokens  # columns of the result, padding included
        if longest + max_new_tokens > self.config.max_seq_len:
            what = (
                f"prompt_len {prompt_len}"
                if longest == prompt_len
                else f"the longest prompt's {longest} real tokens"
            )
            raise ValueError(
                f"{what} + max_new_tokens {max_new_tokens} = {longest + max_new_tokens} exceeds the "
                f"position table (max_seq_len={self.config.max_seq_len}); refused, not truncated"
            )
        if max_new_tokens == 0:
            return tokens.clone()
        real = positions = None
        if key_padding is not None:
            real = torch.ones(batch, total, dtype=torch.bool, device=tokens.device)  # (batch, total)
            real[:, :prompt_len] = key_padding
            # each row counts from 0 at its first real token; padding (never attended) takes position 0
            positions = (real.cumsum(dim=1) - 1).clamp(min=0)  # (batch, total)

        def cols(t: Tensor | None, lo: int, hi: int) -> Tensor | None:
            return None if t is None else t[:, lo:hi]  # (batch, hi - lo)

        generator = None
        if seed is not None:
            generator = torch.Generator(device=tokens.device)
            generator.manual_seed(seed)
        was_training = self.training
        self.eval()
        try:
            out = torch.empty(batch, total, dtype=torch.long, device=tokens.device)  # (batch, total)
            out[:, :prompt_len] = tokens
            # one slot per column, padding included (may exceed max_seq_len; positions never do)
            caches = [b.attn.make_kv_cache(batch, total) for b in self.blocks] if use_cache else None
            logits = self(
                tokens.long(), cols(real, 0, prompt_len), caches, positions=cols(positions, 0, prompt_len)
            )[:, -1]  # (batch, vocab_size)
            for pos in range(prompt_len, total):
                out[:, pos] = _sample(logits, temperature, top_k, generator)
                if pos + 1 == total:
                    break
                if use_cache:
                    # key_padding covers every cached position plus the new one
                    logits = self(
                        out[:, pos : pos + 1],
                        cols(real, 0, pos + 1),
                        caches,
                        positions=cols(positions, pos, pos + 1),
                    )[:, -1]  # (batch, vocab_size)
                else:
                    logits = self(
                        out[:, : pos + 1], cols(real, 0, pos + 1), positions=cols(positions, 0, pos + 1)
                    )[:, -1]  # (batch, vocab_size)
        finally:
            self.train(was_training)
        return out


def _sample(
    logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> Tensor:
    """One token id per row of ``logits`` [batch, vocab_size] -> [batch]."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (batch, 1)
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)  # (batch, vocab_size)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (batch,)
