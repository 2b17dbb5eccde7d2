"""The families :func:`headspace.load` reads from a checkpoint folder, as data: ``headspace models``,
the README's table and docs/families.md are all generated from :data:`FAMILIES`.

One :class:`Family` per ``config.json`` ``model_type`` that
:data:`headspace.pretrained.registry.FOLDER_LOADERS` loads, no more and no fewer
(tests/pretrained/test_families_table.py checks the two sets are equal, and that the layout, the rotation
and the decoding route of a row are what loading a tiny checkpoint of that family builds).

``bound``: the exactness against transformers' eager forward as the row's ``tested_in`` file checks it,
``"<logits> / <patterns>"``: ``"1e-4 rel"`` is ``|ours - theirs| <= 1e-4 * max|theirs|`` on the logits,
``"1e-4 abs"`` an absolute 1e-4, ``"1e-5*"`` ``torch.testing.assert_close``'s float32 defaults (atol
1e-5, rtol 1.3e-6); the pattern figure is the largest absolute difference of any head's attention
pattern (``"-"``: not compared).

``decode``: each way (by configuration) :meth:`~headspace.pretrained.PretrainedDecoder.generate` runs
a new token:
``"native"`` (the C++ cached step once built, the Python one meanwhile), ``"python"`` (the Python cached
step: the native one refuses a field by name), ``"forward"`` (the whole forward with its KV cache: the
cached steps refuse a field by name), ``"encdec"`` (:meth:`headspace.EncoderDecoder.generate`, cached
self-attention) or ``"-"`` (an encoder: no decoding). :func:`decode_route` computes it for a loaded model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
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
_ENCDEC_T = "tests/encdec/test_families.py"
_ABSOLUTE_T = "tests/pretrained/test_absolute_families.py"
_NONE: dict[str, Any] = {"rotation": "none", "rope_types": ()}
_ALIBI_T = "tests/pretrained/test_alibi_families.py"


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
        ("forward",),
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
    _d("mixtral", "rotary", _PRE, _RMS, "mixture of experts; sliding window", ("forward",), _REL, _MOE_T),
    _d(
        "qwen2_moe",
        "rotary",
        _PRE,
        _RMS,
        "experts and a gated shared expert; windows on chosen layers",
        ("forward",),
        _REL,
        _MOE_T,
    ),
    _d("qwen3_moe", "rotary", _PRE, _RMS, "mixture of experts; QK-norm per head", ("forward",), _REL, _MOE_T),
    _d(
        "olmoe",
        "rotary",
        _PRE,
        _RMS,
        "mixture of experts; QK-norm over all heads",
        ("forward",),
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
        ("native", "forward"),
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
)


def family(model_type: str) -> Family:
    """The row of ``model_type``; ``KeyError`` naming the known ones where there is none."""
    for row in FAMILIES:
        if row.model_type == model_type:
            return row
    raise KeyError(f"no family {model_type!r}; known: {sorted(r.model_type for r in FAMILIES)}")


def as_json() -> list[dict[str, Any]]:
    """Every row as a dict (its tuples as lists), in :data:`FAMILIES` order."""
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(row).items()} for row in FAMILIES]


#: The marker comments around the generated part of a markdown file (:func:`sync_markdown`).
START, END = (
    "<!-- families:start (generated: python -m headspace.pretrained.families_table) -->",
    ("<!-- families:end -->"),
)
_KEY = (
    "exact: logits / patterns against transformers' eager forward (rel: of the largest logit; "
    "*: assert_close's float32 defaults); decode: the native or Python cached step or the forward "
    "(python/native: by the layout)"
)


def text_table(width: int = 100) -> str:
    """The plain-text table ``headspace models`` prints: one line per family (model_type, kind, layout,
    decode, bound), then its positions, norms and notes indented and wrapped to ``width`` columns."""
    import textwrap

    head = f"{'model_type':<12} {'kind':<15} {'layout':<16} {'decode':<14} exact (logits / patterns)"
    lines = [head, "-" * min(width, len(head))]
    for row in FAMILIES:
        layouts, decode = " or ".join(row.layouts), "/".join(row.decode)
        lines.append(f"{row.model_type:<12} {row.kind:<15} {layouts:<16} {decode:<14} {row.bound}")
        detail = "; ".join(x for x in (f"positions: {row.positions}", f"norms: {row.norm}", row.notes) if x)
        lines += textwrap.wrap(detail, width, initial_indent="    ", subsequent_indent="    ")
    lines += ["", *textwrap.wrap(_KEY, width)]
    return "\n".join(lines) + "\n"


def _md(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") or " " for c in cells) + " |"


def markdown_table() -> str:
    """The full markdown table (docs/families.md): one row per family, every column."""
    head = [
        "model_type",
        "kind",
        "positions",
        "layout",
        "norms",
        "notes",
        "decode",
        "exact (logits / patterns)",
    ]
    lines = [_md(head), "|" + "---|" * len(head)]
    for r in FAMILIES:
        lines.append(_md([f"`{r.model_type}`", r.kind, r.positions, " or ".join(r.layouts), r.norm, r.notes,
                          " or ".join(r.decode), r.bound]))  # fmt: skip
    return "\n".join([*lines, "", _KEY + "."]) + "\n"


def compact_table() -> str:
    """The README's short table: one row per block layout (``parallel`` also names the families that may
    be ``pre``; the encoder-decoders one row), its model_types grouped by how ``generate`` runs them."""
    groups: dict[str, dict[str, list[str]]] = {}
    for r in FAMILIES:
        key = r.kind if r.kind == "encoder-decoder" else r.layouts[0]
        label = "/".join(r.decode) + ("" if len(r.layouts) == 1 else f": {' / '.join(r.layouts)}")
        if r.kind == "encoder-decoder":
            label = f"{r.layouts[0]}-norm, {label}"
        groups.setdefault(key, {}).setdefault(label, []).append(f"`{r.model_type}`")
    lines = [_md(["layout", "model_types (how `generate` runs a token)"]), "|---|---|"]
    for key, by_label in groups.items():
        lines.append(
            _md([key, "; ".join(f"{', '.join(names)} ({label})" for label, names in by_label.items())])
        )
    return "\n".join(lines) + "\n"


def replace_generated(text: str, body: str, where: str) -> str:
    """``text`` with what lies between the :data:`START` and :data:`END` lines replaced by ``body``;
    ``ValueError`` naming ``where`` unless each marker is there exactly once, START first."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"{where}: expected one {START!r} line and then one {END!r} line; found "
                         f"{text.count(START)} and {text.count(END)}")  # fmt: skip
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{body}{END}{tail}"


