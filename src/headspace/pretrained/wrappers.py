"""What a loaded model offers: the :class:`LoadedModel` protocol and its two implementations.

:class:`PretrainedEncoder` (BERT family, sentence embeddings) and :class:`PretrainedDecoder` (GPT family,
generation) both hold ``.model`` (the headspace module), ``.tokenizer`` and ``.config``, and both give
``tokenize_padded(texts) -> (tokens, key_padding)``: the one call every tool (explain, analysis, the
explorer, the CLI) uses to turn text into model input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.checks import is_int
from ..kernels.workspace import Workspace
from ..model.config import ModelConfig
from ..model.models import Decoder, Encoder
from .tokenization import TextTokenizer, check_sentences


@runtime_checkable
class LoadedModel(Protocol):
    """A pretrained model as every headspace tool sees it."""

    model: nn.Module
    tokenizer: TextTokenizer | None

    @property
    def config(self) -> ModelConfig: ...

    def tokenize_padded(self, texts: Sequence[str] | str) -> tuple[Tensor, Tensor]:
        """(tokens int64 [batch, seq], key_padding bool [batch, seq], True = real token), right-padded."""
        ...


class _Loaded:
    """What both wrappers share: the config read from the model, the tokenizer or a clear error."""

    model: nn.Module
    tokenizer: TextTokenizer | None
    #: what a caller passes instead of token ids (named in the no-tokenizer error)
    _text_inputs = "text"

    @property
    def config(self) -> ModelConfig:
        """The model's :class:`~headspace.ModelConfig` (always ``self.model.config``: pruning updates it)."""
        return self.model.config

    @property
    def precision(self) -> str:
        """The model's precision: ``"float32"``, ``"bfloat16"`` or ``"int8"`` (see :meth:`to_precision`)."""
        return self.model.precision

    def to_precision(self, precision: str) -> Any:
        """Convert the model in place to ``precision`` (:meth:`headspace.Encoder.to_precision`); -> self."""
        self.model.to_precision(precision)
        return self

    def _need_tokenizer(self) -> TextTokenizer:
        if self.tokenizer is None:
            raise ValueError(
                f"this checkpoint folder had no tokenizer.json; pass token ids instead of {self._text_inputs}"
            )
        return self.tokenizer


