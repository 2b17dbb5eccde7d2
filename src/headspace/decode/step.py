"""The decoding step, described once: what one new token computes in every block of a Decoder, by name.

:func:`describe` is the one function that reads a model's modules for decoding (each block as a typed
:class:`~headspace.model.block.TransformerBlock`, its maths from ``block.spec``; :func:`products_of`
reads the description the kernel policy decides by, :mod:`headspace.kernels.policy`). It returns a frozen
:class:`DecodeStep`: per block a :class:`LayerStep` (its norms, products, head counts, rotation and
activation, each a named field), then the final norm, the unembedding, the embedding and every hook
point a step passes. The backends (:mod:`headspace.decode.backends`: ``"python"`` and ``"native"``)
run a step from this description alone; the native one hands it to C++ field by field, by name
(:func:`named_fields`).

Per block, for the new position's rows x [batch, d_model] (pre-norm, sandwich and post-sublayer
blocks; the post layout below)::

    qkv = norm1(x) W_QKV (+ b)      -> q [batch, n_heads, 1, d_head], k, v [batch, n_kv_heads, 1, d_head]
    q, k = q_norm(q), k_norm(k)           (QK-norm only: RMSNorm over d_head, or over all heads)
    q, k = rotate(q, k)                   (rotary positions: to the new position, with the layer's base)
    z = softmax(q K^T * scale + M) V      (K, V: the cached keys and values, the new ones appended;
                                           M: -inf on keys outside a sliding window, plus
                                           ALiBi's -m_h (i - j) where set, else none)
    a = attn_out_norm(z W_O (+ b))        (sandwich / post-sublayer norms only)
    h = x + a
    m = act(norm2(h) W_gate) * (norm2(h) W_in) W_out     (plain MLP: act(norm2(h) W_in) W_out)
    out = h + mlp_out_norm(m)             (sandwich / post-sublayer norms only)

then ``final_norm``, the unembedding and, with ``final_softcap``, ``cap * tanh(logits / cap)``. A norm
absent from a block (None) is the identity: a post-sublayer block (OLMo 2) has no ``norm1``/``norm2``.
A post-layout block (BERT's order, OPT-350m: :attr:`LayerStep.post`) normalises after each residual add
instead, the same qkv, attention and MLP products on the unnormalised rows::

    h = norm1(x + z W_O (+ b))            out = norm2(h + m)     (m as above, on h itself)

A description holds the parameters themselves (and views of them): in-place edits of their values
show in later steps, parameters replaced since (``to_precision``, pruning, assignment) do not, and
weights packed for MKL's GEMM (``pack_rows``) are copies made when it was built.

Notation used for tensor shapes:
    batch, d_model, vocab_size, n_heads, n_kv_heads, d_head.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ..kernels.bf16 import BF16Weight, float32_rows
from ..kernels.policy import StepProducts
from ..kernels.prepack import pack_weight, packable
from ..kernels.q8_0 import Q8Blocks
from ..model.block import TransformerBlock
from ..model.config import ModelConfig
from ..nn.hooks import HookPoint, all_idle
from ..nn.norms import RMSNorm
from ..nn.positions import Rotary
from ..nn.spec import BlockSpec, refuse_unsupported

#: the activations a step runs in place by name (torch's modules); any other is ``"module"``
ACTIVATIONS = {(nn.SiLU, None): "silu", (nn.ReLU, None): "relu", (nn.GELU, "none"): "gelu"}
ACTIVATIONS[(nn.GELU, "tanh")] = "gelu_tanh"
#: each activation of a block's description (``MLPSpec.act``) as torch's module (and GELU's approximation)
_ACTIVATION_MODULES: dict[str, tuple[type[nn.Module], str | None]] = {
    name: (kind, approximate) for (kind, approximate), name in ACTIVATIONS.items()
}
#: The block features (:func:`~headspace.nn.spec.features_of`) the decoding step computes (both
#: backends); any other is refused by its field's name.
STEP_FEATURES = ("window", "qk_norm", "bias", "layout", "chunk", "temperature")
#: The block features the ``"python"`` backend alone computes beyond :data:`STEP_FEATURES`: score
#: soft-capping (Gemma 2, :attr:`LayerStep.softcap`) and multi-head latent attention
#: (:attr:`LayerStep.latent`); the native step refuses both by name.
PYTHON_STEP_FEATURES = (*STEP_FEATURES, "softcap", "latent", "moe")


class DecoderModel(Protocol):
    """What :func:`describe` and :func:`~headspace.decode.generate` read of a decoder (a
    :class:`headspace.Decoder`): its configuration, blocks, final norm, embedding and unembedding."""

    config: ModelConfig
    blocks: nn.ModuleList
    ln_final: nn.Module | None
    lm_head: nn.Linear | None
    tok_embed: nn.Embedding
    rotary: Rotary | None
    training: bool

    @property
    def precision(self) -> str: ...
    def embed(self, tokens: Tensor, start: int = 0) -> Tensor: ...
    def eval(self) -> Any: ...
    def train(self, mode: bool = True) -> Any: ...
    def modules(self) -> Any: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Tensor: ...


@dataclass(frozen=True)
class Norm:
    """A norm of the rows: ``"rmsnorm"`` (:func:`headspace.norms.rms_norm` with ``offset``: Gemma's
    ``1 + weight`` is offset 1), ``"layernorm"`` (``F.layer_norm`` over d_model) or ``"module"`` (any
    other: ``module`` itself, no native form)."""

    kind: str
    weight: Tensor | None = None
    bias: Tensor | None = None
    eps: float = 0.0
    module: nn.Module | None = None
    offset: float = 0.0


@dataclass(frozen=True)
class Product:
    """One product ``x W^T + b`` of the rows x [n, in] -> [n, out].

    ``kind``: ``"float32"`` (``weight`` a plain float32 [out, in]), ``"packed"`` (the same with MKL's
    ``packed`` copy for ``rows`` rows), ``"bfloat16"`` (``weight`` the float32 values of a
    :class:`~headspace.kernels.bf16.BF16Weight`, ``packed`` oneDNN's copy or None, from
    ``float32_rows`` rows a float32 GEMM on the rounded values: 0 always, -1 never), ``"q8_0"`` (the
    unembedding only: ``weight`` float32 and exactly its Q8_0 blocks, ``packed`` their int8 integers and
    ``scales`` their float32 scales, :mod:`headspace.kernels.q8_0`) or ``"other"`` (int8 and any other
    carrier: ``F.linear`` of ``carrier``, no native form).
    """

    kind: str
    weight: Tensor
    bias: Tensor | None = None
    packed: Tensor | None = None
    rows: int = 0
    float32_rows: int = -1
    carrier: Tensor | None = None
    scales: Tensor | None = None


@dataclass(frozen=True)
class LayerStep:
    """One block's step (see the module docstring for the formula).

    ``rotary`` is the block's own (layers may differ: Gemma 3's sliding and full layers have two bases,
    NoPE layers None). ``qk_norm`` is ``"head"`` (``q_norm``/``k_norm`` over each head's d_head) or
    ``"all"`` (over the concatenated heads), ``window`` a sliding window (the block's KV cache holds
    only it: :class:`~headspace.nn.kv_cache.KVCache`), ``attn_out_norm``/``mlp_out_norm`` the norms
    of the sublayers' outputs (sandwich and post-sublayer blocks); each None where the block has none.
    """

    norm1: Norm | None
    qkv: Product
    n_heads: int
    n_kv_heads: int
    d_head: int
    scale: float
    rotary: Rotary | None
    o: Product
    norm2: Norm | None
    activation: str
    gate: Product | None
    fc_in: Product | None
    fc_out: Product | None
    act_module: nn.Module | None = None
    qk_norm: str | None = None
    q_norm: Norm | None = None
    k_norm: Norm | None = None
    window: int | None = None
    attn_out_norm: Norm | None = None
    mlp_out_norm: Norm | None = None
    #: True for the parallel layout (GPT-NeoX: ``out = x + Attn(norm1(x)) + MLP(norm2(x))``); None else
    parallel: bool | None = None
    #: True for the post layout (OPT-350m: ``h = norm1(x + Attn(x))``, ``out = norm2(h + MLP(h))``: the
    #: block's ``norm1``/``norm2`` after each residual add, none before a sublayer); None else. Python only
    post: bool | None = None
    #: ALiBi's slopes (``bias="alibi"``: ``-m_h (i - j)`` added to the scaled scores); None else
    alibi_slopes: tuple[float, ...] | None = None
    #: a latent attention layer (DeepSeek: :class:`~headspace.attention.latent.LatentAttention`), whose
    #: one-position step is its own forward with its :class:`~headspace.nn.latent_cache.LatentCache`
    #: (``qkv`` then describes its latent's down projection, ``o`` its W_O); None else. Python only.
    latent: nn.Module | None = dataclasses.field(default=None, compare=False, repr=False)
    #: Llama 4: chunked attention (``AttentionSpec.chunk``) and the query temperature (floor_scale,
    #: attn_scale) of a NoPE layer; None else. Python only (:data:`PYTHON_ONLY`)
    chunk: int | None = None
    temperature: tuple[float, float] | None = None
    #: Gemma 2's score soft-capping: the scaled scores s become ``softcap * tanh(s / softcap)`` before
    #: the mask and the softmax; None else. Python only (:data:`PYTHON_ONLY`)
    softcap: float | None = None
    #: a mixture of experts (:class:`~headspace.model.moe.MixtureOfExperts`, ``mlp.kind == "moe"``), whose
    #: forward on the new position is the MLP's step (``gate``, ``fc_in``, ``fc_out`` then None); None
    #: else. Python only
    moe: nn.Module | None = dataclasses.field(default=None, compare=False, repr=False)
    #: the block's description the step was read from (each backend refuses the fields it lacks by name)
    spec: BlockSpec | None = dataclasses.field(default=None, compare=False, repr=False)


#: the :class:`LayerStep` fields only the ``"python"`` backend computes (a step with any of these set
#: takes the Python backend): the parallel and post layouts; the native step covers QK-norm, sliding
#: windows, per-layer rotations and sandwich / post-sublayer norms
PYTHON_ONLY: tuple[str, ...] = (
    "parallel",
    "post",
    "alibi_slopes",
    "latent",
    "chunk",
    "temperature",
    "softcap",
    "moe",
)


@dataclass(frozen=True)
class DecodeStep:
    """A Decoder's cached one-token step (:func:`describe`): ``layers`` then ``final_norm`` on the
    rows, ``unembed`` to logits (then ``final_softcap``'s ``cap * tanh(logits / cap)`` where set);
    ``embed(tokens, start)`` the model's embedding (Gemma's sqrt(d_model) scale included); ``rotary``
    the first block's rotation (the tables a backend is handed; other layers' rotations are their own
    :attr:`LayerStep.rotary`); ``hook_points`` every hook point a step passes (the step runs only while
    they are idle, :meth:`idle`); ``pack_rows`` the batch the products were packed for (None: not
    packed)."""

    layers: tuple[LayerStep, ...]
    final_norm: Norm | None
    unembed: Product
    embed: Callable[..., Tensor]
    rotary: Rotary | None
    hook_points: tuple[HookPoint, ...]
    pack_rows: int | None
    model: weakref.ref[Any] = dataclasses.field(repr=False, compare=False)
    final_softcap: float | None = None

    def idle(self) -> bool:
        """Whether the step may run now: the model exists and is in eval mode, and no hook point the
        step passes has a function in the calling thread (:func:`headspace.hooks.all_idle`)."""
        model = self.model()
        return model is not None and not model.training and all_idle(self.hook_points)


def norm_of(norm: object) -> Norm | None:
    """``norm`` (a module or None) described: an RMSNorm (any offset) or a LayerNorm over one dim by
    name, any other module as ``"module"``; None for no norm."""
    if norm is None:
        return None
    if not isinstance(norm, nn.Module):
        raise TypeError(f"a norm must be an nn.Module or None; got {type(norm).__name__}")
    if type(norm) is RMSNorm:
        return Norm("rmsnorm", norm.weight, None, norm.eps, offset=float(norm.offset))
    if type(norm) is nn.LayerNorm and len(norm.normalized_shape) == 1 and norm.weight is not None:
        return Norm("layernorm", norm.weight, norm.bias, norm.eps)
    return Norm("module", module=norm)


def product_of(weight: Tensor, bias: Tensor | None, pack_rows: int | None = None) -> Product:
    """The product by ``weight`` [out, in] and ``bias`` described; with ``pack_rows``, a plain float32
    weight is packed for MKL's GEMM at that many rows (:func:`headspace.kernels.prepack.pack_weight`:
    a copy)."""
    plain_bias = bias is None or (type(bias) in (nn.Parameter, Tensor) and bias.dtype == torch.float32)
    if type(weight) is BF16Weight and weight.dim() == 2 and plain_bias:
        with torch._C.DisableTorchFunctionSubclass():
            values = Tensor.as_subclass(weight, Tensor)  # the float32 values, as a plain tensor
        return Product("bfloat16", values, bias, weight.packed, 0, float32_rows(weight), weight)
    if not packable(weight) or not plain_bias:
        return Product("other", weight, bias, carrier=weight)
    if pack_rows is not None:
        return Product("packed", weight, bias, pack_weight(weight, pack_rows), pack_rows)
    return Product("float32", weight, bias)


def describe(
    model: DecoderModel,
    pack_rows: int | None = None,
    unembed_rows: int | None = None,
    unembed_q8: Q8Blocks | None = None,
) -> DecodeStep | None:
    """``model``'s cached decoding step described (:class:`DecodeStep`), or None where some block has no
    such step (:attr:`~headspace.block.TransformerBlock.decode_supported` False: a head-parallel
    shard, ``check_finite``, another attention or MLP), which then decodes by
    ``forward``. ``pack_rows`` packs every float32 product for that batch;
    ``unembed_rows`` (without ``pack_rows``) packs the unembedding alone for that batch;
    ``unembed_q8``, the unembedding's own Q8_0 blocks (:func:`headspace.kernels.q8_0.q8_0_blocks`),
    makes the unembedding a ``"q8_0"`` product instead."""
    layers = []
    for block in model.blocks:
        if not isinstance(block, TransformerBlock) or not block.decode_supported:
            return None
        layers.append(_layer_of(block, pack_rows))
    rows = unembed_rows if pack_rows is None else pack_rows
    weight, bias = unembedding(model)
    if unembed_q8 is not None and bias is None:
        unembed = Product("q8_0", weight, None, unembed_q8.q, scales=unembed_q8.d)
    else:
        unembed = product_of(weight, bias, rows)
    points = tuple(m for m in model.modules() if isinstance(m, HookPoint))
    return DecodeStep(
        layers=tuple(layers),
        final_norm=norm_of(model.ln_final),
        unembed=unembed,
        embed=model.embed,
        rotary=model.rotary,
        hook_points=points,
        pack_rows=pack_rows,
        model=weakref.ref(model),  # a step must not keep its model alive
        final_softcap=model.config.final_softcap,
    )


def _activation_of(act: nn.Module, name: str) -> str:
    """``name`` (the spec's activation) where ``act`` is torch's module for it, else ``"module"``."""
    kind, approximate = _ACTIVATION_MODULES[name]
    same = type(act) is kind and (
        approximate is None or (isinstance(act, nn.GELU) and act.approximate == approximate)
    )
    return name if same else "module"


def _layer_of(block: TransformerBlock, pack_rows: int | None) -> LayerStep:
    """One block with ``decode_supported`` described: its maths read from ``block.spec`` (the layout,
    head counts, scale, window, QK-norm, rotation, MLP kind and activation), its weights and norms from
    its typed modules (``attn``, ``mlp``, ``ln1``/``ln2`` and a sandwich's output norms). A spec field
    the step does not compute raises ``ValueError`` naming it (:data:`STEP_FEATURES`)."""
    spec: BlockSpec = block.spec
    refuse_unsupported(spec, "the decoding step", PYTHON_STEP_FEATURES)
    at, a, mlp = spec.attention, block.attn, block.mlp
    latent = at.latent is not None
    if latent:  # latent attention (its forward runs the step): the latent's down projection, unpacked
        qkv, o = a.kv_a_proj_with_mqa, a.o_proj
        qkv_p, o_p = product_of(qkv.weight, qkv.bias, None), product_of(o.weight, o.bias, None)
    else:
        qkv_p = product_of(a.qkv_weight, a.qkv_bias, pack_rows)
        o_p = product_of(a.o_weight, a.o_bias, pack_rows)
    moe = spec.mlp.kind == "moe"  # a mixture of experts: its own forward is the MLP's step
    activation = "module" if moe else _activation_of(mlp.act, spec.mlp.act)
    gate = mlp.fc_gate if spec.mlp.kind == "gated" else None
    if spec.layout == "post_sublayer":  # OLMo 2: h = x + ln1(attn(x)), out = h + ln2(mlp(h))
        norm1 = norm2 = None
        attn_out, mlp_out = norm_of(block.ln1), norm_of(block.ln2)
    else:  # pre-norm, post (norm1 / norm2 after the adds), or sandwich (Gemma: ln_attn_out / ln_mlp_out too)
        norm1, norm2 = norm_of(block.ln1), norm_of(block.ln2)
        sandwich = spec.layout == "sandwich"
        attn_out = norm_of(block.ln_attn_out) if sandwich else None
        mlp_out = norm_of(block.ln_mlp_out) if sandwich else None
    qk = at.qk_norm is not None
    parallel = True if spec.layout == "parallel" else None  # norm1 / norm2 as a pre-norm block's
    post = True if spec.layout == "post" else None  # norm1 / norm2 after the residual adds
    return LayerStep(
        norm1=norm1,
        qkv=qkv_p,
        n_heads=at.n_heads,
        n_kv_heads=at.n_kv_heads,
        d_head=at.d_head,
        scale=at.score_scale,
        rotary=at.positions,
        o=o_p,
        norm2=norm2,
        activation=activation,
        gate=None if gate is None else product_of(gate.weight, gate.bias, pack_rows),
        fc_in=None if moe else product_of(mlp.fc_in.weight, mlp.fc_in.bias, pack_rows),
        fc_out=None if moe else product_of(mlp.fc_out.weight, mlp.fc_out.bias, pack_rows),
        act_module=mlp.act if activation == "module" else None,
        qk_norm=at.qk_norm,
        q_norm=norm_of(a.q_norm) if qk else None,
        k_norm=norm_of(a.k_norm) if qk else None,
        window=at.window,
        attn_out_norm=attn_out,
        mlp_out_norm=mlp_out,
        parallel=parallel,
        post=post,
        alibi_slopes=at.alibi_slopes,
        latent=a if latent else None,
        chunk=at.chunk,
        temperature=at.temperature,
        softcap=at.softcap,
        moe=mlp if moe else None,
        spec=spec,
    )


def unembedding(model: DecoderModel) -> tuple[Tensor, Tensor | None]:
    """The unembedding's weight [vocab_size, d_model] and bias (None: none): the token embedding's
    where tied, else ``lm_head``'s."""
    if model.lm_head is None:
        return model.tok_embed.weight, None
    return model.lm_head.weight, model.lm_head.bias


def products_of(model: DecoderModel) -> StepProducts:
    """What the kernel policy (:mod:`headspace.kernels.policy`) decides ``model``'s step by: every
    block's description, the unembedding's shape from the configuration, whether the products are
    plain float32 CPU matrices (precision ``"float32"`` on the CPU), whether the unembedding has a
    bias and whether every block has its decoding step."""
    c = model.config
    blocks = [b for b in model.blocks if isinstance(b, TransformerBlock)]
    return StepProducts(
        blocks=tuple(b.spec for b in blocks),
        vocab_size=c.vocab_size,
        d_model=c.d_model,
        float32=model.precision == "float32" and model.tok_embed.weight.device.type == "cpu",
        unembed_bias=unembedding(model)[1] is not None,
        stepped=len(blocks) == len(model.blocks) and all(b.decode_supported for b in blocks),
    )


def blocks_of(model: DecoderModel) -> list[TransformerBlock]:
    """``model.blocks`` as the :class:`~headspace.model.block.TransformerBlock` each is; a TypeError
    naming the first that is not."""
    blocks: list[TransformerBlock] = []
    for i, b in enumerate(model.blocks):
        if not isinstance(b, TransformerBlock):
            raise TypeError(f"a decoder's blocks must be TransformerBlocks; block {i} is {type(b).__name__}")
        blocks.append(b)
    return blocks


def product_weights(model: DecoderModel) -> list[Tensor]:
    """Every weight a decoding step multiplies by, in order: per block the fused QKV, W_O and the
    MLP's (gate, in, out), then the unembedding."""
    weights: list[Tensor] = []
    for b in blocks_of(model):
        weights += [b.attn.qkv_weight, b.attn.o_weight]
        weights += [lin.weight for lin in b.mlp.modules() if isinstance(lin, nn.Linear)]
    weights.append(unembedding(model)[0])
    return weights


NamedFields = tuple[dict[str, Tensor], dict[str, int], dict[str, float], dict[str, str]]


def named_fields(part: Any, prefix: str = "") -> NamedFields | None:
    """A description (a :class:`LayerStep`, :class:`Norm` or :class:`Product`) as four dicts keyed by
    dotted field names (``"qkv.weight"``, ``"norm1.eps"``, ``"rotary.dim"``, ``"q_norm.offset"``,
    ``"window"``, ...): its tensors, ints, floats and strings, None values left out (a post-sublayer
    block has no ``norm1.*``/``norm2.*``, a block without QK-norm no ``qk_norm``). None where a part
    has no native form (a ``"module"`` norm or activation, an ``"other"`` product, a
    :data:`PYTHON_ONLY` field). What the native step reads, by these names."""
    out: NamedFields = ({}, {}, {}, {})
    if isinstance(part, LayerStep) and any(getattr(part, n) is not None for n in PYTHON_ONLY):
        return None  # run by Python only
    for f in dataclasses.fields(part):
        value = getattr(part, f.name)
        name = prefix + f.name
        if value is None or f.name in ("module", "carrier", "act_module", "spec"):
            continue
        if isinstance(value, str) and value in ("module", "other"):
            return None  # run by Python only
        if isinstance(value, Rotary):
            out[3][name + ".kind"] = "interleaved" if value.interleaved else "half"
            out[1][name + ".dim"] = value.rotary_dim
        elif dataclasses.is_dataclass(value):
            inner = named_fields(value, name + ".")
            if inner is None:
                return None
            for mine, theirs in zip(out, inner):
                mine.update(theirs)  # type: ignore[attr-defined]
        elif isinstance(value, Tensor):
            out[0][name] = value
        elif isinstance(value, bool) or isinstance(value, int):
            out[1][name] = int(value)
        elif isinstance(value, float):
            out[2][name] = value
        elif isinstance(value, str):
            out[3][name] = value
        else:
            raise TypeError(f"named_fields: {name} is a {type(value).__name__}, which has no native form")
    return out