#: Each generated file (relative to the repository root) and the function that makes its table.
GENERATED = {"README.md": compact_table, "docs/families.md": markdown_table}


def sync_markdown(root: str | Path, *, write: bool = False) -> list[str]:
    """The files of :data:`GENERATED` under ``root`` whose table differs from the generated one
    (written anew, atomically, where ``write``)."""
    from ..core.fileio import write_atomic

    stale = []
    for name, make in GENERATED.items():
        path = Path(root) / name
        text = path.read_text(encoding="utf-8")
        new = replace_generated(text, make(), str(path))
        if new != text:
            stale.append(name)
            if write:
                write_atomic(path, new)
    return stale


def decode_route(model: Any) -> str:
    """How ``model`` (a loaded :class:`~headspace.pretrained.PretrainedDecoder` or its ``.model``)
    decodes a new token, one of :data:`DECODE_ROUTES` but ``"encdec"`` and ``"-"``: ``"forward"``
    where it has no cached step or the Python step refuses a field, ``"python"`` where the native step
    refuses one or has no form of a part, else ``"native"``."""
    from ..decode import describe
    from ..decode.native import native_form
    from ..decode.python import prepare

    step = describe(getattr(model, "model", model))
    if step is None:
        return "forward"
    try:
        prepare(step)
    except ValueError:
        return "forward"
    try:
        return "python" if native_form(step) is None else "native"
    except ValueError:
        return "python"


def main(argv: list[str] | None = None) -> int:
    """``python -m headspace.pretrained.families_table [--write] [ROOT]``: the generated files that are
    stale (exit 1), or, with ``--write``, write them (exit 0)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    write = "--write" in args
    roots = [a for a in args if a != "--write"]
    stale = sync_markdown(roots[0] if roots else ".", write=write)
    for name in stale:
        print(f"{name}: {'written' if write else 'stale (run with --write)'}")
    return 0 if write or not stale else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