class PretrainedEncoder(_Loaded):
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

    _text_inputs = "sentences"

    def __init__(
        self,
        model: Encoder,
        tokenizer: TextTokenizer | None,
        *,
        max_length: int | None = None,
        pooler: nn.Linear | None = None,
        ignored: Sequence[str] = (),
    ) -> None:
        if max_length is not None and (not is_int(max_length)):
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

    def __repr__(self) -> str:
        return f"PretrainedEncoder({self.config.summary()}, encode max_length={self.max_length})"

    def tokenize(
        self, sentences: Sequence[str] | str, *, max_length: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """(tokens int64 [batch, seq], key_padding bool [batch, seq], True = real token), right-padded.

        No truncation unless ``max_length`` is given (the forward pass refuses sequences longer than the
        position table; :meth:`encode` truncates to :attr:`max_length`).
        """
        return self._need_tokenizer()(sentences, max_length=max_length)

    def tokenize_padded(self, texts: Sequence[str] | str) -> tuple[Tensor, Tensor]:
        """:class:`LoadedModel`'s call: :meth:`tokenize` without truncation."""
        return self.tokenize(texts)

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
        The states are float32 at every precision (a bfloat16 model's are cast).
        """
        if isinstance(sentences_or_tokens, Tensor):
            tokens = sentences_or_tokens
        else:
            if key_padding is not None:
                raise ValueError("key_padding is computed from the sentences; pass it only with token ids")
            tokens, key_padding = self.tokenize(sentences_or_tokens)
        states = self.model(tokens, key_padding, token_type_ids)  # (batch, seq, d_model)
        return states if states.dtype == torch.float32 else states.float()

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
        can feed a model that is trained afterwards (a probe, say). ``progress``: a progress bar (rate,
        ETA; :func:`headspace.progress.progress_bar`); None shows it when there are more than 8
        batches. The embeddings are float32 at every precision: a reduced-precision model's token
        states are pooled in float32.
        """
        sentences = check_sentences(sentences)
        if not is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
        ids = self._need_tokenizer().encode_ids(sentences, max_length=self.max_length)
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        out = torch.empty(len(ids), self.config.d_model)  # (n, d_model)
        starts = range(0, len(order), batch_size)
        if progress or (progress is None and len(starts) > 8):
            from ..core.progress import progress_bar

            starts = progress_bar(starts, desc="encode", unit="batch")
        workspace = Workspace()  # one scratch memory for every batch (the first, longest, sizes it)
        for start in starts:
            rows = order[start : start + batch_size]
            tokens, key_padding = self.tokenizer.pad([ids[i] for i in rows])  # (b, seq) x 2
            states = self.model.infer(tokens, key_padding, workspace=workspace)  # (b, seq, d_model)
            out[rows] = self.pool(states.float(), key_padding, normalize=normalize)  # pooled in float32
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


class PretrainedDecoder(_Loaded):
    """A pretrained :class:`~headspace.Decoder` (GPT-2, Llama family) with its tokenizer (when it has one).

    ``special_tokens`` (``{"bos": id, "eos": id, ...}``, and ``"eot"`` / ``"eom"`` where the file names
    them) and ``chat_template`` come from a GGUF file's metadata (empty / None for Hugging Face folders,
    whose ``tokenizer_config.json`` / ``generation_config.json`` say the same:
    :meth:`chat_template_text`, :attr:`stop_token_ids`).
    """

    def __init__(
        self, model: Decoder, tokenizer: TextTokenizer | None, *, ignored: Sequence[str] = ()
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.ignored = list(ignored)
        self.special_tokens: dict[str, int] = {}
        self.chat_template: str | None = None

    def __repr__(self) -> str:
        return f"PretrainedDecoder({self.config.summary()})"

    def tokenize(self, texts: Sequence[str] | str) -> Tensor:
        """Token ids [batch, seq] (texts of one batch must tokenize to the same length: GPT-2 has no pad).

        :meth:`generate` left-pads prompts of different lengths itself.
        """
        return self._need_tokenizer()(texts)[0]

    def tokenize_padded(self, texts: Sequence[str] | str) -> tuple[Tensor, Tensor]:
        """(tokens [batch, seq], key_padding [batch, seq], True = real): right-padded with any id.

        The padded positions come after every real token, so a causal model's real positions never see
        them; pass ``key_padding`` on to keep them out of statistics.
        """
        tokenizer = self._need_tokenizer()
        fill = 0 if tokenizer.pad_id is None else tokenizer.pad_id
        return tokenizer.pad(tokenizer.encode_ids(check_sentences(texts, "texts")), fill_id=fill)

    @torch.no_grad()
    def __call__(self, tokens: Tensor | Sequence[str] | str) -> Tensor:
        """Logits [batch, seq, vocab_size] for token ids or texts."""
        if not isinstance(tokens, Tensor):
            tokens = self.tokenize(tokens)
        return self.model(tokens)

    def generate(
        self,
        prompt: str | Sequence[str] | Tensor,
        max_new_tokens: int,
        *,
        chat: bool = False,
        on_text: Callable[[str], object] | None = None,
        **kwargs: Any,
    ) -> str | list[str] | Tensor:
        """:meth:`Decoder.generate` on token ids, on a text prompt, or on a list of text prompts.

        Token ids (a Tensor) give token ids back, and take every keyword of :meth:`Decoder.generate`
        (``key_padding``, ``stop_tokens``, ``on_token`` included), as :meth:`Decoder.generate` does. A
        text gives text back: the prompt followed by its continuation, decoded without control tokens
        (:attr:`~.tokenization.TextTokenizer.control_ids`), ending where the model ends a text or a turn
        (:attr:`stop_token_ids`; ``stop_tokens=None`` or ids of your own instead). A list of texts gives a
        list of such texts, one per prompt: the prompts may tokenize to different lengths; they are
        left-padded into one batch with its ``key_padding``, so each continuation is the one that prompt
        gets alone (exactly so with ``temperature=0``; sampled batches draw their random numbers
        together), each row stopping on its own.

        ``chat=True`` puts each text in the model's chat template (:attr:`chat_template`, else its
        folder's ``tokenizer_config.json`` / ``chat_template.jinja``) as a user message, with the
        assistant's turn opened, and returns the reply alone. ``on_text(piece)`` (a str prompt only) is
        handed the text as it comes: the prompt (not with ``chat``), then each new piece; the pieces add
        up to the text returned (:class:`~.generation.TextStream`).

        Raises:
            ValueError: no tokenizer.json in the checkpoint folder; a text prompt that tokenizes to no
                token; ``key_padding`` passed with text prompts (it is computed from them); ``chat``
                for a model without a chat template, or a template that fails.
            TypeError: ``on_text`` with a list of prompts or token ids, or not callable.
        """
        from .generation import generate_text

        if isinstance(prompt, Tensor):
            if chat or on_text is not None:
                raise TypeError("chat and on_text take text prompts; with token ids use on_token")
            return self.model.generate(prompt, max_new_tokens, **kwargs)
        if "key_padding" in kwargs:
            raise ValueError("key_padding is computed from the text prompts; pass it only with token ids")
        tokenizer = self._need_tokenizer()
        template = self.chat_template_text() if chat else None
        if chat and template is None:
            raise ValueError(
                "chat=True needs the model's chat template; this model has none (no tokenizer.chat_template "
                "in its GGUF, no chat_template in its folder's tokenizer_config.json)"
            )
        stops = kwargs.pop("stop_tokens") if "stop_tokens" in kwargs else self.stop_token_ids
        return generate_text(self.model, tokenizer, prompt, max_new_tokens, stops=list(stops or ()),
                             template=template, on_text=on_text, options=kwargs)  # fmt: skip

    def chat_template_text(self) -> str | None:
        """The chat template: :attr:`chat_template` (a GGUF's ``tokenizer.chat_template``), else the
        tokenizer folder's (``tokenizer_config.json``'s ``chat_template``, ``chat_template.jinja``)."""
        if self.chat_template is not None or self.tokenizer is None:
            return self.chat_template
        return self.tokenizer.folder_settings().chat_template

    @property
    def stop_token_ids(self) -> list[int]:
        """The ids that end a text or a turn for this model, sorted
        (:func:`~.generation.stop_token_ids`); empty without a tokenizer."""
        from .generation import stop_token_ids

        if self.tokenizer is None:
            return []
        template = self.chat_template_text()
        extra = self.config.extra
        return stop_token_ids(self.tokenizer, self.special_tokens, extra, template, self.config.vocab_size)


def cosine(a: Tensor, b: Tensor) -> float:
    """Cosine similarity of two embedding vectors."""
    return float(F.cosine_similarity(a.flatten(), b.flatten(), dim=0))
