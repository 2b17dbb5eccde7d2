"""The rows of the supported-families table (:data:`FAMILIES`): one :class:`Family` per ``config.json``
``model_type``, the data that :mod:`headspace.pretrained.families_table` prints and checks (its docstring
says what each column means)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The kinds of model (``Family.kind``).
KINDS = ("encoder", "decoder", "encoder-decoder")
#: How a family decodes (``Family.decode``; module docstring).
DECODE_ROUTES = ("native", "python", "forward", "encdec", "-")
#: The rotations (``Family.rotation``): Llama's half-split planes ``(i, i + rotary_dim / 2)``,
#: GPT-J's interleaved planes ``(2i, 2i + 1)``, or no rotary at all.
ROTATIONS = ("half-split", "interleaved", "none")

_REL = "1e-4 rel / 1e-5"
_ABS = "1e-4 abs / 5e-5"
_DEFAULT = "1e-5* / 1e-5*"
_ROTARY_T = "tests/pretrained/test_rotary_families.py"
_PARALLEL_T = "tests/pretrained/test_parallel_families.py"
_VARIANTS_T = "tests/pretrained/test_llama_variants.py"
_MOE_T = "tests/pretrained/test_moe_families.py"
_NEXT_T = "tests/pretrained/test_qwen_next.py"
_LLAMA4_T = "tests/pretrained/test_llama4.py"
_ENCDEC_T = "tests/encdec/test_families.py"
_ABSOLUTE_T = "tests/pretrained/test_absolute_families.py"
_NONE: dict[str, Any] = {"rotation": "none", "rope_types": ()}
_ALIBI_T = "tests/pretrained/test_alibi_families.py"
_DEEPSEEK_T = "tests/pretrained/test_deepseek.py"


@dataclass(frozen=True)
class Family:
    """One ``model_type`` that loads: what its blocks compute and how exactly that is tested.

    ``positions`` and ``notes`` are prose; ``layouts`` (the ``BlockSpec.layout`` values its blocks may
    take; an encoder-decoder's ``EncDecConfig.layout``), ``rotation`` (one of :data:`ROTATIONS`),
    ``partial`` (the rotation may cover only part of each head), ``rope_types`` (the ``rope_type``
    values its tests load; none where ``rotation`` is ``"none"``), ``kind`` (one of :data:`KINDS`) and
    ``decode`` (the :data:`DECODE_ROUTES` it takes, by configuration: as ``layouts``) are checked
    against loaded models by the tests."""

    model_type: str
    kind: str
    positions: str
    layouts: tuple[str, ...]
    norm: str
    notes: str
    decode: tuple[str, ...]
    bound: str
    tested_in: str
    rotation: str = "half-split"
    partial: bool = False
    rope_types: tuple[str, ...] = ("default",)

    def __post_init__(self) -> None:
        for name, value, choices in (("kind", self.kind, KINDS), ("rotation", self.rotation, ROTATIONS)):
            if value not in choices:
                raise ValueError(f"Family.{name} must be one of {list(choices)}; got {value!r}")
        if (self.rotation == "none") != (not self.rope_types):
            raise ValueError(
                f"Family.rope_types must be empty exactly when rotation is 'none'; got {self.rope_types!r}"
            )
        if not self.decode or any(route not in DECODE_ROUTES for route in self.decode):
            raise ValueError(f"Family.decode must be a tuple of {list(DECODE_ROUTES)}; got {self.decode!r}")


def _d(model_type: str, positions: str, layouts: tuple[str, ...], norm: str, notes: str, decode: str,
       bound: str, tested_in: str, **kw: Any) -> Family:  # fmt: skip
    return Family(model_type, "decoder", positions, layouts, norm, notes, decode, bound, tested_in, **kw)


_RMS = "RMSNorm"
_LN = "LayerNorm"
_PRE = ("pre",)

#: Every family :func:`headspace.load` reads from a folder, in the order of the registry.
FAMILIES: tuple[Family, ...] = (
    Family(
        "bert",
        "encoder",
        "learned absolute",
        ("post",),
        _LN,
        "token types; pooled sentence embeddings",
        ("-",),
        "- / 1e-5",
        "tests/pretrained/test_pretrained.py",
        rotation="none",
        rope_types=(),
    ),
    _d(
        "gpt2",
        "learned absolute",
        _PRE,
        _LN,
        "fused qkv (Conv1D)",
        ("native",),
        "1e-5* / -",
        "tests/pretrained/test_pretrained.py",
        rotation="none",
        rope_types=(),
    ),
    _d(
        "llama",
        "rotary: default, linear, llama3, YaRN, dynamic NTK",
        _PRE,
        _RMS,
        "",
        ("native",),
        _REL,
        "tests/pretrained/test_llama.py, test_rope_scaling.py",
        rope_types=("default", "linear", "llama3", "yarn", "dynamic"),
    ),
    _d("mistral", "rotary", _PRE, _RMS, "sliding window", ("native",), _ABS, _VARIANTS_T),
    _d(
        "qwen2", "rotary", _PRE, _RMS, "q/k/v biases", ("native",), _DEFAULT, "tests/pretrained/test_llama.py"
    ),
    _d(
        "gemma2",
        "rotary",
        ("sandwich",),
        f"{_RMS} (1 + w)",
        "score and final soft-capping; alternating windows",
        ("python",),
        _ABS,
        _VARIANTS_T,
    ),
    _d(
        "gemma3_text",
        "rotary, a base for local and one for global layers",
        ("sandwich",),
        f"{_RMS} (1 + w)",
        "QK-norm per head; windows on chosen layers",
        ("native",),
        _ABS,
        _VARIANTS_T,
    ),
    _d("qwen3", "rotary", _PRE, _RMS, "QK-norm per head; optional window", ("native",), _ABS, _VARIANTS_T),
    _d("olmo2", "rotary", ("post_sublayer",), _RMS, "QK-norm over all heads", ("native",), _ABS, _VARIANTS_T),
    _d("smollm3", "rotary, none on chosen layers", _PRE, _RMS, "", ("native",), _ABS, _VARIANTS_T),
    Family(
        "t5",
        "encoder-decoder",
        "relative-position buckets",
        _PRE,
        f"{_RMS} without bias",
        "unscaled scores; gated-gelu or relu MLP",
        ("encdec",),
        _REL,
        _ENCDEC_T,
        rotation="none",
        rope_types=(),
    ),
    Family(
        "bart",
        "encoder-decoder",
        "learned absolute (offset 2)",
        ("post",),
        _LN,
        "final_logits_bias; optional scaled embedding",
        ("encdec",),
        _REL,
        _ENCDEC_T,
        rotation="none",
        rope_types=(),
    ),
    Family(
        "marian",
        "encoder-decoder",
        "sinusoidal",
        ("post",),
        _LN,
        "scaled embedding; final_logits_bias",
        ("encdec",),
        _REL,
        _ENCDEC_T,
        rotation="none",
        rope_types=(),
    ),
    Family(
        "whisper",
        "encoder-decoder",
        "sinusoid (encoder), learned (decoder)",
        _PRE,
        _LN,
        "two convolutions before the encoder",
        ("encdec",),
        _REL,
        _ENCDEC_T,
        rotation="none",
        rope_types=(),
    ),
    _d(
        "phi3",
        "partial rotary; LongRoPE or plain",
        _PRE,
        _RMS,
        "fused qkv and gate_up; optional window",
        ("native",),
        _REL,
        _ROTARY_T,
        partial=True,
        rope_types=("default", "longrope"),
    ),
    _d(
        "gemma",
        "rotary",
        _PRE,
        f"{_RMS} (1 + w)",
        "embeddings times sqrt(d_model)",
        ("native",),
        _REL,
        _ROTARY_T,
    ),
    _d(
        "granite",
        "rotary",
        _PRE,
        _RMS,
        "embedding, attention, residual and logits multipliers",
        ("native",),
        _REL,
        _ROTARY_T,
    ),
    _d(
        "olmo",
        "rotary",
        _PRE,
        f"{_LN} without weight or bias",
        "clip_qkv refused",
        ("native",),
        _REL,
        _ROTARY_T,
    ),
    _d("seed_oss", "rotary", _PRE, _RMS, "q/k/v and output biases", ("native",), _REL, _ROTARY_T),
    _d(
        "olmo3",
        "rotary, a base per layer type",
        ("post_sublayer",),
        _RMS,
        "QK-norm over all heads; windows on chosen layers",
        ("native",),
        _REL,
        _ROTARY_T,
    ),
    _d(
        "exaone4",
        "rotary on sliding layers, none on full ones",
        ("post_sublayer",),
        _RMS,
        "QK-norm per head; windows on chosen layers",
        ("native",),
        _REL,
        _ROTARY_T,
    ),
    _d(
        "gpt_neox",
        "partial rotary",
        ("parallel", "pre"),
        f"{_LN} with bias",
        "use_parallel_residual",
        ("python", "native"),
        _REL,
        _PARALLEL_T,
        partial=True,
    ),
    _d(
        "stablelm",
        "partial rotary",
        ("parallel", "pre"),
        f"{_LN} with bias",
        "use_parallel_residual; qk_layernorm: a LayerNorm per head",
        ("python", "native"),
        _REL,
        _PARALLEL_T,
        partial=True,
    ),
    _d(
        "cohere",
        "interleaved rotary",
        ("parallel",),
        f"{_LN} without bias",
        "logit_scale; use_qk_norm: a LayerNorm per head",
        ("python",),
        _REL,
        _PARALLEL_T,
        rotation="interleaved",
    ),
    _d(
        "phi",
        "partial rotary",
        ("parallel",),
        f"{_LN} with bias",
        "biases everywhere; qk_layernorm refused",
        ("python",),
        _REL,
        _PARALLEL_T,
        partial=True,
    ),
    _d(
        "gptj",
        "interleaved partial rotary",
        ("parallel",),
        f"{_LN} with bias",
        "unembedding with a bias",
        ("python",),
        _REL,
        _PARALLEL_T,
        rotation="interleaved",
        partial=True,
    ),
    _d("mixtral", "rotary", _PRE, _RMS, "mixture of experts; sliding window", ("python",), _REL, _MOE_T),
    _d(
        "qwen2_moe",
        "rotary",
        _PRE,
        _RMS,
        "experts and a gated shared expert; windows on chosen layers",
        ("python",),
        _REL,
        _MOE_T,
    ),
    _d("qwen3_moe", "rotary", _PRE, _RMS, "mixture of experts; QK-norm per head", ("python",), _REL, _MOE_T),
    _d(
        "olmoe",
        "rotary",
        _PRE,
        _RMS,
        "mixture of experts; QK-norm over all heads",
        ("python",),
        _REL,
        _MOE_T,
    ),
    _d(
        "gpt_oss",
        "rotary (YaRN refused)",
        _PRE,
        _RMS,
        "experts with clamped SwiGLU; attention sinks; alternating windows",
        ("forward",),
        _REL,
        _MOE_T,
    ),
    _d(
        "opt",
        "learned absolute (offset 2)",
        ("pre", "post"),
        _LN,
        "do_layer_norm_before; projected embeddings",
        ("native", "python"),
        _REL,
        _ABSOLUTE_T,
        **_NONE,
    ),
    _d(
        "gpt_neo",
        "learned absolute",
        _PRE,
        _LN,
        "unscaled scores; local windows on chosen layers",
        ("native",),
        _REL,
        _ABSOLUTE_T,
        **_NONE,
    ),
    _d(
        "gpt_bigcode",
        "learned absolute",
        _PRE,
        _LN,
        "multi-query (one key/value head)",
        ("native",),
        _REL,
        _ABSOLUTE_T,
        **_NONE,
    ),
    Family(
        "roberta",
        "encoder",
        "learned absolute (past pad_token_id)",
        ("post",),
        _LN,
        "BERT with its position table offset by pad_token_id + 1",
        ("-",),
        "1e-4 rel / 1e-5",
        "tests/pretrained/test_encoder_families.py",
        **_NONE,
    ),
    *(
        Family(
            kin,
            "encoder",
            "learned absolute (past pad_token_id)",
            ("post",),
            _LN,
            "RoBERTa's architecture (loaded as roberta)",
            ("-",),
            _REL,
            "tests/pretrained/test_roberta_kin.py",
            **_NONE,
        )
        for kin in ("xlm-roberta", "camembert")
    ),
    Family(
        "modernbert",
        "encoder",
        "rotary, a base for local and one for global layers",
        _PRE,
        _LN,
        "bidirectional windows on local layers; GeGLU; no norm before layer 0's attention; MLM head",
        ("-",),
        _REL,
        "tests/pretrained/test_modernbert.py",
    ),
    _d(
        "gemma4_text",
        "rotary; proportional partial rotary on global layers",
        ("sandwich",),
        _RMS,
        "value norm, score scale 1, k_eq_v, shared K/V layers, per-layer inputs; dense or MoE",
        ("forward",),
        _REL,
        "tests/pretrained/test_gemma4.py",
        partial=True,
        rope_types=("default", "proportional"),
    ),
    _d(
        "gemma3n_text",
        "rotary, a base for local and one for global layers",
        ("sandwich",),
        _RMS,
        "AltUp streams, LAuReL, per-layer inputs, activation sparsity, value norm, shared K/V layers",
        ("forward",),
        _REL,
        "tests/pretrained/test_gemma3n.py",
    ),
    _d(
        "bloom",
        "ALiBi",
        _PRE,
        f"{_LN} with bias",
        "LayerNorm after the embeddings; qkv fused per head",
        ("python",),
        _REL,
        _ALIBI_T,
        rotation="none",
        rope_types=(),
    ),
    _d(
        "falcon",
        "rotary or ALiBi",
        ("parallel", "pre"),
        f"{_LN} with bias",
        "new_decoder_architecture (grouped kv, ln_attn/ln_mlp) or multi_query; parallel_attn; bias",
        ("python", "native"),
        _REL,
        _ALIBI_T,
    ),
    _d(
        "mpt",
        "ALiBi",
        _PRE,
        f"{_LN} without bias",
        "no biases; softmax_scale; clip_qkv, qk_ln refused",
        ("python",),
        _REL,
        _ALIBI_T,
        rotation="none",
        rope_types=(),
    ),
    _d(
        "qwen3_next",
        "partial rotary",
        _PRE,
        f"{_RMS} (1 + w)",
        "Gated DeltaNet layers among gated softmax layers; experts and a shared expert",
        ("forward",),
        _REL,
        _NEXT_T,
        partial=True,
    ),
    _d(
        "qwen3_5_text",
        "partial rotary",
        _PRE,
        f"{_RMS} (1 + w)",
        "Gated DeltaNet layers among gated softmax layers (text only)",
        ("forward",),
        _REL,
        _NEXT_T,
        partial=True,
    ),
    _d(
        "deepseek_v2",
        "rotary on the shared key part",
        _PRE,
        _RMS,
        "latent attention (query latent optional); group-limited experts, ungated shared experts",
        ("python",),
        _REL,
        _DEEPSEEK_T,
        rotation="interleaved",
    ),
    _d(
        "deepseek_v3",
        "rotary on the shared key part",
        _PRE,
        _RMS,
        "latent attention; dense then sigmoid-routed experts with a correction bias",
        ("python",),
        _REL,
        _DEEPSEEK_T,
        rotation="interleaved",
        rope_types=("default", "yarn"),
    ),
    _d(
        "llama4_text",
        "rotary; NoPE layers with a query temperature",
        _PRE,
        _RMS,
        "chunked attention; weightless L2 QK-norm; sigmoid-routed experts and dense layers",
        ("python",),
        _REL,
        _LLAMA4_T,
        rotation="interleaved",
    ),
    _d(
        "diffllama",
        "rotary",
        _PRE,
        _RMS,
        "differential attention: head pairs, p_1 - lambda p_2, a norm per pair",
        ("forward",),
        _REL,
        "tests/pretrained/test_diffllama.py",
    ),
)
